"""Triton ``encode_tiles`` against the torch codec (kvarn.codec.encode_tiles).

Codes are compared exactly up to the documented reduction-order allowance (at most 0.01% of codes,
each by one step); fp16 scales within one ulp. When two normalization iterates score the same
imbalance up to fp32 rounding (the torch codec sums in float64, the kernel in fp32 trees), the kernel
may keep the other one. Such a tile is checked against the torch codec's encoding at the iterate
the kernel kept, after checking that this iterate ties the best one (measured on the H200: 5 of 256
K tiles at D 64, each 1 fp32 ulp of the score above the best).
"""

import pytest
import torch

from kvarn.codec import encode_tile_fields, encode_tiles as torch_encode
from kvarn.config import KVarNConfig
from kvarn.codec.normalize import apply_scales, normalize_iterates
from kvarn.codec.pack import unpack_codes
from kvarn.codec.record import FIELD_ORDER, TileFields, fields_to_records

from kernel_data import HAS_CUDA, fast_cases, full_sweep, rotated_tiles, synthetic_kv

kernels = pytest.importorskip("kvarn.kernels", reason="triton is not importable")


def _ulp16(x: torch.Tensor) -> torch.Tensor:
    a = x.abs().clamp_min(2.0 ** -14)
    return torch.exp2(torch.floor(torch.log2(a)) - 10)


def _within_ulp(a, b):
    a, b = a.float(), b.float()
    return (a - b).abs() <= _ulp16(torch.maximum(a.abs(), b.abs()))


SCORE_TIE = 1e-6  # relative imbalance gap of a tie: a few fp32 ulps (2^-23 = 1.2e-7)


def tie_adjusted(out, ref, k_tiles, v_tiles, config):
    """``(ref, moved)``: the torch codec's fields, where the kernel kept another normalization iterate
    (column scales not within one ulp) replaced by the torch encoding at that iterate; asserts that
    the iterate exists and ties the best one."""
    fields = {n: getattr(ref, n).clone() for n in FIELD_ORDER}
    moved = 0
    for side, x, bits, quantile in (("k", k_tiles, config.key_bits, config.quantiles[0]),
                                    ("v", v_tiles, config.value_bits, config.quantiles[1])):
        col = f"{side}_col_scale"
        off = ~_within_ulp(getattr(out, col), getattr(ref, col)).all(-1)
        if not off.any():
            continue
        xs = x.to(torch.float32)[off]  # [moved, R, C]
        a, b, score = normalize_iterates(xs, config.sinkhorn_iters)
        kept = _within_ulp(torch.exp(a).half(), getattr(out, col)[off][:, None, :]).all(-1)  # [moved, iters + 1]
        assert kept.any(-1).all(), f"{side}: a tile's column scales match no normalization iterate"
        pick = kept.float().argmax(-1)
        at = lambda t: t.gather(1, pick[:, None, None].expand(-1, 1, t.shape[-1]))[:, 0]  # noqa: E731
        gap = (score.gather(1, pick[:, None])[:, 0] - score.amin(-1)) / score.amin(-1)
        assert (gap <= SCORE_TIE).all(), f"{side}: the kernel kept an iterate {gap.max():.2e} worse than the best"
        ca, cb = at(a), at(b)
        y = apply_scales(xs, ca, cb)
        codes, scale, zero, colf = encode_tile_fields(xs, bits, config.sinkhorn_iters, quantile,
                                               normalized=(y, torch.exp(ca), torch.exp(cb)))
        for name, val in ((f"{side}_codes", codes), (f"{side}_row_scale", scale), (f"{side}_row_zero", zero),
                          (col, colf)):
            fields[name][off] = val
        moved += int(off.sum())
    return TileFields(**fields), moved


def compare(out, ref, config, tiles=None):
    """Returns (code flips, codes, tiles where the kernel kept a tied iterate); asserts everything else.
    ``tiles``: the encoded ``(k_tiles, v_tiles)``, to allow ties (None: every scale within one ulp)."""
    ref, moved = (ref, 0) if tiles is None else tie_adjusted(out, ref, *tiles, config)
    flips, total = 0, 0
    for name, bits in (("k_codes", config.key_bits), ("v_codes", config.value_bits)):
        a, b = unpack_codes(getattr(out, name), bits).int(), unpack_codes(getattr(ref, name), bits).int()
        assert (a - b).abs().max() <= 1, f"{name}: a code moved by more than one step"
        flips += int((a != b).sum())
        total += a.numel()
    for name in ("k_row_scale", "k_row_zero", "k_col_scale", "v_col_scale", "v_row_scale", "v_row_zero"):
        assert _within_ulp(getattr(out, name), getattr(ref, name)).all(), f"{name}: a scale is off by more than one ulp"
    return flips, total, moved


@pytest.mark.parametrize("bits", fast_cases([((2, 2),), ((4, 2),), ((4, 4),), ((8, 4),)], fast=(0, 3)))
def test_encode_small(bits, kdevice):
    cfg = KVarNConfig(key_bits=bits[0], value_bits=bits[1], tile=64, sinkhorn_iters=4)
    k, v = synthetic_kv(1, 2, 64, 64, kdevice, seed=bits[0] * 10 + bits[1])
    kt, vt = rotated_tiles(k, v, cfg)  # [1, 2, 1, 64, 64]; kt is a transposed view
    out = kernels.encode_tiles(kt, vt, cfg)
    ref = torch_encode(kt, vt, cfg)
    flips, total, moved = compare(out, ref, cfg, (kt, vt))
    assert flips <= max(1, int(1e-4 * total))


def test_encode_writes_records_in_place(kdevice):
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=64, sinkhorn_iters=2)
    k, v = synthetic_kv(1, 1, 128, 64, kdevice, seed=3)
    kt, vt = rotated_tiles(k, v, cfg)  # [1, 1, 2, D, G]
    records = torch.full((1, 1, 3, cfg.record_bytes(64)), 7, dtype=torch.uint8, device=kdevice)
    view = kernels.record_fields_view(records[:, :, 1:], cfg, 64)
    out = kernels.encode_tiles(kt, vt, cfg, out=view)
    assert out is view
    ref = kernels.encode_tiles(kt, vt, cfg)
    for name in FIELD_ORDER:  # the store's bytes are the fields (code matrices in stored order)
        assert torch.equal(getattr(view, name), getattr(ref, name)), name
    assert torch.equal(fields_to_records(view, cfg, 64), fields_to_records(ref, cfg, 64))
    assert (records[:, :, 0] == 7).all()  # untouched slot


def _model_frame(k, v, cfg, dtype=torch.float16):
    """Model-frame K/V ``[B, H, T, D]`` as the tail holds them (fp16 unless told), and their tiles as
    the flush passes them: views (keys transposed), no copy."""
    b, h, t, d = k.shape
    k16, v16 = k.to(dtype), v.to(dtype)
    n = t // cfg.tile
    return k16, v16, k16.reshape(b, h, n, cfg.tile, d).transpose(-1, -2), v16.reshape(b, h, n, cfg.tile, d)


@pytest.mark.parametrize("bits,dtype", fast_cases([((2, 2), torch.float16), ((4, 2), torch.float16),
                                                    ((4, 2), torch.bfloat16), ((2, 2), torch.float32)], fast=(0, 2)))
def test_encode_rotates_model_frame_tiles(bits, dtype, kdevice):
    """rotate=True: the kernel's own rotation of model-frame tiles encodes as the torch codec does
    the tiles rotated in torch (fp32); fp16 tiles take the rotation's one-MMA first stage, bf16 and
    fp32 ones the split one."""
    cfg = KVarNConfig(key_bits=bits[0], value_bits=bits[1], tile=64, sinkhorn_iters=4)
    k, v = synthetic_kv(1, 2, 128, 64, kdevice, seed=7 + bits[0])
    k16, v16, kt16, vt16 = _model_frame(k, v, cfg, dtype)
    out = kernels.encode_tiles(kt16, vt16, cfg, rotate=True)
    kt, vt = rotated_tiles(k16.float(), v16.float(), cfg)
    flips, total, moved = compare(out, torch_encode(kt, vt, cfg), cfg, (kt, vt))
    assert flips <= max(1, int(1e-4 * total))
    unrotated = kernels.encode_tiles(kt16, vt16, cfg)  # the same tiles read as rotated ones
    assert not torch.equal(unrotated.k_codes, out.k_codes)


@pytest.mark.parametrize("name,d", full_sweep(["k2v2_g128", "k4v2_g128"], [128, 256]))
def test_encode_rotates_full_size_tiles(name, d, kdevice):
    """The flush's form at a real tile size (G 128, D 128 / 256: both factors of the in-kernel
    rotation, 16K-32K values a program), also under the interpreter: 16 tiles of K and of V."""
    cfg = KVarNConfig.from_name(name)
    k, v = synthetic_kv(1, 8, 2 * cfg.tile, d, kdevice, seed=d + cfg.key_bits)
    k16, v16, kt16, vt16 = _model_frame(k, v, cfg)
    kt, vt = rotated_tiles(k16.float(), v16.float(), cfg)
    out = kernels.encode_tiles(kt16, vt16, cfg, rotate=True)
    flips, total, moved = compare(out, torch_encode(kt, vt, cfg), cfg, (kt, vt))
    assert flips <= max(1, int(1e-4 * total)) and moved <= 4


@pytest.mark.parametrize("mag, offset, spread", fast_cases([(30, 30, 1.0), (100, 20, 1.5)]))
def test_encode_keeps_the_twin_on_large_values(mag, offset, spread, kdevice):
    """Far from unit scale (values up to about 10^4, channel offsets 20-30x a value's scale, token
    scales spread over about two decades), the fp32 sums stay within the twin's tolerance: a pass's
    deviations are taken around that pass's own means (sums around a stale mean cancel there:
    scales that match no iterate, measured for one-pass sums shifted by the previous iteration's means)."""
    cfg = KVarNConfig.from_name("k4v2_g128")
    g = torch.Generator().manual_seed(1000 * mag + offset)
    b, h, t, d = 1, 4, cfg.tile, 128
    chan = 1 + 4 * torch.rand(1, h, 1, d, generator=g) ** 4
    tok = torch.exp(spread * torch.randn(b, h, t, 1, generator=g))
    k = mag * (torch.randn(b, h, t, d, generator=g) * chan * tok + offset * torch.randn(1, h, 1, d, generator=g))
    v = 0.1 * mag * (torch.randn(b, h, t, d, generator=g) * tok + offset * torch.randn(1, h, 1, d, generator=g))
    kt, vt = rotated_tiles(k.to(kdevice), v.to(kdevice), cfg)
    out = kernels.encode_tiles(kt, vt, cfg)
    flips, total, moved = compare(out, torch_encode(kt, vt, cfg), cfg, (kt, vt))
    assert flips <= max(1, int(1e-4 * total)) and moved <= 4


@pytest.mark.parametrize("tile,d,quantiles", fast_cases([(64, 64, (0.03, 0.03)), (64, 128, (0.0, 0.05)),
                                                          (128, 128, (0.03, 0.03)), (128, 256, (0.005, 0.2))],
                                                         fast=(2,)))
def test_encode_quantile_ranges(tile, d, quantiles, kdevice):
    """Rows rounded over their [q, 1 - q] quantiles (kvarn-auto's 2-bit ranges), per K and V: the
    kernel's rank extraction and interpolation give the torch codec's torch.quantile ranges, and they differ
    from min/max ones (values past the quantiles are clipped to the end codes). Also at full size
    (G 128, D 128 / 256) and far from kvarn-auto's q (0.2: 52 ranks from each end)."""
    cfg = KVarNConfig(key_bits=2, value_bits=2, tile=tile, sinkhorn_iters=4,
                      key_quantile=quantiles[0], value_quantile=quantiles[1])
    k, v = synthetic_kv(1, 2, tile, d, kdevice, seed=tile + d)
    k16, v16, kt16, vt16 = _model_frame(k, v, cfg)
    kt, vt = rotated_tiles(k16.float(), v16.float(), cfg)
    out = kernels.encode_tiles(kt16, vt16, cfg, rotate=True)
    flips, total, moved = compare(out, torch_encode(kt, vt, cfg), cfg, (kt, vt))
    assert flips <= max(1, int(1e-4 * total)) and moved <= 4
    minmax = kernels.encode_tiles(kt16, vt16, KVarNConfig(key_bits=2, value_bits=2, tile=tile, sinkhorn_iters=4),
                                  rotate=True)
    assert torch.equal(out.k_row_scale, minmax.k_row_scale) == (quantiles[0] == 0.0)
    assert not torch.equal(out.v_row_scale, minmax.v_row_scale)


@pytest.mark.parametrize("slot_dtype", fast_cases([torch.long, torch.int32]))
def test_encode_writes_at_a_device_slot(kdevice, slot_dtype):
    """slot: tiles n = 0, 1 land at slot + n of fields with a capacity axis; the rest is untouched
    (an int32 slot, as a cache's tile count is, the same as a long one)."""
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=64, sinkhorn_iters=2)
    k, v = synthetic_kv(2, 1, 128, 64, kdevice, seed=4)
    _, _, kt16, vt16 = _model_frame(k, v, cfg)
    ref = kernels.encode_tiles(kt16, vt16, cfg, rotate=True)  # [2, 1, 2, ...]
    from kvarn.kernels.layout import empty_fields

    store = empty_fields((2, 1, 4), cfg, 64, kdevice)
    for name in FIELD_ORDER:
        getattr(store, name).fill_(3)
    slot = torch.tensor([1], dtype=slot_dtype, device=kdevice)
    kernels.encode_tiles(kt16, vt16, cfg, store, rotate=True, slot=slot)
    for name in FIELD_ORDER:
        x = getattr(store, name)
        assert torch.equal(x[:, :, 1:3], getattr(ref, name)), name
        assert (x[:, :, 0] == 3).all() and (x[:, :, 3] == 3).all(), name
    with pytest.raises(ValueError, match="slot needs"):
        kernels.encode_tiles(kt16, vt16, cfg, rotate=True, slot=slot)  # no fields to index into


def test_encode_capped_grid_encodes_every_tile_the_same(kdevice):
    """programs: fewer programs than tiles, each looping over every programs-th tile (5 programs
    for 12 tiles: two take three, at a device slot too), give the same bits as one program a tile."""
    from kvarn.kernels.layout import empty_fields

    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=64, sinkhorn_iters=2)
    k, v = synthetic_kv(2, 2, 192, 64, kdevice, seed=5)
    _, _, kt16, vt16 = _model_frame(k, v, cfg)  # [2, 2, 3, ...]: 12 tiles of K and of V
    ref = kernels.encode_tiles(kt16, vt16, cfg, rotate=True)
    one = kernels.encode_tiles(kt16, vt16, cfg, rotate=True, programs=1)
    store = empty_fields((2, 2, 4), cfg, 64, kdevice)
    kernels.encode_tiles(kt16, vt16, cfg, store, rotate=True, slot=torch.tensor([1], device=kdevice), programs=5)
    for name in FIELD_ORDER:
        assert torch.equal(getattr(one, name), getattr(ref, name)), name
        assert torch.equal(getattr(store, name)[:, :, 1:], getattr(ref, name)), name


def test_encode_flags_nonfinite_scales(kdevice):
    """bad: 1 when a stored fp16 scale overflows, untouched (0) otherwise; no host read needed."""
    cfg = KVarNConfig(tile=64, sinkhorn_iters=2)
    k, v = synthetic_kv(1, 2, 64, 64, kdevice, seed=9)
    bad = torch.zeros(1, dtype=torch.int32, device=kdevice)
    _, _, kt16, vt16 = _model_frame(k, v, cfg)
    kernels.encode_tiles(kt16, vt16, cfg, rotate=True, bad=bad)
    assert int(bad[0]) == 0
    big = torch.zeros_like(v)
    big[0, 1] = v[0, 1] * 1e12  # past what the clipped scales absorb (e^10 each): fp16 overflow
    kt, vt = rotated_tiles(k, big, cfg)
    out = kernels.encode_tiles(kt, vt, cfg, bad=bad)
    assert int(bad[0]) == 1
    assert not torch.isfinite(out.v_row_scale[0, 1].float()).all() and torch.isfinite(out.v_row_scale[0, 0].float()).all()


def test_encode_keeps_the_identity_when_its_score_is_not_a_number(kdevice):
    """The identity's imbalance is the first best even when it is NaN (fp32 values whose variances
    overflow: inf / inf), so no later iterate is taken (spec section 2: best = imbalance(X)); the
    launch is flagged."""
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=64, sinkhorn_iters=2)
    g = torch.Generator().manual_seed(0)
    kt = (torch.randn(1, 1, 64, 64, generator=g) * 1e20).to(kdevice)  # [.., D, G]
    vt = torch.randn(1, 1, 64, 64, generator=g).to(kdevice)
    bad = torch.zeros(1, dtype=torch.int32, device=kdevice)
    out = kernels.encode_tiles(kt, vt, cfg, bad=bad)
    assert int(bad[0]) == 1
    assert (out.k_col_scale.float() == 1).all()  # the identity (the twin refuses such a tile by name)


def test_encode_errors(kdevice, monkeypatch):
    cfg = KVarNConfig(tile=64)
    kt = torch.randn(2, 64, 64, device=kdevice)
    with pytest.raises(ValueError, match="G=64"):
        kernels.encode_tiles(kt, kt, KVarNConfig(tile=128))
    with pytest.raises(TypeError):
        kernels.encode_tiles(kt, kt, "k4v2_g64")
    with pytest.raises(ValueError, match="rotate must be None, True or"):
        kernels.encode_tiles(kt, kt, cfg, rotate="yes")
    with pytest.raises(ValueError, match="32 <= D <= 256, got D=16"):
        small = torch.randn(2, 16, 64, device=kdevice)
        kernels.encode_tiles(small, small.transpose(-1, -2), cfg, rotate=True)
    with pytest.raises(ValueError, match="bad must be an int32"):
        kernels.encode_tiles(kt, kt, cfg, bad=torch.zeros(1, device=kdevice))
    with pytest.raises(ValueError, match=r"num_warps=3; use None"):
        kernels.encode_tiles(kt, kt, cfg, num_warps=3)
    with pytest.raises(ValueError, match=r"max_registers=0; use None"):
        kernels.encode_tiles(kt, kt, cfg, max_registers=0)
    with pytest.raises(ValueError, match=r"programs must be an int >= 1 \(programs per K and per V\), got 0"):
        kernels.encode_tiles(kt, kt, cfg, programs=0)
    with pytest.raises(ValueError, match="slot must be an int32 or long tensor of one element"):
        kernels.encode_tiles(kt[None, None], kt[None, None], cfg, kernels.encode_tiles(kt[None, None], kt[None, None], cfg),
                             slot=torch.zeros(1, dtype=torch.int16, device=kdevice))
    if not HAS_CUDA:  # no silent fallback: CPU tensors outside the interpreter are refused
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="CUDA"):
            kernels.encode_tiles(kt, kt, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name,d", full_sweep(["k2v2_g128", "k4v2_g128", "k4v4_g128", "k4v2_g64"], [64, 128, 256]))
def test_encode_full(name, d):
    cfg = KVarNConfig.from_name(name)
    k, v = synthetic_kv(4, 8, 4 * cfg.tile, d, "cuda", seed=d)
    kt, vt = rotated_tiles(k, v, cfg)  # 128 tiles of K and of V
    out = kernels.encode_tiles(kt, vt, cfg)
    ref = torch_encode(kt, vt, cfg)
    flips, total, moved = compare(out, ref, cfg, (kt, vt))
    assert flips <= 1e-4 * total, f"{flips} of {total} codes differ"
    assert moved <= 0.25 * kt.shape[:-2].numel() * 2
    # The flush's form: fp16 model-frame tiles rotated by the kernel, against the torch rotation.
    k16, v16, kt16, vt16 = _model_frame(k, v, cfg)
    kt, vt = rotated_tiles(k16.float(), v16.float(), cfg)
    out = kernels.encode_tiles(kt16, vt16, cfg, rotate=True)
    flips, total, moved = compare(out, torch_encode(kt, vt, cfg), cfg, (kt, vt))
    assert flips <= 1e-4 * total, f"model frame: {flips} of {total} codes differ"
    assert moved <= 0.25 * kt.shape[:-2].numel() * 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("opts", [
    pytest.param(dict(num_warps=4), marks=pytest.mark.slow),
    pytest.param(dict(num_warps=8, max_registers=128), marks=pytest.mark.slow),
    pytest.param(dict(num_warps=8), marks=pytest.mark.slow),
    dict(programs="beside"),  # the cache's own cap beside the decode step
])
def test_encode_launch_options_keep_the_tolerance(opts):
    """The launch knobs (the defaults pick them by launch size, see ``_launch_options``) change the
    reduction order, not the encoding: every form stays within the twin's tolerance, here on a
    launch of 512 programs (about 4 per SM on an H200, a size the cache's flush only reaches at larger
    batches) in the flush's form (fp16 model-frame tiles rotated by the kernel); and the capped grid
    of the encodes beside the decode step (the cache's own cap, a quarter of the SMs for K and for V)."""
    if opts.get("programs") == "beside":
        from kvarn.integrations.transformers.freeze_schedule import beside_programs

        opts = dict(programs=beside_programs(torch.device("cuda")))
    cfg = KVarNConfig.from_name("k4v2_g128")
    k, v = synthetic_kv(8, 8, 4 * cfg.tile, 128, "cuda", seed=7)
    k16, v16, kt16, vt16 = _model_frame(k, v, cfg)
    kt, vt = rotated_tiles(k16.float(), v16.float(), cfg)  # 256 tiles of K and of V
    out = kernels.encode_tiles(kt16, vt16, cfg, rotate=True, **opts)
    flips, total, moved = compare(out, torch_encode(kt, vt, cfg), cfg, (kt, vt))
    assert flips <= 1e-4 * total, f"{opts}: {flips} of {total} codes differ"
    assert moved <= 0.25 * kt.shape[:-2].numel() * 2


def test_encode_per_tile_normalization_matches_the_flavour_codec(kdevice):
    """kvarn-auto: normalization off for some tiles' K or V, the torch twin with T = 0 there."""
    from kvarn.codec.flavour import Flavours, encode_flavoured

    cfg = KVarNConfig(key_bits=2, value_bits=2, tile=64, sinkhorn_iters=4)
    k, v = synthetic_kv(1, 4, 128, 64, kdevice, seed=5)  # [1, 4, 128, 64]: two tiles per head
    fl = Flavours(torch.tensor([[True, False, True, False]]), torch.tensor([[True, True, False, False]]),
                  torch.tensor([[False, True, True, False]]), torch.tensor([[False, True, False, True]]))
    fl = fl.map(lambda x: x.to(kdevice))
    from kvarn.integrations.transformers.attention import TritonTileCodec

    codec = TritonTileCodec("kvarn-auto", cfg)
    assert codec.config.quantiles == (0.03, 0.03)  # kvarn-auto's 2-bit ranges, through the flags' path too
    enc = codec.encode(k, v, fl)
    ref = encode_flavoured(k, v, fl, codec.config)
    flips, total, moved = compare(enc.tiles, ref, codec.config)
    assert flips <= max(1, total // 10000) and moved == 0
    off_k = ~fl.key_normalize[0]
    assert torch.equal(enc.tiles.k_col_scale[0, off_k], torch.ones_like(enc.tiles.k_col_scale[0, off_k]))
    with pytest.raises(ValueError, match="normalize must be"):
        kt, vt = rotated_tiles(k, v, cfg)
        kernels.encode_tiles(kt, vt, cfg, normalize=(fl.key_normalize, fl.value_normalize))  # not per tile
