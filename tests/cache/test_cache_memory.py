"""memory_report: the baseline is the model's own cache in the model dtype; reserved buffers stay
within 10% of the stored bytes plus one full-precision tile per row and layer."""

import pytest
import torch

from kvarn import KVarNCache
from kvarn.cache.store import grown_capacity

H, D = 3, 64


def _kv(b, t, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, H, t, D, generator=g).to(dtype), torch.randn(b, H, t, D, generator=g).to(dtype))


@pytest.mark.parametrize("dtype,esize", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_baseline_is_the_models_own_cache_in_its_dtype(dtype, esize):
    cache = KVarNCache(None, "kvarn", "k2v2_g128")
    cache.update(*_kv(2, 900, dtype), 0)
    cache.freeze()
    total = cache.memory_report()["total"]
    tokens = 2 * 900
    assert total["tokens"] == tokens
    assert total["baseline_dtype"] == str(dtype).removeprefix("torch.")
    assert total["baseline_bytes"] == tokens * H * D * 2 * esize
    assert total["fp16_equivalent_bytes"] == tokens * H * D * 2 * 2
    assert total["compression_ratio"] == pytest.approx(total["baseline_bytes"] / total["total_bytes"])
    assert total["compression_vs_fp16"] == pytest.approx(total["fp16_equivalent_bytes"] / total["total_bytes"])
    # An fp32 model's cache is twice the fp16 figure, and so is the saving against it.
    assert total["compression_ratio"] == pytest.approx(total["compression_vs_fp16"] * esize / 2)


def test_fp16_method_saves_nothing_against_the_model_dtype():
    cache = KVarNCache(None, "fp16", "k2v2_g128")
    cache.update(*_kv(1, 300, torch.float32), 0)
    cache.freeze()
    total = cache.memory_report()["total"]
    assert total["compression_ratio"] == pytest.approx(1.0)
    assert total["compression_vs_fp16"] == pytest.approx(0.5)


def _check_reserved(cache, batch, dtype):
    g = cache.config.tile
    one_tile = batch * g * H * D * 2 * torch.tensor([], dtype=dtype).element_size()
    for entry in cache.memory_report()["layers"]:
        stored = entry["total_bytes"]
        assert entry["reserved_bytes"] >= stored
        assert entry["reserved_bytes"] <= 1.1 * stored + one_tile, entry


@pytest.mark.parametrize("prompt,sink_tiles", [(900, 1), (5, 1), (40, 3)])
@pytest.mark.parametrize("method", ["kvarn", "fp16"])
def test_reserved_bytes_stay_close_to_stored(prompt, sink_tiles, method):
    dtype, batch = torch.float32, 2
    cache = KVarNCache(None, method, "k2v2_g64", tile=32, sink_tokens=32 * sink_tiles)
    cache.update(*_kv(batch, prompt, dtype), 0)
    _check_reserved(cache, batch, dtype)
    for step in range(150):
        cache.update(*_kv(batch, 1, dtype, seed=step + 1), 0)
        _check_reserved(cache, batch, dtype)
    cache.freeze()
    _check_reserved(cache, batch, dtype)


def test_multi_token_steps_keep_the_bound():
    dtype, batch = torch.bfloat16, 1
    cache = KVarNCache(None, "kvarn", "k4v2_g64", tile=32)
    cache.update(*_kv(batch, 70, dtype), 0)
    for step in range(12):  # chunks of 40 tokens, as a pseudo-decode does
        cache.update(*_kv(batch, 40, dtype, seed=step + 1), 0)
        _check_reserved(cache, batch, dtype)


def test_growth_is_geometric_and_tight():
    cap, reallocs = 0, 0
    for need in range(1, 5001):
        new = grown_capacity(cap, need) if need > cap else cap
        reallocs += new != cap
        cap = new
        assert need <= cap <= max(need * 1.1, need + 1)
    assert reallocs < 100  # ~log_1.1(5000) + the first ten unit steps, not one per append
    assert grown_capacity(100, 101, limit=105) == 105
    assert grown_capacity(100, 200, limit=105) == 200
