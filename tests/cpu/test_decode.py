"""The scale-folded ragged decode (kvarn.cpu.decode) against the reference decode_attention."""

import pytest
import torch

from kvarn.attention import decode_attention
from kvarn.codec import encode_tiles, kv_to_tiles, rotate_kv
from kvarn.config import KVarNConfig
from kvarn.cpu.decode import folded_decode_attention, unpack_centred
from kvarn.codec.hadamard import rotate
from kvarn.codec.pack import pack_codes, unpack_codes

try:
    import numba  # noqa: F401
except ImportError:
    numba = None
# The products by the codes: unpacked int8 codes and bmm, or the numba kernel over packed bytes.
KERNELS = ["torch", pytest.param("numba", marks=pytest.mark.skipif(numba is None, reason="needs numba"))]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_unpack_centred(bits):
    g = torch.Generator().manual_seed(bits)
    # [.., n, C] in natural order; every code 0 .. 2^b - 1 occurs
    codes = (torch.randperm(3 * 16 * 8, generator=g) % 2**bits).to(torch.uint8).view(3, 16, 8)
    packed = pack_codes(codes.transpose(-1, -2), bits).transpose(-1, -2)  # packed along n: [.., n/P, C]
    out = unpack_centred(packed, bits)
    assert out.dtype == torch.int8
    # natural order along n, centred on 2^(b-1) (a wrong sign extension or order shows on some code)
    assert torch.equal(out.short(), codes.short() - 2 ** (bits - 1))


def _case(cfg, b, hk, hq, d, tiles_per_row, fp_lens, seed):
    """Random history per sequence; the reference gets it padded, the folded path ragged."""
    g = torch.Generator().manual_seed(seed)
    n_max, l_cap = max(tiles_per_row), max(fp_lens)
    t = n_max * cfg.tile
    k = torch.randn(b, hk, t, d, generator=g) * (1 + 3 * torch.rand(1, 1, 1, d, generator=g)) + 2.0
    v = torch.randn(b, hk, t, d, generator=g) * torch.exp(torch.randn(b, 1, t, 1, generator=g))
    tiles = encode_tiles(*kv_to_tiles(rotate_kv(k, cfg), rotate_kv(v, cfg), cfg.tile), cfg)  # [B, Hk, N]
    fk = torch.randn(b, hk, l_cap, d, generator=g) * 3
    fv = torch.randn(b, hk, l_cap, d, generator=g)
    q = torch.randn(b, hq, 1, d, generator=g) * 2
    counts = torch.tensor(tiles_per_row)
    lens = torch.tensor(fp_lens)
    return q, fk, fv, tiles, counts, lens


def _dense_reference(q, fk, fv, tiles, counts, lens, cfg, scale, dtype=torch.float64):
    """Every tile dequantized exactly in float64 (docs/algorithm.md section 3), then plain attention
    in ``dtype`` (float64: the reference; a 16-bit dtype: what torch gets in that dtype)."""
    f = tiles.map(lambda x: x.double() if x.is_floating_point() else x)
    kq = unpack_codes(f.k_codes.transpose(-1, -2), cfg.key_bits).double()  # [B, Hk, N, D, G]
    kd = (kq * f.k_row_scale[..., None] + f.k_row_zero[..., None]) * f.k_col_scale[..., None, :]
    vq = unpack_codes(f.v_codes.transpose(-1, -2), cfg.value_bits).double()  # [B, Hk, N, G, D]
    vd = (vq * f.v_row_scale[..., None] + f.v_row_zero[..., None]) * f.v_col_scale[..., None, :]
    b, hk, n, d, g = kd.shape
    keys = torch.cat([kd.transpose(-1, -2).reshape(b, hk, n * g, d), fk.double()], 2).to(dtype)
    values = torch.cat([vd.reshape(b, hk, n * g, d), fv.double()], 2).to(dtype)
    valid = torch.cat([torch.arange(n * g)[None, :] // g < counts[:, None],
                       torch.arange(fk.shape[2])[None, :] < lens[:, None]], 1)
    group = q.shape[1] // hk
    qr = rotate(q[:, :, 0].to(dtype), dtype)
    s = torch.einsum("bhd,bhld->bhl", qr, keys.repeat_interleave(group, 1)) * scale
    p = torch.softmax(s.masked_fill(~valid[:, None], float("-inf")), -1)
    return rotate(torch.einsum("bhl,bhld->bhd", p, values.repeat_interleave(group, 1)), dtype).double()


def _ragged(tiles, counts, seed=1):
    """[B, Hk, N] tiles -> the T tiles the counts keep, rows of several sequences mixed, and their rows."""
    b = counts.numel()
    rows = torch.repeat_interleave(torch.arange(b), counts)
    cols = torch.cat([torch.arange(int(c)) for c in counts])
    ragged = tiles.map(lambda x: x[rows, :, cols])  # [T, Hk, ...]
    perm = torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(seed))  # order is free
    return ragged.map(lambda x: x[perm]), rows[perm]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", ["k4v2_g128", "k2v2_g64", "k4v4_g64"])
@pytest.mark.parametrize("d", [64, 128])
def test_matches_reference_decode(name, d, kernels):
    cfg = KVarNConfig.from_name(name)
    b, hk, hq = 4, 2, 6
    q, fk, fv, tiles, counts, lens = _case(cfg, b, hk, hq, d, [3, 0, 1, 2], [5, 1, cfg.tile, 17], seed=d)
    twin = decode_attention(q, None, None, tiles, fk, fv, cfg, 0.3, tile_counts=counts, tail_lengths=lens,
                            causal=False)[:, :, 0]
    ref = _dense_reference(q, fk, fv, tiles, counts, lens, cfg, 0.3)
    ragged, rows = _ragged(tiles, counts)
    valid = torch.arange(fk.shape[2])[None, :] < lens[:, None]
    out = folded_decode_attention(q[:, :, 0], fk, fv, valid, ragged, rows, cfg, 0.3, kernels=kernels)
    # Both float32: the reference's own tolerance against float64 (tests/test_attention.py), and
    # against the reference itself.
    torch.testing.assert_close(twin.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, twin, atol=2e-5, rtol=1e-4)
    # a wrong tile owner changes the result
    bad = folded_decode_attention(q[:, :, 0], fk, fv, valid, ragged, rows.flip(0), cfg, 0.3, kernels=kernels)
    assert (bad.double() - ref).abs().max() > 1e-2


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_fp_keys_within_the_dtype_rounding(dtype, kernels):
    """A bf16/fp16 engine stages its fp sink and tail in that dtype, and the fp part runs in it.
    Bound: twice the rounding of the exact output to that dtype (stricter than the usual kernel
    bound, twice torch's own error in the dtype: softmax attention in bf16 errs far more)."""
    cfg = KVarNConfig.from_name("k4v2_g128")
    b, hk, hq, d = 4, 2, 6, 64
    q, fk, fv, tiles, counts, lens = _case(cfg, b, hk, hq, d, [3, 0, 1, 2], [5, 1, cfg.tile, 17], seed=3)
    q, fk, fv = q.to(dtype), fk.to(dtype), fv.to(dtype)
    ref = _dense_reference(q, fk, fv, tiles, counts, lens, cfg, 0.3)
    rounding = (ref.to(dtype).double() - ref).abs().max()
    assert rounding <= (_dense_reference(q, fk, fv, tiles, counts, lens, cfg, 0.3, dtype) - ref).abs().max()
    ragged, rows = _ragged(tiles, counts)
    valid = torch.arange(fk.shape[2])[None, :] < lens[:, None]
    out = folded_decode_attention(q[:, :, 0], fk, fv, valid, ragged, rows, cfg, 0.3, kernels=kernels)
    assert out.dtype == torch.float32
    assert (out.double() - ref).abs().max() <= 2 * rounding + 1e-5
    # the mask matters: seeing every staged position changes the result by far more
    wrong = folded_decode_attention(q[:, :, 0], fk, fv, torch.ones_like(valid), ragged, rows, cfg, 0.3,
                                    kernels=kernels)
    assert (wrong.double() - ref).abs().max() > 100 * rounding


def test_fp_only_and_nothing_visible():
    cfg = KVarNConfig.from_name("k4v2_g128")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 64, generator=g)
    fk, fv = torch.randn(2, 2, 7, 64, generator=g), torch.randn(2, 2, 7, 64, generator=g)
    valid = torch.tensor([[True] * 7, [False] * 7])
    out = folded_decode_attention(q, fk, fv, valid, None, None, cfg)
    ref = decode_attention(q[:, :, None], None, None, None, fk, fv, cfg, tail_lengths=torch.tensor([7, 0]),
                           causal=False)[:, :, 0]
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("name", ["k4v2_g128", "k2v2_g64"])
def test_chunked_products_match_one_chunk(name, monkeypatch):
    """The codes are converted to float32 and multiplied a chunk of tiles at a time: chunk boundaries
    (one tile per chunk, a chunk that ends short, one chunk for all) leave every product unchanged."""
    import kvarn.cpu.decode as folded

    cfg = KVarNConfig.from_name(name)
    b, hk, hq, d = 3, 2, 6, 64
    q, fk, fv, tiles, counts, lens = _case(cfg, b, hk, hq, d, [3, 2, 2], [5, 1, 17], seed=7)
    ragged, rows = _ragged(tiles, counts)
    valid = torch.arange(fk.shape[2])[None, :] < lens[:, None]
    tile_bytes = hk * cfg.tile * d * 4  # float32 codes of one tile, K or V
    outs = []
    for chunk in (1, 2 * tile_bytes, 3 * tile_bytes, 1 << 30):
        monkeypatch.setattr(folded, "CHUNK_BYTES", chunk)
        outs.append(folded_decode_attention(q[:, :, 0], fk, fv, valid, ragged, rows, cfg, 0.3, workspace={}))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    ref = _dense_reference(q, fk, fv, tiles, counts, lens, cfg, 0.3)
    torch.testing.assert_close(outs[0].double(), ref, atol=2e-5, rtol=1e-4)


def test_unknown_kernels_are_refused():
    cfg = KVarNConfig.from_name("k4v2_g128")
    q, fk, fv = torch.zeros(1, 2, 64), torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64)
    with pytest.raises(ValueError, match="kernels='cuda'.*torch"):
        folded_decode_attention(q, fk, fv, torch.ones(1, 3, dtype=torch.bool), None, None, cfg, kernels="cuda")
