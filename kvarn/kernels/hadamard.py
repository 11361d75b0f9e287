"""The Hadamard rotation of a few rows in registers, on tensor cores: the kernels' counterpart of
:func:`kvarn.codec.hadamard.rotate` (spec section 1) for their tiles and queries.

:func:`hadamard_rows` returns ``x @ (sqrt(D) H)`` with ``H`` the normalized Sylvester matrix (its
callers scale by ``1 / sqrt(D)``): ``sqrt(D) H_D`` is made from indices (entries 0 and +-1, exact
in fp16), so no matrix is read from memory, and the product is two 16-wide MMAs whose fp32 inputs
go in as fp16 high and low halves (about 2^-22 relative).
"""

import triton
import triton.language as tl


@triton.jit
def _pm1_factor(A: tl.constexpr):
    """``I_{16/A} (x) sqrt(A) H_A`` as fp16 ``[16, 16]`` (``A`` = 16: ``sqrt(16) H_16``), made from indices.

    Sylvester's ``H[i, j] = (-1)^popcount(i & j) / sqrt(n)``; the identity factor acts on the high
    bits of the index, ``H_A`` on its low ``log2 A`` bits. Entries are 0 or +-1, exact in fp16.
    """
    i = tl.arange(0, 16)[:, None]
    j = tl.arange(0, 16)[None, :]
    x = i & j & (A - 1)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)  # bit 0: parity of the popcount (at most 4 bits)
    sign = 1 - 2 * (x & 1)
    return tl.where(i // A == j // A, sign, 0).to(tl.float16)


@triton.jit
def _mm16(x, b):
    """fp32 ``[R, 16] @ b`` for fp16 ``b`` exact (0, +-1): ``x`` as fp16 high and low halves, fp32
    sums, so the result is accurate to about 2^-22 relative. An fp16 ``x`` is exact as it is: one
    MMA."""
    if x.dtype == tl.float16:
        return tl.dot(x, b, out_dtype=tl.float32)
    hi = x.to(tl.float16)
    y = tl.dot(hi, b)
    return tl.dot((x - hi.to(tl.float32)).to(tl.float16), b, y)


@triton.jit
def hadamard_rows(x, D: tl.constexpr, SPLIT_ROWS: tl.constexpr = False, mid=None):
    """``x @ (sqrt(D) H)`` for fp32 rows ``x [R, D]`` (``D`` = 2^n, 32 <= D <= 256, ``R * D >= 256``),
    in registers: no matrix is read from memory. fp16 rows are taken as they are by the first MMA
    (exact products, fp32 sums); ``mid`` (fp32 scalar, optional) multiplies the first MMA's result,
    before the second splits it into fp16 halves (a power of two keeps it in the fp16 range).

    ``sqrt(D) H_D`` is the Kronecker product of ``sqrt(16) H_16`` on the low 4 bits of the channel
    index and ``sqrt(A) H_A`` (``A = D / 16``) on the high bits, so the product is two small MMAs:
    over the low 4 bits (rows ``[R * A, 16]``), then, with the two index halves swapped, over the
    high bits (``I (x) H_A`` as a ``[16, 16]`` matrix: ``H_A`` on the low bits of each group of 16).

    ``SPLIT_ROWS`` (even ``R``): the same product, with the second MMA's rows ordered (row // 2,
    high channel bits, row % 2, low 2 channel bits) instead of (row, channels), which only changes
    where the result lands. An MMA result puts bits 0-2 of its row index on lanes, bit 3 in
    registers, bits 4-6 on warps (8 warps) and the rest in registers, its 16 columns on lanes
    and registers. In that order, of a 128 x 128 result at 8 warps, a thread holds 8 rows x 8
    channels, the 32 lanes of a warp span 2 rows x 16 channels and the warps split the rows; in
    the plain order a thread holds 16 rows x 4 channels and the lanes span 32 channels. The
    encoder's loop (:mod:`kvarn.kernels.encode_tile`), which reduces along both axes and keeps a scale
    per row and per column, does about 30% fewer instructions on the split order (fewer shuffle
    steps per reduction, 8 instead of 16 copies of the channel scales a thread).
    """
    A: tl.constexpr = D // 16
    R: tl.constexpr = x.shape[0]
    y = _mm16(tl.reshape(x, [R * A, 16]), _pm1_factor(16))  # low bits done: [R, A, 16]
    if mid is not None:
        y = y * mid
    y = tl.reshape(tl.permute(tl.reshape(y, [R, A, 16]), (0, 2, 1)), [R * A, 16])  # index (low, high)
    if SPLIT_ROWS:
        AL: tl.constexpr = 4 if A >= 4 else A
        AH: tl.constexpr = A // AL
        y = tl.reshape(tl.permute(tl.reshape(y, [R // 2, 2, AH, AL, 16]), (0, 2, 1, 3, 4)), [R * A, 16])
    y = _mm16(y, _pm1_factor(A))  # high bits done: rows (r, low), columns (low-rest, high)
    if SPLIT_ROWS:
        y = tl.reshape(tl.permute(tl.reshape(y, [R // 2, AH, 2, AL, 16]), (0, 2, 1, 3, 4)), [R * A, 16])
    return tl.reshape(tl.permute(tl.reshape(y, [R, 16, A]), (0, 2, 1)), [R, D])
