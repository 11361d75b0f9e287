"""One tile's encode in registers: the dual-axis normalization, the rounding, the packing, the stores.

Device functions of :func:`kvarn.kernels.encode_tiles` (``encode_one``: a fp32 tile ``X [R, C]`` in
the rotated frame, rows quantized; K tiles are ``[D, G]``, V tiles ``[G, D]``): the T iterations of
spec section 2 with the best iterate kept (identity included, ties to the later iterate), RTN per
row (spec section 3), codes packed low bits first (spec section 4) and stored transposed, fp16 fields.

Differences from the torch twin, by design: the unbiased standard deviations are two-pass sums in a
different reduction order, two of each iteration's four are derived from earlier ones (see
``encode_one``), the others are taken of ``X * exp(-a) / sqrt(C - 1)`` (rows) and
``X * exp(-b) / sqrt(R - 1)`` (columns: the unbiased divisors go into the scales' exp), products
fused into the sums and deviations (FMAs), and then scaled; the loop keeps the
log-scales in log2 units and the deviations as log2 of the std (half the log2 of the variance, no
square root), clamped at the spec's bounds in those units, and the imbalance is ``2^(max - min)``
of them; divisions are multiplications by ``exp(-b)``, ``exp(-a)`` and ``1 / step`` (``(Y - lo) / step``
as one FMA of ``X exp(-a)``, ``X exp(-a) (exp(-b) / step) - lo / step``), ``exp`` and
``log`` are the GPU's ``ex2.approx`` and ``lg2.approx`` (``tl.exp2`` and ``tl.log2`` under the
interpreter; in the loop their ``.ftz`` forms: the clamped scales keep every argument and result
normal, so only the subnormal handling is left out); fp16 tiles are rotated with their first
Hadamard factor exact (:func:`kvarn.kernels.encode._rotate`), so a scale can differ by one fp16 ulp, a code
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

import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function


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
def encode_one(
    x, codes_ptr, codes_off, rs_ptr, rs_off, rz_ptr, rz_off, cs_ptr, cs_off, bad_ptr,
    norm, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr, CHECK: tl.constexpr,
    QUANT: tl.constexpr, LO0: tl.constexpr, LO1: tl.constexpr, HI0: tl.constexpr, HI1: tl.constexpr,
    c_lo, c_hi, ASM: tl.constexpr,
):
    """Normalize, round, pack and store one fp32 tile ``x [R, C]`` (rotated frame)."""
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    # Two of the four deviations an iteration of the spec takes are known without a pass over the
    # tile: the column update uses the columns' deviations the last score took (same Y), and a
    # row update scales each row, so the rows' deviations after it are the ones before it times
    # exp(b_old - b_new) (in log2: minus b2_new - b2_old). Two reductions over the tile per
    # iteration instead of four.
    # Y = X / (exp(b) (x) exp(a)) is never formed: a row's deviation of Y is exp(-b) times that
    # row's deviation of X * exp(-a) (a column's alike), and X * exp(-a) itself is never formed
    # either (_lg2_std_rows), so only X is live and a pass costs about three operations per value
    # (the product in the sum, the deviation, its square; mostly FMAs): at 8 warps 64 registers a
    # thread hold the tile, and under a 128-register cap two programs share an SM
    # (kvarn.kernels.encode._launch_options).
    # The scale vectors carry the unbiased divisors, 1 / sqrt(n - 1) (_lg2_std_cols).
    KR: tl.constexpr = _lg2_rsqrt(R - 1)
    KC: tl.constexpr = _lg2_rsqrt(C - 1)
    id_r = tl.full([R], (R - 1) ** -0.5, tl.float32)  # the identity's scales, exp(0) / sqrt(n - 1)
    id_c = tl.full([C], (C - 1) ** -0.5, tl.float32)
    lcs = _lg2_std_cols(x, id_r, R, ASM)  # log2 deviations of Y's columns (Y = X before any update)
    lrs = _lg2_std_rows(x, id_c, C, ASM)
    # The log-scales are kept in log2 units (a2 = a log2(e)), their deviations as log2 std. Zeros
    # made from the deviations take their layout, so that this function also runs where layouts are
    # explicit (a Gluon caller); the same constants here.
    a2 = tl.where(lcs != lcs, 0.0, 0.0)
    b2 = tl.where(lrs != lrs, 0.0, 0.0)
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
    prows = tl.arange(0, R)  # the packed codes' own index (their layout differs from the scales')
    # Stored transposed, [C / P, R] (the code byte order of kvarn.codec.record).
    tl.store(codes_ptr + codes_off + pcols[None, :] * R + prows[:, None], packed.to(tl.uint8))
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
