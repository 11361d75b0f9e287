import pytest

from kvarn import PRESETS, KVarNConfig

# Spec section 4: bytes per token per KV head.
SPEC_BYTES = {
    ("k2v2_g128", 128): 76, ("k4v2_g128", 128): 108, ("k4v4_g128", 128): 140,
    ("k4v2_g64", 128): 114, ("k4v4_g64", 128): 146,
}


def test_presets_match_spec_table():
    assert set(PRESETS) == {"k2v2_g128", "k4v2_g128", "k4v4_g128", "k2v2_g64", "k4v2_g64", "k4v4_g64"}
    for name, cfg in PRESETS.items():
        assert cfg.name == name
        assert f"k{cfg.key_bits}v{cfg.value_bits}_g{cfg.tile}" == name
        assert cfg.sinkhorn_iters == 8
        assert cfg.sink_tokens == cfg.tile


@pytest.mark.parametrize("key", sorted(SPEC_BYTES))
def test_bytes_per_token_spec_figures(key):
    name, d = key
    assert KVarNConfig.from_name(name).bytes_per_token(d) == SPEC_BYTES[key]


def test_record_bytes_example_and_ratios():
    cfg = KVarNConfig.from_name("k4v2_g128")
    assert cfg.record_bytes(128) == 13824
    assert round(KVarNConfig.from_name("k2v2_g128").compression_ratio(128), 2) == 6.74
    assert round(cfg.compression_ratio(128), 2) == 4.74
    assert round(KVarNConfig.from_name("k4v4_g128").compression_ratio(128), 2) == 3.66


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_record_bytes_formula(name, d):
    cfg = KVarNConfig.from_name(name)
    g = cfg.tile
    raw = d * g * cfg.key_bits // 8 + 4 * d + 2 * g + g * d * cfg.value_bits // 8 + 2 * d + 4 * g
    assert cfg.record_bytes(d) == (raw + 7) // 8 * 8
    assert cfg.record_bytes(d) % 8 == 0


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="k4v2_g128") as e:
        KVarNConfig.from_name("k3v3_g128")
    assert "k3v3_g128" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, word",
    [({"key_bits": 3}, "key_bits"), ({"value_bits": 1}, "value_bits"), ({"tile": 100}, "tile"),
     ({"sinkhorn_iters": -1}, "sinkhorn_iters"), ({"sink_tokens": 10}, "sink_tokens"),
     ({"key_quantile": 0.6}, "key_quantile"), ({"value_quantile": -0.1}, "value_quantile"),
     ({"value_quantile": "0.03"}, "value_quantile"), ({"rotation_dtype": "bf16"}, "rotation_dtype")],
)
def test_bad_config_names_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        KVarNConfig(**kwargs)


def test_quantiles_resolve_none_to_min_max():
    assert KVarNConfig().quantiles == (0.0, 0.0)
    assert KVarNConfig(key_quantile=0.02).quantiles == (0.02, 0.0)
    assert KVarNConfig(value_quantile=0.05).quantiles == (0.0, 0.05)


def test_overrides_and_frozen():
    cfg = KVarNConfig.from_name("k2v2_g128", sinkhorn_iters=16, sink_tokens=256)
    assert (cfg.sinkhorn_iters, cfg.sink_tokens, cfg.key_bits) == (16, 256, 2)
    with pytest.raises(Exception):
        cfg.tile = 64  # frozen


@pytest.mark.parametrize("d", [48, 96, 100, 8])
def test_unsupported_head_dim(d):
    with pytest.raises(ValueError, match=f"head_dim={d}"):
        KVarNConfig().record_bytes(d)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"key_bits": 2.0}, "key_bits"), ({"value_bits": True}, "value_bits"), ({"tile": 64.0}, "tile"),
     ({"sinkhorn_iters": True}, "sinkhorn_iters"), ({"sinkhorn_iters": 8.0}, "sinkhorn_iters"),
     ({"sink_tokens": 128.0}, "sink_tokens"), ({"quantize_sliding_window": "yes"}, "quantize_sliding_window")],
)
def test_integer_and_bool_fields_refuse_other_types(kwargs, field):
    # 2.0 == 2 and True == 1 pass a membership test; the error must name the field given, not a later one.
    with pytest.raises(ValueError, match=f"^{field}="):
        KVarNConfig(**kwargs)


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    cfg = KVarNConfig(key_bits=np.int64(2), tile=np.int32(64), sink_tokens=np.int64(128))
    assert cfg.name == "k2v2_g64" and cfg.bytes_per_token(128) == 82
    assert all(type(getattr(cfg, f)) is int for f in ("key_bits", "tile", "sink_tokens"))  # JSON-ready


@pytest.mark.parametrize("name", [None, ["k4v2_g128"], 42])
def test_preset_name_of_another_type_lists_valid_names(name):
    with pytest.raises(ValueError, match="valid presets: .*k4v2_g128"):
        KVarNConfig.from_name(name)
