"""Error measures of the drift study (pure functions on tensors).

Per-token decomposition of a key (or value) error, docs/algorithm.md section 7. For a token vector ``k`` and its
reconstruction ``k^``, with ``n = ||k||``, ``m = ||k^||`` and ``cos θ = k·k^ / (n m)``::

    ||k - k^||^2 = (n - m)^2 + 2 n m (1 - cos θ)
                   magnitude   direction

The magnitude part is the token-scale error, the direction part what is left.
"""

from __future__ import annotations

import torch


def decompose_error(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Magnitude and direction parts of the squared error of each vector along the last axis.

    x, x_hat: ``[..., D]``. Returns ``(magnitude, direction, norm_sq)``, each ``[...]``, float64, where
    ``magnitude + direction == ||x - x_hat||^2`` (up to rounding) and ``norm_sq = ||x||^2``.
    """
    x = x.to(torch.float64)
    x_hat = x_hat.to(torch.float64)
    n = x.norm(dim=-1)
    m = x_hat.norm(dim=-1)
    dot = (x * x_hat).sum(-1)
    magnitude = (n - m) ** 2
    # 2 n m (1 - cos) = 2 (n m - x·x^); clamp the rounding residue of identical vectors.
    direction = (2 * (n * m - dot)).clamp_min(0.0)
    return magnitude, direction, n * n


def relative_l2(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``||x - x_hat||_F / ||x||_F`` (0 for an empty or all-zero ``x``)."""
    if x.numel() == 0:
        return 0.0
    den = x.to(torch.float64).norm()
    if den == 0:
        return 0.0
    return float((x.to(torch.float64) - x_hat.to(torch.float64)).norm() / den)


def mean_abs_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean absolute difference of two tensors of the same shape."""
    return float((x.to(torch.float32) - x_hat.to(torch.float32)).abs().mean())


def kl_and_top1(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position ``KL(p_ref || p)`` in nats and top-1 agreement. logits: ``[T, V]`` -> ``([T], [T] bool)``."""
    ref_logp = torch.log_softmax(ref_logits.to(torch.float32), dim=-1)
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)
    top1 = ref_logits.argmax(-1) == logits.argmax(-1)
    return kl, top1


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets [T]`` under ``logits [T, V]`` (nats), ``[T]``."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return -logp.gather(-1, targets[:, None]).squeeze(-1)


def worst_fraction_summary(
    magnitude: torch.Tensor, direction: torch.Tensor, fraction: float = 0.05
) -> dict[str, float]:
    """Mean magnitude and direction parts over all tokens and over the worst ``fraction`` by total error.

    magnitude, direction: ``[N]`` already normalized (see :class:`DecompositionAccumulator`).
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} must be in (0, 1]")
    n = magnitude.numel()
    if n == 0:
        nan = float("nan")
        return {"magnitude": nan, "direction": nan, "magnitude_top": nan, "direction_top": nan, "tokens": 0}
    total = magnitude + direction
    k = max(1, int(round(fraction * n)))
    idx = total.topk(k).indices
    return {
        "magnitude": float(magnitude.mean()),
        "direction": float(direction.mean()),
        "magnitude_top": float(magnitude[idx].mean()),
        "direction_top": float(direction[idx].mean()),
        "tokens": n,
    }


class DecompositionAccumulator:
    """Collects per-token magnitude/direction errors of one tensor kind (K or V) across layers and chunks.

    Each (layer, head) is normalized by the mean ``||x||^2`` of its tokens, so that layers with large
    activations do not swamp the pooled statistics; the parts then read as a fraction of a typical
    token's squared norm.
    """

    def __init__(self) -> None:
        self._parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def add(self, layer: int, x: torch.Tensor, x_hat: torch.Tensor) -> None:
        """x, x_hat: ``[B, H, T, D]``."""
        mag, dirn, nsq = decompose_error(x, x_hat)
        # [B, H, T] -> [H, B*T]: keep heads apart for their own normalization.
        h = mag.shape[1]
        self._parts.setdefault(layer, []).append(
            tuple(t.transpose(0, 1).reshape(h, -1) for t in (mag, dirn, nsq))
        )

    def normalized(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pooled ``(magnitude, direction, layer_index)`` over every token seen, each ``[N]``."""
        mags, dirs, layers = [], [], []
        for layer, parts in sorted(self._parts.items()):
            mag = torch.cat([p[0] for p in parts], dim=1)
            dirn = torch.cat([p[1] for p in parts], dim=1)
            nsq = torch.cat([p[2] for p in parts], dim=1)
            scale = nsq.mean(dim=1, keepdim=True).clamp_min(1e-30)
            mags.append((mag / scale).flatten())
            dirs.append((dirn / scale).flatten())
            layers.append(torch.full((mag.numel(),), layer, dtype=torch.long))
        if not mags:
            empty = torch.zeros(0, dtype=torch.float64)
            return empty, empty, torch.zeros(0, dtype=torch.long)
        return torch.cat(mags), torch.cat(dirs), torch.cat(layers)

    def summary(self, fraction: float = 0.05) -> dict[str, float]:
        mag, dirn, _ = self.normalized()
        return worst_fraction_summary(mag, dirn, fraction)
