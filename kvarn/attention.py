"""Decode attention over a KVarN cache: the pure-torch reference (docs/algorithm.md section 5).

A sequence's history is three regions, all stored in the rotated frame (``k' = k @ H``):

    [ sink: fp, S tokens | quantized tiles: N tiles of G tokens | tail: fp, R tokens ]

``decode_attention`` rotates the query (``q' = q @ H``), takes one softmax over the three regions
(``q' k'^T = q k^T``, so the scores are the ordinary ones), and un-rotates the output
(``o = o' @ H``). The quantized tiles are dequantized with :func:`kvarn.codec.decode_tiles`.

GQA: query head ``hq`` reads KV head ``hq // (Hq // Hk)``, as transformers' ``repeat_kv`` does.

Per-head frames (kvarn-auto, :mod:`kvarn.codec.flavour`): ``key_rotated`` / ``value_rotated`` (bool
``[B, Hk]``, None = all True, the spec) say, per row and KV head, whether that head's keys / values
live in the rotated frame or in the model frame. The query is rotated only where ``key_rotated``
and the output un-rotated only where ``value_rotated``; with ``fp_frame="model"`` the sink and tail
are rotated into the key / value frame only where the flag says. Scores are unchanged either way
(``q k^T = q' k'^T``): the flags only say where the tiles' quantization error lives.

Causality among several query tokens (speculative verification): the ``Tq`` query tokens are the
last ``Tq`` tokens of the sequence and are already in the tail (a token that may be rejected is never
frozen into a tile). Query ``i`` (0-based) sees the sink, every tile, and tail positions
``r <= R - Tq + i``. Every sequence therefore needs ``R >= Tq`` when ``causal`` and ``Tq > 1``.

The Triton twin with the same signature is :func:`kvarn.kernels.decode_attention`.
"""

from __future__ import annotations

import math

import torch

from .codec.flavour import rotate_where
from .codec.record import TileFields
from .codec.tiles import decode_tiles
from .config import KVarNConfig

__all__ = ["decode_attention", "check_decode_inputs", "head_flags"]


def _lengths(x: torch.Tensor | None, full: int, batch: int, name: str, device) -> torch.Tensor:
    if x is None:
        return torch.full((batch,), full, dtype=torch.int32, device=device)
    if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.shape[0] != batch:
        raise ValueError(f"{name} must be a 1-D integer tensor of length B={batch}")
    return x.to(device=device, dtype=torch.int32)


def head_flags(x: torch.Tensor | None, batch: int, heads: int, name: str, device) -> torch.Tensor:
    """A validated per-(row, KV head) frame flag, bool ``[B, Hk]`` (None: all True, the spec)."""
    if x is None:
        return torch.ones(batch, heads, dtype=torch.bool, device=device)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bool or tuple(x.shape) != (batch, heads):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a bool tensor [B={batch}, Hk={heads}] or None, got {got}")
    return x.to(device)


def check_decode_inputs(query, sink_k, sink_v, tiles, tail_k, tail_v, config):
    """Validate shapes; returns ``(B, Hq, Tq, D, Hk)``. Raises ValueError/TypeError."""
    if not isinstance(config, KVarNConfig):
        raise TypeError(f"config must be a KVarNConfig, got {type(config).__name__}")
    if not isinstance(query, torch.Tensor) or query.dim() != 4:
        raise ValueError("query must be a tensor [B, Hq, Tq, D]")
    b, hq, tq, d = query.shape
    hk = None
    for name, x in (("sink_k", sink_k), ("sink_v", sink_v), ("tail_k", tail_k), ("tail_v", tail_v)):
        if x is None:
            continue
        if x.dim() != 4 or x.shape[0] != b or x.shape[-1] != d:
            raise ValueError(f"{name} must be [B={b}, Hk, n, D={d}], got {tuple(x.shape)}")
        hk = x.shape[1] if hk is None else hk
        if x.shape[1] != hk:
            raise ValueError(f"{name} has {x.shape[1]} KV heads, expected {hk}")
    if (sink_k is None) != (sink_v is None) or (tail_k is None) != (tail_v is None):
        raise ValueError("sink_k/sink_v and tail_k/tail_v must be given together")
    for a, c, name in ((sink_k, sink_v, "sink"), (tail_k, tail_v, "tail")):
        if a is not None and a.shape != c.shape:
            raise ValueError(f"{name} K {tuple(a.shape)} and V {tuple(c.shape)} differ")
    if tiles is not None:
        lead = tiles.k_codes.shape[:-2]
        if len(lead) != 3 or lead[0] != b:
            raise ValueError(f"tiles must have leading dims [B={b}, Hk, N], got {tuple(lead)}")
        hk = lead[1] if hk is None else hk
        if lead[1] != hk:
            raise ValueError(f"tiles have {lead[1]} KV heads, expected {hk}")
        if tiles.k_codes.shape[-1] != d or tiles.v_codes.shape[-1] != config.tile:
            raise ValueError(f"tiles do not match D={d}, G={config.tile}")
    if hk is None:
        raise ValueError("at least one of sink, tiles or tail must be given")
    if hq % hk:
        raise ValueError(f"Hq={hq} query heads is not a multiple of Hk={hk} KV heads")
    return b, hq, tq, d, hk


def decode_attention(
    query: torch.Tensor,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    tiles: TileFields | None,
    tail_k: torch.Tensor | None,
    tail_v: torch.Tensor | None,
    config: KVarNConfig,
    scaling: float | None = None,
    *,
    sink_lengths: torch.Tensor | None = None,
    tile_counts: torch.Tensor | None = None,
    tail_lengths: torch.Tensor | None = None,
    causal: bool = True,
    fp_frame: str = "rotated",
    compute_dtype: torch.dtype = torch.float32,
    key_rotated: torch.Tensor | None = None,
    value_rotated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few new query tokens over [sink | quantized tiles | tail].

    query:   ``[B, Hq, Tq, D]`` un-rotated (after RoPE), any float dtype.
    sink_k, sink_v: ``[B, Hk, S, D]`` rotated, full precision (or None: no sink).
    tiles:   :class:`TileFields` with leading dims ``[B, Hk, N]`` (or None: no quantized tiles).
    tail_k, tail_v: ``[B, Hk, R, D]`` rotated, full precision; holds the Tq query tokens last.
    config:  the codec settings the tiles were written with (bits, G).
    scaling: softmax scale, default ``1 / sqrt(D)``.
    sink_lengths / tile_counts / tail_lengths: optional int ``[B]``: valid sink tokens, valid tiles
        and valid tail tokens of each sequence (default: all of S, N, R). Entries beyond are ignored,
        so callers may pass preallocated buffers.
    causal:  mask tail positions after each query token (see module docstring).
    fp_frame: "rotated" (sink and tail are in the key / value frame, like the tiles) or "model" (they
        hold the model's own K/V, as :class:`kvarn.KVarNCache` keeps them).
    compute_dtype: dtype of the dequantized K/V and of the softmax (float32 is the accuracy
        reference; float16 gives "torch's own error in that dtype" for kernel tolerances).
    key_rotated, value_rotated: bool ``[B, Hk]`` or None (all True): the frame of each head's keys /
        values, see the module docstring.

    Returns ``[B, Hq, Tq, D]`` un-rotated, in ``query.dtype``. A query with no visible key returns 0.
    """
    b, hq, tq, d, hk = check_decode_inputs(query, sink_k, sink_v, tiles, tail_k, tail_v, config)
    if fp_frame not in ("rotated", "model"):
        raise ValueError(f"fp_frame={fp_frame!r}; choose 'rotated' or 'model'")
    dev = query.device
    k_rot = head_flags(key_rotated, b, hk, "key_rotated", dev)
    v_rot = head_flags(value_rotated, b, hk, "value_rotated", dev)
    if fp_frame == "model":
        sink_k, tail_k = (None if x is None else rotate_where(x, k_rot) for x in (sink_k, tail_k))
        sink_v, tail_v = (None if x is None else rotate_where(x, v_rot) for x in (sink_v, tail_v))
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    group = hq // hk

    keys, values, valid = [], [], []
    s_cap = 0 if sink_k is None else sink_k.shape[2]
    n_cap = 0 if tiles is None else tiles.k_codes.shape[2]
    r_cap = 0 if tail_k is None else tail_k.shape[2]
    s_len = _lengths(sink_lengths, s_cap, b, "sink_lengths", dev)
    n_len = _lengths(tile_counts, n_cap, b, "tile_counts", dev)
    r_len = _lengths(tail_lengths, r_cap, b, "tail_lengths", dev)
    if causal and tq > 1 and bool((r_len < tq).any()):
        raise ValueError(f"with Tq={tq} causal query tokens every tail must hold at least {tq} tokens")

    if s_cap:
        keys.append(sink_k.to(compute_dtype))
        values.append(sink_v.to(compute_dtype))
        pos = torch.arange(s_cap, device=dev)
        valid.append((pos[None, :] < s_len[:, None])[:, None, :].expand(b, tq, s_cap))
    if n_cap:
        k_t, v_t = decode_tiles(tiles, config)  # k_t [B, Hk, N, D, G], v_t [B, Hk, N, G, D]
        g = config.tile
        keys.append(k_t.transpose(-1, -2).reshape(b, hk, n_cap * g, d).to(compute_dtype))
        values.append(v_t.reshape(b, hk, n_cap * g, d).to(compute_dtype))
        tile_idx = torch.arange(n_cap * g, device=dev) // g
        valid.append((tile_idx[None, :] < n_len[:, None])[:, None, :].expand(b, tq, n_cap * g))
    if r_cap:
        keys.append(tail_k.to(compute_dtype))
        values.append(tail_v.to(compute_dtype))
        pos = torch.arange(r_cap, device=dev)
        limit = r_len[:, None].expand(b, tq)  # [B, Tq]: tail positions < limit are visible
        if causal:
            limit = limit - tq + 1 + torch.arange(tq, device=dev)[None, :]
        valid.append(pos[None, None, :] < limit[:, :, None])

    k = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)  # [B, Hq, L, D]
    v = torch.cat(values, dim=2).repeat_interleave(group, dim=1)
    mask = torch.cat(valid, dim=2)[:, None]  # [B, 1, Tq, L]

    q_rot = rotate_where(query, k_rot.repeat_interleave(group, dim=1)).to(compute_dtype)
    scores = (q_rot @ k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(compute_dtype)
    out_rot = probs @ v
    return rotate_where(out_rot.float(), v_rot.repeat_interleave(group, dim=1)).to(query.dtype)
