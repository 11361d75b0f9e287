"""Triton building blocks of the fused decode kernel (:mod:`kvarn.kernels.decode`).

Unpacking packed codes, the split-precision product, the online-softmax step over full-precision
tokens (sink and tail) and the loads of one tile's codes and scales.
"""

import triton
import triton.language as tl


@triton.jit
def unpack_rows(c, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr):
    """Packed bytes ``[R, C * BITS / 8]`` -> fp16 ``[R, C]`` codes / CODE_SCALE, natural column order.

    CODE_SCALE is 512 for 2/4-bit (fp8 e4m3 reading of the low bits), 1 for 8-bit.
    """
    if BITS == 8:
        y = c.to(tl.float16)
    elif BITS == 4:
        x = tl.join(c & 15, c >> 4)  # [R, C/2, 2]: column 2j + a
        y = tl.reshape(x, [R, C]).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        x = tl.join(tl.join(c & 3, (c >> 4) & 3), tl.join((c >> 2) & 3, c >> 6))  # [R, C/4, 2, 2]
        # element [j, a, b] is the code 4j + 2a + b
        y = tl.reshape(x, [R, C]).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return y


@triton.jit
def dot_split(a, b, PRECISE: tl.constexpr, SPLIT_ROWS: tl.constexpr):
    """``a @ b`` for fp32 ``a`` and fp16 ``b`` (exact codes or +-1 entries).

    PRECISE splits ``a`` into fp16 high and low parts, so ``a`` keeps about 22 bits instead of 11.
    Without it, the folded scales lose accuracy where the dot cancels against the zero-point term
    (keys with a large per-channel offset), and the output picks up an extra fp16 rounding before
    the un-rotation. SPLIT_ROWS stacks the two parts as rows of one MMA (``[2M, K] @ b``, then the
    row halves are added): the query block has idle rows anyway (GQA groups of 4 in a 16-row
    block), and ``b``, whose operand layout is the expensive part, is fed once. Otherwise: two MMAs.
    """
    hi = a.to(tl.float16)
    if PRECISE:
        lo = (a - hi.to(tl.float32)).to(tl.float16)
        if SPLIT_ROWS:
            m: tl.constexpr = a.shape[0]
            k: tl.constexpr = a.shape[1]
            n: tl.constexpr = b.shape[1]
            both = tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), [2 * m, k])
            out = tl.sum(tl.reshape(tl.dot(both, b), [2, m, n]), axis=0)
        else:
            out = tl.dot(hi, b) + tl.dot(lo, b)
    else:
        out = tl.dot(hi, b)
    return out


@triton.jit
def fp_block(
    qr, k_ptr, v_ptr, base, s_n, n0, n_len, lim, m_i, l_i, acc, hmat, inv_sqrt_d,
    D: tl.constexpr, BLOCK_N: tl.constexpr, ROTATED: tl.constexpr, PRECISE: tl.constexpr,
    SPLIT_ROWS: tl.constexpr,
):
    """Online-softmax update with BLOCK_N full-precision tokens starting at n0.

    ROTATED: the stored tokens are already ``x @ H``; otherwise they are rotated here (a small dot).
    """
    offs = n0 + tl.arange(0, BLOCK_N)
    ok = offs < n_len
    d = tl.arange(0, D)
    k = tl.load(k_ptr + base + offs[:, None] * s_n + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
    v = tl.load(v_ptr + base + offs[:, None] * s_n + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
    if not ROTATED:
        k = (tl.dot(k, hmat) * inv_sqrt_d).to(tl.float16)
        v = (tl.dot(v, hmat) * inv_sqrt_d).to(tl.float16)
    s = dot_split(qr, tl.trans(k), PRECISE, SPLIT_ROWS)  # [M, BLOCK_N], log2 domain (scale folded into q)
    vis = ok[None, :] & (offs[None, :] < lim[:, None])
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot_split(p, v, PRECISE, SPLIT_ROWS)
    return m_new, l_i, acc


@triton.jit
def load_tile(
    n, b64, h64, rows_d, rows_g, cols_kb, cols_vb,
    kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
    kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
    vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
    vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn,
    D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
):
    """All bytes of tile n: packed codes and the six fp16 scale vectors."""
    n64 = b64 * 0 + n  # int64 offsets (the loop index is a plain int in the interpreter)
    kc = tl.load(kc_ptr + b64 * kc_sb + h64 * kc_sh + n64 * kc_sn + rows_d[:, None] * (G * KB // 8) + cols_kb[None, :])
    vc = tl.load(vc_ptr + b64 * vc_sb + h64 * vc_sh + n64 * vc_sn + rows_g[:, None] * (D * VB // 8) + cols_vb[None, :])
    sk = tl.load(ks_ptr + b64 * ks_sb + h64 * ks_sh + n64 * ks_sn + rows_d)
    zk = tl.load(kz_ptr + b64 * kz_sb + h64 * kz_sh + n64 * kz_sn + rows_d)
    rk = tl.load(kr_ptr + b64 * kr_sb + h64 * kr_sh + n64 * kr_sn + rows_g)
    cv = tl.load(vcs_ptr + b64 * vcs_sb + h64 * vcs_sh + n64 * vcs_sn + rows_d)
    sv = tl.load(vs_ptr + b64 * vs_sb + h64 * vs_sh + n64 * vs_sn + rows_g)
    zv = tl.load(vz_ptr + b64 * vz_sb + h64 * vz_sh + n64 * vz_sn + rows_g)
    return kc, vc, sk, zk, rk, cv, sv, zv
