"""Tile records in vLLM's paged KV cache: the pure-torch twins of the paged Triton kernels.

Layout (docs/vllm.md). A KV block of G tokens holds, per KV head, one record of
docs/algorithm.md section 4 (the tile-store order of :mod:`kvarn.codec.record`): a layer's pages are
uint8 ``[num_blocks, Hk, record_bytes]``, and a request's tile ``j`` (tokens ``jG .. jG + G - 1``)
is the record at page ``block_table[row, j]``. Tokens not in a record (the sink, the unfinished
tail) live in the request's staging slot ``[L, Hk, D]`` in the rotated frame: the sink at slot rows
``0 .. S - 1`` and the tail, from its first token, at rows ``S ..``.

- :func:`encode_into_pages`: tiles of G consecutive token rows -> records at given pages.
- :func:`paged_decode_attention`: one query token per row over [sink | records | tail].

Their Triton twins (:func:`kvarn.kernels.encode.encode_into_pages`,
:func:`kvarn.kernels.decode.paged_decode_attention`) take the same arguments.
"""

from __future__ import annotations

import torch

from .attention import decode_attention
from .codec import encode_tiles
from .config import KVarNConfig
from .codec.hadamard import rotate as rotate_rows
from .codec.record import record_field_views, store_records


def _tile_rows(rows: torch.Tensor, src_rows: torch.Tensor, tile: int) -> torch.Tensor:
    """``rows [N, Hk, D]`` -> the tiles starting at ``src_rows`` as ``[C, G, Hk, D]``."""
    idx = src_rows.long()[:, None] + torch.arange(tile, device=rows.device)[None, :]
    return rows[idx]


def encode_into_pages(
    rows_k: torch.Tensor, rows_v: torch.Tensor, src_rows: torch.Tensor, pages: torch.Tensor,
    dst_pages: torch.Tensor, config: KVarNConfig, *, rotate: bool = False,
) -> None:
    """Encode the tiles of G token rows starting at ``src_rows`` (int32 ``[C]``) of ``rows_k``,
    ``rows_v`` (``[N, Hk, D]``, rotated frame, or the model frame with ``rotate``) into ``pages``
    (uint8 ``[num_blocks, Hk, record_bytes]``) at ``dst_pages`` (int32 ``[C]``; negative: skipped)."""
    keep = dst_pages >= 0
    src, dst = src_rows[keep], dst_pages[keep].long()
    if not src.numel():
        return
    d = rows_k.shape[-1]
    k = _tile_rows(rows_k, src, config.tile).float()  # [C, G, Hk, D]
    v = _tile_rows(rows_v, src, config.tile).float()
    if rotate:
        k, v = rotate_rows(k), rotate_rows(v)
    fields = encode_tiles(k.permute(0, 2, 3, 1).contiguous(), v.permute(0, 2, 1, 3).contiguous(), config)
    pages.index_copy_(0, dst, store_records(fields, config, d).to(pages.device))


def paged_decode_attention(
    query: torch.Tensor,
    staging_k: torch.Tensor,
    staging_v: torch.Tensor,
    slots: torch.Tensor,
    sink_lengths: torch.Tensor,
    tail_lengths: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    tile_counts: torch.Tensor,
    config: KVarNConfig,
    scaling: float | None = None,
    *,
    sink_tokens: int,
    max_tiles: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query [R, Hq, D]`` (model frame, one token per row) over row ``r``'s sink
    ``staging[slots[r], :sink_lengths[r]]``, its ``tile_counts[r]`` records at pages
    ``block_table[r, S/G ..]`` and its tail ``staging[slots[r], S : S + tail_lengths[r]]``
    (``S = sink_tokens``; staging ``[P, L, Hk, D]`` in the rotated frame). ``max_tiles`` bounds
    ``tile_counts`` (the kernel's launch size). Returns ``[R, Hq, D]`` (model frame), in ``out``
    when given. A row that sees no key gets 0."""
    r = query.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if r == 0:
        return out
    slot = slots.long()
    sink_k, sink_v = staging_k[slot, :sink_tokens], staging_v[slot, :sink_tokens]  # [R, S, Hk, D]
    tail_k, tail_v = staging_k[slot, sink_tokens:], staging_v[slot, sink_tokens:]
    tiles = None
    if max_tiles:
        first = sink_tokens // config.tile
        blocks = block_table[:, first:first + max_tiles].long()  # [R, N]; entries past a count unread
        blocks = blocks.clamp(0, pages.shape[0] - 1)
        rec = pages[blocks].transpose(1, 2).contiguous()  # [R, Hk, N, record]
        tiles = record_field_views(rec, config, query.shape[-1])
    o = decode_attention(
        query[:, :, None], *(x.transpose(1, 2) if x.shape[1] else None for x in (sink_k, sink_v)), tiles,
        tail_k.transpose(1, 2), tail_v.transpose(1, 2), config, scaling,
        sink_lengths=sink_lengths.long() if sink_tokens else None, tile_counts=tile_counts.long() if max_tiles else None,
        tail_lengths=tail_lengths.long(), causal=False, fp_frame="rotated")
    out.copy_(o[:, :, 0])
    return out


__all__ = ["encode_into_pages", "paged_decode_attention"]
