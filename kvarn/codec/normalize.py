"""Dual-axis, log-domain variance normalization (Sinkhorn-like) with best-iterate tracking.

Spec section 2. For a tile ``X: [R, C]`` find log-scales ``a: [C]`` (columns) and ``b: [R]`` (rows)
so that ``Y = X / (exp(b)[:, None] * exp(a)[None, :])`` has balanced unbiased standard deviations
along both axes. Each iteration updates columns, then rows, then scores
``imbalance(Y) = max(cs)/max(min(cs), 1e-8) + max(rs)/max(min(rs), 1e-8)``; the lowest score wins,
ties to the later iterate, and the identity (a = b = 0) is a candidate. The clamps keep every scale
in ``[e^-0.3, e^10]``: a small row or column is magnified by at most 1.35x.

Arithmetic. The standard deviations are computed in float64 (mean, then the sum of squared
deviations) and rounded once to float32: the correctly rounded ``ustd`` up to float64 rounding,
which is also what ``torch.std`` returns for float32 input on CPU (it accumulates in float64,
with Welford's update, one element at a time). The two agree bit for bit on every value tested
(tests/codec/test_normalize.py); the two-pass form takes a fraction of the time. Each iteration computes
three of them, not four: the column deviations scored by one iteration's imbalance are the ones the
next iteration's column update starts from.
"""

from __future__ import annotations

import torch

STD_MIN, STD_MAX = 1e-3, 1e3
LOG_MIN, LOG_MAX = -0.3, 10.0
IMBALANCE_EPS = 1e-8


def _ustd_(y64: torch.Tensor, dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`ustd` of a float64 tensor; the deviations are written into ``out`` (a buffer of its
    shape), by default over ``y64`` itself (no new large buffers either way)."""
    dev = torch.sub(y64, y64.mean(dim, keepdim=True), out=y64 if out is None else out)
    return dev.mul_(dev).sum(dim).div_(y64.shape[dim] - 1).sqrt_().to(torch.float32)


def ustd(y: torch.Tensor, dim: int) -> torch.Tensor:
    """Unbiased standard deviation of float32 ``y`` along ``dim`` (dropped), float32 (module docstring)."""
    return _ustd_(y.to(torch.float64), dim)


def _score(cs: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
    return cs.amax(-1) / cs.amin(-1).clamp_min(IMBALANCE_EPS) + rs.amax(-1) / rs.amin(-1).clamp_min(IMBALANCE_EPS)


def imbalance(y: torch.Tensor) -> torch.Tensor:
    """y: ``[..., R, C]`` -> ``[...]``; 2.0 for a perfectly balanced tile."""
    return _score(ustd(y, -2), ustd(y, -1))


def apply_scales(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x / (exp(b)[:, None] * exp(a)[None, :])``, optionally into preallocated ``out`` (the outer
    product is formed there, then divided in place: one buffer fewer in the cache)."""
    outer = torch.mul(torch.exp(b)[..., :, None], torch.exp(a)[..., None, :], out=out)
    return torch.div(x, outer, out=outer)


class Workspace:
    """The passes over one batch of tiles ``x [..., R, C]`` that the normalization makes, as torch
    operations, with buffers reused by every iteration: fresh large tensors cost page faults on CPU,
    which took most of the time of these memory-bound passes. Log-scales ``a [..., C]`` and
    ``b [..., R]`` give the tile ``Y = apply_scales(x, a, b)``. :class:`kvarn.cpu.encoder.TilePasses` makes
    the same passes as numba loops (same interface)."""

    def __init__(self, x: torch.Tensor):
        self.y = torch.empty_like(x)
        self.y64 = torch.empty(x.shape, dtype=torch.float64, device=x.device)
        self.dev64 = torch.empty_like(self.y64)

    def row_std(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """:func:`ustd` of each row of Y, ``[..., R]``."""
        return _ustd_(self.y64.copy_(apply_scales(x, a, b, self.y)), -1)

    def both_std(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(per column over rows ``[..., C]``, per row over columns ``[..., R]``) of Y."""
        y64 = self.y64.copy_(apply_scales(x, a, b, self.y))
        rs = _ustd_(y64, -1, out=self.dev64)  # before the column pass overwrites y64
        return _ustd_(y64, -2), rs


def normalize_iterates(x: torch.Tensor, iters: int = 8, passes=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every iterate of the normalization: ``(a [..., iters + 1, C], b [..., iters + 1, R],
    score [..., iters + 1])``, the identity first (log-scales ``a`` of the columns, ``b`` of the rows,
    module docstring). The kernels' tests use it to show that a tile where the Triton encoder kept
    another iterate is a tie up to fp32 rounding. ``passes``: who makes the passes over the tiles,
    a :class:`Workspace` of ``x`` by default."""
    if x.dtype != torch.float32:
        raise TypeError(f"the normalization expects float32 tiles, got {x.dtype}")
    a = x.new_zeros(*x.shape[:-2], x.shape[-1])
    b = x.new_zeros(*x.shape[:-2], x.shape[-2])
    ws = Workspace(x) if passes is None else passes
    cs, rs = ws.both_std(x, a, b)  # of the current tile
    out_a, out_b, out_m = [a], [b], [_score(cs, rs)]
    for _ in range(iters):
        a = (a + torch.log(cs.clamp(STD_MIN, STD_MAX))).clamp(LOG_MIN, LOG_MAX)
        b = (b + torch.log(ws.row_std(x, a, b).clamp(STD_MIN, STD_MAX))).clamp(LOG_MIN, LOG_MAX)
        cs, rs = ws.both_std(x, a, b)
        out_a.append(a)
        out_b.append(b)
        out_m.append(_score(cs, rs))
    return torch.stack(out_a, -2), torch.stack(out_b, -2), torch.stack(out_m, -1)


def best_iterate(a: torch.Tensor, b: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-scales ``(a [..., C], b [..., R])`` of the lowest score per tile among
    :func:`normalize_iterates`' output, ties to the later iterate."""
    best, best_a, best_b = m[..., 0], a[..., 0, :], b[..., 0, :]
    for i in range(1, m.shape[-1]):
        take = m[..., i] <= best  # ties go to the later iterate
        best = torch.where(take, m[..., i], best)
        best_a = torch.where(take[..., None], a[..., i, :], best_a)
        best_b = torch.where(take[..., None], b[..., i, :], best_b)
    return best_a, best_b


def variance_normalize(
    x: torch.Tensor, iters: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched normalization of tiles.

    x: ``[..., R, C]`` float32. Returns ``(y_bal [..., R, C], col_scale [..., C], row_scale [..., R])``
    with ``y_bal = x / (row_scale[..., :, None] * col_scale[..., None, :])``, best iterate per tile.
    """
    best_a, best_b = best_iterate(*normalize_iterates(x, iters))
    return apply_scales(x, best_a, best_b), torch.exp(best_a), torch.exp(best_b)
