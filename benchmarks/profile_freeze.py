"""Profile: which kernels the freeze steps stretch, against a plain step (issue 12).

On the ``bench_e2e`` model (random-weight Llama-3.1-8B shape, fp16, ``kvarn_graph`` cache), greedy
decoding with ``decode_greedy`` under torch's profiler (CUPTI reports the kernels of each replayed
CUDA graph under the graph launch's correlation id). Each replay is tagged with its step kind
(plain, fill, flush), and for each kind the table gives the replay's GPU span and, per kernel
family (GEMMs, decode attention, encoder, append, the rest), the kernels' count and summed time:
the family that grows in the fill or flush step is the one the side-stream encodes slow down (or
that reads more: the fill step's longest fp16 tail). Sums exceed the span where kernels overlap
(the encodes run on a side stream). Plain steps: the median of the profiled ones; fill and flush:
each replayed freeze (the first freeze also captures its graphs and is not replayed). The profiled
windows run from 12 steps before a tile completes to 8 after its freeze, so the plain steps are
those of the longest and the shortest tails; the JSON keeps every replay in order. On the H200
(torch 2.11) the first window came back with no kernel timings (the script says so and goes on), so
with ``--new 272`` one freeze is reported.

    PYTHONPATH=. python benchmarks/profile_freeze.py --context 8192 --out benchmarks/results/profile_freeze_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

FAMILIES = (  # (family, substrings of the kernel name), first match wins
    ("encode", ("_encode_tiles_kernel",)),
    ("attention", ("_decode_attention_kernel",)),
    ("append", ("_append_tail_kernel",)),
    ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k.lower() in low for k in keys):
            return fam
    return "other"


def replays(trace: dict) -> list[dict]:
    """Per tagged replay, in order: its kind, GPU span (µs) and per-family (count, summed µs).

    A replay is a host range ``replay:KIND`` (recorded around ``_Graphs._replay``); the graph launch
    inside it (a runtime event whose name contains ``GraphLaunch``) carries a correlation id that
    every kernel of that replay shares.
    """
    events = trace.get("traceEvents", [])
    ranges = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"].split(":", 1)[1]) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and str(e.get("name", "")).startswith("replay:"))
    launches = [e for e in events if e.get("ph") == "X" and "GraphLaunch" in str(e.get("name", ""))]
    kernels: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            kernels.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    out = []
    for t0, t1, kind in ranges:
        inside = [e for e in launches if t0 <= e["ts"] <= t1]
        ks = [k for e in inside for k in kernels.get(e.get("args", {}).get("correlation"), [])]
        if not ks:
            continue
        fams: dict = {}
        for k in ks:
            c, s = fams.get(family(k["name"]), (0, 0.0))
            fams[family(k["name"])] = (c + 1, s + k.get("dur", 0))
        span = max(k["ts"] + k.get("dur", 0) for k in ks) - min(k["ts"] for k in ks)
        out.append({"kind": kind, "span_us": span, "families": fams})
    return out


def summarize(rows: list[dict]) -> list[dict]:
    """Plain replays reduced to their median (span and each family's sum); each fill and flush kept."""
    plain = [r for r in rows if r["kind"] == "plain"]
    out = []
    if plain:
        fams = sorted({f for r in plain for f in r["families"]})
        out.append({"kind": f"plain (median of {len(plain)})",
                    "span_us": statistics.median(r["span_us"] for r in plain),
                    "families": {f: (round(statistics.median(r["families"].get(f, (0, 0))[0] for r in plain)),
                                     statistics.median(r["families"].get(f, (0, 0.0))[1] for r in plain))
                                 for f in fams}})
    out += [r for r in rows if r["kind"] != "plain"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--new", type=int, default=272)
    ap.add_argument("--out", default="benchmarks/results/profile_freeze.json")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if not torch.cuda.is_available():
        sys.exit("profile_freeze needs a CUDA device: it profiles replayed CUDA graphs")
    import bench_e2e as be
    from kvarn.integrations import hf_attention, hf_graph

    own_replay = hf_graph._Graphs._replay

    def tagged(self, kind):
        with record_function(f"replay:{kind}"):
            own_replay(self, kind)

    hf_graph._Graphs._replay = tagged
    torch.manual_seed(0)
    hf_attention.register()
    model = be.build_model("llama8b", "cuda")
    cfg = model.config
    t = a.context - a.new // 2
    cache, _ = be.make_cache(model, f"kvarn_graph:{a.preset}", t + a.new + 8)
    be.fill(cache, cfg, a.batch, t, 4096, "cuda")
    ids = torch.randint(0, 1000, (a.batch, 1), device="cuda")
    layer = cache.layers[0]
    windows, live = [], []

    def on_step(i: int) -> None:
        """Profile from 12 steps before each tile completion to 8 steps after its freeze, once the
        graphs are captured (the first completion captures the fill and flush graphs)."""
        tail = layer.tail_len[0]
        if not live and i > 20 and tail == layer.tile - 12:
            live.append(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
            live[0].start()
        elif live and tail == 8:
            torch.cuda.synchronize()
            live[0].stop()
            windows.append(live.pop())

    torch.cuda.synchronize()
    with torch.no_grad():
        hf_graph.decode_greedy(model, cache, ids, a.new, on_step=on_step)
    if live:
        torch.cuda.synchronize()
        live[0].stop()
        windows.append(live.pop())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, prof in enumerate(windows):
            path = os.path.join(tmp, f"trace{n}.json")
            prof.export_chrome_trace(path)
            with open(path) as fh:
                trace = json.load(fh)
            got = replays(trace)
            if not got:  # say what the trace holds, to see why nothing matched
                ev = trace.get("traceEvents", [])
                cats = {}
                for e in ev:
                    cats[e.get("cat")] = cats.get(e.get("cat"), 0) + 1
                sample = [e for e in ev if e.get("cat") == "kernel"][:2]
                print(f"window {n}: no tagged replay with kernels; categories {cats}; kernels e.g. {sample}")
            rows += got
    if not any(r["kind"] != "plain" for r in rows):
        sys.exit("no replayed fill or flush step in the trace (use --new of at least two tiles)")
    summary = summarize(rows)
    fams = ["gemm", "attention", "encode", "append", "other"]
    print(f"context {a.context} x B {a.batch}, {a.preset}: µs (kernels)")
    print("| step | GPU span µs | " + " | ".join(fams) + " |")
    print("|---|---|" + "---|" * len(fams))
    for r in summary:
        cells = [f"{r['families'].get(f, (0, 0))[1]:.0f} ({r['families'].get(f, (0, 0))[0]})" for f in fams]
        print(f"| {r['kind']} | {r['span_us']:.0f} | " + " | ".join(cells) + " |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a),
                   "replays": rows, "summary": summary}, fh, indent=1)


if __name__ == "__main__":
    main()
