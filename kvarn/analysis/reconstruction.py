"""Reconstruction quality of K/V under a method: SQNR and per-token norm (token-scale) errors.

For one layer's K (or V) ``x: [B, H, T, D]`` and its reconstruction ``x^``:

- SQNR in dB: ``10 log10(sum x^2 / sum (x - x^)^2)``.
- Relative token-norm error per (head, token): ``| ||x|| - ||x^|| | / ||x||``. This is the
  magnitude (token-scale) part of the error decomposition of docs/algorithm.md section 7; the paper finds
  the worst ~5% of tokens by this measure dominate end-to-end degradation. We report the mean
  over the worst 5% and the maximum.
"""

from __future__ import annotations

import torch

from ..config import KVarNConfig
from ..methods import TileCodec


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    x, x_hat = x.double(), x_hat.double()
    err = (x - x_hat).pow(2).sum()
    return float("inf") if err == 0 else float(10 * torch.log10(x.pow(2).sum() / err))


def token_norm_error(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """x, x_hat: ``[..., T, D]`` -> relative token-norm error ``[..., T]``."""
    n, n_hat = x.double().norm(dim=-1), x_hat.double().norm(dim=-1)
    return (n - n_hat).abs() / n.clamp_min(1e-12)


def worst_fraction_mean(err: torch.Tensor, fraction: float = 0.05) -> float:
    flat = err.flatten()
    k = max(1, int(round(fraction * flat.numel())))
    return float(flat.topk(k).values.mean())


def reconstruction_report(
    layers: list[tuple[torch.Tensor, torch.Tensor]], method: str, config: KVarNConfig
) -> list[dict]:
    """Per layer: quantize the full tiles of (K, V) ``[B, H, T, D]`` with ``method`` and measure.

    Tokens beyond the last full tile are ignored (they would stay in full precision in a cache).
    """
    codec = TileCodec(method, config)
    rows = []
    for i, (k, v) in enumerate(layers):
        t = k.shape[2] // config.tile * config.tile
        if t == 0:
            raise ValueError(f"layer {i} has {k.shape[2]} tokens, fewer than one tile of {config.tile}")
        k, v = k[:, :, :t].float(), v[:, :, :t].float()
        kd, vd = codec.roundtrip(k, v)
        ke, ve = token_norm_error(k, kd), token_norm_error(v, vd)
        rows.append({
            "layer": i,
            "k_sqnr_db": sqnr_db(k, kd), "v_sqnr_db": sqnr_db(v, vd),
            "k_norm_err_top5": worst_fraction_mean(ke), "k_norm_err_max": float(ke.max()),
            "v_norm_err_top5": worst_fraction_mean(ve), "v_norm_err_max": float(ve.max()),
        })
    return rows
