"""The fused transformers path (attn_implementation="kvarn") against KVarNCache's own read path."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("kvarn.kernels", reason="triton is not importable")

from kvarn import KVarNCache  # noqa: E402
from kvarn.integrations import hf_attention  # noqa: E402
from kernel_data import HAS_CUDA  # noqa: E402


def _tiny_llama(device, dtype):
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def test_fused_generate_matches_cache_read_path(kdevice):
    dtype = torch.float16 if HAS_CUDA else torch.float32
    model = _tiny_llama(kdevice, dtype)
    ids = torch.randint(0, 97, (1, 140), device=kdevice)
    kw = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, past_key_values=KVarNCache(model, "kvarn", "k4v2_g64", sinkhorn_iters=2), **kw)
    hf_attention.register()
    model.set_attn_implementation("kvarn")
    cache = hf_attention.fused_cache(model, "k4v2_g64", sinkhorn_iters=2)
    out = model.generate(ids, past_key_values=cache, **kw)
    assert any(isinstance(layer, hf_attention.FusedKVarNLayer) for layer in cache.layers)
    assert cache.layers[0].store.counts == [1]  # tokens 64..127 frozen into one tile
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(out.sequences, ref.sequences)


def test_cache_for_fuses_kvarn_on_cuda_only():
    model = _tiny_llama("cpu", torch.float32)
    plain = hf_attention.cache_for(model, "kvarn", "k4v2_g64")
    assert type(plain) is KVarNCache and not any(isinstance(x, hf_attention.FusedKVarNLayer) for x in plain.layers)
    with pytest.raises(ValueError, match="use_fused"):
        hf_attention.cache_for(model, "kvarn", "k4v2_g64", device="cuda")
    hf_attention.use_fused(model)
    try:
        fused = hf_attention.cache_for(model, "kvarn", "k4v2_g64", device="cuda")  # built, not run
        other = hf_attention.cache_for(model, "kivi", "k4v2_g64", device="cuda")
    finally:
        model.set_attn_implementation("sdpa")
    assert all(isinstance(x, hf_attention.FusedKVarNLayer) for x in fused.layers)
    assert other.method.name == "kivi" and not any(isinstance(x, hf_attention.FusedKVarNLayer) for x in other.layers)
