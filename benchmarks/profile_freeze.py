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

Then each fill and flush replay is compared kernel by kernel with its neighbouring plain replay
(:func:`compare`): the step's own kernels aligned by name, each one's time in both, whether an
encode ran beside it, the idle gaps on the step's stream (a wait on a side-stream event shows as a
longer gap), the kernels only the freeze step has, and the idle time between one replay's last
kernel and the next one's first (what a step-to-step clock like ``bench_e2e``'s sees beyond the
span).

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
        t0k = min(k["ts"] for k in ks)
        line = sorted((k["name"], k["ts"] - t0k, k.get("dur", 0)) for k in ks)
        out.append({"kind": kind, "span_us": span, "families": fams,
                    "kernels": sorted(line, key=lambda k: k[1]), "start": t0k, "end": t0k + span})
    # What a step-to-step clock (bench_e2e's events) sees beyond the span: the idle time between the
    # previous replay's last kernel and this one's first (graph launch, the join of the side stream).
    for prev, r in zip([None] + out[:-1], out):
        r["lead_in_us"] = r["start"] - prev["end"] if prev is not None else None
    for r, nxt in zip(out, out[1:] + [None]):
        r["interval_us"] = nxt["start"] - r["start"] if nxt is not None else None
    for r in out:
        del r["start"], r["end"]
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, union: list[tuple[float, float]]) -> float:
    """The part of [a, b] inside the union of intervals (µs)."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in union)


def compare(plain: dict, freeze: dict) -> dict:
    """What a freeze replay spends beyond a plain replay, kernel by kernel on the step's stream.

    The step's own kernels (all but the encoder's, which run on the side stream) are aligned by
    name between the two replays (``difflib``; the freeze step's extra kernels are counted apart).
    For each aligned kernel: its duration in each, the idle gap before it on the step's stream in
    each (a wait on a side-stream event, or launch latency), and the share of its duration during
    which an encode ran. The excess of the freeze step's span is split into: kernels slowed while
    an encode ran beside them ("overlapped": at least half their time), kernels slowed without one,
    longer gaps (with and without an encode running), and extra kernels.
    """
    import difflib

    def split(r):
        main = [k for k in r["kernels"] if family(k[0]) != "encode"]
        enc = [(k[1], k[1] + k[2]) for k in r["kernels"] if family(k[0]) == "encode"]
        return main, _union(enc)

    mp, _ = split(plain)
    mf, enc = split(freeze)
    sm = difflib.SequenceMatcher(a=[k[0] for k in mp], b=[k[0] for k in mf], autojunk=False)
    rows = []  # (family, overlapped share, dur plain, dur freeze, gap plain, gap freeze)
    extra, extra_names = 0.0, {}
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                gp = mp[i][1] - (mp[i - 1][1] + mp[i - 1][2]) if i else 0.0
                gf = mf[j][1] - (mf[j - 1][1] + mf[j - 1][2]) if j else 0.0
                a, d = mf[j][1], mf[j][2]
                ov = _covered(a, a + d, enc) / d if d > 0 else 0.0
                gov = _covered(a - max(gf, 0.0), a, enc) / gf if gf > 0 else 0.0
                rows.append((family(mf[j][0]), ov, mp[i][2], mf[j][2], max(gp, 0.0), max(gf, 0.0), gov))
        else:
            extra += sum(k[2] for k in mf[j1:j2]) - sum(k[2] for k in mp[i1:i2])
            for k in mf[j1:j2]:
                extra_names[k[0][:60]] = extra_names.get(k[0][:60], 0) + 1
            for k in mp[i1:i2]:
                extra_names[k[0][:60]] = extra_names.get(k[0][:60], 0) - 1
    def total(sel, col):
        return sum(r[col] for r in rows if sel(r))
    out = {"span_plain_us": plain["span_us"], "span_freeze_us": freeze["span_us"],
           "encode_busy_us": sum(b - a for a, b in enc), "aligned": len(rows),
           "unaligned_extra_us": extra, "families": {}}
    for fam in sorted({r[0] for r in rows}):
        for name, sel in (("overlapped", lambda r, f=fam: r[0] == f and r[1] >= 0.5),
                          ("alone", lambda r, f=fam: r[0] == f and r[1] < 0.5)):
            n = sum(1 for r in rows if sel(r))
            if n:
                out["families"][f"{fam} {name}"] = {"count": n, "plain_us": total(sel, 2),
                                                    "freeze_us": total(sel, 3)}
    out["gaps"] = {"plain_us": total(lambda r: True, 4), "freeze_us": total(lambda r: True, 5),
                   "freeze_with_encode_us": sum(r[5] * r[6] for r in rows)}
    waits = sorted(((r[5] - r[4], r[0]) for r in rows), reverse=True)[:8]
    out["unaligned_kernels"] = {n: c for n, c in sorted(extra_names.items(), key=lambda x: -abs(x[1]))
                                if c}  # net count: freeze step's minus plain step's
    out["longest_extra_gaps_us"] = [[round(w, 1), f] for w, f in waits]
    return out


def comparisons(rows: list[dict]) -> list[dict]:
    """Each fill and flush replay against its nearest plain replay (the tail decides the
    attention's time: the fill step against the plain step before it, the flush step against the
    one after it)."""
    out = []
    for n, r in enumerate(rows):
        if r["kind"] == "plain" or "kernels" not in r:
            continue
        order = range(n - 1, -1, -1) if r["kind"] == "fill" else range(n + 1, len(rows))
        ref = next((rows[m] for m in order if rows[m]["kind"] == "plain"), None)
        if ref is not None:
            out.append({"kind": r["kind"], **compare(ref, r)})
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
    versus = comparisons(rows)
    print("| replay | GPU span µs | idle before it µs | to the next replay's first kernel µs |")
    print("|---|---|---|---|")
    for r in rows:
        lead = "-" if r["lead_in_us"] is None else f"{r['lead_in_us']:.1f}"
        nxt = "-" if r["interval_us"] is None else f"{r['interval_us']:.0f}"
        print(f"| {r['kind']} | {r['span_us']:.0f} | {lead} | {nxt} |")
    for r in rows:
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
              f"{c['aligned']} kernels aligned, extra kernels {c['unaligned_extra_us']:+.0f} µs")
        print("| step-stream kernels | count | plain µs | freeze µs | excess µs |")
        print("|---|---|---|---|---|")
        for name, f in c["families"].items():
            print(f"| {name} | {f['count']} | {f['plain_us']:.0f} | {f['freeze_us']:.0f} | "
                  f"{f['freeze_us'] - f['plain_us']:+.0f} |")
        g = c["gaps"]
        print(f"| idle gaps (encode beside: {g['freeze_with_encode_us']:.0f}) | | {g['plain_us']:.0f} | "
              f"{g['freeze_us']:.0f} | {g['freeze_us'] - g['plain_us']:+.0f} |")
        print(f"longest extra gaps (µs, before a kernel of): {c['longest_extra_gaps_us']}")
        print(f"kernels the freeze step has beyond the plain one (net count): {c['unaligned_kernels']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "args": vars(a),
                   "replays": rows, "summary": summary,
                   "versus_plain": versus}, fh, indent=1)


if __name__ == "__main__":
    main()
