"""Asymmetric round-to-nearest per row (docs/algorithm.md section 3).

For each row over all its columns: ``lo = min``, ``hi = max``, ``step = max((hi - lo) / (2^b - 1), 1e-10)``,
``q = clamp(round_half_to_even((y - lo) / step), 0, 2^b - 1)``. ``torch.round`` rounds half to even.
"""

from __future__ import annotations

import torch

STEP_MIN = 1e-10


def row_range(y: torch.Tensor, quantile: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """y: ``[..., R, C]`` -> (lo, hi) each ``[..., R]``; min/max, or the [q, 1-q] quantiles."""
    if quantile > 0.0:
        qs = torch.tensor([quantile, 1.0 - quantile], dtype=y.dtype, device=y.device)
        lohi = torch.quantile(y, qs, dim=-1)
        return lohi[0], lohi[1]
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


def row_step(y: torch.Tensor, bits: int, quantile: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The rounding grid of each row of y ``[..., R, C]``: ``(step [..., R], lo [..., R])``."""
    lo, hi = row_range(y, quantile)
    return ((hi - lo) / ((1 << bits) - 1)).clamp_min(STEP_MIN), lo


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale[..., None] + zero[..., None]`` in float32. codes: ``[..., R, C]``."""
    return codes.to(torch.float32) * scale.to(torch.float32)[..., None] + zero.to(torch.float32)[..., None]
