"""Triton building blocks of the fused decode kernel (:mod:`kvarn.kernels.decode`).

Code planes, the split-precision product, the online softmax steps over a quantized tile and over a
block of full-precision tokens (sink and tail), and the merge of the splits' partial results (its
rotation back: :func:`kvarn.kernels.hadamard.hadamard_rows`).
"""

import triton
import triton.language as tl

from .hadamard import hadamard_rows


@triton.jit
def code_plane(c, SHIFT: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Packed bytes -> fp16 codes of one bit plane: the code at bit offset SHIFT of every byte.

    2/4-bit codes come out as ``code / 512``: the code in the low bits of a byte, read as fp8 e4m3,
    is exactly that (subnormals and the first binade), and the hardware converts fp8 pairs to fp16
    (the caller folds 512 into the scales). 8-bit codes come out as themselves. ASM does the
    mask/shift on 32-bit words (four bytes at once) and two paired conversions in one inline-PTX
    block; the plain form is the same arithmetic, for the interpreter.
    """
    if BITS == 8:
        y = c.to(tl.float16)
    elif ASM:
        mask: tl.constexpr = 0x03030303 if BITS == 2 else 0x0F0F0F0F
        y = tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            .reg .b16 lo, hi;
            shr.b32 t, $2, {SHIFT};
            and.b32 t, t, {mask};
            mov.b32 {{lo, hi}}, t;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }}""",
            constraints="=r,=r,r", args=[c], dtype=tl.float16, is_pure=True, pack=4)
    else:
        y = ((c >> SHIFT) & ((1 << BITS) - 1)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return y


@triton.jit
def hilo(x):
    """fp32 ``[K, N]`` -> fp16 ``[K, 2N]``: column ``2n`` the high half of ``x[:, n]``, ``2n+1`` the rest.

    As the right operand of an MMA whose left operand is exact in fp16 (codes, +-1), the pair keeps
    about 22 bits of ``x`` instead of 11; :func:`pair_sum` adds the two output columns back.
    """
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    k: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    return tl.reshape(tl.join(hi, lo), [k, 2 * n])


@triton.jit
def pair_sum(y):
    """``[M, 2N]`` -> ``[M, N]``: sum of columns ``2n`` and ``2n+1`` (adjacent in a thread's registers)."""
    m: tl.constexpr = y.shape[0]
    n: tl.constexpr = y.shape[1] // 2
    a, b = tl.split(tl.reshape(y, [m, n, 2]))
    return a + b


@triton.jit
def interleave_rows(planes, P: tl.constexpr):
    """P tensors ``[R, N]`` -> ``[P R, N]`` with row ``P r + i`` from ``planes[i][r]``.

    Puts the scores of the P token groups of a K tile (bit plane i: tokens ``P t + i``) back in
    token order; small (``G x M``), unlike the codes.
    """
    if P == 1:
        y = planes[0]
    elif P == 2:
        r: tl.constexpr = planes[0].shape[0]
        n: tl.constexpr = planes[0].shape[1]
        y = tl.reshape(tl.permute(tl.join(planes[0], planes[1]), (0, 2, 1)), [2 * r, n])
    else:
        r: tl.constexpr = planes[0].shape[0]
        n: tl.constexpr = planes[0].shape[1]
        x = tl.join(tl.join(planes[0], planes[2]), tl.join(planes[1], planes[3]))  # [r, n, a, b]: plane 2a + b
        y = tl.reshape(tl.permute(x, (0, 2, 3, 1)), [4 * r, n])
    return y


@triton.jit
def fp_block(
    bq, k_ptr, v_ptr, base, s_n, n0, n_len, lim, m_i, l_i, acc,
    D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Online-softmax update of the transposed state with BLOCK_N full-precision tokens from n0.

    bq: the scaled query, transposed and split (:func:`hilo`), ``[D, 2M]``; lim ``[M]``: positions
    visible to each query row; acc: the PV accumulator ``[2M, D]``, rows 2m and 2m + 1 the products
    of the high and low halves of row m's weights (the split keeps ~22 bits because V, the other
    operand, is exact in fp16; :func:`fp_result` adds the halves once per program). K and V enter
    the MMAs as stored (K on the left, V on the right): whole rows in wide loads, which Triton's
    pipeline turns into async copies of the next block, and no transposition in registers (the
    V products in the tiles' channel order took strided 2-byte loads: 830 instructions a block
    against 690, and 3x the time; BENCHMARKS.md table 1).
    """
    offs = n0 + tl.arange(0, BLOCK_N)
    ok = offs < n_len
    d = tl.arange(0, D)
    at = base + offs[:, None] * s_n + d[None, :]  # [BLOCK_N, D] element offsets, K and V alike
    k = tl.load(k_ptr + at, mask=ok[:, None], other=0.0).to(tl.float16)
    v = tl.load(v_ptr + at, mask=ok[:, None], other=0.0).to(tl.float16)
    s = pair_sum(tl.dot(k, bq))  # [BLOCK_N, M], log2 domain (scale folded into the query)
    vis = ok[:, None] & (offs[:, None] < lim[None, :])
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    alpha2 = tl.reshape(tl.join(alpha, alpha), [2 * alpha.shape[0]])  # each row's factor for both halves
    acc = acc * alpha2[:, None] + tl.dot(tl.trans(hilo(p)), v)
    return m_new, l_i, acc


@triton.jit
def fp_result(acc, PV: tl.constexpr):
    """:func:`fp_block`'s accumulator ``[2M, D]`` -> the tiles' PV accumulators ``[D / PV, M]``."""
    m: tl.constexpr = acc.shape[0] // 2
    d: tl.constexpr = acc.shape[1]
    hi, lo = tl.split(tl.permute(tl.reshape(acc, [m, 2, d]), (2, 0, 1)))  # [D, M] each
    return channel_groups(hi + lo, PV, m)


@triton.jit
def channel_groups(x, PV: tl.constexpr, M: tl.constexpr = 0):
    """``[D]`` (M = 0) or ``[D, M]`` -> PV tensors ``[D / PV]`` or ``[D / PV, M]``, group j holding
    channels ``PV c + j`` (the order of the V tiles' bit planes)."""
    D: tl.constexpr = x.shape[0]
    if PV == 1:
        out = (x,)
    elif PV == 2:
        if M == 0:
            y = tl.reshape(x, [D // 2, 2])
        else:
            y = tl.permute(tl.reshape(x, [D // 2, 2, M]), (0, 2, 1))
        c0, c1 = tl.split(y)
        out = (c0, c1)
    else:  # channel 4c + 2a + b: split on b, then on a
        if M == 0:
            y = tl.reshape(x, [D // 4, 2, 2])
        else:
            y = tl.permute(tl.reshape(x, [D // 4, 2, 2, M]), (0, 3, 1, 2))
        e, o = tl.split(y)
        c0, c2 = tl.split(e)
        c1, c3 = tl.split(o)
        out = (c0, c1, c2, c3)
    return out


@triton.jit
def tile_load(
    n, b64, h64, t, c, d, g,
    kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
    kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
    vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
    vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn,
    D: tl.constexpr, G: tl.constexpr, VB: tl.constexpr,
):
    """Every field of tile ``n``, the loads issued together before any use, so a tile pays one
    memory latency, not one per field; Triton's pipeline (``num_stages`` >= 2) issues them for
    tile n+1 while tile n is computed."""
    PV: tl.constexpr = 8 // VB
    n64 = b64 * 0 + n
    # K bytes [G/PK, D] and V bytes [D/PV, G]: rows run along each product's reduction axis.
    kc = tl.load(kc_ptr + b64 * kc_sb + h64 * kc_sh + n64 * kc_sn + t[:, None] * D + d[None, :])
    vc = tl.load(vc_ptr + b64 * vc_sb + h64 * vc_sh + n64 * vc_sn + c[:, None] * G + g[None, :])
    sk = tl.load(ks_ptr + b64 * ks_sb + h64 * ks_sh + n64 * ks_sn + d)
    zk = tl.load(kz_ptr + b64 * kz_sb + h64 * kz_sh + n64 * kz_sn + d)
    rk = tl.load(kr_ptr + b64 * kr_sb + h64 * kr_sh + n64 * kr_sn + g)
    sv = tl.load(vs_ptr + b64 * vs_sb + h64 * vs_sh + n64 * vs_sn + g)
    zv = tl.load(vz_ptr + b64 * vz_sb + h64 * vz_sh + n64 * vz_sn + g)
    # The V column scales in one load (wide enough for an async copy), split into the PV channel
    # groups of the V bit planes: group j is channels PV c + j.
    cv = tl.load(vcs_ptr + b64 * vcs_sb + h64 * vcs_sh + n64 * vcs_sn + d)
    return kc, vc, sk, zk, rk, sv, zv, channel_groups(cv, PV)


@triton.jit
def tile_step(
    fields, qt, m_i, l_i, accs,
    KB: tl.constexpr, VB: tl.constexpr, KSCALE: tl.constexpr, VSCALE: tl.constexpr, ASM: tl.constexpr,
):
    """One quantized tile (``fields`` from :func:`tile_load`): scores per K bit plane, online
    softmax in token order, V per bit plane."""
    PK: tl.constexpr = 8 // KB
    PV: tl.constexpr = 8 // VB
    kc, vc, sk, zk, rk, sv, zv, cvs = fields
    bqs = hilo(qt * (sk.to(tl.float32) * KSCALE)[:, None])  # [D, 2M]
    qz = tl.sum(qt * zk.to(tl.float32)[:, None], axis=0)  # [M]
    raw = ()
    for i in tl.static_range(PK):
        raw = raw + (pair_sum(tl.dot(code_plane(kc, i * KB, KB, ASM), bqs)),)  # tokens PK t + i
    s = (interleave_rows(raw, PK) + qz[None, :]) * rk.to(tl.float32)[:, None]  # [G, M], token order
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    zs = tl.sum(p * zv.to(tl.float32)[:, None], axis=0)
    bp = hilo(p * (sv.to(tl.float32) * VSCALE)[:, None])  # [G, 2M]
    new = ()
    for j in tl.static_range(PV):
        y = pair_sum(tl.dot(code_plane(vc, j * VB, VB, ASM), bp))  # channels PV c + j
        new = new + (accs[j] * alpha[None, :] + (y + zs[None, :]) * cvs[j].to(tl.float32)[:, None],)
    return m_new, l_i, new


@triton.jit
def merge_range(pacc_ptr, pml_ptr, base, s_lo, s_hi, FP_SPLITS, fp_out_rot, v_rot, inv_sqrt_d, rows,
                D: tl.constexpr, M: tl.constexpr, CACHE: tl.constexpr):
    """Merge partials ``s_lo .. s_hi - 1`` (slots ``base + s``) into one ``(m, l, acc)`` in the model
    frame: the rotated-frame ones (``s < FP_SPLITS``: ``fp_out_rot``, else ``v_rot``) are summed
    apart and un-rotated once, in registers.

    One pass, online (a running maximum rescales the sums), so each step's loads are issued at
    once and no step waits for a pass over the maxima: the merge runs after the programs it merges
    and is a chain of memory round trips.
    """
    SB: tl.constexpr = 8  # partials per step
    d = tl.arange(0, D)
    s_off = tl.arange(0, SB)
    m_run = tl.full([M], float("-inf"), tl.float32)
    l_run = tl.zeros([M], tl.float32)
    acc_rot = tl.zeros([M, D], tl.float32)
    acc_model = tl.zeros([M, D], tl.float32)
    for s0 in range(s_lo, s_hi, SB):
        s_idx = s0 + s_off
        ok = s_idx < s_hi
        off = (base + s_idx[:, None]) * M + rows[None, :]  # [SB, M]
        m_s = tl.load(pml_ptr + off * 2, mask=ok[:, None], other=float("-inf"), cache_modifier=CACHE)
        l_s = tl.load(pml_ptr + off * 2 + 1, mask=ok[:, None], other=0.0, cache_modifier=CACHE)
        a_s = tl.load(pacc_ptr + off[:, :, None] * D + d[None, None, :], mask=ok[:, None, None], other=0.0,
                      cache_modifier=CACHE)
        m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)  # 0 while nothing was seen (m_run = -inf)
        w = tl.exp2(m_s - m_safe[None, :])  # [SB, M]
        l_run = l_run * alpha + tl.sum(w * l_s, axis=0)
        rot = tl.where(s_idx < FP_SPLITS, fp_out_rot, v_rot) != 0  # [SB]: partial in the rotated frame
        wa = w[:, :, None] * a_s
        acc_rot = acc_rot * alpha[:, None] + tl.sum(tl.where(rot[:, None, None], wa, 0.0), axis=0)
        acc_model = acc_model * alpha[:, None] + tl.sum(tl.where(rot[:, None, None], 0.0, wa), axis=0)
        m_run = m_new
    return m_run, l_run, hadamard_rows(acc_rot, D) * inv_sqrt_d + acc_model


@triton.jit
def store_partial(pacc_ptr, pml_ptr, slot, m, l, acc, rows, D: tl.constexpr):
    """``(m, l, acc)`` of the ``M`` query rows at partial slot ``slot`` (channels in natural order)."""
    off = slot * acc.shape[0] + rows
    tl.store(pacc_ptr + off[:, None] * D + tl.arange(0, D)[None, :], acc)
    tl.store(pml_ptr + off * 2, m)
    tl.store(pml_ptr + off * 2 + 1, l)


@triton.jit
def store_output(o_ptr, o_sb, o_sh, o_st, b64, l, acc, row_ok, qi, qh, D: tl.constexpr):
    """The attention output ``acc / l`` of the query rows (0 where a row saw no key)."""
    inv_l = tl.where(l > 0, 1.0 / l, 0.0)
    d = tl.arange(0, D)
    tl.store(o_ptr + b64 * o_sb + qh[:, None].to(tl.int64) * o_sh + qi[:, None] * o_st + d[None, :],
             (acc * inv_l[:, None]).to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
