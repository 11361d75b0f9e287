"""Batched tile flush in one launch: normalization, RTN, packing, fields written in place.

Twin of :func:`kvarn.codec.encode_tiles`. One program per (tile, K or V): the whole tile ``X [R, C]``
stays in registers through the T iterations of the dual-axis normalization (spec section 2; best
iterate per tile, identity included, ties to the later iterate), then rows are rounded to nearest
even (spec section 3), packed low bits first (spec section 4; code matrices stored transposed, as :mod:`kvarn.record`
says) and the fp16 fields are stored.

The tiles come in rotated, or in the model frame (``rotate``): then the kernel rotates each token
itself (spec section 1, in fp32), so a cache's flush is one launch from its fp16 tail to its
reserved slots (``slot``), with the range check as a device flag (``bad``) instead of a host read.

kvarn-auto: ``normalize`` flags per tile switch the normalization off for K or V of that tile: the
identity stays the chosen iterate, so the column scales are exactly 1 and only the RTN step is
stored, as :mod:`kvarn.flavour` encodes with T = 0; ``rotate`` flags per tile say which tiles are
rotated (the others are stored in the model frame).

Differences from the torch twin, by design: the unbiased standard deviations are two-pass sums in a
different reduction order, two of each iteration's four are derived from earlier ones (see
``_encode_one``), the others are taken of ``X * exp(-a) / sqrt(C - 1)`` (rows) and
``X * exp(-b) / sqrt(R - 1)`` (columns: the unbiased divisors go into the scales' exp), products
fused into the sums and deviations (FMAs), and then scaled; the loop keeps the
log-scales in log2 units and the deviations as log2 of the std (half the log2 of the variance, no
square root), clamped at the spec's bounds in those units, and the imbalance is ``2^(max - min)``
of them; divisions are multiplications by ``exp(-b)``, ``exp(-a)`` and ``1 / step`` (``(Y - lo) / step``
as one FMA of ``X exp(-a)``, ``X exp(-a) (exp(-b) / step) - lo / step``), ``exp`` and
``log`` are the GPU's ``ex2.approx`` and ``lg2.approx`` (``tl.exp2`` and ``tl.log2`` under the
interpreter; in the loop their ``.ftz`` forms: the clamped scales keep every argument and result
normal, so only the subnormal handling is left out); fp16 tiles are rotated with their first
Hadamard factor exact (:func:`_rotate`), so a scale can differ by one fp16 ulp, a code
that sits on a rounding boundary can move by one step, and where two iterates score the same
imbalance up to fp32 rounding the kernel may keep the other one (rarely: see the kernel tests).
Quantile ranges (``config.key_quantile`` / ``value_quantile`` > 0): the ranks each quantile
interpolates between are taken from the row by repeated minimum (maximum) extraction, exact like a
sort (``_order_stats``: about ``q * C`` reductions per end, 5 for kvarn-auto's q = 0.03 of 128), and
interpolated as torch.quantile does (fp32 ranks, its lerp as an FMA, as its vectorized CPU kernel
computes it).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from ..config import KVarNConfig
from ..quantize import quantile_ranks
from ..record import TileFields
from .decode_blocks import hadamard_rows
from .layout import (check_device, check_fields, check_launch_knobs, empty_fields, interpreting, lead_strides,
                     num_sms)


@constexpr_function
def _lg2_rsqrt(n):
    """log2(1 / sqrt(n)), a compile-time constant."""
    return -0.5 * math.log2(n)


@triton.jit
def _lg2_std_cols(x, f, R: tl.constexpr, ASM: tl.constexpr):
    """log2 of the unbiased std of each column of ``x * f[:, None] * sqrt(R - 1)`` (over rows),
    two-pass: ``x [R, C]`` -> ``[C]``. ``f`` carries the unbiased divisor ``1 / sqrt(R - 1)`` (an
    addend in the ex2 of the loop's scales, where it takes the place of their negation), so the sum
    of squares is the variance: no multiply per copy of the result. The scaled tile is never
    formed: the products fuse into the sum's additions where the compiler pairs them (its in-thread
    sums are trees: about 1.4 instructions a value), the deviations are ``fma(x, f, -mean)``, and
    only ``x`` stays live. The loop works on log2 deviations: half the log2 of the variance, no
    square root per copy of a vector."""
    mean = tl.sum(x * f[:, None], axis=0) * (1.0 / R)
    dev = tl.fma(x, f[:, None], -mean[None, :])
    return _lg2(tl.sum(dev * dev, axis=0), ASM) * 0.5


@triton.jit
def _lg2_std_rows(x, e, C: tl.constexpr, ASM: tl.constexpr):
    """log2 of the unbiased std of each row of ``x * e[None, :] * sqrt(C - 1)`` (over columns):
    ``[R, C]`` -> ``[R]``; ``e`` carries ``1 / sqrt(C - 1)`` (:func:`_lg2_std_cols`)."""
    mean = tl.sum(x * e[None, :], axis=1) * (1.0 / C)
    dev = tl.fma(x, e[None, :], -mean[:, None])
    return _lg2(tl.sum(dev * dev, axis=1), ASM) * 0.5


@triton.jit
def _max_min(a, b, c, d):
    return tl.maximum(a, c), tl.minimum(b, d)


@triton.jit
def _spread(v, ASM: tl.constexpr):
    """``max(s) / max(min(s), 1e-8)`` of the deviations ``s = 2^v``: both extremes in one reduction."""
    hi, lo = tl.reduce((v, v), 0, _max_min)
    return _ex2(hi - tl.maximum(lo, _LG2_1E_8), ASM)


@triton.jit
def _score(lcs, lrs, ASM: tl.constexpr):
    """The spec's imbalance from the columns' and rows' log2 standard deviations."""
    return _spread(lcs, ASM) + _spread(lrs, ASM)


@triton.jit
def _lg2(x, ASM: tl.constexpr):
    """log2 of the loop's deviations. ASM: the GPU's ``lg2.approx.ftz`` (error about 2^-22, one
    MUFU op; without the subnormal fix-up: a subnormal variance reads as 0, both clamped the same)
    instead of libdevice's polynomial (about 20 instructions), which the per-row and per-column
    vectors pay once per copy a thread holds; the interpreter takes ``tl.log2``."""
    if ASM:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _ex2(x, ASM: tl.constexpr):
    """2^x: ``ex2.approx.ftz`` (what ``tl.exp2`` emits, without the subnormal fix-up: the loop's
    scales are in [4.5e-5, 1.35] times 1 / sqrt(n - 1), and an imbalance is 0 or at least 2^-100);
    the interpreter takes ``tl.exp2``."""
    if ASM:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


# The spec's clamps in log2 units (the loop keeps its log-scales as log2, so exp and log are the
# GPU's ex2 and lg2 with no change of base per copy): deviations clamped to [1e-3, 1e3], scales to
# [-0.3, 10] (natural log); the imbalance's floor 1e-8.
_LG2_1E_3 = tl.constexpr(-9.965784284662087)
_LG2_1E3 = tl.constexpr(9.965784284662087)
_A_LO = tl.constexpr(-0.43280851226668897)  # -0.3 * log2(e)
_A_HI = tl.constexpr(14.426950408889634)  # 10 * log2(e)
_LG2_1E_8 = tl.constexpr(-26.575424759098897)


@triton.jit
def _order_stats(y, I0: tl.constexpr, I1: tl.constexpr, LOW: tl.constexpr, C: tl.constexpr):
    """Each row's values of ranks ``I0 <= I1`` of ``y [R, C]`` in ascending order (``LOW``) or in
    descending order (rank 0 = the largest): ``I1 + 1`` extractions of the row's minimum (maximum),
    removing one entry each time. Exact, as a sort is, and cheap for the few ranks a small quantile
    needs (q = 0.03 of 128 values: 5 from each end), where ``tl.sort`` of a whole tile costs a
    bitonic network in registers and long compiles."""
    cols = tl.arange(0, C)
    work = y
    v0 = tl.zeros([y.shape[0]], dtype=tl.float32)
    v1 = v0
    for j in tl.static_range(I1 + 1):
        if LOW:
            m, idx = tl.min(work, axis=1, return_indices=True)
        else:
            m, idx = tl.max(work, axis=1, return_indices=True)
        if j == I0:
            v0 = m
        if j == I1:
            v1 = m
        if j < I1:
            work = tl.where(cols[None, :] == idx[:, None], float("inf") if LOW else -float("inf"), work)
    return v0, v1


@triton.jit
def _lerp(below, above, coeff):
    """torch.quantile's interpolation as its lerp computes it, an FMA: ``below + w (above - below)``
    for a weight ``w < 0.5`` (``coeff = w``), else ``above + (w - 1) (above - below)`` (``coeff = w - 1``)."""
    c = coeff + tl.zeros_like(below)
    return tl.fma(c, above - below, tl.where(c < 0, above, below))


@triton.jit
def _encode_one(
    x, codes_ptr, codes_off, rs_ptr, rs_off, rz_ptr, rz_off, cs_ptr, cs_off, bad_ptr,
    norm, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr, CHECK: tl.constexpr,
    QUANT: tl.constexpr, LO0: tl.constexpr, LO1: tl.constexpr, HI0: tl.constexpr, HI1: tl.constexpr,
    c_lo, c_hi, ASM: tl.constexpr,
):
    """Normalize, round, pack and store one fp32 tile ``x [R, C]`` (rotated frame)."""
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    # The log-scales are kept in log2 units (a2 = a log2(e)), their deviations as log2 std.
    a2 = tl.zeros([C], dtype=tl.float32)
    b2 = tl.zeros([R], dtype=tl.float32)
    # Two of the four deviations an iteration of the spec takes are known without a pass over the
    # tile: the column update uses the columns' deviations the last score took (same Y), and a
    # row update scales each row, so the rows' deviations after it are the ones before it times
    # exp(b_old - b_new) (in log2: minus b2_new - b2_old). Two reductions over the tile per
    # iteration instead of four.
    # Y = X / (exp(b) (x) exp(a)) is never formed: a row's deviation of Y is exp(-b) times that
    # row's deviation of X * exp(-a) (a column's alike), and X * exp(-a) itself is never formed
    # either (_lg2_std_rows), so only X is live and a pass costs about three operations per value
    # (the product in the sum, the deviation, its square; mostly FMAs): at 8 warps 64 registers a
    # thread hold the tile, and under a 128-register cap two programs share an SM (_launch_options).
    # The scale vectors carry the unbiased divisors, 1 / sqrt(n - 1) (_lg2_std_cols).
    KR: tl.constexpr = _lg2_rsqrt(R - 1)
    KC: tl.constexpr = _lg2_rsqrt(C - 1)
    id_r = tl.full([R], (R - 1) ** -0.5, tl.float32)  # the identity's scales, exp(0) / sqrt(n - 1)
    id_c = tl.full([C], (C - 1) ** -0.5, tl.float32)
    lcs = _lg2_std_cols(x, id_r, R, ASM)  # log2 deviations of Y's columns (Y = X before any update)
    lrs = _lg2_std_rows(x, id_c, C, ASM)
    best = _score(lcs, lrs, ASM)
    best_a = a2
    best_b = b2
    for _ in range(ITERS):
        a2 = tl.minimum(tl.maximum(a2 + tl.minimum(tl.maximum(lcs, _LG2_1E_3), _LG2_1E3), _A_LO), _A_HI)
        ea = _ex2(KC - a2, ASM)
        hr = _lg2_std_rows(x, ea, C, ASM)  # rows of X * exp(-a): Y's rows before the row update, plus b2
        b2 = tl.minimum(tl.maximum(b2 + tl.minimum(tl.maximum(hr - b2, _LG2_1E_3), _LG2_1E3), _A_LO), _A_HI)
        eb = _ex2(KR - b2, ASM)
        lrs = hr - b2  # the rows of Y after the row update
        lcs = _lg2_std_cols(x, eb, R, ASM) - a2
        m = _score(lcs, lrs, ASM)
        take = (m <= best) & norm  # ties go to the later iterate; without normalization: the identity
        best = tl.where(take, m, best)
        best_a = tl.where(take, a2, best_a)
        best_b = tl.where(take, b2, best_b)

    col_scale = tl.exp2(best_a)
    row_scale = tl.exp2(best_b)
    eb = tl.exp2(-best_b)
    z = x * tl.exp2(-best_a)[None, :]  # Y = z * exp(-b), row by row; formed only for the quantiles

    QMAX: tl.constexpr = (1 << BITS) - 1
    if QUANT:  # the rows' [q, 1 - q] quantiles (config.key_quantile / value_quantile > 0)
        y = z * eb[:, None]
        b0, b1 = _order_stats(y, LO0, LO1, True, C)
        lo = _lerp(b0, b1, c_lo)
        a1, a0 = _order_stats(y, C - 1 - HI1, C - 1 - HI0, False, C)  # sorted ranks HI0 <= HI1, from the top
        hi = _lerp(a0, a1, c_hi)
    else:  # a row's extremes of z times exp(-b) > 0: Y's extremes, the same values (rounding is monotone)
        lo = tl.min(z, axis=1) * eb
        hi = tl.max(z, axis=1) * eb
    step = tl.maximum((hi - lo) / QMAX, 1e-10)
    inv = 1.0 / step
    # (Y - lo) / step as one FMA a value, z (exp(-b) / step) - lo / step. Its error is about
    # 2^-23 |lo| / step, so a code differs from the twin's only where t is that close to a half
    # integer, where both codes reconstruct within half a step plus that much (lo's own fp32
    # precision, when a row's range is tiny next to its offset).
    t = tl.fma(z, (eb * inv)[:, None], (-lo * inv)[:, None])
    # Clamped before rounding (the same codes: rounding is monotone and keeps the integer bounds).
    # t + M with M = 1.5 * 2^23 rounds fp32 t in [0, QMAX] half to even into the low mantissa bits,
    # whose pattern is M's (low 22 bits zero) plus the code: the code is those bits, no conversion.
    t = tl.minimum(tl.maximum(t, 0.0), QMAX) + 12582912.0
    q = t.to(tl.int32, bitcast=True) & QMAX

    P: tl.constexpr = 8 // BITS
    CB: tl.constexpr = C // P
    if P == 1:
        packed = q
    else:
        packed = _pack(q, BITS, P)
    pcols = tl.arange(0, CB)
    # Stored transposed, [C / P, R] (the code byte order of kvarn.record).
    tl.store(codes_ptr + codes_off + pcols[None, :] * R + rows[:, None], packed.to(tl.uint8))
    rs = (row_scale * step).to(tl.float16)
    rz = (row_scale * lo).to(tl.float16)
    cs = col_scale.to(tl.float16)
    tl.store(rs_ptr + rs_off + rows, rs)
    tl.store(rz_ptr + rz_off + rows, rz)
    tl.store(cs_ptr + cs_off + cols, cs)
    if CHECK:  # a non-finite stored scale (fp16 overflow) flags the launch; read later, off the step
        if _nonfinite(rs) + _nonfinite(rz) + _nonfinite(cs) > 0:
            tl.atomic_or(bad_ptr, 1)


@triton.jit
def _pack(q, BITS: tl.constexpr, P: tl.constexpr):
    """Codes ``q [R, C]`` -> bytes ``[R, C / P]``, code j of a byte at bit ``j * BITS``: neighbours
    joined in pairs, P / 2 times, each a split of a last axis of 2 that stays in a thread's registers.
    A sum of the P shifted codes over a last axis of P compiles to more instructions and, under the
    128-register cap, more spills (sass_encoder.py, uncapped: 10599 against 10312 instructions a
    tile for k2v2, 10455 against 10308 for k4v2; capped spills 56 against 24 and 40 against 32
    bytes)."""
    lo, hi = tl.split(tl.reshape(q, [q.shape[0], q.shape[1] // 2, 2]))
    packed = lo | (hi << BITS)
    if P == 4:
        lo, hi = tl.split(tl.reshape(packed, [q.shape[0], q.shape[1] // 4, 2]))
        packed = lo | (hi << (2 * BITS))
    return packed


@triton.jit
def _nonfinite(v):
    """How many of the fp16 values ``v`` are Inf or NaN (NaN fails every comparison)."""
    return tl.sum((~(tl.abs(v.to(tl.float32)) < float("inf"))).to(tl.int32), axis=0)


@triton.jit
def _load_tile(ptr, off, s_r, s_c, R: tl.constexpr, C: tl.constexpr):
    """The tile in its stored dtype."""
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    return tl.load(ptr + off + rows[:, None] * s_r + cols[None, :] * s_c)


@triton.jit
def _rotate(x, D: tl.constexpr, inv_sqrt_d):
    """``x @ H`` in fp32 of rows ``x [R, D]`` as stored. The MMAs take fp16 halves of their input, so
    the tile is brought to a largest magnitude of at most 1 by a power of two first (and back
    after): values past the fp16 range (bf16 or fp32 models) and tiny ones keep fp32's relative
    precision. fp16 rows go into the first MMA as they are (exact) and its sums are scaled before
    the second: one MMA fewer and no fp16 split of the input (fp16 models, the cache's usual tail)."""
    if x.dtype == tl.float16:  # each thread's 8-value runs first: one max in registers, not shuffles per row
        amax = tl.max(tl.max(tl.max(tl.reshape(tl.abs(x), [x.shape[0], D // 8, 8]), axis=2), axis=0), axis=0)
    else:
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    amax = amax.to(tl.float32)
    scale = tl.exp2(tl.where(amax > 0, tl.ceil(tl.log2(amax)), 0.0))
    if x.dtype == tl.float16:
        return hadamard_rows(x, D, True, 1.0 / scale) * (inv_sqrt_d * scale)
    else:
        return hadamard_rows(x.to(tl.float32) / scale, D, True) * (inv_sqrt_d * scale)


@triton.jit
def _frame_rows(raw, rot, D: tl.constexpr, inv_sqrt_d):
    """Model-frame rows ``[R, D]`` as stored -> fp32, rotated (:func:`_rotate`) where ``rot``
    (a tile's flag, or True)."""
    if rot:
        x = _rotate(raw, D, inv_sqrt_d)
    else:
        x = raw.to(tl.float32)
    return x


@triton.jit
def _field_offset(i0, i1, i2, s0, s1, s2):
    return i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def _encode_tiles_kernel(
    k_ptr, k_s0, k_s1, k_s2, k_sr, k_sc, v_ptr, v_s0, v_s1, v_s2, v_sr, v_sc,
    kc_ptr, kc_s0, kc_s1, kc_s2, ks_ptr, ks_s0, ks_s1, ks_s2,
    kz_ptr, kz_s0, kz_s1, kz_s2, kr_ptr, kr_s0, kr_s1, kr_s2,
    vc_ptr, vc_s0, vc_s1, vc_s2, vcs_ptr, vcs_s0, vcs_s1, vcs_s2,
    vs_ptr, vs_s0, vs_s1, vs_s2, vz_ptr, vz_s0, vz_s1, vz_s2,
    N1, N2, n_tiles, flag_ptr, slot_ptr, bad_ptr, inv_sqrt_d,
    k_clo, k_chi, v_clo, v_chi,
    D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    HAS_NORM: tl.constexpr, ROTATE: tl.constexpr, HAS_ROT: tl.constexpr, HAS_SLOT: tl.constexpr,
    CHECK: tl.constexpr, KQ: tl.constexpr, KLO0: tl.constexpr, KLO1: tl.constexpr, KHI0: tl.constexpr,
    KHI1: tl.constexpr, VQ: tl.constexpr, VLO0: tl.constexpr, VLO1: tl.constexpr, VHI0: tl.constexpr,
    VHI1: tl.constexpr, ASM: tl.constexpr, PERSIST: tl.constexpr,
):
    kv = tl.program_id(1)  # 0: the K tile, 1: the V tile
    # Each program encodes tiles pid, pid + programs, ... under a capped grid (PERSIST), else one:
    # a loop of one known trip, which the compiler removes (a loop costs registers at a cap of 128).
    first = tl.program_id(0)
    for tile in range(first, n_tiles if PERSIST else first + 1, tl.num_programs(0) if PERSIST else 1):
        if HAS_NORM:  # flags [tiles, 4] int8: K, V normalized; K, V rotated
            norm = tl.load(flag_ptr + tile * 4 + kv) != 0
        else:
            norm = True
        if HAS_ROT:
            rot = tl.load(flag_ptr + tile * 4 + 2 + kv) != 0
        else:
            rot = True
        i2 = tile % N2
        i1 = (tile // N2) % N1
        i0 = tile // (N1 * N2)
        o2 = i2
        if HAS_SLOT:  # the fields have a capacity axis: tile i2 goes to slot + i2 (read on the device)
            o2 = i2 + tl.load(slot_ptr).to(tl.int32)
        if kv == 0:
            off = _field_offset(i0, i1, i2, k_s0, k_s1, k_s2)
            if ROTATE:  # model-frame keys: rotate each token (rows of [G, D]), then the tile is [D, G]
                xk = tl.trans(_frame_rows(_load_tile(k_ptr, off, k_sc, k_sr, G, D), rot, D, inv_sqrt_d))
            else:
                xk = _load_tile(k_ptr, off, k_sr, k_sc, D, G).to(tl.float32)
            _encode_one(
                xk,
                kc_ptr, _field_offset(i0, i1, o2, kc_s0, kc_s1, kc_s2),
                ks_ptr, _field_offset(i0, i1, o2, ks_s0, ks_s1, ks_s2),
                kz_ptr, _field_offset(i0, i1, o2, kz_s0, kz_s1, kz_s2),
                kr_ptr, _field_offset(i0, i1, o2, kr_s0, kr_s1, kr_s2),
                bad_ptr, norm, D, G, KB, ITERS, CHECK, KQ, KLO0, KLO1, KHI0, KHI1, k_clo, k_chi, ASM,
            )
        else:
            raw = _load_tile(v_ptr, _field_offset(i0, i1, i2, v_s0, v_s1, v_s2), v_sr, v_sc, G, D)
            if ROTATE:
                xv = _frame_rows(raw, rot, D, inv_sqrt_d)
            else:
                xv = raw.to(tl.float32)
            _encode_one(
                xv,
                vc_ptr, _field_offset(i0, i1, o2, vc_s0, vc_s1, vc_s2),
                vs_ptr, _field_offset(i0, i1, o2, vs_s0, vs_s1, vs_s2),
                vz_ptr, _field_offset(i0, i1, o2, vz_s0, vz_s1, vz_s2),
                vcs_ptr, _field_offset(i0, i1, o2, vcs_s0, vcs_s1, vcs_s2),
                bad_ptr, norm, G, D, VB, ITERS, CHECK, VQ, VLO0, VLO1, VHI0, VHI1, v_clo, v_chi, ASM,
            )


def _quantile_taps(q: float, n: int) -> tuple[bool, tuple]:
    """The [q, 1 - q] quantiles of rows of n values as torch.quantile takes them
    (:func:`kvarn.quantize.quantile_ranks`) -> (on, (lo below, lo above, hi below, hi above, lo
    coeff, hi coeff)), the lerp coefficients as :func:`_lerp` takes them; q = 0: min/max (off)."""
    if q <= 0.0:
        return False, (0, 0, 0, 0, 0.0, 0.0)
    (b0, a0, w0), (b1, a1, w1) = quantile_ranks(q, n)
    coeff = [float(np.float32(w) if w < 0.5 else np.float32(w) - np.float32(1.0)) for w in (w0, w1)]
    return True, (b0, a0, b1, a1, *coeff)


def _lead3(x: torch.Tensor, n_lead: int) -> tuple[int, ...]:
    """The three leading strides the kernel indexes with (missing leading dims: stride 0)."""
    return (0,) * (3 - n_lead) + tuple(x.stride(i) for i in range(n_lead))


def _tile_flags(pairs, lead, name, device) -> list[torch.Tensor]:
    if len(pairs) != 2 or any(not isinstance(x, torch.Tensor) or x.dtype != torch.bool
                              or tuple(x.shape) != lead for x in pairs):
        raise ValueError(f"{name} must be (keys, values), bool tensors of shape {lead} (one flag per tile)")
    return [x.reshape(-1).to(device) for x in pairs]


def check_rotate_dim(d: int) -> None:
    """The head_dim range of the encoder's own rotation (``rotate``): 32 <= D <= 256."""
    if not 32 <= d <= 256:
        raise ValueError(f"rotation inside the encoder needs 32 <= D <= 256, got D={d}")


def _launch_options(n_tiles: int, tile_elems: int, device: torch.device, quantiles: bool = False) -> dict:
    """Warps per program and register cap by launch size, from runs on the H200 (BENCHMARKS.md
    table 2; the cache flushes a layer at a time: 16 programs at batch 1, 256 at batch 16, on 132
    SMs). With only X live a 16K-element tile takes 128 registers a thread at 4 warps, 64 at 8.
    4 warps from three programs per SM up (the most tiles per second: 8192 rotating programs 2.12
    ms, against 2.11 ms at 8 warps capped as below and 2.24 ms uncapped). 8 warps, capped at 128
    registers (a few spills to L1), from one program per SM: two programs then share an SM, so a
    batch-16 layer runs as one wave (the cache's 32 layers: 2.22 against 2.59 ms uncapped and 2.67
    ms at 4 warps). 8 warps uncapped below that, where each program's latency is the step's and
    the cap only adds spills (batch 1: 1.37 against 1.54 ms capped and 1.95 ms at 4 warps). Larger
    tiles and rows rounded over quantiles (their order statistics work on a copy of the tile): 8
    warps, uncapped."""
    if tile_elems > 16384 or quantiles:
        return {"num_warps": 8}
    if 2 * n_tiles >= 3 * num_sms(device):
        return {"num_warps": 4}
    if 2 * n_tiles >= num_sms(device):
        return {"num_warps": 8, "maxnreg": 128}
    return {"num_warps": 8}


def _options(default: dict, num_warps: int | None, max_registers: int | None) -> dict:
    """The launch options: the defaults with the caller's knobs over them (the default register cap
    goes with the default warps); no register cap under the interpreter (it has no registers)."""
    opts = dict(default)
    if num_warps is not None:
        opts = {"num_warps": num_warps}
    if max_registers is not None:
        opts["maxnreg"] = max_registers
    if interpreting():
        opts.pop("maxnreg", None)
    return opts


def encode_tiles(
    k_tiles: torch.Tensor, v_tiles: torch.Tensor, config: KVarNConfig, out: TileFields | None = None,
    *, normalize: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotate: bool | tuple[torch.Tensor, torch.Tensor] | None = None, slot: torch.Tensor | None = None,
    bad: torch.Tensor | None = None, num_warps: int | None = None, max_registers: int | None = None,
    programs: int | None = None,
) -> TileFields:
    """Quantize tiles in one launch. k_tiles: ``[..., D, G]``, v_tiles: ``[..., G, D]``.

    Any float dtype and strides (a transposed view of ``[..., G, D]`` keys is fine). ``out``:
    optional TileFields to write into (for example :func:`record_fields_view` of a cache's record
    buffer at the tiles being flushed), leading dims equal to the inputs' (at most 3 of them).
    Returns the written TileFields. ``normalize``: kvarn-auto's ``(key_normalize, value_normalize)``,
    bool tensors of the leading shape (per tile); False keeps that tile unnormalized (module
    docstring); None normalizes every tile, the spec.

    ``rotate``: None, the tiles are in the rotated frame already; True, they are in the model frame
    and the kernel rotates every token (``x @ H`` in fp32, two small MMAs per row block, as the
    decode kernel rotates its query; 32 <= D <= 256); ``(key_rotate, value_rotate)``, bool per tile
    like ``normalize``: only those (kvarn-auto; the others are stored in the model frame).
    ``slot``: int32 or long ``[1]`` on the device (a cache passes its int32 tile count as it is: a
    cast would be one more launch in each side-stream freeze); ``out`` then has 3 leading dims
    whose last is a capacity, and input tile ``(i, j, n)`` is written at ``(i, j, slot + n)`` (read
    on the device, so a captured CUDA graph writes each replay's tiles at the slot of that replay).
    ``bad``: int32 ``[1]`` on the device, set to 1 if a stored fp16 scale is non-finite (the range
    check without a host read). ``num_warps``, ``max_registers``: tuning knobs (default: see
    ``_launch_options``). The warps set the reduction order, so results can differ within the
    twin's tolerance (module docstring: a tied iterate, a code on a rounding boundary); the
    register cap moves values to local memory, not the arithmetic. ``programs``: at most this
    many programs each for K and V, each encoding every ``programs``-th tile (default: one
    program a tile; the launch options follow the programs): the same bits, in a launch that
    leaves SMs to the kernels it runs beside (the decode step's encodes on a side stream, see
    :meth:`~kvarn.integrations.triton_codec.TritonTileCodec.beside`).
    """
    if not isinstance(config, KVarNConfig):
        raise TypeError(f"config must be a KVarNConfig, got {type(config).__name__}")
    if k_tiles.dim() < 2 or v_tiles.dim() != k_tiles.dim():
        raise ValueError("k_tiles [..., D, G] and v_tiles [..., G, D] must have the same rank")
    d, g = k_tiles.shape[-2:]
    lead = tuple(k_tiles.shape[:-2])
    if tuple(v_tiles.shape) != (*lead, g, d):
        raise ValueError(f"v_tiles must be {(*lead, g, d)} to match k_tiles {tuple(k_tiles.shape)}")
    if g != config.tile:
        raise ValueError(f"tiles have G={g} tokens, config.tile={config.tile}")
    if len(lead) > 3:
        raise ValueError(f"at most 3 leading dims are supported, got {lead}")
    config.record_bytes(d)  # validates head_dim
    if rotate is not None and rotate is not True and not isinstance(rotate, tuple):
        raise ValueError(f"rotate must be None, True or (key_rotate, value_rotate), got {rotate!r}")
    if rotate is not None:
        check_rotate_dim(d)
    check_device(k_tiles, v_tiles)
    dev = k_tiles.device
    if slot is not None:
        if len(lead) != 3 or out is None:
            raise ValueError("slot needs 3 leading dims and out fields with a capacity axis")
        if not isinstance(slot, torch.Tensor) or slot.dtype not in (torch.int32, torch.long) or slot.numel() != 1:
            raise ValueError(f"slot must be an int32 or long tensor of one element, got {slot!r}")
        check_fields(out, (*lead[:2], out.k_codes.shape[2]), config, d)
    else:
        if out is None:
            out = empty_fields(lead, config, d, dev)
        check_fields(out, lead, config, d)
    check_launch_knobs(num_warps, max_registers)
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"programs must be an int >= 1 (programs per K and per V), got {programs!r}")
    if bad is not None and (not isinstance(bad, torch.Tensor) or bad.dtype != torch.int32 or bad.numel() != 1):
        raise ValueError(f"bad must be an int32 tensor of one element, got {bad!r}")
    n_tiles = 1
    for s in lead:
        n_tiles *= s
    if n_tiles == 0:
        return out
    sizes = (1,) * (3 - len(lead)) + lead
    flags = []
    if normalize is not None:
        flags = _tile_flags(normalize, lead, "normalize", dev)
    if isinstance(rotate, tuple):
        rot = _tile_flags(rotate, lead, "rotate", dev)
        flags = (flags or rot) + rot  # without normalize flags their slots are unread (HAS_NORM is False)
    elif flags:
        flags = flags + flags  # rotation flags unread (HAS_ROT is False): any values
    # A placeholder when absent (never read): no allocation and fill per flush.
    flag_t = torch.stack(flags, dim=1).to(torch.int8) if flags else k_tiles
    n_lead = len(lead)

    def strides(name, inner):
        return (0,) * (3 - n_lead) + lead_strides(getattr(out, name), n_lead, inner)

    args = []
    for name, inner in (("k_codes", 2), ("k_row_scale", 1), ("k_row_zero", 1), ("k_col_scale", 1),
                        ("v_codes", 2), ("v_col_scale", 1), ("v_row_scale", 1), ("v_row_zero", 1)):
        args += [getattr(out, name), *strides(name, inner)]
    kq, vq = config.quantiles
    kt, vt = _quantile_taps(kq, g), _quantile_taps(vq, d)  # K rows run over G tokens, V rows over D channels
    grid = min(n_tiles, programs or n_tiles)
    opts = _options(_launch_options(grid, d * g, dev, kt[0] or vt[0]), num_warps, max_registers)
    _encode_tiles_kernel[(grid, 2)](
        k_tiles, *_lead3(k_tiles, n_lead), k_tiles.stride(-2), k_tiles.stride(-1),
        v_tiles, *_lead3(v_tiles, n_lead), v_tiles.stride(-2), v_tiles.stride(-1),
        *args, sizes[1], sizes[2], n_tiles, flag_t, slot if slot is not None else k_tiles,
        bad if bad is not None else k_tiles, 1.0 / math.sqrt(d), *kt[1][4:], *vt[1][4:],
        D=d, G=g, KB=config.key_bits, VB=config.value_bits, ITERS=config.sinkhorn_iters,
        HAS_NORM=normalize is not None, ROTATE=rotate is not None, HAS_ROT=isinstance(rotate, tuple),
        HAS_SLOT=slot is not None, CHECK=bad is not None,
        KQ=kt[0], KLO0=kt[1][0], KLO1=kt[1][1], KHI0=kt[1][2], KHI1=kt[1][3],
        VQ=vt[0], VLO0=vt[1][0], VLO1=vt[1][1], VHI0=vt[1][2], VHI1=vt[1][3], ASM=not interpreting(),
        PERSIST=grid < n_tiles, **opts,
    )
    return out
