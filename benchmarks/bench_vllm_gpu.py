"""vLLM on a GPU: vLLM's default attention backend against the KVarN backend, in one invocation.

Model: a dummy-weight Llama-3.1-8B shape (bf16, ``load_format="dummy"``, token-id prompts, no
tokenizer), vLLM's default mode (torch.compile and CUDA graphs) for every engine. Each engine runs
in its own subprocess, backends alternated within each engine configuration, the default first.
Scenarios (``--scenarios``; sizes with ``--sizes name=REQUESTSxPROMPT+NEW``):

- ``equal_load``: 64 requests x (2000 + 256), ``max_num_seqs`` 64;
- ``reasoning``: short prompts, long generations: 64 x (256 + 4096), ``max_num_seqs`` 64;
- ``at_capacity``: 512 x (256 + 2048), ``max_num_seqs`` 512: more requests than the default holds.

Per row: requests finished, output tokens/s over the timed ``generate`` (prefill included; one
untimed warm-up of prompts past the first tile first), the KV capacity vLLM reports (tokens; for KVarN with its fp staging counted
in the budget), and the most requests running at once (vLLM's ``num_requests_running`` gauge,
polled), and the kernel compiles vLLM's JIT monitor reported inside the timed window (each stalls
every running request for seconds; the warm-up should leave none). Also: greedy tokens and log-probabilities of the first ``--logprob-steps`` steps of 8
prompts against the default backend, and (``--spec``) KVarN with vLLM's ngram speculative decoding
against KVarN without it, token for token. An engine that dies is a row with ``error`` and counts
in ``engine_deaths``. Each engine's log and the probes' raw tokens are kept in ``--logs``.

Run it on the GPU machine with vLLM staged (``../shared/tools/vllm_gpu/README.md``):

    python benchmarks/bench_vllm_gpu.py --out benchmarks/results/vllm_gpu.json

A run too long for one device call splits over calls, each merging into ``--out`` with
``--append``. Each call is a run, numbered in ``meta.runs`` with its command, card and date, and
each row names its ``run``. A row replaces the earlier row of its scenario and backend, and a kvarn
row's ratios are against the default of its own run (``baseline_run``): with ``--skip-default``
(on the same machine), against the newest default row of the scenario in ``--out``; a default row
stays while a kvarn row is measured against it. With no ``--scenarios``, ``--spec`` alone runs
against the probe an earlier call stored.

Prints a Markdown table and writes JSON; asserts nothing; not run by CI.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001,
}
SCENARIOS = {  # name: (requests, prompt tokens, new tokens, max_num_seqs)
    "equal_load": (64, 2000, 256, 64),
    "reasoning": (64, 256, 4096, 64),
    "at_capacity": (512, 256, 2048, 512),
}
PROBE = (8, 300, 48)  # prompts, prompt tokens, new tokens: logprobs and speculative decoding
WARM = (4, 600, 8)  # the warm-up: past the sink and the first tile
TIMED = "KVARN_BENCH_TIMED"  # marks a timed window in an engine's log
JIT_IN_SERVICE = "during inference"  # vLLM's JIT monitor: a kernel compiled after the engine's warm-up


def compiles_in_timed_windows(log: str) -> dict[str, int]:
    """Per scenario, the kernel compiles vLLM's JIT monitor reported inside its timed window (each
    variant is reported once per process)."""
    counts, current = {}, None
    for line in log.splitlines():
        if line.startswith(TIMED):
            _, what, name = line.split()
            current = name if what == "start" else None
            counts.setdefault(name, 0)
        elif current is not None and JIT_IN_SERVICE in line:
            counts[current] += 1
    return counts


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1000, 120000) for _ in range(length)] for _ in range(n)]


def _poll_running(llm, stop, out) -> None:
    while not stop.is_set():
        try:
            for m in llm.get_metrics():
                if m.name == "vllm:num_requests_running":
                    out[0] = max(out[0], int(m.value))
        except Exception:  # noqa: BLE001 - a metrics read that fails leaves the maximum as it is
            pass
        time.sleep(0.05)


def worker(spec: dict) -> dict:
    """One engine: the scenarios of its configuration, then the probe. Runs in a subprocess."""
    import threading

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              gpu_memory_utilization=spec["gpu_memory_utilization"], max_num_seqs=spec["max_num_seqs"],
              max_model_len=spec["max_model_len"], disable_log_stats=False)
    if spec["backend"].startswith("kvarn:"):
        kw["additional_config"] = {"kvarn": {"preset": spec["backend"].split(":", 1)[1]}}
    if spec.get("spec_decode"):
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2}
    llm = LLM(**kw)
    result = {"backend": spec["backend"], "kv_capacity_tokens": llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens,
              "rows": [], "probe": None}
    # Warm-up: prompts past the sink and the first tile, so every kernel of both backends (commits,
    # prefill, decode over records) is compiled before anything is timed.
    warm = SamplingParams(max_tokens=WARM[2], temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(*WARM[:2], 99)], warm, use_tqdm=False)
    for name in spec["scenarios"]:
        n, plen, new, _ = spec["sizes"][name]
        params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(n, plen, 1)]
        running, stop = [0], threading.Event()
        poller = threading.Thread(target=_poll_running, args=(llm, stop, running), daemon=True)
        poller.start()
        print(f"{TIMED} start {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        print(f"{TIMED} end {name}", file=sys.stderr, flush=True)
        stop.set()
        poller.join()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["rows"].append({"scenario": name, "requests": n, "prompt_tokens": plen, "new_tokens": new,
                               "finished": sum(1 for o in outs if len(o.outputs[0].token_ids) == new),
                               "seconds": elapsed, "tokens_per_s": tokens / elapsed, "max_running": running[0]})
        print(json.dumps({"progress": spec["backend"], **result["rows"][-1]}), file=sys.stderr, flush=True)
    if spec.get("probe"):
        n, plen, new = PROBE
        params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True, logprobs=0)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(n, plen, 7)], params, use_tqdm=False)
        result["probe"] = [{"tokens": list(o.outputs[0].token_ids),
                            "logprobs": [float(next(iter(lp.values())).logprob) if lp else None
                                         for lp in (o.outputs[0].logprobs or [])]} for o in outs]
    return result


def run_engine(spec: dict, timeout: int, logs: Path) -> dict:
    """One engine in a subprocess; its log (stderr) kept at ``logs``, its compiles in service counted."""
    name = f"{spec['backend'].replace(':', '_')}_{spec['max_num_seqs']}{'_spec' if spec.get('spec_decode') else ''}"
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True,
                              text=True, timeout=timeout)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:  # its streams may be bytes even with text=True
        text = (lambda x: x.decode() if isinstance(x, bytes) else (x or ""))
        stdout, stderr = text(e.stdout), text(e.stderr) + f"\nkilled after {timeout} s"
    (logs / f"{name}.log").write_text(stderr)
    line = next((x for x in reversed(stdout.splitlines()) if x.startswith("RESULT ")), None)
    if line is None:
        sys.stderr.write(stderr[-4000:])
        return {"backend": spec["backend"], "error": stderr[-2000:], "rows": [], "probe": None}
    result = json.loads(line[len("RESULT "):])
    compiles = compiles_in_timed_windows(stderr)
    for row in result["rows"]:
        row["compiles_in_service"] = compiles.get(row["scenario"], 0)
    return result


def compare_probe(ref, got, steps: int) -> dict:
    same, diffs, first = 0, [], []
    for a, b in zip(ref, got):
        k = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        first.append(k)
        same += k == len(a["tokens"])
        diffs += [abs(x - y) for x, y in zip(a["logprobs"][:min(k, steps)], b["logprobs"][:min(k, steps)])
                  if x is not None and y is not None]
    return {"identical": same, "prompts": len(ref), "first_divergence": first,
            "max_abs_logprob_diff": max(diffs) if diffs else None}


def merge(old: list, rows: list) -> list:
    """This call's rows over an earlier call's. A kvarn row replaces the earlier one of its
    (scenario, backend) pair. An earlier default row stays while a kvarn row is measured against it
    (its ``baseline_run``), or, with no kvarn row of its scenario, until a default of the scenario
    runs again. A dead engine's row names all its scenarios ("a,b"), and goes once any of them ran
    again."""
    def pairs(r):
        return {(name, r["backend"]) for name in r.get("scenario", "").split(",")}

    ran = set().union(*map(pairs, rows))
    kept = [r for r in old if r["backend"] != "default" and not pairs(r) & ran]
    needed = {(r["scenario"], r.get("baseline_run")) for r in kept + rows}
    measured = {r["scenario"] for r in kept + rows if r["backend"] != "default"}
    defaults = [r for r in old if r["backend"] == "default" and ((r["scenario"], r.get("run")) in needed
                                                                 or not pairs(r) & ran and r["scenario"] not in measured)]
    return defaults + kept + rows


def compare(rows: list, earlier: list) -> None:
    """Sets this call's rows' ratios: a kvarn row's against the default of its scenario in this call,
    else in ``earlier`` (the newest run: --skip-default), naming that row's run."""
    for r in rows:
        if "tokens_per_s" not in r:
            continue
        if r["backend"] == "default":
            r["vs_default"] = r["capacity_vs_default"] = 1.0
            continue
        bases = [x for x in rows + earlier if x.get("scenario") == r["scenario"] and x["backend"] == "default"
                 and "tokens_per_s" in x]
        if not bases:
            continue
        base = max(bases, key=lambda x: x.get("run", 0))
        r["baseline_run"] = base.get("run")
        r["vs_default"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["capacity_vs_default"] = (r["kv_capacity_tokens"] or 0) / max(base["kv_capacity_tokens"] or 1, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS),
                    help="none: only --spec, against the probe of an earlier call's --out (with --append)")
    ap.add_argument("--presets", nargs="*", default=["k4v2_g128", "k2v2_g128"], help="none: the default backend only")
    ap.add_argument("--sizes", nargs="*", default=[], help="override, e.g. reasoning=64x256+1024")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--logprob-steps", type=int, default=16)
    ap.add_argument("--spec", action="store_true", help="also KVarN with ngram speculative decoding")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per engine")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_gpu.json"))
    ap.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "bench_vllm_gpu",
                    help="each engine's log and the probes' tokens (--append reads the probes of earlier calls here)")
    ap.add_argument("--append", action="store_true",
                    help="keep --out's rows of other (scenario, backend) pairs and --logs' probes: a run split over "
                         "calls of one machine")
    ap.add_argument("--skip-default", action="store_true", help="run only the kvarn presets (with --append)")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    import torch
    import vllm

    sizes = dict(SCENARIOS)
    for item in args.sizes:
        m = re.fullmatch(r"(\w+)=(\d+)x(\d+)\+(\d+)", item)
        if m is None or m.group(1) not in SCENARIOS:
            ap.error(f"--sizes {item!r}: expected SCENARIO=REQUESTSxPROMPT+NEW with SCENARIO in {list(SCENARIOS)}")
        sizes[m.group(1)] = (int(m.group(2)), int(m.group(3)), int(m.group(4)), sizes[m.group(1)][3])
    old = json.loads(args.out.read_text()) if args.append and args.out.exists() else None
    run = 1 + max((r["run"] for r in old["meta"].get("runs", [])), default=0) if old else 1
    folder = Path(tempfile.mkdtemp(prefix="llama8b_"))
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    if args.skip_default and not args.presets:
        ap.error("--skip-default with no --presets runs nothing")
    if not args.scenarios and not (args.spec and args.append and args.presets):
        ap.error("no --scenarios runs only --spec, which needs --append (the probe without it) and a preset")
    if args.skip_default and not args.append:
        ap.error("--skip-default needs --append: the default backend's rows come from an earlier call's --out")
    logs = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    kvarn_backends = [f"kvarn:{p}" for p in args.presets]
    backends = ([] if args.skip_default else ["default"]) + kvarn_backends
    configs = {}  # max_num_seqs -> scenarios
    for name in args.scenarios:
        configs.setdefault(sizes[name][3], []).append(name)
    rows, probes = [], {}
    probe_len = max(sum(PROBE[1:]), sum(WARM[1:]))  # every engine runs the warm-up, a probing one the probe
    for seqs, names in sorted(configs.items()):
        longest = max(sizes[n][1] + sizes[n][2] for n in names)
        for backend in backends:
            spec = {"model": str(folder), "backend": backend, "scenarios": names, "sizes": sizes,
                    "max_num_seqs": seqs, "max_model_len": max(longest, probe_len) + 16,
                    "gpu_memory_utilization": args.gpu_memory_utilization, "probe": seqs == min(configs)}
            res = run_engine(spec, args.timeout, logs)
            for r in res["rows"]:
                rows.append({**r, "backend": backend, "max_num_seqs": seqs,
                             "kv_capacity_tokens": res.get("kv_capacity_tokens"), "run": run})
            if res.get("probe"):
                probes[backend] = {"run": run, "probe": res["probe"]}
            if "error" in res:
                rows.append({"scenario": ",".join(names), "backend": backend, "error": res["error"][-500:], "run": run})
            # what a call cut short leaves: the rows so far
            (logs / "partial.json").write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
    compare(rows, old["rows"] if old and args.skip_default else [])
    if old:
        rows = merge(old["rows"], rows)
        stored = logs / "probes.json"
        probes = {**(json.loads(stored.read_text()) if stored.exists() else {}), **probes}
    (logs / "probes.json").write_text(json.dumps(probes))
    logprobs = {**(old or {}).get("logprobs", {}),
                **{b: {**compare_probe(probes["default"]["probe"], p["probe"], args.logprob_steps), "run": p["run"]}
                   for b, p in probes.items() if b != "default" and "default" in probes}}
    spec_result = None
    if args.spec and kvarn_backends:
        seqs = min(configs) if configs else SCENARIOS["equal_load"][3]
        base = {"model": str(folder), "backend": kvarn_backends[0], "scenarios": [], "sizes": sizes, "max_num_seqs": seqs,
                "max_model_len": probe_len + 16,
                "gpu_memory_utilization": args.gpu_memory_utilization, "probe": True}
        res = run_engine({**base, "spec_decode": True}, args.timeout, logs)
        if res.get("probe") and kvarn_backends[0] in probes:
            spec_result = {"backend": kvarn_backends[0], "run": run,
                           **compare_probe(probes[kvarn_backends[0]]["probe"], res["probe"], 0)}
        else:
            spec_result = {"backend": kvarn_backends[0], "run": run, "error": res.get("error", "no probe")[-500:]}
    device, today = torch.cuda.get_device_name(0), time.strftime("%Y-%m-%d")
    meta = {"device": device, "vllm": vllm.__version__, "torch": torch.__version__,
            "model": "Llama-3.1-8B shape, dummy weights, bf16", "mode": "torch.compile + CUDA graphs (default)",
            "gpu_memory_utilization": args.gpu_memory_utilization, "date": today,
            "runs": (old["meta"].get("runs", []) if old else [])
            + [{"run": run, "command": "python " + " ".join(sys.argv), "device": device, "date": today}]}
    if old and spec_result is None:
        spec_result = old.get("spec_decode")
    # An engine that failed is a row with an error (or the speculative run's error).
    deaths = sum("error" in r for r in rows) + bool(spec_result and "error" in spec_result)
    out = {"meta": meta, "rows": rows, "logprobs": logprobs, "spec_decode": spec_result, "engine_deaths": deaths}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{meta['device']}, vLLM {meta['vllm']}, {meta['mode']}\n")
    print("| run | scenario | backend | requests | finished | tokens/s | vs default | KV capacity (tokens) | vs default | "
          "max running | compiles in service |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"| {r.get('run', '-')} | {r['scenario']} | {r['backend']} | error: engine died | | | | | | | |")
            continue
        print(f"| {r.get('run', '-')} | {r['scenario']} | {r['backend']} | {r['requests']} x ({r['prompt_tokens']} + {r['new_tokens']}) | "
              f"{r['finished']} | {r['tokens_per_s']:.0f} | {r.get('vs_default', 1):.2f}x | {r['kv_capacity_tokens']} | "
              f"{r.get('capacity_vs_default', 1):.2f}x | {r['max_running']} | {r.get('compiles_in_service', '-')} |")
    print(f"\nlogprobs vs default (first {args.logprob_steps} steps): {json.dumps(logprobs)}")
    print(f"speculative decoding (ngram, 4 tokens) vs none: {json.dumps(spec_result)}")
    print(f"engine deaths: {deaths}; engine logs: {logs}")


if __name__ == "__main__":
    main()
