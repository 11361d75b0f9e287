"""Batched tile flush in one launch: normalization, RTN, packing, fields written in place.

Twin of :func:`kvarn.codec.encode_tiles`. One program per (tile, K or V): the whole tile ``X [R, C]``
stays in registers through the T iterations of the dual-axis normalization (spec section 2; best
iterate per tile, identity included, ties to the later iterate), then rows are rounded to nearest
even (spec section 3), packed low bits first (spec section 4; code matrices stored transposed, as :mod:`kvarn.codec`
says) and the fp16 fields are stored.

kvarn-auto: ``normalize`` flags per tile switch the normalization off for K or V of that tile: the
identity stays the chosen iterate, so the column scales are exactly 1 and only the RTN step is
stored, as :mod:`kvarn.flavour` encodes with T = 0. (The rotation is applied, or not, by the caller,
before the tiles reach the kernel.)

Differences from the torch twin, by design: the unbiased standard deviations are two-pass sums in a
different reduction order and ``exp``/``log`` come from the GPU's math library, so a scale can differ
by one fp16 ulp and a code that sits on a rounding boundary can move by one step (rarely: see the
kernel tests). Quantile ranges (``config.quantile > 0``) are not implemented here: ValueError.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codec import TileFields
from ..config import KVarNConfig
from .layout import check_device, check_fields, empty_fields, lead_strides

_RNE_MAGIC = 12582912.0  # 1.5 * 2^23: (x + M) - M rounds fp32 x to nearest even for |x| < 2^22


@triton.jit
def _ustd_cols(y, R: tl.constexpr):
    """Unbiased std of each column (over rows), two-pass. y: [R, C] -> [C]."""
    mean = tl.sum(y, axis=0) / R
    dev = y - mean[None, :]
    return tl.sqrt(tl.sum(dev * dev, axis=0) / (R - 1))


@triton.jit
def _ustd_rows(y, C: tl.constexpr):
    mean = tl.sum(y, axis=1) / C
    dev = y - mean[:, None]
    return tl.sqrt(tl.sum(dev * dev, axis=1) / (C - 1))


@triton.jit
def _imbalance(y, R: tl.constexpr, C: tl.constexpr):
    cs = _ustd_cols(y, R)
    rs = _ustd_rows(y, C)
    return tl.max(cs, axis=0) / tl.maximum(tl.min(cs, axis=0), 1e-8) + tl.max(rs, axis=0) / tl.maximum(
        tl.min(rs, axis=0), 1e-8
    )


@triton.jit
def _encode_one(
    x_ptr, x_tile, x_sr, x_sc,
    codes_ptr, codes_off, rs_ptr, rs_off, rz_ptr, rz_off, cs_ptr, cs_off,
    norm, R: tl.constexpr, C: tl.constexpr, BITS: tl.constexpr, ITERS: tl.constexpr,
):
    rows = tl.arange(0, R)
    cols = tl.arange(0, C)
    x = tl.load(x_ptr + x_tile + rows[:, None] * x_sr + cols[None, :] * x_sc).to(tl.float32)

    a = tl.zeros([C], dtype=tl.float32)
    b = tl.zeros([R], dtype=tl.float32)
    best = _imbalance(x, R, C)
    best_a = a
    best_b = b
    y = x
    for _ in range(ITERS):
        a = tl.minimum(tl.maximum(a + tl.log(tl.minimum(tl.maximum(_ustd_cols(y, R), 1e-3), 1e3)), -0.3), 10.0)
        y = x / (tl.exp(b)[:, None] * tl.exp(a)[None, :])
        b = tl.minimum(tl.maximum(b + tl.log(tl.minimum(tl.maximum(_ustd_rows(y, C), 1e-3), 1e3)), -0.3), 10.0)
        y = x / (tl.exp(b)[:, None] * tl.exp(a)[None, :])
        m = _imbalance(y, R, C)
        take = (m <= best) & norm  # ties go to the later iterate; without normalization: the identity
        best = tl.where(take, m, best)
        best_a = tl.where(take, a, best_a)
        best_b = tl.where(take, b, best_b)

    col_scale = tl.exp(best_a)
    row_scale = tl.exp(best_b)
    y = x / (row_scale[:, None] * col_scale[None, :])

    QMAX: tl.constexpr = (1 << BITS) - 1
    lo = tl.min(y, axis=1)
    hi = tl.max(y, axis=1)
    step = tl.maximum((hi - lo) / QMAX, 1e-10)
    t = (y - lo[:, None]) / step[:, None]
    q = (t + 12582912.0) - 12582912.0  # round half to even
    q = tl.minimum(tl.maximum(q, 0.0), QMAX).to(tl.int32)

    P: tl.constexpr = 8 // BITS
    CB: tl.constexpr = C // P
    if P == 1:
        packed = q
    else:
        shifts = tl.arange(0, P) * BITS
        packed = tl.sum(tl.reshape(q, [R, CB, P]) << shifts[None, None, :], axis=2)
    pcols = tl.arange(0, CB)
    # Stored transposed, [C / P, R] (the code byte order of kvarn.codec).
    tl.store(codes_ptr + codes_off + pcols[None, :] * R + rows[:, None], packed.to(tl.uint8))
    tl.store(rs_ptr + rs_off + rows, (row_scale * step).to(tl.float16))
    tl.store(rz_ptr + rz_off + rows, (row_scale * lo).to(tl.float16))
    tl.store(cs_ptr + cs_off + cols, col_scale.to(tl.float16))


@triton.jit
def _field_offset(i0, i1, i2, s0, s1, s2):
    return i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def _encode_tiles_kernel(
    k_ptr, k_st, k_sr, k_sc, v_ptr, v_st, v_sr, v_sc,
    kc_ptr, kc_s0, kc_s1, kc_s2, ks_ptr, ks_s0, ks_s1, ks_s2,
    kz_ptr, kz_s0, kz_s1, kz_s2, kr_ptr, kr_s0, kr_s1, kr_s2,
    vc_ptr, vc_s0, vc_s1, vc_s2, vcs_ptr, vcs_s0, vcs_s1, vcs_s2,
    vs_ptr, vs_s0, vs_s1, vs_s2, vz_ptr, vz_s0, vz_s1, vz_s2,
    N1, N2, norm_ptr,
    D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    tile = tl.program_id(0)
    if HAS_NORM:  # [tiles, 2] int8: K, V normalized
        norm = tl.load(norm_ptr + tile * 2 + tl.program_id(1)) != 0
    else:
        norm = True
    i2 = tile % N2
    i1 = (tile // N2) % N1
    i0 = tile // (N1 * N2)
    t64 = tile.to(tl.int64)
    if tl.program_id(1) == 0:
        _encode_one(
            k_ptr, t64 * k_st, k_sr, k_sc,
            kc_ptr, _field_offset(i0, i1, i2, kc_s0, kc_s1, kc_s2),
            ks_ptr, _field_offset(i0, i1, i2, ks_s0, ks_s1, ks_s2),
            kz_ptr, _field_offset(i0, i1, i2, kz_s0, kz_s1, kz_s2),
            kr_ptr, _field_offset(i0, i1, i2, kr_s0, kr_s1, kr_s2),
            norm, D, G, KB, ITERS,
        )
    else:
        _encode_one(
            v_ptr, t64 * v_st, v_sr, v_sc,
            vc_ptr, _field_offset(i0, i1, i2, vc_s0, vc_s1, vc_s2),
            vs_ptr, _field_offset(i0, i1, i2, vs_s0, vs_s1, vs_s2),
            vz_ptr, _field_offset(i0, i1, i2, vz_s0, vz_s1, vz_s2),
            vcs_ptr, _field_offset(i0, i1, i2, vcs_s0, vcs_s1, vcs_s2),
            norm, G, D, VB, ITERS,
        )


def _flat_tiles(x: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    return x.reshape(-1, x.shape[-2], x.shape[-1]) if lead else x[None]


def encode_tiles(
    k_tiles: torch.Tensor, v_tiles: torch.Tensor, config: KVarNConfig, out: TileFields | None = None,
    *, normalize: tuple[torch.Tensor, torch.Tensor] | None = None, num_warps: int | None = None,
) -> TileFields:
    """Quantize rotated tiles in one launch. k_tiles: ``[..., D, G]``, v_tiles: ``[..., G, D]``.

    Any float dtype and strides (a transposed view of ``[..., G, D]`` keys is fine). ``out``:
    optional TileFields to write into (for example :func:`record_fields_view` of a cache's record
    buffer at the tiles being flushed), leading dims equal to the inputs' (at most 3 of them).
    Returns the written TileFields. ``normalize``: kvarn-auto's ``(key_normalize, value_normalize)``,
    bool tensors of the leading shape (per tile); False keeps that tile unnormalized (module
    docstring); None normalizes every tile, the spec. ``num_warps``: a tuning knob (default: 8, 16
    for tiles over 16K elements), no effect on results.
    """
    if not isinstance(config, KVarNConfig):
        raise TypeError(f"config must be a KVarNConfig, got {type(config).__name__}")
    if config.quantile > 0.0:
        raise ValueError("the Triton encoder implements min/max ranges only (config.quantile must be 0)")
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
    check_device(k_tiles, v_tiles)
    if out is None:
        out = empty_fields(lead, config, d, k_tiles.device)
    check_fields(out, lead, config, d)
    n_tiles = 1
    for s in lead:
        n_tiles *= s
    if n_tiles == 0:
        return out
    sizes = (1,) * (3 - len(lead)) + lead
    if normalize is not None:
        if len(normalize) != 2 or any(not isinstance(x, torch.Tensor) or x.dtype != torch.bool
                                      or tuple(x.shape) != lead for x in normalize):
            raise ValueError(f"normalize must be (key_normalize, value_normalize), bool tensors of shape {lead}")
        norm = torch.stack([x.reshape(-1) for x in normalize], dim=1).to(device=k_tiles.device, dtype=torch.int8)
    else:
        norm = k_tiles  # a placeholder, never read (HAS_NORM is False): no allocation and fill per flush
    kt, vt = _flat_tiles(k_tiles, lead), _flat_tiles(v_tiles, lead)

    def strides(name, inner):
        s = lead_strides(getattr(out, name), len(lead), inner)
        return (0,) * (3 - len(lead)) + s

    args = []
    for name, inner in (("k_codes", 2), ("k_row_scale", 1), ("k_row_zero", 1), ("k_col_scale", 1),
                        ("v_codes", 2), ("v_col_scale", 1), ("v_row_scale", 1), ("v_row_zero", 1)):
        args += [getattr(out, name), *strides(name, inner)]
    _encode_tiles_kernel[(n_tiles, 2)](
        kt, kt.stride(0), kt.stride(1), kt.stride(2), vt, vt.stride(0), vt.stride(1), vt.stride(2),
        *args, sizes[1], sizes[2], norm,
        D=d, G=g, KB=config.key_bits, VB=config.value_bits, ITERS=config.sinkhorn_iters,
        HAS_NORM=normalize is not None,
        num_warps=num_warps or (16 if d * g > 16384 else 8),
    )
    return out
