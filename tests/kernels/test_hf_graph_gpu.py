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


def decode_with_logits(model, cache, ids, mode):
    """decode_greedy's tokens and the logits each token was chosen from (``[NEW, B, V]``): a hook
    copies the LM head's output into a fixed buffer (captured with the step, so replays refresh it)
    and ``on_step`` saves it after each token."""
    from kvarn.integrations import hf_graph

    last = torch.zeros(ids.shape[0], model.config.vocab_size, device="cuda")
    hist = torch.zeros(NEW, *last.shape, device="cuda")
    def keep(module, args, output) -> None:  # returns None: the output itself is left as it is
        last.copy_(output[:, -1])

    hook = model.lm_head.register_forward_hook(keep)
    try:
        tokens = hf_graph.decode_greedy(model, cache, ids, NEW, capture=mode, on_step=lambda i: hist[i].copy_(last))
    finally:
        hook.remove()
    return tokens, hist


def assert_same_decoding(tokens, logits, ref_tokens, ref_logits, rel: float = 0.05):
    """Same tokens, or the same up to a step where the reference's top two logits were within the
    logit error so far; before that step the logits agree within ``rel`` of their largest magnitude.

    Why not bit-equal: captured GEMMs need not be eager's (cuBLAS picks per stream and workspace:
    the fp16 StaticCache differs too, measured on the H200), and in a 2-4 bit cache a rounding
    difference in a key can flip a code, which moves the logits by much more than the rounding
    (1.5-1.8% of the largest logit after 300 steps of this random model, measured). A capture bug
    (a stale position, a missing tile) moves them by their own size.
    """
    differ = (tokens != ref_tokens).any(0).nonzero()
    first = int(differ[0]) if len(differ) else tokens.shape[1]
    scale = ref_logits[:first].abs().amax().item()
    err = (logits[:first] - ref_logits[:first]).abs().amax().item() if first else 0.0
    assert err <= rel * scale, f"logits differ by {err} (scale {scale}) before any token does"
    if first < tokens.shape[1]:
        top2 = ref_logits[first].topk(2, dim=-1).values  # [B, 2]
        rows = (tokens[:, first] != ref_tokens[:, first]).nonzero()[:, 0]
        gap = (top2[rows, 0] - top2[rows, 1]).max().item()
        assert gap <= 4 * max(err, 1e-3 * scale), (
            f"token {first} differs with a top-2 logit gap of {gap} (logit error so far {err})")


@pytest.mark.parametrize("preset", ["k4v2_g128", "k2v2_g128"])
def test_captured_kvarn_decode_matches_eager(model, preset):
    from kvarn.integrations import hf_attention

    ids = torch.randint(0, 1000, (3, PROMPT), device="cuda")
    hf_attention.use_fused(model)
    try:
        out = {}
        for mode in ("none", "cuda"):
            cache = hf_attention.fused_cache(model, preset, max_length=PROMPT + NEW)
            out[mode] = decode_with_logits(model, cache, ids, mode)
            assert cache.layers[0].store.counts == [(PROMPT + NEW - 1 - 128) // 128] * 3
        # The same reserved buffers as the loop, so the kernels run the same launch plan (a plan
        # from other buffer shapes sums the splits in another order and can flip a near tie).
        ref = model.generate(ids, past_key_values=hf_attention.fused_cache(model, preset, max_length=PROMPT + NEW),
                             max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids),
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("sdpa")
    ref_logits = torch.stack([x.float() for x in ref.logits])  # [NEW, B, V]
    assert_same_decoding(*out["none"], ref.sequences[:, PROMPT:], ref_logits)
    assert_same_decoding(*out["cuda"], *out["none"])


def test_captured_static_cache_decode_matches_eager(model):
    ids = torch.randint(0, 1000, (2, PROMPT), device="cuda")
    model.set_attn_implementation("sdpa")
    out = {}
    for mode in ("none", "cuda"):
        cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
        out[mode] = decode_with_logits(model, cache, ids, mode)
    assert_same_decoding(*out["cuda"], *out["none"])
