"""CPU cost of kvarn-auto's decision: prefill time against the plain prefill, and decode steps.

For each model and prompt length, the median wall time of:

- ``fp16``: the prefill forward alone (transformers' DynamicCache), the reference cost;
- ``kvarn``: the prefill forward with KVarNCache(kvarn) plus the freeze that encodes the prompt's tiles;
- ``kvarn-auto``: the same with the prompt capture, the decision (:mod:`kvarn.auto`) and the
  flavoured encode;
- one decode step after the prefill, for kvarn and kvarn-auto (the read path is the same code).

The goal of the issue is ``kvarn-auto prefill <= 2 x fp16 prefill``; the table also gives the
decision's own share, ``(kvarn-auto - kvarn) / fp16``.

    python benchmarks/bench_auto_prefill.py --models smollm2-135m,gemma3-270m --lengths 512,2048 \
        --out benchmarks/results/auto_prefill_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(models: list[str], lengths: list[int], preset: str, text_path: str, repeats: int) -> list[dict]:
    from transformers import DynamicCache

    from kvarn import KVarNCache
    from kvarn import models as kv_models

    from kvarn.analysis.inputs import load_text

    text = load_text(text_path)
    rows = []
    for name in models:
        model, tok = kv_models.load(name)
        ids_all = tok(text[: max(lengths) * 16], return_tensors="pt").input_ids
        for n in lengths:
            ids = ids_all[:, :n]

            def fp16():
                with torch.no_grad():
                    model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)

            def prefill(method):
                def fn():
                    cache = KVarNCache(model, method, preset)
                    with torch.no_grad():
                        model(input_ids=ids, past_key_values=cache, use_cache=True)
                    cache.freeze()
                    return cache
                return fn

            def decode(method):
                cache = prefill(method)()
                step = ids[:, -1:]

                def fn():  # each call appends one token: a few tokens more context, negligible
                    with torch.no_grad():
                        model(input_ids=step, past_key_values=cache, use_cache=True)
                return fn

            t_fp = _median_time(fp16, repeats)
            t_kv = _median_time(prefill("kvarn"), repeats)
            t_auto = _median_time(prefill("kvarn-auto"), repeats)
            d_kv = _median_time(decode("kvarn"), repeats)
            d_auto = _median_time(decode("kvarn-auto"), repeats)
            rows.append({
                "model": name, "tokens": n, "preset": preset,
                "fp16_prefill_s": t_fp, "kvarn_prefill_s": t_kv, "kvarn_auto_prefill_s": t_auto,
                "auto_over_fp16": t_auto / t_fp, "decision_over_fp16": (t_auto - t_kv) / t_fp,
                "kvarn_decode_step_s": d_kv, "kvarn_auto_decode_step_s": d_auto,
            })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--preset", default="k2v2_g128")
    p.add_argument("--text", default="wikitext2", help="a bundled corpus (wikitext2, reasoning, book) or a file")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/auto_prefill_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = run(args.models.split(","), [int(x) for x in args.lengths.split(",")], args.preset, args.text,
               args.repeats)
    print(f"| model | tokens | fp16 prefill s | kvarn prefill+encode s | kvarn-auto s | auto / fp16 "
          f"| decision / fp16 | decode step kvarn / auto ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['fp16_prefill_s']:.2f} | {r['kvarn_prefill_s']:.2f} "
              f"| {r['kvarn_auto_prefill_s']:.2f} | {r['auto_over_fp16']:.2f} | {r['decision_over_fp16']:.2f} "
              f"| {1e3 * r['kvarn_decode_step_s']:.0f} / {1e3 * r['kvarn_auto_decode_step_s']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "torch": torch.__version__, "machine": platform.machine(),
            "repeats": args.repeats, "note": "shared 2-core CPU box; other work was running"}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
