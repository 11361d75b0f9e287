"""kvarn-auto: the per-head flavour codec and the prompt decision (constructed cases)."""

import pytest
import torch

from kvarn.auto.rules import (LOW_BIT_QUANTILE, TRIAL_TILES, AutoSettings, auto_ranges, decide, decide_row,
                              error_sums)
from kvarn.codec import encode_tiles, kv_to_tiles, rotate_kv
from kvarn.cpu import numba_available, tile_passes
from kvarn.config import KVarNConfig
from kvarn.codec.flavour import (NAMED, OPTIONS, Flavours, decode_flavoured, encode_flavoured, option_index,
                           roundtrip_flavoured, roundtrip_options, select_options)
from kvarn.methods import TileCodec
from kvarn.codec.record import FIELD_ORDER

CFG = KVarNConfig(key_bits=2, value_bits=2, tile=32, sink_tokens=32)
D = 64


def _aligned_case(query_on_high_variance: bool, t: int = 32 + 4 * 32, hq: int = 2, seed: int = 0, high: int = 4):
    """One KV head whose keys vary a lot on ``high`` channels and little on the others.

    The queries put their energy on the high-variance channels or on the low-variance ones.
    """
    g = torch.Generator().manual_seed(seed)
    std = torch.full((D,), 0.05)
    std[:high] = 8.0
    mean = torch.zeros(D)
    mean[high:] = 3.0  # low-variance channels carry a large constant part, as k-normed keys do
    keys = mean + std * torch.randn(1, t, D, generator=g)
    values = torch.randn(1, t, D, generator=g)
    energy = torch.zeros(D)
    if query_on_high_variance:
        energy[:high] = 1.0
    else:
        energy[high:] = 1.0
    query = energy * torch.randn(hq, t, D, generator=g)
    return query, keys, values


def test_low_variance_alignment_picks_unrotated_keys():
    q, k, v = _aligned_case(query_on_high_variance=False)
    for rule in ("a2", "a3"):
        d = decide_row(q, k, v, CFG, AutoSettings(rule=rule))
        assert d.decided and not bool(d.key_rotate[0]), rule
        rot, unrot = d.key_logit_error[0, 0], d.key_logit_error[0, 1]
        assert rot > 1.5 * unrot  # the rotation spreads the large channels' error where queries look


def test_high_variance_alignment_picks_rotated_keys():
    # Queries on 8 high-variance channels: per-channel error concentrates where they look unless the
    # rotation spreads it (with only one or two such channels it does not win in this construction).
    q, k, v = _aligned_case(query_on_high_variance=True, high=8)
    d = decide_row(q, k, v, CFG, AutoSettings(rule="a2"))
    assert d.decided and bool(d.key_rotate[0]) and bool(d.key_normalize[0])
    assert d.key_logit_error[0, 0] < d.key_logit_error[0, 1]


def test_each_rule_measures_the_options_it_can_pick():
    # a2 scores the keys' two normalized options only, n2 the values' too: the same scores as the
    # rules that measure all four, and the same choice.
    q, k, v = _aligned_case(False, seed=6)
    full = decide_row(q, k, v, CFG, AutoSettings(rule="a3"))
    for rule, (ck, cv) in (("a2", (2, 4)), ("n2", (2, 2)), ("r3", (4, 4))):
        d = decide_row(q, k, v, CFG, AutoSettings(rule=rule))
        assert d.key_logit_error.shape == (1, ck) and d.value_output_error.shape == (1, cv), rule
        assert d.prompt_tiles.k_codes.shape[0] == ck and d.prompt_tiles.v_codes.shape[0] == cv, rule
        torch.testing.assert_close(d.key_logit_error, full.key_logit_error[:, :ck], rtol=1e-5, atol=0)
        torch.testing.assert_close(d.value_output_error, full.value_output_error[:, :cv], rtol=1e-5, atol=0)
    a2 = decide_row(q, k, v, CFG, AutoSettings(rule="a2"))
    want = full.key_logit_error[0, 1] < full.key_logit_error[0, 0]  # VarN's keys strictly better
    assert bool(a2.key_rotate[0]) == (not bool(want)) and bool(a2.key_normalize[0])


def test_rule_n2_and_the_margin():
    q, k, v = _aligned_case(False)
    n2 = decide_row(q, k, v, CFG, AutoSettings(rule="n2"))
    assert not bool(n2.key_rotate[0]) and bool(n2.key_normalize[0]) and bool(n2.value_normalize[0])
    ratio = float(n2.key_logit_error[0, 0] / n2.key_logit_error[0, 1])  # ~2: rotated is worse
    assert not bool(decide_row(q, k, v, CFG, AutoSettings(margin=0.9 * (1 - 1 / ratio))).key_rotate[0])
    kept = decide_row(q, k, v, CFG, AutoSettings(margin=1.1 * (1 - 1 / ratio)))
    assert bool(kept.key_rotate[0])  # a gain smaller than the margin keeps KVarN's rotated keys
    assert AutoSettings.parse("n2@0.1") == AutoSettings(rule="n2", margin=0.1)
    assert AutoSettings.parse("n2@0.1").name == "n2@0.1" and AutoSettings.parse("a3").name == "a3"
    with pytest.raises(ValueError, match="margin"):
        AutoSettings.parse("a2@1.5")
    with pytest.raises(ValueError, match="rule"):
        AutoSettings.parse("b2@0.1")


def test_correlation_sign_follows_the_alignment():
    low = decide_row(*_aligned_case(False), CFG)
    high = decide_row(*_aligned_case(True, high=8), CFG)
    assert low.variance_energy_corr[0] < -0.5 < 0.5 < high.variance_energy_corr[0]


@pytest.mark.parametrize("t", [1, 32, 63])
def test_short_prompt_falls_back_to_kvarn(t):
    q, k, v = _aligned_case(False, t=t)
    d = decide_row(q, k, v, CFG)
    assert not d.decided and d.prompt_tokens == t
    flags = (d.key_rotate, d.key_normalize, d.value_rotate, d.value_normalize)
    assert all(bool(f.all()) for f in flags) and d.key_logit_error is None


def test_a_long_prompt_decides_as_its_first_sink_plus_three_tiles():
    """The decision reads the first S + TRIAL_TILES * G tokens: a prompt twice as long, whose later
    tokens look nothing like its start, gets the scores, flags and trial encodings of its prefix."""
    horizon = CFG.sink_tokens + TRIAL_TILES * CFG.tile
    q, k, v = _aligned_case(False, t=2 * horizon, seed=3)
    q[:, horizon:], k[:, horizon:] = q[:, horizon:].flip(-1) * 5, k[:, horizon:].flip(-1) * 5
    full, prefix = decide_row(q, k, v, CFG), decide_row(q[:, :horizon], k[:, :horizon], v[:, :horizon], CFG)
    assert full.prompt_tokens == 2 * horizon and full.prompt_tiles.k_codes.shape[2] == TRIAL_TILES
    assert torch.equal(full.key_logit_error, prefix.key_logit_error)
    assert torch.equal(full.value_output_error, prefix.value_output_error)
    for name in ("key_rotate", "key_normalize", "value_rotate", "value_normalize"):
        assert torch.equal(getattr(full, name), getattr(prefix, name)), name
    for name in FIELD_ORDER:
        assert torch.equal(getattr(full.prompt_tiles, name), getattr(prefix.prompt_tiles, name)), name


def test_left_padded_batch_each_row_decides_alone():
    q0, k0, v0 = _aligned_case(False, t=160, seed=1)
    q1, k1, v1 = _aligned_case(True, t=100, seed=2)  # 100 = sink + 2 tiles + 4
    pad = 60
    lead = lambda x: torch.cat([torch.full((x.shape[0], pad, D), 7.0), x], dim=1)  # noqa: E731
    q = torch.stack([q0, lead(q1)])
    k = torch.stack([k0, lead(k1)])
    v = torch.stack([v0, lead(v1)])
    out = decide(q, k, v, CFG, pads=[0, pad])
    for i, (qq, kk, vv) in enumerate(((q0, k0, v0), (q1, k1, v1))):
        alone = decide_row(qq, kk, vv, CFG)
        got = out.rows[i]
        assert got.prompt_tokens == kk.shape[1]
        torch.testing.assert_close(got.key_logit_error, alone.key_logit_error)
        assert torch.equal(got.key_rotate, alone.key_rotate)
    assert out.flavours.key_rotate.tolist() == [[False], [True]]
    short = decide(q[:, :, :80], k[:, :, :80], v[:, :, :80], CFG, pads=[0, pad])  # row 1 keeps 20 tokens
    assert [r.decided for r in short.rows] == [True, False]


def _kv(m=2, h=3, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = n * CFG.tile
    k = torch.randn(m, h, t, D, generator=g) * (1 + 4 * torch.rand(1, 1, 1, D, generator=g))
    return k, torch.randn(m, h, t, D, generator=g)


def test_kvarn_flavour_is_the_spec_codec_bit_for_bit():
    k, v = _kv()
    fl = Flavours.named("kvarn", 2, 3)
    got = encode_flavoured(k, v, fl, CFG)
    ref = encode_tiles(*kv_to_tiles(rotate_kv(k, CFG), rotate_kv(v, CFG), CFG.tile), CFG)
    for name in ("k_codes", "k_row_scale", "k_row_zero", "k_col_scale", "v_codes", "v_col_scale", "v_row_scale"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    # Without flavours kvarn-auto is KVarN with its own ranges (quantiles for 2-bit rows).
    a = TileCodec("kvarn-auto", CFG).encode(k, v).tiles
    b = TileCodec("kvarn", auto_ranges(CFG)).encode(k, v).tiles
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in FIELD_ORDER)


def test_kvarn_auto_rounds_2_bit_rows_over_their_quantiles():
    assert auto_ranges(KVarNConfig.from_name("k2v2_g128")).quantiles == (LOW_BIT_QUANTILE, LOW_BIT_QUANTILE)
    assert auto_ranges(KVarNConfig.from_name("k4v2_g128")).quantiles == (0.0, LOW_BIT_QUANTILE)
    assert auto_ranges(KVarNConfig.from_name("k4v4_g128")).quantiles == (0.0, 0.0)
    explicit = KVarNConfig.from_name("k2v2_g128", key_quantile=0.0, value_quantile=0.1)
    assert auto_ranges(explicit).quantiles == (0.0, 0.1)  # a caller's choice stays
    assert TileCodec("kvarn-auto", CFG).config.quantiles == (LOW_BIT_QUANTILE, LOW_BIT_QUANTILE)
    assert TileCodec("kvarn", CFG).config.quantiles == (0.0, 0.0)  # the spec's min/max
    from kvarn.cache import KVarNCache

    assert KVarNCache(None, "kvarn-auto", "k2v2_g128").config.quantiles == (LOW_BIT_QUANTILE, LOW_BIT_QUANTILE)
    # On Gaussian tiles, 2-bit rows clipped at their quantiles reconstruct better than min/max rows.
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, 64, D, generator=g), torch.randn(2, 3, 64, D, generator=g)
    errs = {}
    for method in ("kvarn", "kvarn-auto"):
        codec = TileCodec(method, CFG)
        kh, vh = codec.decode(codec.encode(k, v))
        errs[method] = (float((kh - k).pow(2).mean()), float((vh - v).pow(2).mean()))
    assert errs["kvarn-auto"][0] < 0.9 * errs["kvarn"][0] and errs["kvarn-auto"][1] < 0.9 * errs["kvarn"][1]


def test_mixed_flavours_match_each_named_flavour_per_head():
    k, v = _kv(m=2, h=4)
    names = [["kvarn", "varn", "hkivi", "kivi"], ["kivi", "kvarn", "varn", "hkivi"]]
    flags = [[NAMED[n] for n in row] for row in names]
    fl = Flavours(*(torch.tensor([[f[i] for f in row] for row in flags]) for i in range(4)))
    assert fl.names() == names
    tiles = encode_flavoured(k, v, fl, CFG)
    dk, dv = decode_flavoured(tiles, fl, CFG)
    for b in range(2):
        for h in range(4):
            one = Flavours.named(names[b][h], 1, 1)
            t1 = encode_flavoured(k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1], one, CFG)
            assert torch.equal(tiles.k_codes[b, h], t1.k_codes[0, 0])
            assert torch.equal(tiles.v_row_scale[b, h], t1.v_row_scale[0, 0])
            if not NAMED[names[b][h]][1]:  # no normalization: unit column scales, exactly
                assert bool((tiles.k_col_scale[b, h] == 1).all()) and bool((tiles.v_col_scale[b, h] == 1).all())
    # dequantized in the model frame whatever the flavour: a 2-bit round trip, not a rotated copy
    rel = (dk - k).norm() / k.norm()
    assert rel < 0.6 and (dv - v).norm() / v.norm() < 0.6


def test_bad_inputs():
    with pytest.raises(ValueError, match="rule"):
        AutoSettings(rule="a9")
    with pytest.raises(ValueError, match="max_queries"):
        AutoSettings(max_queries=0)
    with pytest.raises(ValueError, match="unknown flavour"):
        Flavours.named("quarot", 1, 1)
    with pytest.raises(ValueError, match="bool tensor"):
        Flavours(torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool),
                 torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2, dtype=torch.bool))
    k, v = _kv()
    with pytest.raises(ValueError, match="only meaningful for method 'kvarn-auto'"):
        TileCodec("kvarn", CFG).encode(k, v, Flavours.named("kvarn", 2, 3))
    with pytest.raises(ValueError, match=r"\[M, Hk\]"):
        encode_flavoured(k, v, Flavours.named("kvarn", 1, 3), CFG)
    with pytest.raises(ValueError, match="Hk dividing Hq"):
        decide_row(torch.randn(3, 64, D), torch.randn(2, 64, D), torch.randn(2, 64, D), CFG)


@pytest.mark.parametrize("kernels", ["torch", pytest.param("numba", marks=pytest.mark.skipif(
    not numba_available(), reason="numba is not installed"))])
@pytest.mark.parametrize("counts", [(4, 4), (2, 4), (2, 2)])
def test_the_options_batch_and_its_selection_are_the_per_flavour_encode_bit_for_bit(kernels, counts):
    # The freeze and the self-test reuse the decision's trial encodings in place of encoding the
    # prompt's tiles again: every field must be what encode_flavoured writes, one tile per row.
    # A rule that measures fewer options (a2's keys: the two normalized ones) gets those, the same bits.
    k, v = _kv(m=1, h=3, n=3, seed=4)
    tiles, kh, vh = roundtrip_options(k[0], v[0], CFG, tile_passes(kernels, k.device), *counts)
    assert tiles.k_codes.shape[0] == kh.shape[0] == counts[0] and tiles.v_codes.shape[0] == vh.shape[0] == counts[1]
    for c, (rot, norm) in enumerate(OPTIONS):
        one = Flavours(*(torch.full((1, 3), x, dtype=torch.bool) for x in (rot, norm, rot, norm)))
        one_tiles = encode_flavoured(k, v, one, CFG)
        dk, dv = roundtrip_flavoured(k, v, one, CFG)
        for name in FIELD_ORDER:
            if c < counts[0 if name.startswith("k_") else 1]:
                assert torch.equal(getattr(tiles, name)[c], getattr(one_tiles, name)[0]), (c, name)
        assert c >= counts[0] or torch.equal(kh[c], dk[0])
        assert c >= counts[1] or torch.equal(vh[c], dv[0])
    if counts != (4, 4):
        with pytest.raises(ValueError, match="key_options=3"):
            roundtrip_options(k[0], v[0], CFG, tile_passes(kernels, k.device), 3, 4)
        return
    flags = [torch.tensor(x) for x in ([True, False, True], [True, True, False], [False, True, False],
                                       [False, True, True])]
    per_tile = Flavours(*(f[None].expand(3, 3) for f in flags))
    # [1, Hk, N*G, D] -> [N, Hk, G, D]: one tile per batch row, as the cache's freeze encodes them
    as_tiles = lambda x: x[0].reshape(3, 3, CFG.tile, D).transpose(0, 1)  # noqa: E731
    want = encode_flavoured(as_tiles(k), as_tiles(v), per_tile, CFG)
    got = select_options(tiles, option_index(flags[0], flags[1]), option_index(flags[2], flags[3]))
    for name in FIELD_ORDER:
        assert torch.equal(getattr(got, name), getattr(want, name)[:, :, 0].transpose(0, 1)), name


def test_error_sums_equal_the_dense_causal_sums():
    """The block-causal sums (the four options in one product) equal the sums over every causal
    (query, key) pair computed densely, one option at a time."""
    g = torch.Generator().manual_seed(5)
    hq, hk, t, s, nk, c = 4, 2, 150, 32, 96, 4
    q, k = torch.randn(hq, t, D, generator=g), torch.randn(hk, t, D, generator=g)
    k_err, v_err = 0.1 * torch.randn(hk, nk, c, D, generator=g), 0.1 * torch.randn(hk, nk, c, D, generator=g)
    pos = torch.cat([torch.arange(s, t, 2), torch.tensor([t - 1])])  # in and past the body, two blocks
    key_sum, value_sum, pairs = error_sums(q, k, k_err, v_err, pos, s, 0.125)
    qs = q[:, pos].reshape(hk, hq // hk, len(pos), D)
    causal = (torch.arange(s, s + nk)[None, :] <= pos[:, None]).float()  # [nq, nK]
    visible = torch.arange(t)[None, :] <= pos[:, None]
    p = torch.softmax((qs @ k[:, None].transpose(-1, -2) * 0.125).masked_fill(~visible, float("-inf")), -1)
    for o in range(c):
        logit = (qs @ k_err[:, None, :, o].transpose(-1, -2)).abs() * 0.125
        torch.testing.assert_close(key_sum[:, o], (logit * causal).sum((1, 2, 3)), rtol=1e-5, atol=1e-6)
        out = p[..., s:s + nk] @ v_err[:, None, :, o]
        torch.testing.assert_close(value_sum[:, o], out.abs().sum((1, 2, 3)), rtol=1e-5, atol=1e-6)
    assert pairs == float(causal.sum()) * (hq // hk)
