"""Scale-folded decode attention over packed KVarN tiles, ragged across sequences (the CPU path).

One query token for each of B sequences (``Hq = Hk * Gq`` query heads). The history of a sequence
has two parts, both in the rotated frame (``k' = k @ H``):

- full-precision keys/values ``[B, Hk, L, D]`` (the sink and the unfinished tail, in any order)
  with a validity mask ``[B, L]``;
- packed tiles, ragged: ``T`` tiles in all, tile ``t`` (leading dims ``[T, Hk]`` of a
  :class:`~kvarn.codec.record.TileFields`) belongs to sequence ``tile_row[t]``, so no sequence is padded
  to the longest one.

The full-precision part is one fused attention call (PyTorch's CPU flash attention, which also
returns the log-sum-exp) in the dtype of the staged keys, the dtype the vLLM backend's exact
prefill attention runs in too: its output and log-sum-exp merge into the softmax over the tiles. The tiles are never
dequantized. With the scales folded (docs/algorithm.md section 5, exact):

    s[g]  = rK[g] * ( sum_d (q'_d sK_d) codeK[d, g] + q' . zK )
    o'[d] = sum over tiles of cV[d] * ( sum_g (p_g sV_g) codeV[g, d] + p . zV )

so each tile costs two batched matrix products of its unpacked codes (small integers, exact in
float32) against ``Gq`` rows, plus vectors of length G or D. The codes enter the products
centred, ``code - c`` with ``c = 2^(b-1)`` (the zero becomes ``z + c s``): the two terms then no
longer cancel where a row's range sits far from zero, which keeps the float32 rounding of the sums
at the size of the reference's. One softmax covers both parts: the maximum and the sum per
(sequence, query head) are reduced over the tiles with ``scatter_reduce`` / ``index_add`` on
``tile_row``.

Code order. The codes are unpacked in the order of the packed axis: byte row ``r`` of the stored K
bytes ``[G/P, D]`` holds the tokens ``P r .. P r + P - 1``, and its ``P`` fields go to rows
``P r + i`` of the unpacked ``[G, D]`` (the shift that moves field ``i`` to the top of the byte
writes that row directly), so scores, probabilities and outputs are in natural token and channel
order and nothing is permuted afterwards; the V bytes ``[D/P, G]`` unpack to ``[D, G]`` alike.

Agrees with :func:`kvarn.attention.decode_attention` (the reference, which dequantizes every tile
to float32) to float32 rounding for float32 inputs, and to the rounding of the input dtype for
16-bit fp keys; tests/cpu/test_decode.py checks both.
"""

from __future__ import annotations

import math

import torch

from ..codec.hadamard import rotate
from ..codec.record import TileFields
from ..config import KVarNConfig

__all__ = ["folded_decode_attention", "unpack_centred", "scratch_buffer"]


def scratch_buffer(workspace: dict | None, name: str, shape, dtype, device) -> torch.Tensor:
    """A scratch tensor, reused from ``workspace`` when it has one of this shape and dtype."""
    shape = tuple(shape)
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buf = workspace.get(name)
    if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
        buf = workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def unpack_centred(codes: torch.Tensor, bits: int, workspace: dict | None = None,
                   name: str = "codes") -> torch.Tensor:
    """Packed codes ``uint8 [..., R, C]`` (packed along ``R``) -> int8 ``[..., P * R, C]`` of
    ``code - 2^(b-1)``, in natural order: row ``P r + i`` holds field ``i`` (bits ``i*b .. i*b + b - 1``)
    of byte row ``r`` (docs/algorithm.md section 4).

    The codes come out centred on ``2^(b-1)`` (integers in ``[-2^(b-1), 2^(b-1))``) at no cost:
    flipping the top bit of every field turns its sign extension, two shifts of an int8, into
    ``code - 2^(b-1)``, so no float pass subtracts the centre. They stay int8 (exact): the products
    convert them to float32 a cache-sized chunk at a time (:func:`_chunked_matmul`).
    ``workspace``: a dict of scratch buffers kept by the caller between calls of one shape (the
    result is one of them, valid until the next call with that workspace and ``name``).
    """
    per_byte = 8 // bits
    *lead, r, c = codes.shape
    top_bits = sum(1 << (bits * i + bits - 1) for i in range(per_byte))  # 0x80, 0x88 or 0xAA
    fields = scratch_buffer(workspace, name + "_fields", (*lead, r, per_byte, c), torch.uint8, codes.device)
    if per_byte == 1:
        return torch.bitwise_xor(codes, top_bits, out=fields.squeeze(-2)).view(torch.int8)
    flipped = scratch_buffer(workspace, name + "_bytes", codes.shape, torch.uint8, codes.device)
    torch.bitwise_xor(codes, top_bits, out=flipped)
    # Field i moved to the top of the byte, then an arithmetic shift back down sign-extends it. One
    # shift by a scalar per field: a broadcast tensor of shifts took twice as long.
    for i in range(per_byte):
        torch.bitwise_left_shift(flipped, 8 - bits * (i + 1), out=fields[..., i, :])
    return fields.view(torch.int8).bitwise_right_shift_(8 - bits).flatten(-3, -2)


# Float32 bytes of the codes converted per product call: the conversion writes them and the product
# reads them back while they are still in the core's L2 cache (2 MiB per core here; each of the two
# threads of a call takes half). One conversion and one product over a whole layer's codes (tens of
# MiB) run at memory speed instead, about 1.5x the time.
CHUNK_BYTES = 1 << 20


def _chunked_matmul(a: torch.Tensor, codes: torch.Tensor, out: torch.Tensor, workspace: dict | None,
                    name: str) -> torch.Tensor:
    """``out = a @ codes.float().transpose(-1, -2)`` over leading dim 0, converting ``codes`` (int8
    ``[T, ..., N, K]``) to float32 a chunk of tiles at a time. a: ``[T, ..., M, K]``, out ``[T, ..., M, N]``,
    both contiguous. Each matrix is the same product as without chunks (one ``bmm`` per chunk, on
    3-d views: ``matmul`` over 4-d slices added a dozen view operations per chunk)."""
    t, per = codes.shape[0], codes[0].numel() // (codes.shape[-2] * codes.shape[-1])  # matrices per tile
    step = max(1, CHUNK_BYTES // (codes[0].numel() * 4))
    buf = scratch_buffer(workspace, name + "_f32", (min(step, t) * per, *codes.shape[-2:]), torch.float32,
                         codes.device)
    a3, c3, out3 = a.view(-1, *a.shape[-2:]), codes.view(-1, *codes.shape[-2:]), out.view(-1, *out.shape[-2:])
    for t0 in range(0, t, step):
        i0, i1 = t0 * per, min(t0 + step, t) * per
        f = buf[: i1 - i0].copy_(c3[i0:i1])  # int8 to float32 is vectorized on CPU (uint8's is not)
        torch.bmm(a3[i0:i1], f.transpose(1, 2), out=out3[i0:i1])
    return out


def _code_products(a: torch.Tensor, codes: torch.Tensor, bits: int, workspace: dict | None, name: str,
                   kernels: str) -> torch.Tensor:
    """``a [T, Hk, M, K] @ unpack_centred(codes [T, Hk, N/P, K]).T`` -> float32 ``[T, Hk, M, N]``."""
    if kernels == "numba":
        from .matmul import packed_matmul

        return packed_matmul(a, codes, bits)
    unpacked = unpack_centred(codes, bits, workspace, name)  # [T, Hk, N, K]
    return _chunked_matmul(a, unpacked, a.new_empty(*a.shape[:3], unpacked.shape[-2]), workspace, name)


def _fp_attention(q: torch.Tensor, fp_k: torch.Tensor, fp_v: torch.Tensor,
                  fp_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled query ``q [B, Hk, Gq, D]`` (float32) over the fp keys, non-causal: the ``Gq`` query
    heads of a KV head are its query rows, so K/V are never repeated per head.

    Returns (output float32 ``[B, Hk, Gq, D]``, normalized; log-sum-exp ``[B, Hk, Gq]``, ``-inf``
    where a sequence sees no fp key). In the dtype of ``fp_k``, read in place (no float32 copies).
    """
    b, hk, gq, d = q.shape
    if fp_k.shape[2] == 0:
        return q.new_zeros(b, hk, gq, d), q.new_full((b, hk, gq), float("-inf"))
    bias = torch.zeros(fp_valid.shape, dtype=fp_k.dtype, device=q.device).masked_fill_(~fp_valid, float("-inf"))
    # The aten op behind F.scaled_dot_product_attention on CPU: the public function does not return
    # the log-sum-exp, which the merge with the tiles needs.
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to(fp_k.dtype), fp_k, fp_v, 0.0, False, attn_mask=bias[:, None, None, :], scale=1.0)
    # A row that sees nothing comes back as output 0, log-sum-exp 0.
    lse = lse.masked_fill(~fp_valid.any(-1)[:, None, None], float("-inf"))
    return out.to(torch.float32), lse


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
    kernels: str = "torch",
) -> torch.Tensor:
    """Attention of one query token per sequence over [fp keys | ragged packed tiles].

    query:    ``[B, Hq, D]`` un-rotated (after RoPE), any float dtype.
    fp_k, fp_v: ``[B, Hk, L, D]`` rotated, one float dtype, CPU tensors (``L`` may be 0); any strides
        with a contiguous last axis (views of a token-major staging buffer are fine).
    fp_valid: bool ``[B, L]``: which fp positions a sequence sees.
    tiles:    :class:`TileFields` with leading dims ``[T, Hk]`` (views of records are fine), or None.
    tile_row: int64 ``[T]``: the sequence of each tile (any order), or None with ``tiles``.
    config:   the codec settings the tiles were written with (bits, G).
    scaling:  softmax scale, default ``1 / sqrt(D)``.
    workspace: optional dict the caller keeps between calls of the same shapes (every layer of a
        step): the unpacked codes are written into its buffers instead of fresh tensors, whose
        page faults cost on CPU about as much as the passes themselves.

    kernels:  who multiplies by the codes: ``"torch"`` (unpacked int8 codes, float32 ``bmm``) or
        ``"numba"`` (:func:`kvarn.cpu.matmul.packed_matmul`, from the packed bytes).

    Returns float32 ``[B, Hq, D]``, un-rotated. A sequence with no visible key gets 0.
    """
    if kernels not in ("torch", "numba"):
        raise ValueError(f"kernels={kernels!r}; choose one of ['torch', 'numba']")
    b, hq, d = query.shape
    hk = fp_k.shape[1]
    if hq % hk:
        raise ValueError(f"Hq={hq} query heads is not a multiple of Hk={hk} KV heads")
    if (tiles is None) != (tile_row is None):
        raise ValueError("tiles and tile_row must be given together")
    gq = hq // hk
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    q = (rotate(query, torch.float32) * scale).view(b, hk, gq, d)  # the softmax scale, once

    o_fp, lse_fp = _fp_attention(q, fp_k, fp_v, fp_valid)
    m = lse_fp  # the fp part's log-sum-exp starts the maximum
    has_tiles = tiles is not None and tile_row.numel() > 0
    if has_tiles:
        # Every product keeps the long axis (keys, or channels of the output) innermost: the scores are
        # [.., Gq, keys], so the per-key scale, the maximum and exp run over contiguous rows (with the
        # Gq = Hq / Hk axis innermost they cost several times more than the products).
        kb, vb = config.key_bits, config.value_bits
        qt = q.index_select(0, tile_row)  # [T, Hk, Gq, D]
        k_scale = tiles.k_row_scale.to(torch.float32)
        k_zero = torch.add(tiles.k_row_zero.to(torch.float32), k_scale, alpha=1 << (kb - 1))  # the centred codes' zero
        s_t = _code_products(qt * k_scale[:, :, None, :], tiles.k_codes, kb, workspace, "k", kernels)  # [T, Hk, Gq, G]
        qz = torch.matmul(qt, k_zero[..., None])  # [T, Hk, Gq, 1]
        s_t.add_(qz).mul_(tiles.k_col_scale.to(torch.float32)[:, :, None, :])  # rK
        t_max = s_t.amax(-1)  # [T, Hk, Gq]
        m = m.scatter_reduce(0, tile_row[:, None, None].expand_as(t_max), t_max, "amax")
    # Where nothing is visible m is -inf: a finite floor makes exp give 0 instead of NaN.
    m = m.clamp_min(torch.finfo(torch.float32).min)
    w_fp = torch.exp(lse_fp - m)  # the fp part's sum of weights, relative to exp(m)
    l_sum = w_fp
    acc = o_fp.mul_(w_fp[..., None])  # [B, Hk, Gq, D]
    if has_tiles:
        p = s_t.sub_(m.index_select(0, tile_row)[..., None]).exp_()  # [T, Hk, Gq, G]
        l_sum = l_sum.index_add(0, tile_row, p.sum(-1))
        v_scale = tiles.v_row_scale.to(torch.float32)
        v_zero = torch.add(tiles.v_row_zero.to(torch.float32), v_scale, alpha=1 << (vb - 1))
        pz = torch.matmul(p, v_zero[..., None])  # [T, Hk, Gq, 1]
        o_t = _code_products(p.mul_(v_scale[:, :, None, :]), tiles.v_codes, vb, workspace, "v", kernels)  # [T, Hk, Gq, D]
        o_t.add_(pz).mul_(tiles.v_col_scale.to(torch.float32)[:, :, None, :])  # cV
        acc = acc.index_add(0, tile_row, o_t)
    # The largest visible score contributes exp(0) = 1, so a sum below 1 means nothing is visible
    # (and then acc is 0): clamping gives the 0 output without a NaN.
    out = acc / l_sum.clamp_min(1.0)[..., None]
    return rotate(out.reshape(b, hq, d), torch.float32)
