"""Where a vLLM engine's time goes, step by step and op by op, for one backend and one load.

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine core's steps run
here), vLLM's default mode (torch.compile and CUDA graphs), the dummy-weight Llama-3.1-8B shape of
``bench_vllm_gpu.py``. After a warm-up, one ``generate`` of REQUESTS x (PROMPT + NEW) runs with
every engine step timed (and its scheduled tokens and rows recorded), then a shorter one under
``torch.profiler``. Prints per-phase step times (steps that prefill, steps that only decode) and the
ops that take the most GPU and host time; writes ``steps.json`` and ``ops.txt`` to ``--out``.

    python benchmarks/tools/profile_vllm.py --backend kvarn:k4v2_g128 --load 64x2000+32 --out /tmp/prof

Run it on the GPU machine with vLLM staged (``../shared/tools/vllm_gpu/README.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_vllm_gpu import LLAMA_8B, prompts  # noqa: E402


def _timed_steps(llm, record: list) -> None:
    """Time every engine step and note what the scheduler gave it (tokens, rows)."""
    core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
    schedule, step = core.scheduler.schedule, core.step_fn
    last = {}

    def scheduled(*a, **kw):
        out = schedule(*a, **kw)
        last["tokens"], last["rows"] = out.total_num_scheduled_tokens, len(out.num_scheduled_tokens)
        return out

    def timed(*a, **kw):
        last.clear()
        t0 = time.perf_counter()
        out = step(*a, **kw)
        record.append({"seconds": time.perf_counter() - t0, **last})
        return out

    core.scheduler.schedule = scheduled
    core.step_fn = timed


def summarize(steps: list[dict]) -> dict:
    phases = {"prefill": [s for s in steps if s.get("tokens", 0) > s.get("rows", 0)],
              "decode": [s for s in steps if 0 < s.get("tokens", 0) == s.get("rows", 0)]}
    return {name: {"steps": len(xs), "seconds": sum(x["seconds"] for x in xs),
                   "ms_per_step": 1e3 * sum(x["seconds"] for x in xs) / max(len(xs), 1),
                   "tokens": sum(x["tokens"] for x in xs)} for name, xs in phases.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="kvarn:k4v2_g128", help="default | kvarn:PRESET")
    ap.add_argument("--load", default="64x2000+32", help="REQUESTSxPROMPT+NEW")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--profile-load", default="16x2000+4", help="the load run under torch.profiler")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("profile_vllm"))
    a = ap.parse_args()
    loads = []
    for item in (a.load, a.profile_load):
        m = re.fullmatch(r"(\d+)x(\d+)\+(\d+)", item)
        if m is None:
            ap.error(f"load {item!r}: expected REQUESTSxPROMPT+NEW, e.g. 64x2000+32")
        loads.append(tuple(int(x) for x in m.groups()))
    if a.backend != "default" and not a.backend.startswith("kvarn:"):
        ap.error(f"--backend {a.backend!r}: expected 'default' or 'kvarn:PRESET'")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder = Path(tempfile.mkdtemp(prefix="llama8b_"))
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    longest = max(p + n for _, p, n in loads) + 16
    kw = dict(model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              gpu_memory_utilization=a.gpu_memory_utilization, max_num_seqs=a.max_num_seqs, max_model_len=longest)
    if a.backend.startswith("kvarn:"):
        kw["additional_config"] = {"kvarn": {"preset": a.backend.split(":", 1)[1]}}
    llm = LLM(**kw)

    def run(n, plen, new, seed):
        params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(n, plen, seed)], params, use_tqdm=False)

    run(*loads[1], 99)  # warm-up: every kernel variant of the load's shapes compiled
    steps: list[dict] = []
    _timed_steps(llm, steps)
    t0 = time.perf_counter()
    run(*loads[0], 1)
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(*loads[1], 2)
        torch.cuda.synchronize()
    ev = prof.key_averages()
    tables = [ev.table(sort_by="cuda_time_total", row_limit=a.top, max_name_column_width=70),
              ev.table(sort_by="cpu_time_total", row_limit=a.top, max_name_column_width=70)]
    summary = {"backend": a.backend, "load": a.load, "wall_seconds": wall, "phases": summarize(steps),
               "device": torch.cuda.get_device_name(0)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "steps.json").write_text(json.dumps({**summary, "steps": steps}, indent=1))
    (a.out / "ops.txt").write_text("\n\n".join(tables))
    print(json.dumps(summary, indent=1))
    print(tables[0])


if __name__ == "__main__":
    main()
