"""End to end: decode tokens/s of a random-weight Llama-3.1-8B-shaped model through ``generate``.

Caches: transformers' fp16 ``DynamicCache`` (concatenates every step), fp16 ``StaticCache``
(preallocated), and kvarn fused (``attn_implementation="kvarn"`` over ``KVarNCache`` packed tiles).
The history of ``context`` tokens is written straight into each cache (random K/V: speed does not
depend on values), then ``generate`` runs ``--new`` greedy tokens; the step time is the median gap
between CUDA events recorded by a logits processor at each step (no host synchronization).
Also: peak GPU memory during decode, KV bytes (measured and docs/algorithm.md section 4), the flush's share of a
step (with ``--flush-json`` from bench_flush.py), and the largest batch x context whose KV fits
in 100 GiB. Prints tables, writes JSON, asserts nothing.

    PYTHONPATH=. python benchmarks/bench_e2e.py --out results/e2e.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, StaticCache

from kvarn.config import KVarNConfig
from kvarn.integrations import hf_attention

LAYERS, HQ, HK, D = 32, 32, 8, 128
GIB = 1 << 30


def build_model():
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
                      num_attention_heads=HQ, num_key_value_heads=HK, head_dim=D, max_position_embeddings=131072,
                      rope_theta=500000.0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cuda").half().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    with torch.device("cuda"):  # buffers (inv_freq) are not parameters: rebuild them for real
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


class StepClock(LogitsProcessor):
    """Records a CUDA event per step, and the peak memory of each step (the first step, which
    processes the uncached prompt token and builds generate's state, apart from the steady ones)."""

    def __init__(self):
        self.events, self.peaks = [], []

    def __call__(self, input_ids, scores):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.events.append(e)
        self.peaks.append(torch.cuda.max_memory_allocated())  # a host read of an allocator counter: no sync
        torch.cuda.reset_peak_memory_stats()
        return scores


def fill(cache, b, t, dtype=torch.float16):
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(LAYERS):
        k = torch.randn(b, HK, t, D, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(b, HK, t, D, device="cuda", dtype=dtype, generator=g)
        cache.update(k, v, i)
        del k, v
    if hasattr(cache, "freeze"):
        cache.freeze()  # encode the filled history into tiles now (the first decode step would)


def kv_bytes(kind, cache):
    if kind.startswith("kvarn"):
        rep = cache.memory_report()["total"]
        return rep["total_bytes"], rep["reserved_bytes"]
    n = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers) * 2
    return n, n


def spec_bytes(kind, b, t):
    """Spec section 4 bytes of the history: records for full tiles past the sink, fp16 sink + tail."""
    if not kind.startswith("kvarn"):
        return b * t * LAYERS * HK * D * 4
    cfg = KVarNConfig.from_name(kind.split(":")[1])
    n = (t - cfg.sink_tokens) // cfg.tile
    fp_tokens = t - n * cfg.tile
    return b * LAYERS * HK * (n * cfg.record_bytes(D) + fp_tokens * D * 4)


def run_one(model, kind, b, t, new):
    torch.cuda.empty_cache()
    if kind == "fp16_dynamic":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    elif kind == "fp16_static":
        model.set_attn_implementation("sdpa")
        cache = StaticCache(config=model.config, max_cache_len=t + new + 8)
    else:
        model.set_attn_implementation("kvarn")
        cache = hf_attention.fused_cache(model, kind.split(":")[1])
    fill(cache, b, t)
    stored, reserved = kv_bytes(kind, cache)
    ids = torch.randint(0, 1000, (b, t + 1), device="cuda")
    clock = StepClock()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        model.generate(ids, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       logits_processor=[clock], attention_mask=torch.ones_like(ids))
    torch.cuda.synchronize()
    gaps = [a.elapsed_time(c) for a, c in zip(clock.events[3:-1], clock.events[4:])]
    step = statistics.median(gaps) * 1e-3
    row = {"cache": kind, "batch": b, "context": t, "step_ms": step * 1e3, "tokens_per_s": b / step,
           "peak_gib": max(clock.peaks + [torch.cuda.max_memory_allocated()]) / GIB,
           "peak_first_step_gib": clock.peaks[0] / GIB, "peak_later_steps_gib": max(clock.peaks[1:]) / GIB,
           "allocated_before_gib": before / GIB, "kv_gib": stored / GIB,
           "kv_reserved_gib": reserved / GIB, "kv_spec_gib": spec_bytes(kind, b, t) / GIB}
    row["kv_over_spec"] = stored / spec_bytes(kind, b, t)
    del cache
    return row


def capacity(contexts, budget=100 * GIB):
    out = []
    for kind in ("fp16", "kvarn:k4v2_g128", "kvarn:k2v2_g128"):
        for t in contexts:
            per_seq = spec_bytes(kind, 1, t)
            if kind.startswith("kvarn"):  # worst case: a full tail of G tokens beside the sink
                per_seq += LAYERS * HK * 128 * D * 4
            out.append({"cache": kind, "context": t, "max_batch": int(budget // per_seq),
                        "gib_per_seq": per_seq / GIB})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--caches", nargs="+", default=["fp16_dynamic", "fp16_static", "kvarn:k4v2_g128", "kvarn:k2v2_g128"])
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--flush-json", default=None)
    ap.add_argument("--out", default="benchmarks/results/e2e.json")
    a = ap.parse_args()
    hf_attention.register()
    model = build_model()
    rows = []
    for t in a.contexts:
        for b in a.batches:
            for kind in a.caches:
                try:
                    row = run_one(model, kind, b, t, a.new)
                except Exception as exc:  # a failed row is reported, the others still run
                    row = {"cache": kind, "batch": b, "context": t, "error": f"{type(exc).__name__}: {exc}"[:300]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    flush = []
    if a.flush_json:
        with open(a.flush_json) as fh:
            fl = json.load(fh)["rows"]
        for r in rows:
            if r.get("cache", "").startswith("kvarn") and "step_ms" in r:
                preset = r["cache"].split(":")[1]
                match = [f for f in fl if f["preset"] == preset and f["batch"] == r["batch"]]
                if match:
                    us = match[0]["triton_us"]
                    flush.append({"cache": r["cache"], "batch": r["batch"], "context": r["context"], "flush_us": us,
                                  "step_ms": r["step_ms"], "share_of_step": us * 1e-3 / r["step_ms"]})
    cap = capacity([8192, 32768, 131072])
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "transformers": transformers.__version__,
                   "rows": rows, "flush_share": flush, "capacity_100gib": cap}, fh, indent=1)
    print("| context | B | cache | step ms | tokens/s | vs fp16 static | vs fp16 dynamic | peak GiB | KV GiB (spec) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" not in r:
            print(f"| {r['context']} | {r['batch']} | {r['cache']} | {r['error'][:40]} |")
            continue
        base = {x["cache"]: x for x in rows if x["context"] == r["context"] and x["batch"] == r["batch"] and "step_ms" in x}
        rs = base.get("fp16_static", {}).get("step_ms", float("nan")) / r["step_ms"]
        rd = base.get("fp16_dynamic", {}).get("step_ms", float("nan")) / r["step_ms"]
        print(f"| {r['context']} | {r['batch']} | {r['cache']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{rs:.2f}x | {rd:.2f}x | {r['peak_gib']:.1f} | {r['kv_gib']:.2f} ({r['kv_spec_gib']:.2f}) |")
    for f in flush:
        print(f"flush {f['cache']} B={f['batch']} ctx={f['context']}: {f['flush_us']:.0f} us = "
              f"{100 * f['share_of_step']:.2f}% of a {f['step_ms']:.2f} ms step")
    for c in cap:
        print(f"100 GiB: {c['cache']} context {c['context']}: max batch {c['max_batch']}")


if __name__ == "__main__":
    main()
