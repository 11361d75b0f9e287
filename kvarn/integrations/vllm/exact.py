"""Exact attention paths of the KVarN vLLM layer, all through ``scaled_dot_product_attention``.

- *prefill*: prompt tokens attend causally to the prompt, in the model's dtype. A prompt that starts
  in this step uses the new ``q, k, v`` as given (scores are frame-independent, ``H`` being
  orthonormal); a chunk that continues a prompt reads its earlier tokens from the staging, in the
  rotated frame ``k' = k @ H``, with an explicit mask ``kpos <= qpos``.
- *extend*: several new tokens past the prompt attend to [sink fp | dequantized records | fp tail],
  in fp32 and the rotated frame; the output is rotated back (``H`` is its own inverse).
- *sliding-window layers*: a plain full-precision paged cache ``[num_blocks, Hk, block, 2D]`` (K in
  ``[..., :D]``, V in ``[..., D:]``), masked to ``qpos - window < kpos <= qpos``.

Functions of the step's tensors, called by :class:`~.impl.KVarNAttentionImpl`. The staging
``sk``, ``sv`` is the layer's ``[slots + 1, G, Hk, D]`` (rotated frame, the model's dtype).
"""

from __future__ import annotations

import torch

from ...codec import decode_tiles
from ...config import KVarNConfig
from ...hadamard import rotate
from ...record import record_field_views
from .plan import StepPlan


def prefill(q, k, v, sk, sv, plan: StepPlan, out, scale: float) -> None:
    """Prompt tokens of P requests: exact causal attention, one call per group of
    :attr:`StepPlan.pre_groups` (rows of similar lengths), in the model's dtype as vLLM's own
    backends compute it.

    A group of prompts that all start in this step sees only this step's tokens: attention runs
    on the new ``q, k, v`` as the model gave them (the scores are the same in either frame, H
    being orthonormal), with the kernel's own causal mask (query ``i`` sees keys ``<= i``; padded
    keys lie past every valid query of their row). Rotating the queries in and the outputs back
    (two float32 products over every prompt token and query head) and gathering the staged keys
    would cost about twice the attention itself. A chunk that continues a prompt reads its
    earlier tokens from the staging, in the rotated frame, with an explicit mask.
    """
    _, g, hk, d = sk.shape
    for first, stop, m, kb, fresh in plan.pre_groups:
        rows = slice(first, stop)
        p = stop - first
        tok, valid = plan.pre_tok[rows, :m], plan.pre_valid[rows, :m]
        if fresh:
            qp, kp, vp = (x[tok].transpose(1, 2) for x in (q, k, v))  # [p, H, m, D]
            o = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                                 enable_gqa=True).transpose(1, 2)
        else:
            qp = rotate(q[tok], torch.float32).to(sk.dtype).transpose(1, 2)  # [p, Hq, m, D]
            flat = plan.pre_slots[rows, :kb].reshape(-1)
            kp = sk.index_select(0, flat).view(p, kb * g, hk, d).transpose(1, 2)  # [p, Hk, kb*G, D]
            vp = sv.index_select(0, flat).view(p, kb * g, hk, d).transpose(1, 2)
            kpos = torch.arange(kb * g, device=q.device)
            mask = (kpos[None, None, :] <= plan.pre_qpos[rows, :m, None])[:, None]  # [p, 1, m, kb*G]
            o = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                                                 enable_gqa=True)
            o = rotate(o.transpose(1, 2), torch.float32)  # [p, m, Hq, D], un-rotated
        out[tok[valid]] = o[valid].to(out.dtype)


def extend(q, blocks, length, sk, sv, pages, plan: StepPlan, cfg: KVarNConfig, scale: float) -> torch.Tensor:
    """Several new tokens of a request past its prompt: exact attention over
    [sink fp | dequantized records | fp tail]. q: ``[n, Hq, D]`` -> ``[n, Hq, D]``."""
    _, g, hk, d = sk.shape
    ctx = length - q.shape[0]
    sb = cfg.sink_tokens // g
    nt = max(0, ctx // g - sb)
    host = blocks.cpu()
    slots = plan.index.slots_of(host).to(sk.device)

    def fp(first_block: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = slots[first_block: -(-stop // g)]
        kk = sk.index_select(0, idx).reshape(-1, hk, d)[start - first_block * g: stop - first_block * g]
        vv = sv.index_select(0, idx).reshape(-1, hk, d)[start - first_block * g: stop - first_block * g]
        return kk.transpose(0, 1).float(), vv.transpose(0, 1).float()

    s = min(cfg.sink_tokens, length)
    keys, values = [], []
    if s:
        kk, vv = fp(0, 0, s)
        keys.append(kk), values.append(vv)
    if nt:
        rec = pages.index_select(0, blocks[sb:sb + nt].to(pages.device)).transpose(0, 1)[None]
        kt, vt = decode_tiles(record_field_views(rec.contiguous(), cfg, d), cfg)  # [1, Hk, nt, D, G], ...
        keys.append(kt[0].transpose(-1, -2).reshape(hk, nt * g, d))
        values.append(vt[0].reshape(hk, nt * g, d))
    tail0 = s + nt * g
    if length > tail0:
        kk, vv = fp(tail0 // g, tail0, length)
        keys.append(kk), values.append(vv)
    o = causal(rotate(q, torch.float32), torch.cat(keys, 1), torch.cat(values, 1), ctx, scale)
    return rotate(o, torch.float32)


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


__all__ = ["causal", "extend", "prefill", "sliding_window"]
