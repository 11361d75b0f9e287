"""Fused decode attention over [fp sink | packed KVarN tiles | fp tail]: twin of
:func:`kvarn.attention.decode_attention` (same signature, same result within fp16 tolerance).

One program per (sequence, KV head, split). Its ``GROUP * Tq`` query rows (all query heads that
share the KV head, times the query tokens) form one ``BLOCK_M`` block, so every tile is read and
unpacked once per group. The query is rotated in the kernel (``q' = q @ H``, H as exact +-1 fp16
times ``1/sqrt(D)``); the output is un-rotated in the kernel (one split) or in the combine kernel.

Per quantized tile the scales are folded (spec section 5) so that only raw codes enter the matrix
units, two ``tl.dot`` per tile:

    s[m, g]  = rK[g] * ( (q' * sK)[m, :] @ codes_K[:, g] + q'[m, :] . zK )
    o'[m, d] += cV[d] * ( (p * sV)[m, :] @ codes_V[:, d] + p[m, :] . zV )

The fp32 left operands (q' * sK, p * sV, and the output before un-rotation) are split into fp16
high and low halves stacked as extra rows of the same MMA (``precise``, the default; see
``dot_split``): the codes are exact in fp16, so the products are then accurate to about 2^-22
instead of 2^-11, which matters where the dot cancels against the zero-point term.

Codes are unpacked without integer-to-float conversion: a 2- or 4-bit code c in the low bits of a
byte, read as fp8 e4m3, is exactly ``c / 512`` (subnormals and the first binade), and the hardware
converts fp8 to fp16 directly; the 512 is folded into the scales. The packed bytes of a tile are
loaded whole (contiguous rows) and the codes put back in natural order with ``tl.join``; the next
tile's bytes and scales are loaded before the current tile is computed, so loads stay in flight.

Long contexts at small batch are split over tiles (split-K): each split writes ``(m, l, acc)`` and
a combine kernel merges them; the fp sink and tail then get a split of their own.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..attention import check_decode_inputs
from ..codec import TileFields
from ..config import KVarNConfig
from ..hadamard import hadamard_matrix
from .decode_blocks import dot_split, fp_block, load_tile, unpack_rows
from .layout import check_device, empty_fields, lead_strides

LOG2E = 1.4426950408889634
MIN_TILES_PER_SPLIT = 4
PROGRAMS_PER_SM = 4


@triton.jit
def _decode_attention_kernel(
    q_ptr, q_sb, q_sh, q_st, h_ptr,
    sk_ptr, sv_ptr, s_sb, s_sh, s_sn, s_len_ptr, S_CAP,
    tk_ptr, tv_ptr, t_sb, t_sh, t_sn, t_len_ptr, R_CAP,
    kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
    kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
    vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
    vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn,
    n_len_ptr,
    o_ptr, o_sb, o_sh, o_st, pacc_ptr, pml_ptr,
    HK, qk_scale, inv_sqrt_d, TILES_PER_SPLIT, TILE_SPLITS,
    D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    GROUP: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FP_SPLIT: tl.constexpr, CAUSAL: tl.constexpr, FP_ROTATED: tl.constexpr,
    KSCALE: tl.constexpr, VSCALE: tl.constexpr, PRECISE: tl.constexpr, SPLIT_ROWS: tl.constexpr,
):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // HK
    h = bh % HK
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * TQ
    qi = rows % TQ  # query token of each row
    qh = h * GROUP + rows // TQ  # query head of each row
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b64 * q_sb + qh[:, None].to(tl.int64) * q_sh + qi[:, None] * q_st + d[None, :],
                mask=row_ok[:, None], other=0.0)
    hmat = tl.load(h_ptr + d[:, None] * D + d[None, :])  # +-1, fp16
    # q is fp16 and H is +-1, so the product is exact in fp32 (the split only pads the block to 16 rows).
    qr = dot_split(q.to(tl.float32), hmat, PRECISE, SPLIT_ROWS) * (inv_sqrt_d * qk_scale)  # rotated, log2 domain

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    if FP_SPLIT:
        fp_sp = TILE_SPLITS
    else:
        fp_sp = 0
    if sp == fp_sp:
        big = tl.full([BLOCK_M], 1 << 30, tl.int32)
        s_len = tl.load(s_len_ptr + b)
        for n0 in range(0, S_CAP, BLOCK_N):
            m_i, l_i, acc = fp_block(qr, sk_ptr, sv_ptr, b64 * s_sb + h64 * s_sh, s_sn, n0, s_len, big,
                                     m_i, l_i, acc, hmat, inv_sqrt_d, D, BLOCK_N, FP_ROTATED, PRECISE, SPLIT_ROWS)
        t_len = tl.load(t_len_ptr + b)
        if CAUSAL:
            lim = t_len - TQ + 1 + qi
        else:
            lim = big
        for n0 in range(0, R_CAP, BLOCK_N):
            m_i, l_i, acc = fp_block(qr, tk_ptr, tv_ptr, b64 * t_sb + h64 * t_sh, t_sn, n0, t_len, lim,
                                     m_i, l_i, acc, hmat, inv_sqrt_d, D, BLOCK_N, FP_ROTATED, PRECISE, SPLIT_ROWS)

    if sp < TILE_SPLITS:
        n_len = tl.load(n_len_ptr + b)
        t_start = sp * TILES_PER_SPLIT
        t_end = tl.minimum(t_start + TILES_PER_SPLIT, n_len)
        rows_g = tl.arange(0, G)
        cols_kb = tl.arange(0, G * KB // 8)
        cols_vb = tl.arange(0, D * VB // 8)
        # Prefetch: tile n+1 is loaded before tile n is computed (clamped: a harmless reload at the end).
        kc, vc, sk, zk, rk, cv, sv, zv = load_tile(
            tl.minimum(t_start, tl.maximum(t_end - 1, 0)), b64, h64, d, rows_g, cols_kb, cols_vb,
            kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
            kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
            vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
            vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn, D, G, KB, VB)
        for n in range(t_start, t_end):
            kc2, vc2, sk2, zk2, rk2, cv2, sv2, zv2 = load_tile(
                tl.minimum(n + 1, t_end - 1), b64, h64, d, rows_g, cols_kb, cols_vb,
                kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
                kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
                vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
                vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn, D, G, KB, VB)
            qs = qr * (sk.to(tl.float32) * KSCALE)[None, :]
            qz = tl.sum(qr * zk.to(tl.float32)[None, :], axis=1)
            s = (dot_split(qs, unpack_rows(kc, D, G, KB), PRECISE, SPLIT_ROWS) + qz[:, None]) * rk.to(tl.float32)[None, :]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            ps = p * (sv.to(tl.float32) * VSCALE)[None, :]
            zs = tl.sum(p * zv.to(tl.float32)[None, :], axis=1)
            pv = dot_split(ps, unpack_rows(vc, G, D, VB), PRECISE, SPLIT_ROWS)
            acc = acc * alpha[:, None] + (pv + zs[:, None]) * cv.to(tl.float32)[None, :]
            kc, vc, sk, zk, rk, cv, sv, zv = kc2, vc2, sk2, zk2, rk2, cv2, sv2, zv2

    if not FP_SPLIT:
        # One split: normalize and un-rotate here.
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)
        o = dot_split(acc * inv_l[:, None], hmat, PRECISE, SPLIT_ROWS) * inv_sqrt_d
        tl.store(o_ptr + b64 * o_sb + qh[:, None].to(tl.int64) * o_sh + qi[:, None] * o_st + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        NS = TILE_SPLITS + 1
        pbase = (bh.to(tl.int64) * NS + sp) * BLOCK_M
        tl.store(pacc_ptr + (pbase + rows[:, None]) * D + d[None, :], acc)
        tl.store(pml_ptr + (pbase + rows) * 2, m_i)
        tl.store(pml_ptr + (pbase + rows) * 2 + 1, l_i)


@triton.jit
def _combine_kernel(
    pacc_ptr, pml_ptr, h_ptr, o_ptr, o_sb, o_sh, o_st, HK, inv_sqrt_d,
    NS, D: tl.constexpr, GROUP: tl.constexpr, TQ: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISE: tl.constexpr, SPLIT_ROWS: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // HK
    h = bh % HK
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    m_tot = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NS):
        m_tot = tl.maximum(m_tot, tl.load(pml_ptr + ((bh.to(tl.int64) * NS + s) * BLOCK_M + rows) * 2))
    m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
    l_tot = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(NS):
        base = (bh.to(tl.int64) * NS + s) * BLOCK_M
        w = tl.exp2(tl.load(pml_ptr + (base + rows) * 2) - m_safe)
        l_tot += w * tl.load(pml_ptr + (base + rows) * 2 + 1)
        acc += w[:, None] * tl.load(pacc_ptr + (base + rows[:, None]) * D + d[None, :])
    inv_l = tl.where(l_tot > 0, 1.0 / l_tot, 0.0)
    o = dot_split(acc * inv_l[:, None], tl.load(h_ptr + d[:, None] * D + d[None, :]), PRECISE, SPLIT_ROWS) * inv_sqrt_d
    qi = rows % TQ
    qh = h * GROUP + rows // TQ
    tl.store(o_ptr + b.to(tl.int64) * o_sb + qh[:, None].to(tl.int64) * o_sh + qi[:, None] * o_st + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=(rows < GROUP * TQ)[:, None])


@functools.lru_cache(maxsize=16)
def _pm1_hadamard(d: int, device: torch.device) -> torch.Tensor:
    """``sqrt(D) * H`` in fp16: entries are exactly +-1."""
    return (hadamard_matrix(d, device, torch.float32) * math.sqrt(d)).round().to(torch.float16)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def plan_splits(batch_heads: int, n_tiles: int, device: torch.device) -> int:
    """Tile splits so that about PROGRAMS_PER_SM programs per multiprocessor run, each over >= 4 tiles."""
    if n_tiles == 0:
        return 1
    want = max(1, -(-PROGRAMS_PER_SM * _num_sms(device) // batch_heads))
    return max(1, min(want, -(-n_tiles // MIN_TILES_PER_SPLIT)))


def _lengths(x, full, batch, device):
    if x is None:
        return torch.full((batch,), full, dtype=torch.int32, device=device)
    return x.to(device=device, dtype=torch.int32)


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
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    precise: bool = True,
    split_rows: bool = True,
) -> torch.Tensor:
    """Same contract as :func:`kvarn.attention.decode_attention` (see there for shapes), on CUDA.

    Requirements beyond the reference: D and G at least 64; the last axis of query, sink and tail
    contiguous; tile fields contiguous within a tile (views of a record buffer are fine).
    ``num_splits``: tile splits (default: planned from the batch and the SM count); ``num_warps``:
    warps per program and ``num_stages``: Triton's software pipelining depth (tuning knobs; the
    kernel prefetches the next tile itself, so 1 is the default); ``precise``: fp32 operands split
    into two fp16 halves for the matrix units (off: one fp16 MMA per product, whose error can exceed
    the test bound of twice torch's fp16 error on keys with large per-channel offsets);
    ``split_rows``: the two halves go through one MMA as extra query rows rather than two MMAs
    (tuning knob; the default is the faster on the H200, BENCHMARKS.md). With
    ``causal`` and Tq > 1 the tail length precondition (R >= Tq) is the caller's: it is not checked
    on the device, to avoid a host synchronization.
    """
    b, hq, tq, d, hk = check_decode_inputs(query, sink_k, sink_v, tiles, tail_k, tail_v, config)
    if fp_frame not in ("rotated", "model"):
        raise ValueError(f"fp_frame={fp_frame!r}; choose 'rotated' or 'model'")
    if d < 64 or config.tile < 64:
        raise ValueError(f"the Triton decode kernel needs D >= 64 and G >= 64, got D={d}, G={config.tile}")
    check_device(query, sink_k, tail_k, None if tiles is None else tiles.k_codes)
    dev = query.device
    group = hq // hk
    precise = bool(precise)
    split_rows = bool(precise and split_rows)
    # tl.dot needs at least 16 rows; stacked halves double the block's rows.
    block_m = max(8 if split_rows else 16, triton.next_power_of_2(group * tq))
    scale = (1.0 / math.sqrt(d) if scaling is None else float(scaling)) * LOG2E
    hmat = _pm1_hadamard(d, dev)

    dummy = query.new_zeros(1, 1, 1, d)
    sk, sv = (sink_k, sink_v) if sink_k is not None else (dummy, dummy)
    tk, tv = (tail_k, tail_v) if tail_k is not None else (dummy, dummy)
    for name, x in (("query", query), ("sink_k", sk), ("sink_v", sv), ("tail_k", tk), ("tail_v", tv)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along D")
    if sk.stride() != sv.stride() or tk.stride() != tv.stride():
        raise ValueError("K and V of the sink (and of the tail) must have the same strides")
    s_cap = 0 if sink_k is None else sink_k.shape[2]
    r_cap = 0 if tail_k is None else tail_k.shape[2]
    n_cap = 0 if tiles is None else tiles.k_codes.shape[2]

    no_tiles = tiles is None or n_cap == 0
    if no_tiles:  # one placeholder tile, never computed with: only the prefetch reads it
        tiles, n_cap = empty_fields((1, 1, 1), config, d, dev), 0
    tile_args = []
    for name, inner in (("k_codes", 2), ("k_row_scale", 1), ("k_row_zero", 1), ("k_col_scale", 1),
                        ("v_codes", 2), ("v_col_scale", 1), ("v_row_scale", 1), ("v_row_zero", 1)):
        x = getattr(tiles, name)
        tile_args += [x, *((0, 0, 0) if no_tiles else lead_strides(x, 3, inner))]

    splits = num_splits if num_splits is not None else plan_splits(b * hk, n_cap, dev)
    splits = max(1, min(int(splits), max(1, n_cap)))
    per_split = max(1, -(-n_cap // splits))
    splits = max(1, -(-n_cap // per_split)) if n_cap else 1
    fp_split = 1 if splits > 1 else 0
    ns = splits + fp_split

    out = torch.empty_like(query)
    if ns > 1:
        pacc = torch.empty(b * hk * ns * block_m * d, dtype=torch.float32, device=dev)
        pml = torch.empty(b * hk * ns * block_m * 2, dtype=torch.float32, device=dev)
    else:
        pacc = pml = torch.empty(1, dtype=torch.float32, device=dev)
    _decode_attention_kernel[(b * hk, ns)](
        query, query.stride(0), query.stride(1), query.stride(2), hmat,
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), _lengths(sink_lengths, s_cap, b, dev), s_cap,
        tk, tv, tk.stride(0), tk.stride(1), tk.stride(2), _lengths(tail_lengths, r_cap, b, dev), r_cap,
        *tile_args, _lengths(tile_counts, n_cap, b, dev),
        out, out.stride(0), out.stride(1), out.stride(2), pacc, pml,
        hk, scale, 1.0 / math.sqrt(d), per_split, splits,
        D=d, G=config.tile, KB=config.key_bits, VB=config.value_bits,
        GROUP=group, TQ=tq, BLOCK_M=block_m, BLOCK_N=64,
        FP_SPLIT=fp_split, CAUSAL=causal, FP_ROTATED=fp_frame == "rotated",
        KSCALE=1.0 if config.key_bits == 8 else 512.0, VSCALE=1.0 if config.value_bits == 8 else 512.0,
        PRECISE=precise, SPLIT_ROWS=split_rows, num_warps=num_warps, num_stages=num_stages,
    )
    if ns > 1:
        _combine_kernel[(b * hk,)](
            pacc, pml, hmat, out, out.stride(0), out.stride(1), out.stride(2), hk, 1.0 / math.sqrt(d), ns,
            D=d, GROUP=group, TQ=tq, BLOCK_M=block_m, PRECISE=precise, SPLIT_ROWS=split_rows,
            num_warps=4,
        )
    return out
