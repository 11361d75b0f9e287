"""CUDA-graph decoding (GPU only): the same greedy tokens with and without capture.

A random Llama with the 8B model's head layout (D 128, 4 query heads per KV head), G = 128 tiles,
and enough new tokens that the captured loop replays both of its graphs (two tiles freeze during
decoding), for the fused kvarn cache and for transformers' StaticCache.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kernel_data import HAS_CUDA  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA device")]

PROMPT, NEW = 300, 300


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=4096,
        eos_token_id=None,  # decode_greedy never stops early; generate must not either
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.float16).eval()


@pytest.mark.parametrize("preset", ["k4v2_g128", "k2v2_g128"])
def test_captured_kvarn_decode_matches_eager(model, preset):
    from kvarn.integrations import hf_attention, hf_graph

    ids = torch.randint(0, 1000, (3, PROMPT), device="cuda")
    hf_attention.use_fused(model)
    try:
        out = {}
        for mode in ("none", "cuda"):
            cache = hf_attention.fused_cache(model, preset, max_length=PROMPT + NEW)
            out[mode] = hf_graph.decode_greedy(model, cache, ids, NEW, capture=mode)
            assert cache.layers[0].store.counts == [(PROMPT + NEW - 1 - 128) // 128] * 3
        # The same reserved buffers as the loop, so the kernels run the same launch plan (a plan
        # from other buffer shapes sums the splits in another order and can flip a near tie).
        ref = model.generate(ids, past_key_values=hf_attention.fused_cache(model, preset, max_length=PROMPT + NEW),
                             max_new_tokens=NEW,
                             do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=0)[:, PROMPT:]
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out["none"], ref)
    assert torch.equal(out["cuda"], out["none"]), (
        f"first divergence at token {int((out['cuda'] != out['none']).any(0).nonzero()[0])}")


def test_captured_static_cache_decode_matches_eager(model):
    from kvarn.integrations import hf_graph

    ids = torch.randint(0, 1000, (2, PROMPT), device="cuda")
    model.set_attn_implementation("sdpa")
    out = {}
    for mode in ("none", "cuda"):
        cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
        out[mode] = hf_graph.decode_greedy(model, cache, ids, NEW, capture=mode)
    assert torch.equal(out["cuda"], out["none"])
