"""Guard rails on the fp16 scales: overflow raises, underflow gives flagged zero tiles, records
with non-finite scales are rejected, and no input or record decodes to NaN/Inf without an error.

Property tests (hypothesis) keep their example counts small: they run in CI on 2 cores.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvarn
from kvarn.codec import FP16_MAX, FP16_TINY
from kvarn.methods import TileCodec

CFG = kvarn.KVarNConfig.from_name("k2v2_g64", tile=32)
D = 16
PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
magnitudes = st.floats(min_value=-12, max_value=12).map(lambda e: 10.0 ** e)


def _kv(scale_k: float, scale_v: float, seed: int, tiles: int = 2):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, 2, tiles * CFG.tile, D, generator=g) * scale_k
    v = torch.randn(1, 2, tiles * CFG.tile, D, generator=g) * scale_v
    return k, v


def _roundtrip_or_error(k, v):
    """(k_hat, v_hat, qkv), or None when the codec raised its ValueError."""
    try:
        qkv = kvarn.quantize_kv(k, v, CFG)
    except ValueError as e:
        assert "fp16 limit" in str(e) and "65504" in str(e), str(e)
        return None
    k_hat, v_hat = kvarn.dequantize_kv(qkv)
    return k_hat, v_hat, qkv


def _check_tiles(x, x_hat, zero):
    """Per tile: flagged zero tiles decode to exact zeros; the others keep a 2-bit error level."""
    g = CFG.tile
    b, h, t, d = x.shape
    xt = x.reshape(b, h, t // g, g, d)
    yt = x_hat.reshape(b, h, t // g, g, d)
    assert torch.isfinite(yt).all()
    for idx in zero.nonzero().tolist():
        assert torch.count_nonzero(yt[tuple(idx)]) == 0
    err = (xt - yt).flatten(-2).norm(dim=-1) / xt.flatten(-2).norm(dim=-1).clamp_min(1e-30)
    normal = ~zero
    if normal.any():
        assert float(err[normal].max()) < 0.8, err


@PROPS
@given(mk=magnitudes, mv=magnitudes, seed=st.integers(0, 2**16))
def test_any_magnitude_raises_or_decodes_finite(mk, mv, seed):
    k, v = _kv(mk, mv, seed)
    out = _roundtrip_or_error(k, v)
    if out is None:
        assert max(mk, mv) > 1e3  # only large values can overflow the scales
        return
    k_hat, v_hat, qkv = out
    zk, zv = qkv.zero_tiles
    _check_tiles(k, k_hat, zk)
    _check_tiles(v, v_hat, zv)
    if mk > 1e-3:
        assert not zk.any()
    if mk < 1e-7:  # every scale far below fp16's smallest normal: flagged, not silently noise
        assert zk.all()


@PROPS
@given(c=magnitudes, sign=st.sampled_from([-1.0, 1.0]), noise=st.sampled_from([0.0, 1e-6, 1e-3]),
       seed=st.integers(0, 2**16))
@example(c=10.0 ** -4.875, sign=-1.0, noise=0.0, seed=0)  # a subnormal V row scale beside a normal zero
def test_constant_and_near_constant_tiles(c, sign, noise, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.full((1, 1, CFG.tile, D), sign * c) * (1 + noise * torch.randn(1, 1, CFG.tile, D, generator=g))
    out = _roundtrip_or_error(k, k.clone())
    if out is None:
        assert c > 1e3
        return
    k_hat, v_hat, qkv = out
    zk, zv = qkv.zero_tiles
    sides = ((k_hat, zk, qkv.k_col_scale, CFG.key_bits), (v_hat, zv, qkv.v_col_scale, CFG.value_bits))
    for x_hat, zero, col, bits in sides:
        assert torch.isfinite(x_hat).all()
        if zero.all():
            assert c < 1e-3 and torch.count_nonzero(x_hat) == 0
        else:  # a constant is stored in the zero field: fp16 rounding plus the noise's own spread
            rel = float((x_hat - k).norm() / k.norm())
            # A tile may keep a row scale below fp16's smallest normal beside a normal zero (a
            # constant's 2-bit V row: zero = the rotated constant, scale = a third of it). Such a
            # field is rounded to a step of 2^-24, not to 11 bits: each value col * (zero + code *
            # scale) may be off by col * (1 + qmax) * 2^-25 more, and the inverse rotation keeps
            # the error's norm.
            sub = float(col.float().max()) * 2**bits * 2.0**-25 * k.numel() ** 0.5 / float(k.norm())
            assert rel < 3e-3 + 8 * noise + sub, (rel, sub)


@PROPS
@given(m=magnitudes, pos=st.integers(0, CFG.tile * D - 1), which=st.sampled_from(["k", "v"]),
       seed=st.integers(0, 2**16))
def test_single_huge_outlier(m, pos, which, seed):
    k, v = _kv(1.0, 1.0, seed, tiles=1)
    x = k if which == "k" else v
    x.view(-1)[pos] = m
    out = _roundtrip_or_error(k, v)
    if out is None:
        assert m > 1e3
        return
    k_hat, v_hat, _ = out
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()


def test_overflow_names_magnitude_and_limit():
    k, v = _kv(1e10, 1.0, 0)
    with pytest.raises(ValueError, match=r"magnitude up to [0-9.e+]+.*fp16 limit 65504"):
        kvarn.quantize_kv(k, v, CFG)
    # Every integer method shares the codec's fp16 scales, and so the check.
    for method in ("kivi", "rtn", "quarot", "varn"):
        with pytest.raises(ValueError, match="fp16 limit"):
            TileCodec(method, CFG).encode(k, v)


def test_largest_storable_magnitude_is_bounded_by_the_clamps():
    # Normalization can absorb up to e^10 into a column scale, so well-spread KVarN tiles store
    # values far beyond 65504; per-token KIVI-style rows cannot.
    k, v = _kv(1e6, 1.0, 1)
    kvarn.dequantize_kv(kvarn.quantize_kv(k, v, CFG))
    with pytest.raises(ValueError, match="fp16 limit"):
        TileCodec("kivi", CFG).encode(k, v)
    assert FP16_MAX == 65504.0 and FP16_TINY == 2.0 ** -14


def test_underflow_gives_flagged_zero_tiles_and_a_warning(caplog):
    k, v = _kv(1e-9, 1.0, 2)
    with caplog.at_level("WARNING", logger="kvarn.codec"):
        qkv = kvarn.quantize_kv(k, v, CFG)
    assert "stored as zero tiles" in caplog.text
    zk, zv = qkv.zero_tiles
    assert zk.all() and not zv.any()
    assert torch.count_nonzero(qkv.k_codes) == 0 and torch.count_nonzero(qkv.k_row_zero) == 0
    k_hat, v_hat = kvarn.dequantize_kv(qkv)
    assert torch.count_nonzero(k_hat) == 0
    assert float((v_hat - v).norm() / v.norm()) < 0.5
    # The record format is unchanged: a zero tile round-trips through the bytes.
    back = kvarn.QuantizedKV.from_records(qkv.to_records(), CFG, D, k.dtype)
    assert back.zero_tiles[0].all()


def test_normal_tiles_untouched_by_the_guards():
    # A tile just above the threshold keeps the spec's encoding (no zeroing, no flag).
    k, v = _kv(1e-3, 1e-3, 3)
    qkv = kvarn.quantize_kv(k, v, CFG)
    assert not qkv.zero_tiles[0].any() and not qkv.zero_tiles[1].any()
    assert bool((qkv.k_col_scale > 0.7).all())


@pytest.mark.parametrize("field", ["k_row_scale", "k_row_zero", "k_col_scale", "v_col_scale", "v_row_scale",
                                   "v_row_zero"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_from_records_rejects_non_finite_scales(field, bad):
    k, v = _kv(1.0, 1.0, 4, tiles=3)
    qkv = kvarn.quantize_kv(k, v, CFG)
    getattr(qkv.tiles, field)[0, 1, 2, 3] = bad
    records = qkv.to_records()
    with pytest.raises(ValueError, match=rf"record \(0, 1, 2\).*non-finite {field}"):
        kvarn.QuantizedKV.from_records(records, CFG, D)
    # validate=False is the caller's promise; the decode then still refuses to hand out NaN/Inf.
    loose = kvarn.QuantizedKV.from_records(records, CFG, D, validate=False)
    with pytest.raises(ValueError, match="non-finite"):
        kvarn.dequantize_kv(loose)


@settings(max_examples=30, deadline=None)
@given(data=st.binary(min_size=CFG.record_bytes(D) * 2, max_size=CFG.record_bytes(D) * 2),
       dtype=st.sampled_from([torch.float16, torch.float32]))
def test_random_record_bytes_never_decode_to_nan_silently(data, dtype):
    records = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(1, 2, 1, -1)
    try:
        qkv = kvarn.QuantizedKV.from_records(records, CFG, D, dtype)
        k, v = kvarn.dequantize_kv(qkv)
    except ValueError as e:
        assert "non-finite" in str(e)
        return
    assert torch.isfinite(k).all() and torch.isfinite(v).all()


def test_check_encoded_guards_encoders_without_their_own_check():
    # The Triton flush writes whatever fp16 it computes; its callers run this check on the fields.
    from kvarn.codec import check_encoded, kv_to_tiles

    k, v = _kv(3e9, 1.0, 5)
    qkv = kvarn.quantize_kv(*_kv(1.0, 1.0, 5), CFG)
    qkv.tiles.k_row_zero[0, 0, 1, 0] = math.inf
    kt, vt = kv_to_tiles(k, v, CFG.tile)
    with pytest.raises(ValueError, match=r"magnitude up to 1\.\d+e\+10.*fp16 limit 65504.*record \(0, 0, 1\)"):
        check_encoded(qkv.tiles, kt, vt)
    check_encoded(kvarn.quantize_kv(*_kv(1.0, 1.0, 5), CFG).tiles, kt, vt)  # finite: no error
