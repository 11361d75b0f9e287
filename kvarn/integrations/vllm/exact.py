"""Exact attention paths of the KVarN vLLM layer: prefill chunks and sliding-window layers.

- *A prompt chunk that starts its request* (``ctx = 0``) attends causally over its own ``q, k, v``
  as the model gave them (scores are frame-independent, ``H`` being orthonormal), in the model's
  dtype: on CUDA with vLLM's FlashAttention (varlen, every such row in one call), on CPU with
  ``scaled_dot_product_attention`` per row.
- *A chunk that continues a request* attends over what the cache holds of the tokens before it
  (fp sink, records dequantized, fp tail; rotated frame) and causally over its own tokens, in
  float32 (:func:`continued`); the output is rotated back (``H`` is its own inverse).
- *Sliding-window layers*: a plain full-precision paged cache ``[num_blocks, Hk, block, 2D]``
  (K in ``[..., :D]``, V in ``[..., D:]``), masked to ``qpos - window < kpos <= qpos``.
"""

from __future__ import annotations

import torch

from ...codec import decode_tiles
from ...config import KVarNConfig
from ...codec.hadamard import rotate
from ...codec.record import record_field_views
from .plan import PrefillRow


def fresh(q, k, v, rows: list[PrefillRow], out, scale: float) -> None:
    """Chunks that start their requests: causal attention over their own tokens, written to ``out``."""
    if not rows:
        return
    if q.is_cuda:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

        tok = torch.cat([torch.arange(r.t0, r.t0 + r.n) for r in rows])
        contiguous = bool((tok[1:] - tok[:-1] == 1).all()) if tok.numel() > 1 else True
        lens = torch.tensor([0] + [r.n for r in rows]).cumsum(0).to(torch.int32)
        cu = lens.pin_memory().to(q.device, non_blocking=True)
        if contiguous:
            sl = slice(int(tok[0]), int(tok[-1]) + 1)
            qs, ks, vs = q[sl], k[sl], v[sl]
        else:
            idx = tok.pin_memory().to(q.device, non_blocking=True)
            qs, ks, vs = q[idx], k[idx], v[idx]
        longest = max(r.n for r in rows)
        o = flash_attn_varlen_func(q=qs, k=ks, v=vs, cu_seqlens_q=cu, max_seqlen_q=longest, cu_seqlens_k=cu,
                                   max_seqlen_k=longest, softmax_scale=scale, causal=True,
                                   fa_version=get_flash_attn_version(head_size=q.shape[-1]))
        if contiguous:
            out[sl] = o.to(out.dtype)
        else:
            out[idx] = o.to(out.dtype)
        return
    for r in rows:
        sl = slice(r.t0, r.t0 + r.n)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True)
        out[sl] = o.transpose(0, 1).to(out.dtype)


def history(row: PrefillRow, stage_k, stage_v, pages, cfg: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``ctx`` tokens before a continuing chunk as the cache holds them, float32 ``[Hk, ctx, D]``
    each, rotated frame: the sink, the records (dequantized) and the tail."""
    s, g = cfg.sink_tokens, cfg.tile
    d = stage_k.shape[-1]
    keys, values = [stage_k[row.slot, :min(row.ctx, s)].float()], [stage_v[row.slot, :min(row.ctx, s)].float()]
    if row.tiles.size:
        rec = pages.index_select(0, row.tiles_on_device).transpose(0, 1).contiguous()[None]  # [1, Hk, N, record]
        kt, vt = decode_tiles(record_field_views(rec, cfg, d), cfg)  # [1, Hk, N, D, G], [1, Hk, N, G, D]
        hk, nt = kt.shape[1], kt.shape[2]
        keys.append(kt[0].transpose(-1, -2).reshape(hk, nt * g, d).transpose(0, 1).float())
        values.append(vt[0].reshape(hk, nt * g, d).transpose(0, 1).float())
    if row.ctx > row.tail_base:
        keys.append(stage_k[row.slot, s:s + row.ctx - row.tail_base].float())
        values.append(stage_v[row.slot, s:s + row.ctx - row.tail_base].float())
    return torch.cat(keys).transpose(0, 1), torch.cat(values).transpose(0, 1)


def continued(q, k, v, row: PrefillRow, stage_k, stage_v, pages, cfg: KVarNConfig, out, scale: float) -> None:
    """A chunk that continues its request: attention over the cached history and, causally, itself."""
    sl = slice(row.t0, row.t0 + row.n)
    hk_, hv_ = history(row, stage_k, stage_v, pages, cfg)
    keys = torch.cat([hk_, rotate(k[sl], torch.float32).transpose(0, 1)], 1)  # [Hk, ctx + n, D]
    values = torch.cat([hv_, rotate(v[sl], torch.float32).transpose(0, 1)], 1)
    qpos = torch.arange(row.ctx, row.ctx + row.n, device=q.device)[:, None]
    mask = torch.arange(row.ctx + row.n, device=q.device)[None, :] <= qpos
    o = torch.nn.functional.scaled_dot_product_attention(
        rotate(q[sl], torch.float32).transpose(0, 1), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    out[sl] = rotate(o.transpose(0, 1), torch.float32).to(out.dtype)


def causal(q, keys, values, ctx: int, scale: float, window: int | None = None) -> torch.Tensor:
    """Exact attention of ``q [n, Hq, D]`` at positions ``ctx..`` over ``keys [Hk, L, D]`` (and
    only the last ``window`` positions, when given)."""
    n, length = q.shape[0], keys.shape[1]
    qpos = torch.arange(ctx, ctx + n, device=q.device)[:, None]
    kpos = torch.arange(length, device=q.device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), keys.float(), values.float(), attn_mask=mask, scale=scale,
        enable_gqa=True)
    return o.transpose(0, 1)


def sliding_window(q, k, v, kv_cache, md, out, window: int, scale: float) -> None:
    """Full-precision paged cache for sliding-window layers: ``[nb, Hk, block, 2D]``, K then V."""
    d = q.shape[-1]
    nb, hk, bs, _ = kv_cache.shape
    n_tok = md.num_actual_tokens
    slots = md.slot_mapping[:n_tok].long()
    blk, off = slots // bs, slots % bs
    kv_cache[blk, :, off, :d] = k[:n_tok].to(kv_cache.dtype)
    kv_cache[blk, :, off, d:] = v[:n_tok].to(kv_cache.dtype)
    for r in range(len(md.seq_lens)):
        q0, q1 = md.query_start_loc[r], md.query_start_loc[r + 1]
        if q1 == q0:
            continue
        length = md.seq_lens[r]
        blocks = md.block_table[r, : -(-length // bs)].to(kv_cache.device)
        page = kv_cache.index_select(0, blocks).view(-1, hk, bs, 2, d)  # [nblk, Hk, bs, 2, D]
        kv = page.permute(1, 0, 2, 3, 4).reshape(hk, -1, 2, d)[:, :length]
        out[q0:q1] = causal(q[q0:q1], kv[:, :, 0], kv[:, :, 1], length - (q1 - q0), scale,
                            window).to(out.dtype)


__all__ = ["causal", "continued", "fresh", "history", "sliding_window"]
