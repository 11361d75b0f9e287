"""The numba CPU encoder against its torch twin (kvarn.codec): the same bits, field for field; the
packed decode product (kvarn.cpu.matmul) against the unpacked one."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from kvarn import KVarNConfig  # noqa: E402
from kvarn import codec  # noqa: E402
from kvarn.codec import tiles  # noqa: E402
from kvarn.cpu import encoder, matmul, tile_passes  # noqa: E402
from kvarn.codec import rotate_kv  # noqa: E402
from kvarn.cpu.decode import unpack_centred  # noqa: E402
from kvarn.codec.normalize import Workspace  # noqa: E402
from kvarn.codec.record import FIELD_ORDER  # noqa: E402


def _kv_tiles(seed, n, hk, d, g, spread=3.0):
    """Rotated-frame-like tiles with channel outliers, per-channel offsets and token-scale spread."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, hk, d, g, generator=gen) * torch.exp(spread * torch.rand(n, hk, d, 1, generator=gen))
    k = k * torch.exp(torch.rand(n, hk, 1, g, generator=gen)) + 4 * torch.randn(n, hk, d, 1, generator=gen)
    v = torch.randn(n, hk, g, d, generator=gen) * torch.exp(spread * torch.rand(n, hk, g, 1, generator=gen))
    return k, v


def _assert_same(a, b):
    for name in FIELD_ORDER:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("preset", ["k2v2_g128", "k4v2_g128", "k4v4_g128", "k4v2_g64"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_records_equal_the_torch_codec(preset, d, parallel):
    cfg = KVarNConfig.from_name(preset)
    k, v = _kv_tiles(d, 3, 2, d, cfg.tile)
    k[0, 0, 5] = 0.0  # a constant (zero) row: its deviation is 0, clamped to 1e-3
    v[1, 1, :, 7] = 2.5  # a constant column
    k[2, 1] = 1.0  # a constant tile
    _assert_same(encoder.encode_tiles(k, v, cfg, parallel), codec.encode_tiles(k, v, cfg))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.0, 6.0), iters=st.sampled_from([0, 1, 8, 16]))
def test_records_equal_on_random_tiles(seed, spread, iters):
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=64, sinkhorn_iters=iters)
    k, v = _kv_tiles(seed, 2, 3, 64, 64, spread)
    _assert_same(encoder.encode_tiles(k, v, cfg), codec.encode_tiles(k, v, cfg))


@pytest.mark.parametrize("parallel", [False, True])
def test_records_equal_on_real_kv(smollm2_kv, parallel):
    cfg = KVarNConfig.from_name("k2v2_g128")
    keys, values = smollm2_kv[3]  # [1, 3, 512, 64]
    k_rot, v_rot = rotate_kv(keys, cfg), rotate_kv(values, cfg)
    k_tiles, v_tiles = codec.kv_to_tiles(k_rot, v_rot, cfg.tile)
    _assert_same(encoder.encode_tiles(k_tiles, v_tiles, cfg, parallel),
                 codec.encode_tiles(k_tiles, v_tiles, cfg))


def test_passes_equal_the_torch_workspace():
    """Each pass alone, at arbitrary log-scales: the same float32 deviations and rounding grid."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, 32, generator=gen) * 5 + torch.randn(4, 3, 64, 1, generator=gen) * 20
    a, b = 0.3 * torch.randn(4, 3, 32, generator=gen), 0.3 * torch.randn(4, 3, 64, generator=gen)
    fast, ref = encoder.TilePasses(x), Workspace(x)
    assert torch.equal(fast.row_std(x, a, b), ref.row_std(x, a, b))
    for got, want in zip(fast.both_std(x, a, b), ref.both_std(x, a, b)):
        assert torch.equal(got, want)
    for bits in (2, 4, 8):
        for got, want in zip(fast.quantize(x, a, b, bits, 0.0), tiles.quantize_scaled(x, a, b, bits, 0.0)):
            assert torch.equal(got, want), bits


@pytest.mark.parametrize("n", [64, 128, 256])
def test_order_statistics_are_torch_topks(n):
    """The numba loop's order statistics (kvarn-auto's 2-bit ranges) are torch.topk's values, ties
    included, so the rows' quantiles are torch.quantile's bit for bit on either path."""
    from kvarn.codec import quantize

    y = torch.randn(2, 3, 40, n, generator=torch.Generator().manual_seed(n)) * 3
    y[0, 0, 0, : n // 4] = 1.5  # a run of ties across the ranks read
    y[1, 2, 5, :] = -2.0  # a constant row
    for q in (0.005, 0.03, 0.2):
        for got, want in zip(encoder.order_statistics(y, q), quantize.order_statistics(y, q)):
            assert torch.equal(got, want), q
        ref = torch.quantile(y, torch.tensor([q, 1.0 - q]), dim=-1)
        lo, hi = quantize.row_range(y, q, encoder.order_statistics)
        assert torch.equal(lo, ref[0]) and torch.equal(hi, ref[1]), q


def test_quantile_ranges_equal():
    cfg = KVarNConfig(key_bits=2, value_bits=2, tile=64, key_quantile=0.01, value_quantile=0.03)
    k, v = _kv_tiles(7, 2, 1, 64, 64)
    _assert_same(encoder.encode_tiles(k, v, cfg), codec.encode_tiles(k, v, cfg))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_raises_like_the_twin(bad):
    cfg = KVarNConfig.from_name("k4v2_g64")
    k, v = _kv_tiles(3, 2, 1, 64, 64)
    k[1, 0, 3, 9] = bad
    with pytest.raises(ValueError, match="cannot be stored"):
        codec.encode_tiles(k, v, cfg)
    with pytest.raises(ValueError, match="cannot be stored"):
        encoder.encode_tiles(k, v, cfg)


def test_overflow_and_tiny_tiles_like_the_twin(caplog):
    cfg = KVarNConfig.from_name("k4v2_g64")
    k, v = _kv_tiles(4, 2, 1, 64, 64)
    with pytest.raises(ValueError, match="fp16 limit"):
        encoder.encode_tiles(k * 1e10, v, cfg)
    k[0] *= 1e-9  # every scale below fp16's smallest normal: stored as a zero tile, with a warning
    with caplog.at_level(logging.WARNING, logger="kvarn.codec"):
        got = encoder.encode_tiles(k, v, cfg)
    assert "zero tiles" in caplog.text
    assert not got.k_col_scale[0].any() and got.k_col_scale[1].all()
    _assert_same(got, codec.encode_tiles(k, v, cfg))


def test_rejects_what_it_cannot_take():
    with pytest.raises(ValueError, match="float32 CPU tiles"):
        encoder.TilePasses(torch.zeros(2, 8, 8, dtype=torch.float64))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packed_matmul_equals_the_unpacked_product(bits):
    """Products straight from the packed bytes, against the unpacked centred codes' float64 product;
    strided views (fields of records) are read as they are."""
    gen = torch.Generator().manual_seed(bits)
    per = 8 // bits
    a = torch.randn(5, 2, 3, 64, generator=gen)
    records = torch.randint(0, 256, (5, 2, 16 * 64 + 8), dtype=torch.uint8, generator=gen)
    codes = records[..., : 16 * 64].view(5, 2, 16, 64)  # [.., N / P, K] with a record's stride
    got = matmul.packed_matmul(a, codes, bits)
    want = a.double() @ unpack_centred(codes, bits).double().transpose(-1, -2)
    assert got.shape == (5, 2, 3, 16 * per)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        matmul.packed_matmul(a[..., :32], codes, bits)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        matmul.packed_matmul(a, codes, 3)
    with pytest.raises(TypeError, match="packed uint8"):
        matmul.packed_matmul(a, codes.to(torch.int16), bits)


@pytest.mark.parametrize("method", ["kvarn", "kivi", "varn", "rtn"])
def test_the_codec_kernels_store_the_same_bits(smollm2_kv, method):
    """TileCodec's numba passes (its CPU default) and its torch operations write the same fields, for
    the spec's pipeline, the unrotated and unnormalized methods, and kvarn-auto's mixed flavours."""
    from kvarn.codec.flavour import Flavours
    from kvarn.methods import TileCodec

    cfg = KVarNConfig.from_name("k2v2_g128")
    keys, values = smollm2_kv[5]
    fast, ref = TileCodec(method, cfg, "numba"), TileCodec(method, cfg, "torch")
    assert TileCodec(method, cfg).kernels == "auto" and tile_passes("auto", keys.device) is encoder.TilePasses
    _assert_same(fast.encode(keys, values).tiles, ref.encode(keys, values).tiles)
    mixed = Flavours(*(torch.tensor([[True, False, True]]) ^ torch.tensor(i % 2 == 1) for i in range(4)))
    auto_fast, auto_ref = TileCodec("kvarn-auto", cfg, "numba"), TileCodec("kvarn-auto", cfg, "torch")
    _assert_same(auto_fast.encode(keys, values, mixed).tiles, auto_ref.encode(keys, values, mixed).tiles)


def test_the_codec_kernels_choice_is_checked():
    from kvarn.cache import KVarNCache
    from kvarn.methods import TileCodec

    cfg = KVarNConfig.from_name("k2v2_g128")
    with pytest.raises(ValueError, match=r"kernels='triton'; choose one of \['auto', 'torch', 'numba'\]"):
        TileCodec("kvarn", cfg, "triton")
    with pytest.raises(ValueError, match="kernels='numba' encodes CPU tensors only, these are on meta"):
        tile_passes("numba", torch.device("meta"))
    assert tile_passes("auto", torch.device("meta")) is None and tile_passes("torch", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="transformers' own quantized cache"):
        KVarNCache(None, "hf-quanto", "k4v4_g128", kernels="numba")


def test_the_codec_never_starts_numbas_thread_pool():
    """The caches' codec runs serial loops: numba's OpenMP pool, which slows torch and numba about
    10x once torch.set_num_threads(2+) has been called (kvarn.cpu.encoder's docstring), is never started."""
    import subprocess
    import sys

    script = (
        "import torch, numba\n"
        "torch.set_num_threads(2)\n"
        "from kvarn import KVarNConfig\n"
        "from kvarn.methods import TileCodec\n"
        "k = torch.randn(1, 2, 256, 64)\n"
        "TileCodec('kvarn', KVarNConfig.from_name('k2v2_g128'), 'numba').encode(k, k)\n"
        "try:\n"
        "    print('pool started:', numba.threading_layer())\n"
        "except ValueError:\n"
        "    print('no pool')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no pool", out.stdout
