"""The two batched operations of a KVarN layer's step, dispatched by kernels: committing tiles of
token rows into paged records, and the paged decode attention of the step's decode rows.

- ``"triton"`` (CUDA): :func:`kvarn.kernels.encode.encode_into_pages` and
  :func:`kvarn.kernels.decode.paged_decode_attention`, one launch each, indices read on the device.
- ``"torch"``: their twins in :mod:`kvarn.paged` (any device).
- ``"numba"`` (CPU): the numba tile encoder (:mod:`kvarn.cpu.encoder`, the codec's bits) and the
  CPU decode attention that never dequantizes a record (:func:`kvarn.cpu.decode.folded_decode_attention`).
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import KVarNConfig
from ...codec.hadamard import rotate as rotate_rows
from ...codec.record import record_field_views, store_records

# Tiles per numba encode call: bounded buffers (a prefill commits up to max_num_batched_tokens / G).
CPU_COMMIT_TILES = 256


def launch_size(n: int, sizes: tuple[int, ...]) -> int:
    """The launch size of ``n`` entries in an eager step: the first of vLLM's graph sizes ``sizes``
    (ascending) that holds them, else the next power of two. Triton compiles a kernel variant per
    launch plan and integer specialization; sizing eager launches like the captured ones keeps
    their variants to the few the graph capture and the warm-up compiled (a compile takes seconds)."""
    for size in sizes:
        if size >= n:
            return size
    return 1 << max(n - 1, 0).bit_length()


def aligned_offsets(sizes: list[int], itemsize: int) -> list[int]:
    """Where arrays of ``sizes`` elements of ``itemsize`` bytes start when packed into one buffer,
    each 16-byte aligned, then the buffer's length. Triton specializes a pointer argument on
    whether it is 16-byte aligned: views of one upload at arbitrary offsets would launch other
    variants than the captured steps' aligned buffers, each compiled inside a served step."""
    step = max(1, 16 // itemsize)
    starts, pos = [], 0
    for n in sizes:
        starts.append(pos)
        pos += -(-n // step) * step
    return starts + [pos]


def pack_aligned(arrays: dict[str, np.ndarray], dtype) -> tuple[np.ndarray, dict[str, slice]]:
    """``arrays`` (flattened, cast to ``dtype``) in one buffer, each at a 16-byte aligned start
    (:func:`aligned_offsets`, zeros between them), and the slice of each."""
    flat = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays.values()]
    starts = aligned_offsets([a.size for a in flat], np.dtype(dtype).itemsize)
    packed = np.zeros(starts[-1], dtype=dtype)
    where = {}
    for k, a, start in zip(arrays, flat, starts):
        packed[start:start + a.size] = a
        where[k] = slice(start, start + a.size)
    return packed, where


def graph_sizes(vllm_config) -> tuple[int, ...]:
    """vLLM's CUDA-graph sizes of this engine, ascending (none without graphs)."""
    return tuple(sorted(vllm_config.compilation_config.cudagraph_capture_sizes or ()))


def pad_commits(src: np.ndarray | None, dst: np.ndarray | None,
                sizes: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A commit list padded to :func:`launch_size` with entries of no tile (page -1); an empty or
    absent one stays as it is (nothing is launched for it)."""
    if src is None or not src.size:
        return src, dst
    pad = launch_size(src.size, sizes) - src.size
    return (np.concatenate([src, np.zeros(pad, dtype=src.dtype)]),
            np.concatenate([dst, np.full(pad, -1, dtype=dst.dtype)]))


def commit_tiles(rows_k: torch.Tensor, rows_v: torch.Tensor, src: torch.Tensor | None, pages: torch.Tensor,
                 dst: torch.Tensor | None, cfg: KVarNConfig, kernels: str, static: bool,
                 rotate: bool = False) -> None:
    """Encode the tiles of G token rows starting at ``src`` of ``rows_k``, ``rows_v`` ``[N, Hk, D]``
    into ``pages`` at ``dst`` (negative: none). ``static``: launch even when no entry is a tile (a
    captured graph's launches are fixed); ``rotate``: the rows are in the model frame."""
    if src is None or (not static and src.numel() == 0):
        return
    if kernels == "triton":
        from ...kernels.encode import encode_into_pages

        encode_into_pages(rows_k, rows_v, src, pages, dst, cfg, rotate=rotate)
        return
    if kernels == "torch":
        from ...paged import encode_into_pages

        encode_into_pages(rows_k, rows_v, src, pages, dst, cfg, rotate=rotate)
        return
    from ...cpu.encoder import encode_tiles

    keep = dst >= 0
    src, dst = src[keep].long(), dst[keep].long()
    g, d = cfg.tile, rows_k.shape[-1]
    for first in range(0, src.numel(), CPU_COMMIT_TILES):
        part = src[first:first + CPU_COMMIT_TILES]
        idx = part[:, None] + torch.arange(g)[None, :]
        k, v = rows_k[idx].float(), rows_v[idx].float()  # [C, G, Hk, D]
        if rotate:
            k, v = rotate_rows(k), rotate_rows(v)
        fields = encode_tiles(k.permute(0, 2, 3, 1).contiguous(), v.permute(0, 2, 1, 3).contiguous(), cfg,
                              parallel=True)
        pages.index_copy_(0, dst[first:first + CPU_COMMIT_TILES], store_records(fields, cfg, d))


def decode_rows(q, stage_k, stage_v, pages, md, out, cfg: KVarNConfig, scale: float, max_tiles: int,
                kernels: str) -> None:
    """One query token per decode row of ``md`` over [sink | records | tail], written to ``out``."""
    s = cfg.sink_tokens
    if kernels in ("triton", "torch") and (kernels == "triton" or q.is_cuda):
        if kernels == "triton":
            from ...kernels.decode import paged_decode_attention
        else:
            from ...paged import paged_decode_attention
        args = (stage_k, stage_v, md.dec_slot, md.dec_sink, md.dec_tail, pages)
        kw = dict(sink_tokens=s, max_tiles=max_tiles)
        if md.uniform:  # rows are the step's tokens, in order: no gather, the output in place
            r = md.dec_slot.shape[0]
            paged_decode_attention(q[:r], *args, md.block_table[:r], md.dec_tiles, cfg, scale, out=out[:r], **kw)
        else:
            if kernels == "triton":  # planned as the graphs' launch of this many rows (:func:`launch_size`)
                kw["plan_rows"] = md.dec_plan_rows
            o = paged_decode_attention(q.index_select(0, md.dec_tok), *args, md.block_table.index_select(0, md.dec_req),
                                       md.dec_tiles, cfg, scale, **kw)
            out.index_copy_(0, md.dec_tok, o.to(out.dtype))
        return
    from ...cpu.decode import folded_decode_attention

    fp_k = stage_k.index_select(0, md.dec_slot.long()).transpose(1, 2)  # [Rd, Hk, L, D]
    fp_v = stage_v.index_select(0, md.dec_slot.long()).transpose(1, 2)
    pos = torch.arange(fp_k.shape[2])[None, :]
    valid = torch.where(pos < s, pos < md.dec_sink[:, None], pos - s < md.dec_tail[:, None])
    tiles = rows = None
    if md.dec_tile_list.numel():
        rec = pages.index_select(0, md.dec_tile_list)
        tiles, rows = record_field_views(rec, cfg, q.shape[-1]), md.dec_tile_row
    o = folded_decode_attention(q.index_select(0, md.dec_tok), fp_k, fp_v, valid, tiles, rows, cfg, scale,
                                workspace=md.scratch, kernels="numba" if kernels == "numba" else "torch")
    out.index_copy_(0, md.dec_tok, o.to(out.dtype))


__all__ = ["aligned_offsets", "commit_tiles", "decode_rows", "graph_sizes", "launch_size", "pack_aligned",
           "pad_commits"]
