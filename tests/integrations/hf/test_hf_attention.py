"""The fused transformers path (attn_implementation="kvarn") against KVarNCache's own read path."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("kvarn.kernels", reason="triton is not importable")

from kvarn import KVarNCache  # noqa: E402
from kvarn.integrations.transformers import attention as hf_attention  # noqa: E402
HAS_CUDA = torch.cuda.is_available()


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


def test_fused_kvarn_auto_matches_the_cache_read_path_with_mixed_flags(kdevice):
    """kvarn-auto on the fused path: the same decision, tiles and tokens as KVarNCache's read path."""
    from kvarn.auto import AutoSettings
    from kvarn.codec.flavour import Flavours

    dtype = torch.float16 if HAS_CUDA else torch.float32
    model = _tiny_llama(kdevice, dtype)
    ids = torch.randint(0, 97, (1, 200), device=kdevice)
    kw = dict(max_new_tokens=3, do_sample=False, output_logits=True, return_dict_in_generate=True)
    mixed = Flavours(torch.tensor([[True, False]]), torch.tensor([[False, True]]),
                     torch.tensor([[False, True]]), torch.tensor([[True, False]]))

    def force_mixed(cache):  # every flag combination on some head, whatever the prompt decides
        for layer in cache.layers:
            orig = layer.set_decision

            def set_decision(decision, layer=layer, orig=orig):
                row = decision.rows[0]
                row.key_rotate, row.key_normalize, row.value_rotate, row.value_normalize = (
                    getattr(mixed, n)[0].to(kdevice) for n in ("key_rotate", "key_normalize", "value_rotate",
                                                                "value_normalize"))
                orig(decision)
            layer.set_decision = set_decision

    model.set_attn_implementation("sdpa")
    ref_cache = KVarNCache(model, "kvarn-auto", "k4v2_g64", sinkhorn_iters=2, auto=AutoSettings(rule="a3"))
    force_mixed(ref_cache)
    ref = model.generate(ids, past_key_values=ref_cache, **kw)
    hf_attention.register()
    model.set_attn_implementation("kvarn")
    try:
        cache = hf_attention.fused_cache(model, "k4v2_g64", method="kvarn-auto", auto=AutoSettings(rule="a3"),
                                         sinkhorn_iters=2)
        force_mixed(cache)
        out = model.generate(ids, past_key_values=cache, **kw)
    finally:
        model.set_attn_implementation("sdpa")
    assert all(isinstance(x, hf_attention.FusedKVarNAutoLayer) for x in cache.layers)
    layer = cache.layers[0]
    assert layer.store.counts == [2] and torch.equal(layer.store.flavours.key_rotate.cpu(), mixed.key_rotate)
    inputs = layer.fused_inputs()
    assert torch.equal(inputs["key_rotated"].cpu(), mixed.key_rotate)
    assert torch.equal(inputs["value_rotated"].cpu(), mixed.value_rotate)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(out.sequences, ref.sequences)
    with pytest.raises(ValueError, match="no fused path"):
        hf_attention.fused_cache(model, "k4v2_g64", method="kivi")
