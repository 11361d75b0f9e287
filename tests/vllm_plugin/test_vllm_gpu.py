"""The KVarN backend inside vLLM on a GPU (vLLM's CUDA build, staged as docs/vllm.md says).

A small dummy-weight Llama (4 layers, 8 query / 2 KV heads, head_dim 128), bf16, vLLM's default
mode (torch.compile and full CUDA graphs for one-token decode steps). Each engine runs in a
subprocess (``_run``), so the engines' GPU memory is freed between them.

- The Triton path (graphs) gives the greedy tokens and log-probabilities of the torch twins' path
  (``kernels: "torch"``, eager): the same plan, the same records, only float rounding apart.
- Many more requests than the KV budget holds (vLLM preempts and recomputes): all finish, with
  every token; the engine never dies for lack of staging.
- vLLM's ngram speculative decoding gives the greedy tokens of decoding without it.
- The fp staging is counted once in the KV budget (not also in vLLM's CUDA-graph memory profile).
"""

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "vocab_size": 32000, "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2,
}

_WORKER = r"""
import json, os, random, sys


def memory(worker):
    layers = worker.model_runner.compilation_config.static_forward_context.values()
    stages = [layer.impl.stage for layer in layers if getattr(getattr(layer, "impl", None), "stage", None) is not None]
    return {"graph_estimate": worker.cudagraph_memory_estimate, "granted": worker.kvarn_kv_budget_bytes,
            "staging": sum(x.numel() * x.element_size() for x in stages)}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("memory"):  # the worker in this process, so the report reads its objects
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=2048, **spec["engine"])
    if spec.get("memory"):
        print("MEMORY " + json.dumps({**llm.collective_rpc(memory)[0],
                                      "tokens": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens}))
    rng = random.Random(spec["seed"])
    prompts = [[rng.randrange(100, 31000) for _ in range(spec["prompt"])] for _ in range(spec["requests"])]
    if spec.get("repeat"):  # repetitive prompts: ngram speculation finds drafts
        prompts = [(p[:16] * 64)[: spec["prompt"]] for p in prompts]
    params = SamplingParams(max_tokens=spec["new"], min_tokens=spec["new"], temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    res = [{"tokens": list(o.outputs[0].token_ids),
            "logprobs": [float(next(iter(lp.values())).logprob) for lp in o.outputs[0].logprobs]} for o in outs]
    print("RESULT " + json.dumps(res), flush=True)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_llama")
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    return str(folder)


def _run(model, engine, requests=8, prompt=600, new=48, seed=0, repeat=False, memory=False):
    spec = {"model": model, "engine": engine, "requests": requests, "prompt": prompt, "new": new, "seed": seed,
            "repeat": repeat, "memory": memory}
    proc = subprocess.run([sys.executable, "-c", _WORKER, json.dumps(spec)], capture_output=True, text=True,
                          timeout=600)
    lines = {x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in proc.stdout.splitlines() if " " in x}
    assert proc.returncode == 0 and "RESULT" in lines, proc.stderr[-4000:]
    out = json.loads(lines["RESULT"])
    return (out, json.loads(lines["MEMORY"])) if memory else out


def _kvarn(**extra):
    return {"kvarn": {"preset": "k4v2_g128", **extra}}


def test_graph_decode_matches_the_torch_twins(model):
    # 600-token prompts: a sink, three records after the prefill, a fourth committed while decoding.
    got = _run(model, {"gpu_memory_utilization": 0.3, "additional_config": _kvarn()})
    ref = _run(model, {"gpu_memory_utilization": 0.3, "enforce_eager": True, "additional_config": _kvarn(kernels="torch")})
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(got, ref))
    diffs = [abs(x - y) for a, b in zip(got, ref) for x, y, s, t in
             zip(a["logprobs"][:16], b["logprobs"][:16], a["tokens"], b["tokens"]) if s == t]
    print(json.dumps({"identical": same, "max_logprob_diff": max(diffs)}))
    assert same >= 6, (same, [a["tokens"][:8] for a in got], [b["tokens"][:8] for b in ref])
    assert max(diffs) < 0.1


def test_more_requests_than_the_budget_holds_all_finish(model):
    # About 40 requests of 1100 tokens fit in 256 MiB of records and staging: 96 force preemptions.
    out = _run(model, {"kv_cache_memory_bytes": 256 * 2**20, "max_num_seqs": 64, "additional_config": _kvarn()},
               requests=96, prompt=700, new=400)
    assert len(out) == 96 and all(len(o["tokens"]) == 400 for o in out)


def test_ngram_speculative_decoding_gives_the_same_tokens(model):
    engine = {"gpu_memory_utilization": 0.3, "additional_config": _kvarn()}
    plain = _run(model, engine, requests=6, prompt=300, new=96, seed=3, repeat=True)
    spec = _run(model, {**engine, "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
                requests=6, prompt=300, new=96, seed=3, repeat=True)
    assert [o["tokens"] for o in spec] == [o["tokens"] for o in plain]


def test_continuing_chunks_by_flash_attention_match_the_float32_reference():
    """The CUDA path of continuing prefill chunks (history gathered in bf16, one FlashAttention varlen
    call) against the CPU path (float32 buffers, masked SDPA per chunk) on the same cache state."""
    import numpy as np

    from kvarn.config import PRESETS
    from kvarn.integrations.vllm import exact
    from kvarn.integrations.vllm.plan import PrefillRow, continued_batch
    from kvarn.integrations.vllm.staging import slot_tokens
    from kvarn.paged import encode_into_pages

    cfg, hq, hk, d = PRESETS["k4v2_g128"], 8, 2, 128
    s, g, length = cfg.sink_tokens, cfg.tile, slot_tokens(cfg, 0)
    gen = torch.Generator().manual_seed(0)
    flat_k = torch.randn(3 * length, hk, d, generator=gen).bfloat16()  # slots 0, 1 and the trash slot
    flat_v = torch.randn(3 * length, hk, d, generator=gen).bfloat16()
    pages = torch.zeros(8, hk, cfg.record_bytes(d), dtype=torch.uint8)
    tiles_k, tiles_v = torch.randn(2 * g, hk, d, generator=gen), torch.randn(2 * g, hk, d, generator=gen)
    encode_into_pages(tiles_k, tiles_v, torch.tensor([0, g], dtype=torch.int32), pages,
                      torch.tensor([3, 5], dtype=torch.int32), cfg)
    rows = [PrefillRow(0, 0, 50, 400, 0, 384, np.array([3, 5], dtype=np.int32)),  # sink, 2 records, 16 tail rows
            PrefillRow(1, 50, 60, 100, 1, 128, np.zeros(0, dtype=np.int32))]  # inside the sink
    batch = continued_batch(rows, length, s, g)
    q, k, v = (torch.randn(110, h, d, generator=gen).bfloat16() for h in (hq, hk, hk))

    def on(device):
        i64 = (lambda x: torch.from_numpy(x).to(device))
        i32 = (lambda x: torch.from_numpy(x.astype(np.int32)).to(device))
        co = exact.ContinuedRows(
            q_tok=i64(batch.q_tok), cu_q=i32(batch.cu_q), cu_k=i32(batch.cu_k), max_q=batch.max_q, max_k=batch.max_k,
            stage_src=i64(batch.stage_src), stage_dst=i64(batch.stage_dst), rec_pages=i64(batch.rec_pages),
            rec_dst=i64(batch.rec_dst), chunk_dst=i64(batch.chunk_dst), bounds_q=batch.cu_q.tolist(),
            bounds_k=batch.cu_k.tolist())
        out = torch.zeros(110, hq, d, dtype=torch.bfloat16, device=device)
        fa = exact.flash_attention_version(d) if device == "cuda" else None
        exact.continued(q.to(device), k.to(device), v.to(device), co, flat_k.to(device), flat_v.to(device),
                        pages.to(device), cfg, out, d ** -0.5, fa)
        return out.float().cpu()

    got, ref = on("cuda"), on("cpu")
    err = (got - ref).abs().max().item()
    print(json.dumps({"max_abs_err": err, "ref_abs_max": ref.abs().max().item()}))
    assert err < 2e-2 and ref.abs().max() > 0.1


def test_the_staging_is_counted_once_in_the_kv_budget(model):
    # 1024 slots of staging (about 1 GiB over the 4 layers) against graphs of a few hundred MiB at
    # most: a staging allocated inside vLLM's graph-memory profile would be in its estimate too.
    from kvarn.config import PRESETS

    out, mem = _run(model, {"gpu_memory_utilization": 0.5, "max_num_seqs": 1024, "additional_config": _kvarn()},
                    requests=4, prompt=300, new=8, memory=True)
    print(json.dumps(mem))
    assert len(out) == 4
    assert mem["staging"] > 2**30 * 0.9 and mem["graph_estimate"] < mem["staging"] / 2
    records = (mem["tokens"] * PRESETS["k4v2_g128"].bytes_per_token(128) * SMALL_LLAMA["num_key_value_heads"]
               * SMALL_LLAMA["num_hidden_layers"])
    # vLLM's grant holds the records it reports and the staging, and little else (as on CPU)
    assert 0.95 * mem["granted"] <= records + mem["staging"] <= mem["granted"]
