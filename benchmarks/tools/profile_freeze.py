"""Profile: which kernels the freeze steps stretch, against a plain step.

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

Then each fill and flush replay is compared kernel by kernel with its neighbouring plain replay
(``freeze_trace.compare``): the step's own kernels paired by name and occurrence, each one's time in both, whether an
encode ran beside it, the idle gaps on the step's stream (a wait on a side-stream event shows as a
longer gap), the kernels only the freeze step has, and the idle time between one replay's last
kernel and the next one's first (what a step-to-step clock like ``bench_e2e``'s sees beyond the
span).

    PYTHONPATH=. python benchmarks/tools/profile_freeze.py --context 8192 --out benchmarks/results/profile_freeze_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # freeze_trace beside it, bench_e2e in benchmarks/

from freeze_trace import comparisons, replays, summarize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--new", type=int, default=272)
    ap.add_argument("--no-lead-in", action="store_true",
                    help="without freeze_schedule.lead_in's empty launch ahead of each fork's encodes (its A/B)")
    ap.add_argument("--out", default="benchmarks/results/profile_freeze.json")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if not torch.cuda.is_available():
        sys.exit("profile_freeze needs a CUDA device: it profiles replayed CUDA graphs")
    import bench_e2e as be
    from kvarn.integrations.transformers import freeze_schedule, attention as hf_attention, graph as hf_graph

    if a.no_lead_in:
        freeze_schedule.lead_in = lambda device: None
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
    versus = comparisons(rows)
    print("| replay | GPU span µs | idle before it µs | to the next replay's first kernel µs |")
    print("|---|---|---|---|")
    for r in rows:
        lead = "-" if r["lead_in_us"] is None else f"{r['lead_in_us']:.1f}"
        nxt = "-" if r["interval_us"] is None else f"{r['interval_us']:.0f}"
        print(f"| {r['kind']} | {r['span_us']:.0f} | {lead} | {nxt} |")
    keep = {i for c in versus for i in (c["index"], c["plain_index"])}
    for i, r in enumerate(rows):  # the compared replays keep their kernels, to check the pairing
        if i not in keep:
            r.pop("kernels", None)
    fams = ["gemm", "attention", "encode", "append", "other"]
    print(f"context {a.context} x B {a.batch}, {a.preset}: µs (kernels)")
    print("| step | GPU span µs | " + " | ".join(fams) + " |")
    print("|---|---|" + "---|" * len(fams))
    for r in summary:
        cells = [f"{r['families'].get(f, (0, 0))[1]:.0f} ({r['families'].get(f, (0, 0))[0]})" for f in fams]
        print(f"| {r['kind']} | {r['span_us']:.0f} | " + " | ".join(cells) + " |")
    for c in versus:
        print(f"\n{c['kind']} against its neighbouring plain step: span {c['span_plain_us']:.0f} -> "
              f"{c['span_freeze_us']:.0f} µs; encodes busy {c['encode_busy_us']:.0f} µs; "
              f"step-stream kernels {c['step_kernels'][0]} / {c['step_kernels'][1]}, {c['paired']} paired, "
              f"unpaired {c['unpaired_extra_us']:+.0f} µs")
        print("| step-stream kernels | count | plain µs | freeze µs | excess µs |")
        print("|---|---|---|---|---|")
        for name, f in c["families"].items():
            print(f"| {name} | {f['count']} | {f['plain_us']:.0f} | {f['freeze_us']:.0f} | "
                  f"{f['freeze_us'] - f['plain_us']:+.0f} |")
        g = c["gaps"]
        print(f"| idle gaps on the step's stream | | {g['plain_us']:.0f} | "
              f"{g['freeze_us']:.0f} | {g['freeze_us'] - g['plain_us']:+.0f} |")
        print(f"longest extra gaps (µs, before a kernel of): {c['longest_extra_gaps_us']}")
        print(f"kernels the freeze step has beyond the plain one (net count): {c['unpaired_kernels']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a),
                   "replays": rows, "summary": summary,
                   "versus_plain": versus}, fh, indent=1)


if __name__ == "__main__":
    main()
