"""Scale-folded decode attention over packed KVarN tiles, ragged across sequences (the CPU path).

One query token for each of B sequences (``Hq = Hk * Gq`` query heads). The history of a sequence
has two parts, both in the rotated frame (``k' = k @ H``):

- full-precision keys/values ``[B, Hk, L, D]`` (the sink and the unfinished tail, in any order)
  with a validity mask ``[B, L]``;
- packed tiles, ragged: ``T`` tiles in all, tile ``t`` (leading dims ``[T, Hk]`` of a
  :class:`~kvarn.codec.TileFields`) belongs to sequence ``tile_row[t]``, so no sequence is padded
  to the longest one.

The tiles are never dequantized. With the scales folded (docs/algorithm.md section 5, exact):

    s[g]  = rK[g] * ( sum_d (q'_d sK_d) codeK[d, g] + q' . zK )
    o'[d] = sum over tiles of cV[d] * ( sum_g (p_g sV_g) codeV[g, d] + p . zV )

so each tile costs two batched matrix products of its unpacked codes (small integers, exact in
float32) against ``Gq`` columns, plus vectors of length G or D. The codes enter the products
centred, ``code - c`` with ``c = (2^b - 1) / 2`` (exact halves; the zero becomes ``z + c s``): the two
terms then no longer cancel where a row's range sits far from zero, which keeps the float32
rounding of the sums at the size of the reference's. One softmax covers both parts:
the maximum and the sum per (sequence, query head) are reduced over the tiles with
``scatter_reduce`` / ``index_add`` on ``tile_row``.

Code order. The codes are unpacked by bit plane and used in that order, never interleaved back:
bit plane ``i`` of the stored K bytes ``[G/P, D]`` holds the tokens ``{P t + i}``, so the scores of
a tile come out in token order ``(i, t)``; ``rK`` is permuted to match and the probabilities are put
back in natural order (a ``[T, Hk, G, Gq]`` tensor) for the V product. Bit plane ``j`` of the stored V
bytes ``[D/P, G]`` holds the channels ``{P c + j}``: the tiles' outputs are summed in that channel
order and put back once per sequence.

Agrees with :func:`kvarn.attention.decode_attention` (the reference, which dequantizes every tile
to float32) to float32 rounding; tests/test_folded.py checks it.
"""

from __future__ import annotations

import math

import torch

from .codec import TileFields
from .config import KVarNConfig
from .hadamard import rotate

__all__ = ["folded_decode_attention", "unpack_planes", "plane_order", "natural_order", "scratch_buffer"]


def scratch_buffer(workspace: dict | None, name: str, shape, dtype, device) -> torch.Tensor:
    """A scratch tensor, reused from ``workspace`` when it has one of this shape and dtype."""
    shape = tuple(shape)
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = workspace.get(name)
    if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
        buf = workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def unpack_planes(codes: torch.Tensor, bits: int, center: float = 0.0, workspace: dict | None = None,
                  name: str = "codes") -> torch.Tensor:
    """Packed codes ``uint8 [..., R, C]`` -> float32 ``[..., P * R, C]`` (minus ``center``), bit plane
    by bit plane.

    Row ``i * R + r`` of the result is bit plane ``i`` (bits ``i*b .. i*b + b - 1``) of byte row ``r``:
    the code that sits at index ``P r + i`` along the packed axis (docs/algorithm.md section 4).
    ``workspace``: a dict of scratch buffers kept by the caller between calls of one shape (the
    result is one of them, valid until the next call with that workspace and ``name``).
    """
    per_byte = 8 // bits
    *lead, r, c = codes.shape
    out = scratch_buffer(workspace, name, (*lead, per_byte * r, c), torch.float32, codes.device)
    if per_byte == 1:
        out.copy_(codes)
    else:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device).view(per_byte, 1, 1)
        planes = scratch_buffer(workspace, name + "_planes", (*lead, per_byte, r, c), torch.uint8, codes.device)
        torch.bitwise_right_shift(codes.unsqueeze(-3), shifts, out=planes).bitwise_and_((1 << bits) - 1)
        # Codes below 2^7 read the same as int8, whose conversion to float is vectorized on CPU
        # (uint8's is several times slower there).
        out.copy_(planes.flatten(-3, -2).view(torch.int8))
    return out.sub_(center) if center else out


def plane_order(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Reorder axis ``dim`` (natural order, length ``n``) into the plane order of :func:`unpack_planes`:
    position ``i * (n / P) + r`` gets natural index ``P r + i``."""
    per_byte = 8 // bits
    if per_byte == 1:
        return x
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    out = x.unflatten(-1, (n // per_byte, per_byte)).transpose(-1, -2).flatten(-2)
    return out.movedim(-1, dim)


def natural_order(x: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`plane_order` along ``dim``."""
    per_byte = 8 // bits
    if per_byte == 1:
        return x
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    out = x.unflatten(-1, (per_byte, n // per_byte)).transpose(-1, -2).flatten(-2)
    return out.movedim(-1, dim)


def folded_decode_attention(
    query: torch.Tensor,
    fp_k: torch.Tensor,
    fp_v: torch.Tensor,
    fp_valid: torch.Tensor,
    tiles: TileFields | None,
    tile_row: torch.Tensor | None,
    config: KVarNConfig,
    scaling: float | None = None,
    workspace: dict | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over [fp keys | ragged packed tiles].

    query:    ``[B, Hq, D]`` un-rotated (after RoPE), any float dtype.
    fp_k, fp_v: ``[B, Hk, L, D]`` rotated, any float dtype (``L`` may be 0).
    fp_valid: bool ``[B, L]``: which fp positions a sequence sees.
    tiles:    :class:`TileFields` with leading dims ``[T, Hk]`` (views of records are fine), or None.
    tile_row: int64 ``[T]``: the sequence of each tile (any order), or None with ``tiles``.
    config:   the codec settings the tiles were written with (bits, G).
    scaling:  softmax scale, default ``1 / sqrt(D)``.
    workspace: optional dict the caller keeps between calls of the same shapes (every layer of a
        step): the large intermediates are written into its buffers instead of fresh tensors, whose
        page faults cost on CPU about as much as the passes themselves.

    Returns float32 ``[B, Hq, D]``, un-rotated. A sequence with no visible key gets 0.
    """
    b, hq, d = query.shape
    hk = fp_k.shape[1]
    if hq % hk:
        raise ValueError(f"Hq={hq} query heads is not a multiple of Hk={hk} KV heads")
    if (tiles is None) != (tile_row is None):
        raise ValueError("tiles and tile_row must be given together")
    gq = hq // hk
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    q = rotate(query, torch.float32).view(b, hk, gq, d)

    # The fp part as one product per sequence over all heads, on float32 copies in token-major
    # layout [B, L, Hk * D] (a paged cache's own order: no transposing copy), against a
    # block-diagonal query [Hk * D, Hk * Gq]: the zero blocks add exact zeros.
    fp_len = fp_k.shape[2]
    fk = scratch_buffer(workspace, "fp_k", (b, fp_len, hk, d), torch.float32, q.device).copy_(fp_k.transpose(1, 2))
    fv = scratch_buffer(workspace, "fp_v", (b, fp_len, hk, d), torch.float32, q.device).copy_(fp_v.transpose(1, 2))
    q_blocks = q.new_zeros(b, hk, d, hk, gq)
    torch.diagonal(q_blocks, dim1=1, dim2=3).copy_(q.permute(0, 3, 2, 1))  # [B, D, Gq, Hk] view
    s_fp = fk.view(b, fp_len, hk * d) @ q_blocks.view(b, hk * d, hk * gq)  # [B, L, Hk * Gq]
    s_fp = s_fp.view(b, fp_len, hk, gq).permute(0, 2, 3, 1) * scale  # [B, Hk, Gq, L]
    s_fp = s_fp.masked_fill(~fp_valid[:, None, None, :], float("-inf"))
    m = s_fp.amax(-1) if s_fp.shape[-1] else s_fp.new_full((b, hk, gq), float("-inf"))
    has_tiles = tiles is not None and tile_row.numel() > 0
    if has_tiles:
        kb, vb = config.key_bits, config.value_bits
        kc, vc = ((1 << kb) - 1) / 2, ((1 << vb) - 1) / 2
        qt = q.index_select(0, tile_row)  # [T, Hk, Gq, D]
        k_scale = tiles.k_row_scale.to(torch.float32)
        k_zero = tiles.k_row_zero.to(torch.float32) + kc * k_scale
        k_codes = unpack_planes(tiles.k_codes, kb, kc, workspace, "k")  # [T, Hk, G (plane order), D]
        raw = k_codes @ (qt * k_scale[:, :, None, :]).transpose(-1, -2)
        qz = (qt * k_zero[:, :, None, :]).sum(-1)  # raw: [T, Hk, G (plane order), Gq]; qz: [T, Hk, Gq]
        rk = plane_order(tiles.k_col_scale.to(torch.float32), kb) * scale  # [T, Hk, G]
        s_t = (raw + qz[:, :, None, :]) * rk[..., None]
        t_max = s_t.amax(2)  # [T, Hk, Gq]
        m = m.scatter_reduce(0, tile_row[:, None, None].expand_as(t_max), t_max, "amax")
    # Where nothing is visible m is -inf: use 0 so exp gives 0 instead of NaN.
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e_fp = torch.exp(s_fp - m[..., None])
    l_sum = e_fp.sum(-1)  # [B, Hk, Gq]
    acc = e_fp.reshape(b, hk * gq, fp_len) @ fv.view(b, fp_len, hk * d)  # [B, Hk * Gq, Hk * D]
    acc = torch.diagonal(acc.view(b, hk, gq, hk, d), dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, Hk, Gq, D]
    if has_tiles:
        e_t = torch.exp(s_t - m.index_select(0, tile_row)[:, :, None, :])  # [T, Hk, G, Gq]
        l_sum = l_sum.index_add(0, tile_row, e_t.sum(2))
        p = natural_order(e_t, kb, dim=2)
        v_scale = tiles.v_row_scale.to(torch.float32)
        v_zero = tiles.v_row_zero.to(torch.float32) + vc * v_scale
        pz = (p * v_zero[..., None]).sum(2)  # [T, Hk, Gq]
        v_codes = unpack_planes(tiles.v_codes, vb, vc, workspace, "v")  # [T, Hk, D (plane order), G]
        o_t = v_codes @ (p * v_scale[..., None])
        cv = plane_order(tiles.v_col_scale.to(torch.float32), vb)  # [T, Hk, D]
        o_t = (o_t + pz[:, :, None, :]) * cv[..., None]
        acc_t = o_t.new_zeros(b, hk, d, gq).index_add_(0, tile_row, o_t)
        acc = acc + natural_order(acc_t, vb, dim=2).transpose(-1, -2)
    # The largest visible score contributes exp(0) = 1, so a sum below 1 means nothing is visible
    # (and then acc is 0): clamping gives the 0 output without a NaN.
    out = acc / l_sum.clamp_min(1.0)[..., None]
    return rotate(out.reshape(b, hq, d), torch.float32)
