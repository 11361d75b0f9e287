"""Exact attention paths of the KVarN vLLM layer: prefill chunks and sliding-window layers.

- *Chunks that start their requests* (``ctx = 0``) attend causally over their own ``q, k, v`` as
  the model gave them (scores are frame-independent, ``H`` being orthonormal), in the model's
  dtype: on CUDA with vLLM's FlashAttention (varlen, every such chunk of the step in one call), on
  CPU with ``scaled_dot_product_attention`` per chunk.
- *Chunks that continue their requests* attend over what the cache holds of the tokens before them
  (fp sink, records dequantized, fp tail) and causally over themselves, in the rotated frame; the
  output is rotated back (``H`` is its own inverse). Every such chunk of the step is gathered into
  one key/value buffer by indices the host planned (:class:`~.plan.ContinuedBatch`): on CUDA in the
  model's dtype for one FlashAttention varlen call (causal, aligned bottom-right: chunk token ``i``
  sees the history and the chunk up to ``i``), on CPU in float32 with ``scaled_dot_product_attention``
  per chunk (the reference).
- *Sliding-window layers*: a plain full-precision paged cache ``[num_blocks, Hk, block, 2D]``
  (K in ``[..., :D]``, V in ``[..., D:]``), masked to ``qpos - window < kpos <= qpos``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...codec import decode_tiles
from ...config import KVarNConfig
from ...codec.hadamard import rotate
from ...codec.record import record_field_views


@dataclass
class FreshRows:
    """:class:`~.plan.FreshBatch` on the device."""

    tok: slice | torch.Tensor  # the chunks' step tokens: a slice when consecutive, else int64 indices
    cu: torch.Tensor  # int32 [R + 1]
    longest: int
    bounds: list[int]  # ``cu`` on the host


@dataclass
class ContinuedRows:
    """:class:`~.plan.ContinuedBatch` on the device (index arrays int64, boundaries int32)."""

    q_tok: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    stage_src: torch.Tensor | None
    stage_dst: torch.Tensor | None
    rec_pages: torch.Tensor | None
    rec_dst: torch.Tensor | None
    chunk_dst: torch.Tensor
    bounds_q: list[int]  # ``cu_q`` and ``cu_k`` on the host
    bounds_k: list[int]


def flash_attention_version(head_size: int) -> int | None:
    """The FlashAttention version vLLM picks for this head size on this GPU (FA3 on Hopper)."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    return get_flash_attn_version(head_size=head_size)


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, fa_version) -> torch.Tensor:
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    return flash_attn_varlen_func(q=q, k=k, v=v, cu_seqlens_q=cu_q, max_seqlen_q=max_q, cu_seqlens_k=cu_k,
                                  max_seqlen_k=max_k, softmax_scale=scale, causal=True, fa_version=fa_version)


def fresh(q, k, v, rows: FreshRows | None, out, scale: float, fa_version=None) -> None:
    """Chunks that start their requests: causal attention over their own tokens, written to ``out``."""
    if rows is None:
        return
    if q.is_cuda:
        o = _varlen(q[rows.tok], k[rows.tok], v[rows.tok], rows.cu, rows.cu, rows.longest, rows.longest, scale,
                    fa_version)
        out[rows.tok] = o.to(out.dtype)
        return
    tok = rows.tok if isinstance(rows.tok, torch.Tensor) else torch.arange(rows.tok.start, rows.tok.stop)
    for a, b in zip(rows.bounds[:-1], rows.bounds[1:]):
        t = tok[a:b]
        o = torch.nn.functional.scaled_dot_product_attention(
            q[t].transpose(0, 1), k[t].transpose(0, 1), v[t].transpose(0, 1), is_causal=True, scale=scale,
            enable_gqa=True)
        out[t] = o.transpose(0, 1).to(out.dtype)


def history_buffers(k, v, rows: ContinuedRows, flat_k, flat_v, pages, cfg: KVarNConfig,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every continuing chunk's keys and values, rotated frame, ``[cu_k[-1], Hk, D]`` each in
    ``dtype``: per row the sink and tail from its staging slot (``flat_k``, ``flat_v``: the slots'
    rows), its records dequantized (float32, then ``dtype``), then the chunk's own tokens rotated."""
    hk, d = k.shape[1], k.shape[2]
    size = rows.bounds_k[-1]
    kb = torch.empty((size, hk, d), dtype=dtype, device=k.device)
    vb = torch.empty((size, hk, d), dtype=dtype, device=k.device)
    if rows.stage_src is not None:
        kb.index_copy_(0, rows.stage_dst, flat_k.index_select(0, rows.stage_src).to(dtype))
        vb.index_copy_(0, rows.stage_dst, flat_v.index_select(0, rows.stage_src).to(dtype))
    if rows.rec_pages is not None:
        rec = pages.index_select(0, rows.rec_pages)  # [P, Hk, record]
        kt, vt = decode_tiles(record_field_views(rec, cfg, d), cfg)  # [P, Hk, D, G], [P, Hk, G, D]
        kb.index_copy_(0, rows.rec_dst, kt.permute(0, 3, 1, 2).reshape(-1, hk, d).to(dtype))
        vb.index_copy_(0, rows.rec_dst, vt.permute(0, 2, 1, 3).reshape(-1, hk, d).to(dtype))
    kv = rotate(torch.stack((k.index_select(0, rows.q_tok), v.index_select(0, rows.q_tok)), 1), torch.float32)
    kb.index_copy_(0, rows.chunk_dst, kv[:, 0].to(dtype))
    vb.index_copy_(0, rows.chunk_dst, kv[:, 1].to(dtype))
    return kb, vb


def continued(q, k, v, rows: ContinuedRows | None, flat_k, flat_v, pages, cfg: KVarNConfig, out, scale: float,
              fa_version=None) -> None:
    """Chunks that continue their requests: attention over their cached history and, causally,
    themselves (module docstring), written to ``out``."""
    if rows is None:
        return
    dtype = q.dtype if q.is_cuda else torch.float32
    kb, vb = history_buffers(k, v, rows, flat_k, flat_v, pages, cfg, dtype)
    qr = rotate(q.index_select(0, rows.q_tok), torch.float32)  # [Nq, Hq, D]
    if q.is_cuda:
        o = _varlen(qr.to(dtype), kb, vb, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, scale, fa_version)
    else:
        o = torch.empty_like(qr)
        for i in range(len(rows.bounds_q) - 1):
            (q0, q1), (k0, k1) = rows.bounds_q[i:i + 2], rows.bounds_k[i:i + 2]
            o[q0:q1] = causal(qr[q0:q1], kb[k0:k1].transpose(0, 1), vb[k0:k1].transpose(0, 1),
                              k1 - k0 - (q1 - q0), scale)
    out.index_copy_(0, rows.q_tok, rotate(o, torch.float32).to(out.dtype))


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


__all__ = ["ContinuedRows", "FreshRows", "causal", "continued", "flash_attention_version", "fresh", "history_buffers",
           "sliding_window"]
