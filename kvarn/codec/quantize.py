"""Asymmetric round-to-nearest per row (docs/algorithm.md section 3).

For each row over all its columns: ``lo = min``, ``hi = max``, ``step = max((hi - lo) / (2^b - 1), 1e-10)``,
``q = clamp(round_half_to_even((y - lo) / step), 0, 2^b - 1)``. ``torch.round`` rounds half to even.
"""

from __future__ import annotations

import numpy as np
import torch

STEP_MIN = 1e-10


def quantile_ranks(quantile: float, n: int) -> list[tuple[int, int, float]]:
    """Where torch.quantile (linear interpolation) reads the [q, 1-q] quantiles of n float32 values:
    per quantile, the sorted positions below and above its fp32 rank ``q (n - 1)`` and the weight
    of the upper one. ``1 - q`` is taken in float64, then float32, as ``torch.tensor([q, 1 - q])``."""
    ranks = np.array([quantile, 1.0 - quantile], dtype=np.float32) * np.float32(n - 1)
    below, above = np.floor(ranks), np.ceil(ranks)
    weights = (ranks - below).astype(np.float32)
    return [(int(b), int(a), float(w)) for b, a, w in zip(below, above, weights)]


def order_statistics(y: torch.Tensor, quantile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The order statistics of each row of y ``[..., R, C]`` that its [q, 1-q] quantiles read
    (:func:`quantile_ranks`): ``(low [..., R, a + 1]`` ascending from the minimum, ``high [..., R,
    C - b]`` descending from the maximum``)``, with a the sorted position above the lower quantile's
    rank and b the one below the upper quantile's."""
    n = y.shape[-1]
    (_, a0, _), (b1, _, _) = quantile_ranks(quantile, n)
    low = torch.topk(y, a0 + 1, dim=-1, largest=False, sorted=True).values
    high = torch.topk(y, n - b1, dim=-1, largest=True, sorted=True).values
    return low, high


def quantiles_from(low: torch.Tensor, high: torch.Tensor, quantile: float, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) ``[..., R]``: the [q, 1-q] quantiles of rows of n values from their
    :func:`order_statistics`, interpolated by the ``torch.lerp`` torch.quantile itself uses."""
    (b0, a0, w0), (b1, a1, w1) = quantile_ranks(quantile, n)
    shape, kw = low.shape[:-1], dict(dtype=low.dtype, device=low.device)
    lo = torch.lerp(low[..., b0], low[..., a0], torch.full(shape, w0, **kw))
    hi = torch.lerp(high[..., n - 1 - b1], high[..., n - 1 - a1], torch.full(shape, w1, **kw))
    return lo, hi


def row_range(y: torch.Tensor, quantile: float = 0.0, statistics=order_statistics) -> tuple[torch.Tensor, torch.Tensor]:
    """y: ``[..., R, C]`` -> (lo, hi) each ``[..., R]``; min/max, or the [q, 1-q] quantiles.

    The quantiles are torch.quantile's, bit for bit (tested), from the few order statistics they
    need (``statistics``: :func:`order_statistics`, torch.topk from each end; the numba codec
    passes its own loops) and the same ``torch.lerp``: a fraction of the time of its full sort on
    CPU. Rows with NaN or Inf (and other dtypes than float32) go to torch.quantile itself."""
    if quantile > 0.0:
        # amin/amax propagate NaN: one cheap finiteness check (torch.isfinite(y).all() costs 10x)
        if y.dtype != torch.float32 or not (bool(torch.isfinite(y.amin())) and bool(torch.isfinite(y.amax()))):
            qs = torch.tensor([quantile, 1.0 - quantile], dtype=y.dtype, device=y.device)
            lohi = torch.quantile(y, qs, dim=-1)
            return lohi[0], lohi[1]
        return quantiles_from(*statistics(y, quantile), quantile, y.shape[-1])
    return y.amin(dim=-1), y.amax(dim=-1)


def rtn_rows(
    y: torch.Tensor, bits: int, quantile: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize each row of y: ``[..., R, C]`` float32.

    Returns ``(codes uint8 [..., R, C], step [..., R], lo [..., R])`` in float32, so that
    ``y ~= codes * step[..., None] + lo[..., None]``.
    """
    step, lo = row_step(y, bits, quantile)
    codes = torch.round((y - lo[..., None]) / step[..., None]).clamp_(0, (1 << bits) - 1)
    return codes.to(torch.uint8), step, lo


def row_step(y: torch.Tensor, bits: int, quantile: float = 0.0,
             statistics=order_statistics) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding grid of each row of y ``[..., R, C]``: ``(step [..., R], lo [..., R])``;
    ``statistics``: see :func:`row_range`."""
    lo, hi = row_range(y, quantile, statistics)
    return ((hi - lo) / ((1 << bits) - 1)).clamp_min(STEP_MIN), lo


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale[..., None] + zero[..., None]`` in float32. codes: ``[..., R, C]``."""
    return codes.to(torch.float32) * scale.to(torch.float32)[..., None] + zero.to(torch.float32)[..., None]
