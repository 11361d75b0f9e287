"""``method="hf-quanto"`` / ``"hf-hqq"``: transformers' own quantized cache layers behind KVarNCache.

A tiny random Llama (2 layers, head_dim 64, no download) keeps these fast. Prompt 50 tokens, 40 new
tokens, residual (``tile``) 32: the residual fills and the cache is re-quantized during decoding.
"""

from __future__ import annotations

import argparse
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from kvarn.cache import KVarNCache  # noqa: E402
from kvarn.cache.hf_baselines import HF_METHODS  # noqa: E402
from kvarn.methods import METHODS  # noqa: E402

PROMPT_LEN, NEW = 50, 40
TILE = 32

_BACKEND = {"hf-quanto": ("optimum.quanto", "QuantoQuantizedLayer"), "hf-hqq": ("hqq", "HQQQuantizedLayer")}
BASELINES = [
    pytest.param(name, marks=pytest.mark.skipif(importlib.util.find_spec(mod) is None, reason=f"{mod} missing"))
    for name, (mod, _) in _BACKEND.items()
]


def _config(**kw):
    base = dict(vocab_size=100, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
    base.update(kw)
    return LlamaConfig(**base)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config()).eval()
    ids = torch.randint(3, 100, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    return model, ids


def _generate(model, ids, cache, n=NEW):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], out.logits


@pytest.mark.parametrize("method", BASELINES)
def test_generate_layers_and_memory(tiny, method):
    model, ids = tiny
    cache = KVarNCache(model, method, "k2v2_g128", decoded_cache=True, tile=TILE)
    layer_cls = _BACKEND[method][1]
    assert [type(layer).__name__ for layer in cache.layers] == [layer_cls] * 2
    assert cache.method.name == method and cache.config.sink_tokens == 0 and cache.codec is None
    tokens, logits = _generate(model, ids, cache)
    assert tokens.shape == (NEW,)
    assert cache.get_seq_length() == PROMPT_LEN + NEW - 1  # the last token is never fed back
    assert all(0 < layer.keys.shape[-2] < TILE for layer in cache.layers)  # the residual was flushed once

    rep = cache.memory_report()
    total = rep["total"]
    assert rep["method"] == method and rep["sink_tokens"] == 0
    assert {layer["kind"] for layer in rep["layers"]} == {"quantized_hf"}
    assert [layer["tokens"] for layer in rep["layers"]] == [PROMPT_LEN + NEW - 1] * 2  # total sums layers
    assert total["quantized_bytes"] > 0 and total["full_precision_bytes"] > 0
    assert total["total_bytes"] == total["quantized_bytes"] + total["full_precision_bytes"]
    # per layer-token: (K + V) x 2 heads x 64 channels x 2 bytes
    assert total["fp16_equivalent_bytes"] == total["tokens"] * 2 * 2 * 64 * 2
    assert total["total_bytes"] < total["fp16_equivalent_bytes"]
    assert total["compression_ratio"] > 1.5

    # the same tokens through the unquantized model (one forward, teacher forced): step 1 reads the
    # unquantized prefill, so it matches; later steps read the 2-bit cache and stay close
    with torch.no_grad():
        ref = model(torch.cat([ids[0], tokens])[None]).logits[0, PROMPT_LEN - 1:-1]
    cos = torch.nn.functional.cosine_similarity(torch.cat(logits).float(), ref.float(), dim=-1)
    assert cos[0] > 0.999
    assert cos[1:].max() < 0.9999  # the cache really is quantized
    assert cos.min() > 0.9


@pytest.mark.parametrize("method", BASELINES)
def test_one_bit_width_only(method):
    with pytest.raises(ValueError, match=r"k4v2_g128.*k2v2_\* or k4v4_\*"):
        KVarNCache(_config(), method, "k4v2_g128")
    KVarNCache(_config(), method, "k4v4_g128")  # same bits: fine


def test_options_and_errors():
    with pytest.raises(ValueError, match="no full-precision sink"):
        KVarNCache(_config(), "hf-quanto", "k2v2_g128", sink_tokens=128)
    with pytest.raises(ValueError, match="sliding-window"):
        KVarNCache(_config(), "hf-quanto", "k2v2_g128", quantize_sliding_window=True)
    with pytest.raises(ValueError, match="multiple of 64"):
        KVarNCache(_config(head_dim=32), "hf-quanto", "k2v2_g128")
    with pytest.raises(ValueError, match="unknown method") as err:
        KVarNCache(_config(), "nope", "k2v2_g128")
    for name in [*METHODS, *HF_METHODS]:
        assert repr(name) in str(err.value)


def test_sliding_layers_stay_full_precision():
    config = _config(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    cache = KVarNCache(config, "hf-quanto", "k2v2_g128")
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    assert type(cache.layers[1]).__name__ == "QuantoQuantizedLayer"


def test_cli_choices_match():
    from kvarn.cli import generate

    assert set(generate.HF_BASELINES) == set(HF_METHODS)
    sub = argparse.ArgumentParser().add_subparsers()
    generate.add_parser(sub)
    args = sub.choices["generate"].parse_args(["hi", "--method", "hf-quanto", "--compare", "fp16"])
    assert args.method == "hf-quanto"
