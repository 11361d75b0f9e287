"""The fused path on the bundled SmolLM2 (GPU only): same greedy tokens as KVarNCache's read path.

On CPU the fused path runs through triton's interpreter, far too slow for a real model; the tiny
random Llama of test_hf_attention.py covers it there.
"""

import copy

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.real_model,
              pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (the interpreter is too slow for a real model)")]

NEW_TOKENS = 48
LOGIT_TOL = 0.2


@pytest.fixture(scope="module")
def smollm2_cuda(smollm2):
    model, tokenizer = smollm2
    return copy.deepcopy(model).to(device="cuda", dtype=torch.float16).eval(), tokenizer


@pytest.mark.parametrize("preset", ["k4v2_g64", pytest.param("k2v2_g128", marks=pytest.mark.slow)])
def test_fused_generate_matches_read_path_on_smollm2(smollm2_cuda, wikitext_excerpt, preset):
    from kvarn import KVarNCache
    from kvarn.integrations.transformers import attention as hf_attention

    model, tokenizer = smollm2_cuda
    ids = tokenizer(wikitext_excerpt, return_tensors="pt").input_ids[:, :400].cuda()
    kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(ids, past_key_values=KVarNCache(model, "kvarn", preset), **kw)
    hf_attention.register()
    model.set_attn_implementation("kvarn")
    try:
        cache = hf_attention.fused_cache(model, preset)
        out = model.generate(ids, past_key_values=cache, **kw)
    finally:
        model.set_attn_implementation("sdpa")
    tile = int(preset.rsplit("_g", 1)[1])
    assert cache.layers[0].store.counts[0] >= 400 // tile - 1  # decode read packed tiles (all but the sink)
    assert torch.equal(out.sequences, ref.sequences), (
        f"first divergence at new token {int((out.sequences[0, 400:] != ref.sequences[0, 400:]).nonzero()[0])}")
    # Same tokens, and logits within fp16 noise: two attention implementations in fp16 through 30
    # layers differed by at most 0.071 (H200, both presets); a wrong tile, scale
    # or length moves them by whole units.
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(out.logits, ref.logits))
    assert worst < LOGIT_TOL, f"largest logit difference {worst:.3f}"
