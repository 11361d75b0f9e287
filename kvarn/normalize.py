"""Dual-axis, log-domain variance normalization (Sinkhorn-like) with best-iterate tracking.

Spec section 2. For a tile ``X: [R, C]`` find log-scales ``a: [C]`` (columns) and ``b: [R]`` (rows)
so that ``Y = X / (exp(b)[:, None] * exp(a)[None, :])`` has balanced unbiased standard deviations
along both axes. Each iteration updates columns, then rows, then scores
``imbalance(Y) = max(cs)/max(min(cs), 1e-8) + max(rs)/max(min(rs), 1e-8)``; the lowest score wins,
ties to the later iterate, and the identity (a = b = 0) is a candidate. The clamps keep every scale
in ``[e^-0.3, e^10]``: a small row or column is magnified by at most 1.35x.
"""

from __future__ import annotations

import torch

STD_MIN, STD_MAX = 1e-3, 1e3
LOG_MIN, LOG_MAX = -0.3, 10.0
IMBALANCE_EPS = 1e-8


def imbalance(y: torch.Tensor) -> torch.Tensor:
    """y: ``[..., R, C]`` -> ``[...]``; 2.0 for a perfectly balanced tile."""
    cs = y.std(dim=-2, correction=1)  # one per column, over rows
    rs = y.std(dim=-1, correction=1)  # one per row, over columns
    return (
        cs.amax(-1) / cs.amin(-1).clamp_min(IMBALANCE_EPS)
        + rs.amax(-1) / rs.amin(-1).clamp_min(IMBALANCE_EPS)
    )


def _apply(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x / (torch.exp(b)[..., :, None] * torch.exp(a)[..., None, :])


def variance_normalize(
    x: torch.Tensor, iters: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched normalization of tiles.

    x: ``[..., R, C]`` float32. Returns ``(y_bal [..., R, C], col_scale [..., C], row_scale [..., R])``
    with ``y_bal = x / (row_scale[..., :, None] * col_scale[..., None, :])``, best iterate per tile.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"variance_normalize expects float32 tiles, got {x.dtype}")
    batch = x.shape[:-2]
    a = x.new_zeros(*batch, x.shape[-1])
    b = x.new_zeros(*batch, x.shape[-2])
    best = imbalance(x)
    best_a, best_b = a.clone(), b.clone()
    y = x
    for _ in range(iters):
        a = (a + torch.log(y.std(dim=-2, correction=1).clamp(STD_MIN, STD_MAX))).clamp(LOG_MIN, LOG_MAX)
        y = _apply(x, a, b)
        b = (b + torch.log(y.std(dim=-1, correction=1).clamp(STD_MIN, STD_MAX))).clamp(LOG_MIN, LOG_MAX)
        y = _apply(x, a, b)
        m = imbalance(y)
        take = m <= best  # ties go to the later iterate
        best = torch.where(take, m, best)
        best_a = torch.where(take[..., None], a, best_a)
        best_b = torch.where(take[..., None], b, best_b)
    return _apply(x, best_a, best_b), torch.exp(best_a), torch.exp(best_b)
