"""The vLLM adapter's host-side logic without vLLM: flag parsing and block-keyed fp staging."""

import pytest
import torch

from kvarn.codec import decode_tiles, fields_to_records, records_to_fields
from kvarn.config import PRESETS
from kvarn.integrations.vllm.settings import is_requested, kv_cache_dtype_names, settings_from_vllm_config
from kvarn.integrations.vllm.staging import LayerStaging, encode_records
from kvarn.methods import TileCodec

CFG = PRESETS["k4v2_g128"]
HK, D, G = 3, 64, CFG.tile


class _Cache:
    def __init__(self, cache_dtype="auto"):
        self.cache_dtype = cache_dtype


class _VllmConfig:
    def __init__(self, additional_config=None, cache_dtype="auto"):
        self.additional_config = additional_config or {}
        self.cache_config = _Cache(cache_dtype)


def test_flag_selects_preset_and_options():
    cfg = _VllmConfig({"kvarn": {"preset": "k2v2_g64", "sinkhorn_iters": 16, "kernels": "torch"}})
    assert is_requested(cfg)
    s = settings_from_vllm_config(cfg)
    assert (s.config.name, s.config.sinkhorn_iters, s.config.sink_tokens, s.kernels) == ("k2v2_g64", 16, 64, "torch")
    assert settings_from_vllm_config(_VllmConfig(cache_dtype="kvarn_k4v4_g128")).config.name == "k4v4_g128"
    assert settings_from_vllm_config(_VllmConfig({"kvarn": "k4v2_g64"})).config.name == "k4v2_g64"
    assert not is_requested(_VllmConfig())
    assert is_requested(_VllmConfig(), custom_backend_selected=True)
    assert settings_from_vllm_config(_VllmConfig()).config.name == "k4v2_g128"
    assert "kvarn_k4v2_g128" in kv_cache_dtype_names()


def test_kvarn_auto_is_refused_naming_the_supported_methods():
    cfg = _VllmConfig({"kvarn": {"preset": "k2v2_g128", "method": "kvarn-auto"}})
    with pytest.raises(ValueError, match=r"method='kvarn-auto' is not supported.*\['kvarn'\]"):
        settings_from_vllm_config(cfg)
    ok = _VllmConfig({"kvarn": {"preset": "k2v2_g128", "method": "kvarn"}})
    assert settings_from_vllm_config(ok).config.name == "k2v2_g128"


@pytest.mark.parametrize("bad", [{"kvarn": {"preset": "k3v3"}}, {"kvarn": {"tile": 64}}, {"kvarn": {"kernels": "cuda"}}])
def test_flag_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        settings_from_vllm_config(_VllmConfig(bad))


def _kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HK, D, generator=g), torch.randn(n, HK, D, generator=g)


def test_records_match_the_transformers_codec():
    """A committed page holds exactly what kvarn's own cache would freeze for the same tile."""
    k, v = _kv(G)
    rec = encode_records(k.transpose(0, 1)[None], v.transpose(0, 1)[None], CFG, use_triton=False)  # [1, Hk, R]
    enc = TileCodec("kvarn", CFG).encode(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    assert torch.equal(rec[:, :, None], fields_to_records(enc.tiles, CFG, D))


def test_write_gather_commit_across_blocks():
    st = LayerStaging(CFG, HK, D, torch.float32, torch.device("cpu"), stale_steps=4, initial_slots=2)
    pages = torch.zeros(16, HK, CFG.record_bytes(D), dtype=torch.uint8)
    blocks = [7, 3, 11]
    k, v = _kv(300)
    st.begin_step()
    st.write(blocks, 0, k[:200], v[:200])  # chunked prefill: two chunks
    st.write(blocks, 200, k[200:], v[200:])
    gk, gv = st.gather(blocks, 100, 290)
    assert torch.equal(gk, k[100:290].transpose(0, 1)) and torch.equal(gv, v[100:290].transpose(0, 1))
    st.commit([3], pages, use_triton=False)
    assert st.committed == {3} and 3 not in st.slot_of
    kt, vt = decode_tiles(records_to_fields(pages[3][None, :, None], CFG, D), CFG)
    assert kt.shape == (1, HK, 1, D, G) and pages[[7, 11]].eq(0).all()
    st.commit([3], pages, use_triton=False)  # never re-encoded: idempotent
    with pytest.raises(RuntimeError, match="no longer staged"):
        st.gather(blocks, 128, 200)
    st.write(blocks, 128, k[:1], v[:1])  # block 3 reused by a new writer: uncommitted again
    assert 3 not in st.committed


def test_stale_slots_are_reclaimed_before_growing():
    st = LayerStaging(CFG, HK, D, torch.float32, torch.device("cpu"), stale_steps=2, initial_slots=2)
    k, v = _kv(1)
    st.begin_step()
    st.write([0], 0, k, v)
    st.write([1], 0, k, v)
    for _ in range(2):
        st.begin_step()
    st.write([2], 0, k, v)  # the two old slots are stale: one is reused, no growth
    assert st.k.shape[0] == 2 and 2 in st.slot_of
    st.write([3], 0, k, v)
    st.write([4], 0, k, v)  # nothing stale now: the pool doubles
    assert st.k.shape[0] == 4
