"""KVarNCache on synthetic K/V (no model): tile layout, padding, crop, reordering, bytes, errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvarn.cache import KVarNCache, pads_from_mask  # noqa: E402
from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.methods import METHODS, TileCodec  # noqa: E402

G, S = 32, 32
SMALL = dict(tile=G, sink_tokens=S)


def _kv(b, h, t, d=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g).to(dtype)
    v = torch.randn(b, h, t, d, generator=g).to(dtype)
    return k, v


def _expected(n_accepted: int, n_pending: int) -> tuple[int, int, int]:
    """(sink, tiles, tail) after ``n_accepted`` frozen-eligible tokens and ``n_pending`` new ones."""
    sink = min(S, n_accepted)
    tiles = max(n_accepted - S, 0) // G
    return sink, tiles, n_accepted - sink - tiles * G + n_pending


@pytest.mark.parametrize("prompt", [0, 1, G - 1, G, G + 1, 2 * G, 3 * G - 1, 3 * G + 1])
def test_invariants_prompt_and_decode(prompt):
    cache = KVarNCache(None, "kvarn", "k2v2_g64", **SMALL)
    k, v = _kv(1, 2, prompt + 2 * G + 3)
    ok, ov = cache.update(k[:, :, :prompt], v[:, :, :prompt], 0)
    assert torch.equal(ok, k[:, :, :prompt])  # the prompt's own attention is exact
    layer = cache.layers[0]
    assert (layer.sink_len[0], layer.num_tiles[0], layer.tail_len[0]) == (0, 0, prompt)  # nothing frozen yet
    for step in range(2 * G + 3):
        n = prompt + step
        ok, ov = cache.update(k[:, :, n:n + 1], v[:, :, n:n + 1], 0)
        assert (layer.sink_len[0], layer.num_tiles[0], layer.tail_len[0]) == _expected(n, 1)
        assert cache.get_seq_length() == n + 1 and ok.shape == (1, 2, n + 1, 64)
    # sink and tail are exact; every tile is the codec's roundtrip of exactly its G tokens
    s, nt, r = layer.sink_len[0], layer.num_tiles[0], layer.tail_len[0]
    total = s + nt * G + r
    assert torch.equal(ok[:, :, :s], k[:, :, :s]) and torch.equal(ok[:, :, total - r:], k[:, :, total - r:total])
    codec = TileCodec("kvarn", cache.config)
    rk, rv = codec.roundtrip(k[:, :, s:s + nt * G], v[:, :, s:s + nt * G])
    assert torch.equal(ok[:, :, s:s + nt * G], rk) and torch.equal(ov[:, :, s:s + nt * G], rv)


def test_tiles_are_never_requantized():
    cache = KVarNCache(None, "kivi", "k2v2_g64", **SMALL)
    k, v = _kv(1, 1, 3 * G)
    cache.update(k[:, :, :2 * G], v[:, :, :2 * G], 0)
    first, _ = cache.update(k[:, :, 2 * G:2 * G + 1], v[:, :, 2 * G:2 * G + 1], 0)
    codes = cache.layers[0].store.fields["k_codes"][:, :, :1].clone()
    for i in range(2 * G + 1, 3 * G):
        later, _ = cache.update(k[:, :, i:i + 1], v[:, :, i:i + 1], 0)
    assert torch.equal(cache.layers[0].store.fields["k_codes"][:, :, :1], codes)
    assert torch.equal(later[:, :, S:S + G], first[:, :, S:S + G])


def test_left_padding_rows_match_rows_alone():
    pads = [0, 5, 40]
    length = 2 * G + 45
    k, v = _kv(3, 2, length)
    mask = torch.ones(3, length, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    batched = KVarNCache(None, "kvarn", "k2v2_g64", attention_mask=mask, **SMALL)
    batched.update(k, v, 0)
    step_k, step_v = _kv(3, 2, G, seed=1)
    for i in range(G):
        ok, ov = batched.update(step_k[:, :, i:i + 1], step_v[:, :, i:i + 1], 0)
    for b, p in enumerate(pads):
        alone = KVarNCache(None, "kvarn", "k2v2_g64", **SMALL)
        alone.update(k[b:b + 1, :, p:], v[b:b + 1, :, p:], 0)
        for i in range(G):
            ak, av = alone.update(step_k[b:b + 1, :, i:i + 1], step_v[b:b + 1, :, i:i + 1], 0)
        assert batched.layers[0].num_tiles[b] == alone.layers[0].num_tiles[0]
        assert torch.equal(ok[b, :, p:], ak[0]) and torch.equal(ov[b, :, p:], av[0])
        assert not ok[b, :, :p].any()  # pad slots hold nothing
    assert len(set(batched.layers[0].num_tiles)) > 1  # rows really are ragged


def test_padding_mask_must_be_left_padding():
    assert pads_from_mask(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])) == [2, 0]
    with pytest.raises(ValueError, match="left padding"):
        pads_from_mask(torch.tensor([[1, 1, 0, 0]]))


def test_crop_only_removes_unfrozen_tokens():
    cache = KVarNCache(None, "kvarn", "k2v2_g64", **SMALL)
    k, v = _kv(1, 2, S + G + 8)
    cache.update(k[:, :, :S + G - 2], v[:, :, :S + G - 2], 0)
    cache.update(k[:, :, S + G - 2:S + G + 2], v[:, :, S + G - 2:S + G + 2], 0)  # speculative block
    layer = cache.layers[0]
    assert layer.num_tiles == [0] and layer.tail_len == [G + 2]
    cache.crop(-3)  # reject 3 drafted tokens: the tile they would have completed is not frozen
    assert cache.get_seq_length() == S + G - 1 and layer.tail_len == [G - 1]
    ok, _ = cache.update(k[:, :, S + G - 1:S + G], v[:, :, S + G - 1:S + G], 0)
    assert layer.num_tiles == [0] and layer.tail_len == [G]
    ok, _ = cache.update(k[:, :, S + G:S + G + 1], v[:, :, S + G:S + G + 1], 0)
    assert layer.num_tiles == [1] and layer.tail_len == [1]
    rk, _ = TileCodec("kvarn", cache.config).roundtrip(k[:, :, S:S + G], v[:, :, S:S + G])
    assert torch.equal(ok[:, :, S:S + G], rk)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(-2)
    cache.crop(-1)
    assert cache.get_seq_length() == S + G


def test_reorder_and_select_rows():
    cache = KVarNCache(None, "rtn", "k4v2_g64", **SMALL)
    k, v = _kv(3, 2, 2 * G + S + 3)
    cache.update(k, v, 0)
    before, _ = cache.update(*_kv(3, 2, 1, seed=3), 0)
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    nk, nv = _kv(3, 2, 1, seed=4)
    after, _ = cache.update(nk, nv, 0)
    assert torch.equal(after[:, :, :-1], before[[2, 0, 0]])
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.layers[0].batch == 2
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].batch == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim", [(1, 256), (2, 128), (4, 64)])
def test_fp16_method_is_exact_for_any_dtype_and_shape(dtype, heads, head_dim):
    cache = KVarNCache(None, "fp16", "k2v2_g64", **SMALL)
    k, v = _kv(2, heads, S + 2 * G + 5, head_dim, dtype)
    cache.update(k[:, :, :40], v[:, :, :40], 0)
    for i in range(40, k.shape[2]):
        ok, ov = cache.update(k[:, :, i:i + 1], v[:, :, i:i + 1], 0)
    assert ok.dtype == dtype and torch.equal(ok, k) and torch.equal(ov, v)
    assert cache.layers[0].num_tiles == [2, 2]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_roundtrips_through_the_cache(method):
    cache = KVarNCache(None, method, "k4v4_g64", **SMALL)
    k, v = _kv(1, 2, S + 2 * G, dtype=torch.bfloat16)
    cache.update(k, v, 0)
    ok, ov = cache.update(*_kv(1, 2, 1, dtype=torch.bfloat16, seed=5), 0)
    rk, rv = TileCodec(method, cache.config).roundtrip(k[:, :, S:], v[:, :, S:])
    assert ok.dtype == torch.bfloat16
    assert torch.equal(ok[:, :, S:-1], rk) and torch.equal(ov[:, :, S:-1], rv)


@pytest.mark.parametrize("preset,head_dim,record", [("k4v2_g128", 128, 13824), ("k2v2_g128", 128, 76 * 128),
                                                    ("k4v4_g128", 128, 140 * 128), ("k4v2_g64", 128, 114 * 64)])
def test_memory_report_matches_spec_bytes(preset, head_dim, record):
    cache = KVarNCache(None, "kvarn", preset)
    g = cache.config.tile
    k, v = _kv(2, 3, g + 3 * g + 7, head_dim, torch.float16)
    cache.update(k, v, 0)
    cache.freeze()
    rep = cache.memory_report()
    layer = rep["layers"][0]
    assert layer["quantized_tiles"] == 2 * 3 * 3
    assert layer["quantized_bytes"] == 2 * 3 * 3 * record
    assert layer["full_precision_bytes"] == 2 * 3 * (g + 7) * head_dim * 2 * 2
    assert layer["fp16_equivalent_bytes"] == 2 * 3 * (4 * g + 7) * head_dim * 2 * 2
    assert rep["total"]["total_bytes"] == layer["quantized_bytes"] + layer["full_precision_bytes"]
    assert rep["total"]["compression_ratio"] == pytest.approx(layer["fp16_equivalent_bytes"] / layer["total_bytes"])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_memory_report_counts_each_methods_stored_bytes(method):
    cache = KVarNCache(None, method, "k2v2_g64", **SMALL)
    k, v = _kv(1, 2, S + 2 * G, dtype=torch.float16)
    cache.update(k, v, 0)
    cache.freeze()
    mem = cache.memory_report()["total"]
    tiles_bytes = TileCodec(method, cache.config).bytes_per_token(64) * 2 * G * 2
    if method == "fp16":
        assert mem["quantized_bytes"] == 0 and mem["compression_ratio"] == 1.0
    else:
        assert mem["quantized_bytes"] == tiles_bytes
        assert mem["compression_ratio"] > 1.0


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        KVarNCache(None, "int3")
    with pytest.raises(ValueError, match="unknown preset 'k1v1'"):
        KVarNCache(None, "kvarn", "k1v1")
    with pytest.raises(ValueError, match="unknown KVarNCache option"):
        KVarNCache(None, "kvarn", "k2v2_g128", tiles=64)
    cache = KVarNCache(None, "kvarn", KVarNConfig(tile=64))
    assert cache.config.tile == 64
    k, v = _kv(1, 2, 8)
    with pytest.raises(ValueError, match=r"keys of shape \(2, 8, 64\); KVarNCache takes \[batch, kv_heads"):
        KVarNCache(None, "kvarn", "k4v2_g64").update(k[0], v[0], 0)


def test_unsupported_layer_type_raises():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=1, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=32)
    config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 1 has type 'linear_attention'"):
        KVarNCache(config, "kvarn")
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = 16
    cache = KVarNCache(config, "kvarn")
    assert [type(layer).__name__ for layer in cache.layers] == ["KVarNLayer", "DynamicSlidingWindowLayer", "KVarNLayer"]
    cache = KVarNCache(config, "kvarn", quantize_sliding_window=True)
    assert [layer.is_sliding for layer in cache.layers] == [False, True, False]


@pytest.mark.parametrize("method", ["kvarn", "kivi", "fp8"])
def test_decoded_cache_reads_the_same_history(method):
    """The optional dequantized working copy returns what re-decoding the packed tiles returns."""
    from kvarn.cache import KVarNCache

    torch.manual_seed(0)
    caches = [KVarNCache(None, method, "k4v2_g64", tile=32, sink_tokens=32, decoded_cache=flag) for flag in (False, True)]
    outs = [[], []]
    steps = [torch.randn(2, 2, 70, 64)] + [torch.randn(2, 2, 1, 64) for _ in range(40)]
    for x in steps:
        for i, cache in enumerate(caches):
            outs[i].append(cache.update(x, -x, 0))
    for (k0, v0), (k1, v1) in zip(*outs):
        torch.testing.assert_close(k1, k0, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v1, v0, rtol=1e-6, atol=1e-6)
    plain, fast = (c.memory_report()["total"] for c in caches)
    assert fast["total_bytes"] == plain["total_bytes"] and plain["decoded_cache_bytes"] == 0
    assert fast["decoded_cache_bytes"] >= 4 * 2 * 2 * 64 * 2 * caches[1].layers[0].num_tiles[0] * 32


@pytest.mark.parametrize("method", ["kvarn", "kivi", "fp8", "fp16"])
def test_store_keeps_no_reference_to_an_appended_batch(method):
    """The format template is one cloned tile: a long prefill's encoded tiles are not held twice."""
    from kvarn.cache.store import TileStore
    from kvarn.codec.record import FIELD_ORDER

    cfg = KVarNConfig(tile=32)
    store = TileStore(TileCodec(method, cfg), batch=1, heads=2, head_dim=64, device=torch.device("cpu"))
    k, v = torch.randn(2, 8, 2, 32, 64).unbind(0)  # 8 tiles of row 0
    store.append([0] * 8, k, v)
    tmpl = store._template
    held = [] if tmpl.tiles is None else [getattr(tmpl.tiles, name) for name in FIELD_ORDER]
    held += [t for t in (tmpl.keys, tmpl.values, tmpl.k_fp8, tmpl.k_scale, tmpl.v_fp8, tmpl.v_scale) if t is not None]
    assert held and all(t.shape[0] == 1 for t in held)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in held)
    dk, dv = store.decode()  # the template still serves decoding
    assert dk.shape == (1, 2, 8 * 32, 64) and torch.isfinite(dk).all()
