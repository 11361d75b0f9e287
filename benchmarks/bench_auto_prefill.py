"""CPU cost of kvarn-auto's decision: prefill time against the plain prefill, and decode steps.

For each model and prompt length, the median wall time of:

- ``fp16``: the prefill forward alone (transformers' DynamicCache), the reference cost;
- ``kvarn``: the prefill forward with KVarNCache(kvarn) plus the freeze that encodes the prompt's tiles;
- ``kvarn-auto`` (its default rule, a2): the same with the prompt capture, the per-head decision
  (:mod:`kvarn.auto`) and the flavoured encode;
- ``kvarn-auto r3`` (an option): the same plus the self-test (:mod:`kvarn.auto.self_test_rule`: the candidate
  policies run as one batch over two tiles of the prompt);
- one decode step after the prefill, for kvarn and kvarn-auto (the read path is the same code),
  also round-robin.

The goal is ``kvarn-auto prefill <= 2 x fp16 prefill``; the table also gives the
decision's own share, ``(kvarn-auto - kvarn) / fp16``. The prefills are timed round-robin and the
ratios are medians over rounds of same-round ratios, so that other work on a shared machine
loads every variant alike; the load average before and after is recorded (run it idle).

    python benchmarks/bench_auto_prefill.py --models smollm2-135m,gemma3-270m --lengths 512,2048 \
        --out benchmarks/results/auto_prefill_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch


def _interleaved(fns: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median time of each function, timed round-robin (one call of each per round, after a warm-up
    round), so that load from other work on a shared machine falls on all of them alike; and the
    median over rounds of each one's time over the first one's in the same round."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    ref = next(iter(fns))
    ratios = {k: statistics.median(a / b for a, b in zip(times[k], times[ref])) for k in fns}
    return {k: statistics.median(v) for k, v in times.items()}, ratios


def run(models: list[str], lengths: list[int], preset: str, text_path: str, repeats: int) -> list[dict]:
    from transformers import DynamicCache

    from kvarn import KVarNCache
    from kvarn import models as kv_models
    from kvarn.auto import AutoSettings

    from kvarn.analysis.inputs import load_text

    text = load_text(text_path)
    rows = []
    for name in models:
        model, tok = kv_models.load(name)
        ids_all = tok(text[: max(lengths) * 16], return_tensors="pt").input_ids
        for n in lengths:
            ids = ids_all[:, :n]

            # logits_to_keep=1, as generate's prefill asks (Gemma's 262K-token head over every
            # position would otherwise cost about as much as the rest of its forward).
            def fp16():
                with torch.no_grad():
                    model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)

            def prefill(method, rule=None):
                kw = {} if rule is None else {"auto": AutoSettings(rule=rule)}

                def fn():
                    cache = KVarNCache(model, method, preset, **kw)
                    with torch.no_grad():
                        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
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

            t, ratio = _interleaved({"fp16": fp16, "kvarn": prefill("kvarn"), "auto": prefill("kvarn-auto"),
                                     "r3": prefill("kvarn-auto", "r3")}, repeats)
            t_fp, t_kv, t_auto, t_r3 = t["fp16"], t["kvarn"], t["auto"], t["r3"]
            # Decode steps round-robin too, more of them (a step is short); same read path, so ~1.0.
            d, d_ratio = _interleaved({"kvarn": decode("kvarn"), "auto": decode("kvarn-auto")}, 5 * repeats)
            d_kv, d_auto = d["kvarn"], d["auto"]
            rows.append({
                "model": name, "tokens": n, "preset": preset, "default_rule": AutoSettings().rule,
                "max_queries": AutoSettings().max_queries,
                "fp16_prefill_s": t_fp, "kvarn_prefill_s": t_kv, "kvarn_auto_prefill_s": t_auto,
                "kvarn_auto_r3_prefill_s": t_r3,
                "auto_over_fp16": ratio["auto"], "r3_over_fp16": ratio["r3"], "kvarn_over_fp16": ratio["kvarn"],
                "decision_over_fp16": ratio["auto"] - ratio["kvarn"],
                "kvarn_decode_step_s": d_kv, "kvarn_auto_decode_step_s": d_auto,
                "auto_over_kvarn_decode": d_ratio["auto"],
                "loadavg": os.getloadavg(),
            })
            logging.getLogger(__name__).info("%s", rows[-1])
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
    p.add_argument("--note", default="", help="free text stored with the results (for example the machine's state)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = run(args.models.split(","), [int(x) for x in args.lengths.split(",")], args.preset, args.text,
               args.repeats)
    load_after = os.getloadavg()
    print("| model | tokens | fp16 prefill s | kvarn prefill+encode s | kvarn-auto s | kvarn-auto r3 s "
          "| kvarn / fp16 | kvarn-auto / fp16 | r3 / fp16 | decode step kvarn / auto ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['fp16_prefill_s']:.2f} | {r['kvarn_prefill_s']:.2f} "
              f"| {r['kvarn_auto_prefill_s']:.2f} | {r['kvarn_auto_r3_prefill_s']:.2f} | {r['kvarn_over_fp16']:.2f} "
              f"| {r['auto_over_fp16']:.2f} | {r['r3_over_fp16']:.2f} "
              f"| {1e3 * r['kvarn_decode_step_s']:.0f} / {1e3 * r['kvarn_auto_decode_step_s']:.0f} |")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"threads": args.threads, "torch": torch.__version__, "machine": platform.machine(),
            "repeats": args.repeats, "note": args.note, "loadavg_before": load_before, "loadavg_after": load_after}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
