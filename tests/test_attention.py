"""The pure-torch decode attention against plain SDPA over the dequantized history."""

import pytest
import torch

from kvarn.attention import decode_attention
from kvarn.codec import decode_tiles, encode_tiles, kv_to_tiles, rotate_kv, tiles_to_kv
from kvarn.config import KVarNConfig


def _history(b, hk, s, n, r, d, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = s + n * cfg.tile + r
    k = torch.randn(b, hk, t, d, generator=g) * (1 + 3 * torch.rand(1, 1, 1, d, generator=g))
    v = torch.randn(b, hk, t, d, generator=g)
    kr, vr = rotate_kv(k, cfg), rotate_kv(v, cfg)
    body = slice(s, s + n * cfg.tile)
    tiles = encode_tiles(*kv_to_tiles(kr[:, :, body], vr[:, :, body], cfg.tile), cfg) if n else None
    return k, v, kr, vr, tiles


def _dense(kr, vr, tiles, cfg, s, n):
    """Full rotated history with the body replaced by its dequantized tiles, un-rotated."""
    k, v = kr.clone(), vr.clone()
    if n:
        kd, vd = tiles_to_kv(*decode_tiles(tiles, cfg))
        k[:, :, s:s + n * cfg.tile], v[:, :, s:s + n * cfg.tile] = kd, vd
    return rotate_kv(k, cfg), rotate_kv(v, cfg)


def _sdpa(q, k, v, causal_tq):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    t, tq = k.shape[2], q.shape[2]
    mask = torch.ones(tq, t, dtype=torch.bool)
    if causal_tq:
        mask = torch.arange(t)[None, :] <= (t - tq + torch.arange(tq))[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


@pytest.mark.parametrize("d,tile", [(64, 32), (128, 64)])
@pytest.mark.parametrize("tq", [1, 3])
@pytest.mark.parametrize("bits", [(2, 2), (4, 2)])
def test_matches_sdpa_over_dequantized(d, tile, tq, bits):
    cfg = KVarNConfig(key_bits=bits[0], value_bits=bits[1], tile=tile)
    b, hk, hq, s, n, r = 2, 2, 4, tile, 2, 5
    k, v, kr, vr, tiles = _history(b, hk, s, n, r, d, cfg)
    q = torch.randn(b, hq, tq, d)
    sl, tl = slice(0, s), slice(s + n * tile, None)
    out = decode_attention(q, kr[:, :, sl], vr[:, :, sl], tiles, kr[:, :, tl], vr[:, :, tl], cfg)
    kd, vd = _dense(kr, vr, tiles, cfg, s, n)
    ref = _sdpa(q, kd, vd, causal_tq=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


def test_lengths_mask_like_truncation():
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=32)
    d, s, n, r = 64, 32, 3, 7
    k, v, kr, vr, tiles = _history(2, 1, s, n, r, d, cfg, seed=1)
    q = torch.randn(2, 2, 1, d)
    sl, tl = slice(0, s), slice(s + n * 32, None)
    out = decode_attention(
        q, kr[:, :, sl], vr[:, :, sl], tiles, kr[:, :, tl], vr[:, :, tl], cfg,
        tile_counts=torch.tensor([3, 1]), tail_lengths=torch.tensor([7, 2]),
    )
    short_tiles = tiles.map(lambda x: x[1:, :, :1])
    ref1 = decode_attention(
        q[1:], kr[1:, :, sl], vr[1:, :, sl], short_tiles, kr[1:, :, tl][:, :, :2], vr[1:, :, tl][:, :, :2], cfg
    )
    torch.testing.assert_close(out[1:], ref1)


def test_no_tiles_is_exact_attention():
    cfg = KVarNConfig(tile=32)
    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    q = torch.randn(1, 8, 2, 64)
    kr, vr = rotate_kv(k, cfg), rotate_kv(v, cfg)
    out = decode_attention(q, kr[:, :, :32], vr[:, :, :32], None, kr[:, :, 32:], vr[:, :, 32:], cfg)
    torch.testing.assert_close(out.double(), _sdpa(q, k, v, causal_tq=True), atol=2e-5, rtol=1e-4)


def test_bad_inputs():
    cfg = KVarNConfig(tile=32)
    q = torch.randn(1, 3, 1, 64)
    kv = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, kv, kv, None, None, None, cfg)
    with pytest.raises(ValueError, match="tail must hold"):
        decode_attention(torch.randn(1, 2, 3, 64), kv, kv, None, kv[:, :, :2], kv[:, :, :2], cfg)
    with pytest.raises(TypeError):
        decode_attention(torch.randn(1, 2, 1, 64), kv, kv, None, None, None, {"tile": 32})


def _mixed_history(b, hk, s, n, r, d, cfg, key_rot, value_rot, seed=0):
    """Model-frame K/V; tiles in each head's own frame (rotated where the flag says), every head with
    normalization on or off at random."""
    from kvarn.codec.flavour import Flavours, encode_flavoured

    g = torch.Generator().manual_seed(seed)
    t = s + n * cfg.tile + r
    k = torch.randn(b, hk, t, d, generator=g) * (1 + 3 * torch.rand(1, 1, 1, d, generator=g))
    v = torch.randn(b, hk, t, d, generator=g)
    norm = torch.rand(2, b, hk, generator=g) < 0.5
    fl = Flavours(key_rot, norm[0], value_rot, norm[1])
    body = slice(s, s + n * cfg.tile)
    return k, v, encode_flavoured(k[:, :, body], v[:, :, body], fl, cfg), fl


def _dense_model_frame(k, v, tiles, fl, cfg, s, n):
    """The history in the model frame with the body dequantized head by head (no flag-aware attention)."""
    kd, vd = tiles_to_kv(*decode_tiles(tiles, cfg))  # each head in its own stored frame
    k, v = k.clone(), v.clone()
    body = slice(s, s + n * cfg.tile)
    for bi in range(k.shape[0]):
        for h in range(k.shape[1]):
            kh, vh = kd[bi, h], vd[bi, h]
            k[bi, h, body] = rotate_kv(kh, cfg) if fl.key_rotate[bi, h] else kh
            v[bi, h, body] = rotate_kv(vh, cfg) if fl.value_rotate[bi, h] else vh
    return k, v


@pytest.mark.parametrize("fp_frame", ["rotated", "model"])
@pytest.mark.parametrize("tq", [1, 3])
def test_mixed_frames_match_dense_reference(fp_frame, tq):
    cfg = KVarNConfig(key_bits=2, value_bits=2, tile=32)
    b, hk, hq, d, s, n, r = 2, 3, 6, 64, 32, 2, 5
    key_rot = torch.tensor([[True, False, True], [False, False, True]])
    value_rot = torch.tensor([[False, True, True], [True, False, False]])
    k, v, tiles, fl = _mixed_history(b, hk, s, n, r, d, cfg, key_rot, value_rot)
    q = torch.randn(b, hq, tq, d)
    sl, tl = slice(0, s), slice(s + n * 32, None)
    if fp_frame == "model":
        fk, fv = k, v
    else:  # the sink and tail in each head's key / value frame, like its tiles
        fk = torch.where(key_rot[:, :, None, None], rotate_kv(k, cfg), k)
        fv = torch.where(value_rot[:, :, None, None], rotate_kv(v, cfg), v)
    out = decode_attention(q, fk[:, :, sl], fv[:, :, sl], tiles, fk[:, :, tl], fv[:, :, tl], cfg,
                           fp_frame=fp_frame, key_rotated=key_rot, value_rotated=value_rot)
    ref = _sdpa(q, *_dense_model_frame(k, v, tiles, fl, cfg, s, n), causal_tq=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    # the flags matter: reading the same tiles as all-rotated is a different (wrong) answer
    wrong = decode_attention(q, fk[:, :, sl], fv[:, :, sl], tiles, fk[:, :, tl], fv[:, :, tl], cfg, fp_frame=fp_frame)
    assert (wrong.double() - ref).abs().max() > 1e-2


def test_all_true_flags_are_the_default():
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=32)
    k, v, kr, vr, tiles = _history(2, 2, 32, 2, 4, 64, cfg, seed=3)
    q = torch.randn(2, 4, 1, 64)
    sl, tl = slice(0, 32), slice(96, None)
    args = (q, kr[:, :, sl], vr[:, :, sl], tiles, kr[:, :, tl], vr[:, :, tl], cfg)
    ones = torch.ones(2, 2, dtype=torch.bool)
    assert torch.equal(decode_attention(*args), decode_attention(*args, key_rotated=ones, value_rotated=ones))
    with pytest.raises(ValueError, match="key_rotated must be a bool tensor"):
        decode_attention(*args, key_rotated=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="value_rotated must be a bool tensor"):
        decode_attention(*args, value_rotated=torch.ones(2, 2))
