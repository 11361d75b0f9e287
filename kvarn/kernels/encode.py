"""Batched tile flush in one launch: normalization, RTN, packing, fields written in place.

Twin of :func:`kvarn.codec.encode_tiles`. One program per (tile, K or V): the whole tile ``X [R, C]``
stays in registers through the T iterations of the dual-axis normalization (spec section 2; best
iterate per tile, identity included, ties to the later iterate), then rows are rounded to nearest
even (spec section 3), packed low bits first (spec section 4; code matrices stored transposed, as :mod:`kvarn.codec.record`
says) and the fp16 fields are stored.

The tiles come in rotated, or in the model frame (``rotate``): then the kernel rotates each token
itself (spec section 1, in fp32), so a cache's flush is one launch from its fp16 tail to its
reserved slots (``slot``), with the range check as a device flag (``bad``) instead of a host read.

kvarn-auto: ``normalize`` flags per tile switch the normalization off for K or V of that tile: the
identity stays the chosen iterate, so the column scales are exactly 1 and only the RTN step is
stored, as :mod:`kvarn.codec.flavour` encodes with T = 0; ``rotate`` flags per tile say which tiles are
rotated (the others are stored in the model frame).

One tile's normalization, rounding, packing and stores, and how their arithmetic differs from
the torch twin's, are :mod:`kvarn.kernels.encode_tile`'s; this module loads (and rotates) the
tiles, indexes the fields and chooses the launch.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from ..codec.quantize import quantile_ranks
from ..codec.record import TileFields
from ..config import KVarNConfig
from .encode_tile import encode_one
from .hadamard import hadamard_rows
from .layout import (check_device, check_fields, check_launch_knobs, empty_fields, interpreting, lead_strides,
                     num_sms)


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


# N1, N2, n_tiles: launch sizes, not specialized (divisible by 16 or not, equal to 1 or not), so
# that varying launch sizes (vLLM's eager steps) reuse one compiled variant per launch option.
@triton.jit(do_not_specialize=["N1", "N2", "n_tiles"])
def _encode_tiles_kernel(
    k_ptr, k_s0, k_s1, k_s2, k_sr, k_sc, v_ptr, v_s0, v_s1, v_s2, v_sr, v_sc,
    kc_ptr, kc_s0, kc_s1, kc_s2, ks_ptr, ks_s0, ks_s1, ks_s2,
    kz_ptr, kz_s0, kz_s1, kz_s2, kr_ptr, kr_s0, kr_s1, kr_s2,
    vc_ptr, vc_s0, vc_s1, vc_s2, vcs_ptr, vcs_s0, vcs_s1, vcs_s2,
    vs_ptr, vs_s0, vs_s1, vs_s2, vz_ptr, vz_s0, vz_s1, vz_s2,
    N1, N2, n_tiles, flag_ptr, slot_ptr, bad_ptr, src_ptr, dst_ptr, inv_sqrt_d,
    k_clo, k_chi, v_clo, v_chi,
    D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, ITERS: tl.constexpr,
    HAS_NORM: tl.constexpr, ROTATE: tl.constexpr, HAS_ROT: tl.constexpr, HAS_SLOT: tl.constexpr,
    CHECK: tl.constexpr, KQ: tl.constexpr, KLO0: tl.constexpr, KLO1: tl.constexpr, KHI0: tl.constexpr,
    KHI1: tl.constexpr, VQ: tl.constexpr, VLO0: tl.constexpr, VLO1: tl.constexpr, VHI0: tl.constexpr,
    VHI1: tl.constexpr, ASM: tl.constexpr, PERSIST: tl.constexpr, INDEXED: tl.constexpr,
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
        s1 = i1
        o1 = i1
        if INDEXED:  # tile i1 starts at input row src[i1] and goes to output row (a page) dst[i1]; < 0: none
            s1 = tl.load(src_ptr + i1)
            o1 = tl.load(dst_ptr + i1)
        if HAS_SLOT:  # the fields have a capacity axis: tile i2 goes to slot + i2 (read on the device)
            o2 = i2 + tl.load(slot_ptr).to(tl.int32)
        if o1 >= 0:
            if kv == 0:
                off = _field_offset(i0, s1, i2, k_s0, k_s1, k_s2)
                if ROTATE:  # model-frame keys: rotate each token (rows of [G, D]), then the tile is [D, G]
                    xk = tl.trans(_frame_rows(_load_tile(k_ptr, off, k_sc, k_sr, G, D), rot, D, inv_sqrt_d))
                else:
                    xk = _load_tile(k_ptr, off, k_sr, k_sc, D, G).to(tl.float32)
                encode_one(
                    xk,
                    kc_ptr, _field_offset(i0, o1, o2, kc_s0, kc_s1, kc_s2),
                    ks_ptr, _field_offset(i0, o1, o2, ks_s0, ks_s1, ks_s2),
                    kz_ptr, _field_offset(i0, o1, o2, kz_s0, kz_s1, kz_s2),
                    kr_ptr, _field_offset(i0, o1, o2, kr_s0, kr_s1, kr_s2),
                    bad_ptr, norm, D, G, KB, ITERS, CHECK, KQ, KLO0, KLO1, KHI0, KHI1, k_clo, k_chi, ASM,
                )
            else:
                raw = _load_tile(v_ptr, _field_offset(i0, s1, i2, v_s0, v_s1, v_s2), v_sr, v_sc, G, D)
                if ROTATE:
                    xv = _frame_rows(raw, rot, D, inv_sqrt_d)
                else:
                    xv = raw.to(tl.float32)
                encode_one(
                    xv,
                    vc_ptr, _field_offset(i0, o1, o2, vc_s0, vc_s1, vc_s2),
                    vs_ptr, _field_offset(i0, o1, o2, vs_s0, vs_s1, vs_s2),
                    vz_ptr, _field_offset(i0, o1, o2, vz_s0, vz_s1, vz_s2),
                    vcs_ptr, _field_offset(i0, o1, o2, vcs_s0, vcs_s1, vcs_s2),
                    bad_ptr, norm, G, D, VB, ITERS, CHECK, VQ, VLO0, VLO1, VHI0, VHI1, v_clo, v_chi, ASM,
                )


def _quantile_taps(q: float, n: int) -> tuple[bool, tuple]:
    """The [q, 1 - q] quantiles of rows of n values as torch.quantile takes them
    (:func:`kvarn.codec.quantize.quantile_ranks`) -> (on, (lo below, lo above, hi below, hi above, lo
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
    twin's tolerance (:mod:`kvarn.kernels.encode_tile`: a tied iterate, a code on a rounding boundary); the
    register cap moves values to local memory, not the arithmetic. ``programs``: at most this
    many programs each for K and V, each encoding every ``programs``-th tile (default: one
    program a tile; the launch options follow the programs): the same bits, in a launch that
    leaves SMs to the kernels it runs beside (the decode step's encodes on a side stream, see
    :meth:`~kvarn.integrations.transformers.triton_codec.TritonTileCodec.beside`).
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
        bad if bad is not None else k_tiles, k_tiles, k_tiles, 1.0 / math.sqrt(d), *kt[1][4:], *vt[1][4:],
        D=d, G=g, KB=config.key_bits, VB=config.value_bits, ITERS=config.sinkhorn_iters,
        HAS_NORM=normalize is not None, ROTATE=rotate is not None, HAS_ROT=isinstance(rotate, tuple),
        HAS_SLOT=slot is not None, CHECK=bad is not None,
        KQ=kt[0], KLO0=kt[1][0], KLO1=kt[1][1], KHI0=kt[1][2], KHI1=kt[1][3],
        VQ=vt[0], VLO0=vt[1][0], VLO1=vt[1][1], VHI0=vt[1][2], VHI1=vt[1][3], ASM=not interpreting(),
        PERSIST=grid < n_tiles, INDEXED=False, **opts,
    )
    return out


def encode_into_pages(
    rows_k: torch.Tensor, rows_v: torch.Tensor, src_rows: torch.Tensor, pages: torch.Tensor,
    dst_pages: torch.Tensor, config: KVarNConfig, *, rotate: bool = False,
) -> None:
    """Encode tiles of G consecutive token rows into paged records, in one launch (vLLM's commit).

    Twin of :func:`kvarn.paged.encode_into_pages`. ``rows_k``, ``rows_v``: ``[N, Hk, D]`` token
    rows (a staging buffer, or a step's keys and values), any float dtype, channels contiguous;
    in the rotated frame, or in the model frame with ``rotate`` (the kernel rotates each token).
    ``src_rows``: int32 ``[C]``, tile ``c`` is rows ``src_rows[c] .. src_rows[c] + G - 1`` of every
    KV head. ``pages``: uint8 ``[num_blocks, Hk, record_bytes]`` (:mod:`kvarn.codec.record`'s tile-store
    order); tile ``c`` is written at page ``dst_pages[c]`` (int32 ``[C]``), and skipped where that is
    negative, so a captured graph can launch a fixed ``C`` and the host decide per replay which
    tiles exist. No range check on the device: the host owns the indices.
    """
    from ..codec.record import record_field_views

    if rows_k.shape != rows_v.shape or rows_k.dim() != 3:
        raise ValueError(f"rows_k and rows_v must be [N, Hk, D] alike, got {tuple(rows_k.shape)}, {tuple(rows_v.shape)}")
    _, hk, d = rows_k.shape
    if rows_k.stride(-1) != 1 or rows_v.stride(-1) != 1:
        raise ValueError("rows_k and rows_v must be contiguous along D")
    for name, x in (("src_rows", src_rows), ("dst_pages", dst_pages)):
        if x.dtype != torch.int32 or x.dim() != 1:
            raise ValueError(f"{name} must be int32 [C], got {x.dtype} {tuple(x.shape)}")
    if src_rows.shape != dst_pages.shape:
        raise ValueError(f"src_rows {tuple(src_rows.shape)} and dst_pages {tuple(dst_pages.shape)} differ")
    if pages.dim() != 3 or pages.shape[1] != hk:
        raise ValueError(f"pages must be uint8 [num_blocks, Hk={hk}, record_bytes], got {tuple(pages.shape)}")
    if rotate:
        check_rotate_dim(d)
    check_device(rows_k, rows_v, src_rows, dst_pages, pages)
    c = src_rows.shape[0]
    if c == 0:
        return
    out = record_field_views(pages, config, d)  # lead [num_blocks, Hk]
    g = config.tile
    args = []
    for name in ("k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
                 "v_codes", "v_col_scale", "v_row_scale", "v_row_zero"):
        x = getattr(out, name)
        args += [x, 0, x.stride(0), x.stride(1)]
    kq, vq = config.quantiles
    kt, vt = _quantile_taps(kq, g), _quantile_taps(vq, d)
    n_tiles = c * hk
    opts = _options(_launch_options(n_tiles, d * g, rows_k.device, kt[0] or vt[0]), None, None)
    # Lead indices (i0, i1, i2) = (0, tile, head): a K tile [D, G] is channels x token rows.
    _encode_tiles_kernel[(n_tiles, 2)](
        rows_k, 0, rows_k.stride(0), rows_k.stride(1), 1, rows_k.stride(0),
        rows_v, 0, rows_v.stride(0), rows_v.stride(1), rows_v.stride(0), 1,
        *args, c, hk, n_tiles, rows_k, rows_k, rows_k, src_rows, dst_pages, 1.0 / math.sqrt(d),
        *kt[1][4:], *vt[1][4:],
        D=d, G=g, KB=config.key_bits, VB=config.value_bits, ITERS=config.sinkhorn_iters,
        HAS_NORM=False, ROTATE=bool(rotate), HAS_ROT=False, HAS_SLOT=False, CHECK=False,
        KQ=kt[0], KLO0=kt[1][0], KLO1=kt[1][1], KHI0=kt[1][2], KHI1=kt[1][3],
        VQ=vt[0], VLO0=vt[1][0], VLO1=vt[1][1], VHI0=vt[1][2], VHI1=vt[1][3], ASM=not interpreting(),
        PERSIST=False, INDEXED=True, **opts,
    )
