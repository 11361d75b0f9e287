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
(:func:`compare`): the step's own kernels paired by name and occurrence, each one's time in both, whether an
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
    """Per tagged replay, in order: its kind, GPU span (µs), per-family (count, summed µs), its
    kernels (``[name, start µs from the replay's first kernel, µs, stream]``, by start), and the
    idle time before it and to the next replay's first kernel (:func:`main`).

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
        first = min(k["ts"] for k in ks)
        span = max(k["ts"] + k.get("dur", 0) for k in ks) - first
        line = sorted(([k["name"], k["ts"] - first, k.get("dur", 0), k.get("args", {}).get("stream")]
                       for k in ks), key=lambda k: k[1])
        out.append({"kind": kind, "span_us": span, "families": fams, "kernels": line,
                    "start": first, "end": first + span})
    # What a step-to-step clock (bench_e2e's events) sees beyond the span: the time between the
    # previous replay's last kernel and this one's first (graph launch, the eager copy of the
    # token between replays).
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


def _step_kernels(r: dict) -> list[list]:
    """The replay's kernels on the step's stream, by start. The step's stream is the first kernel's
    (the step begins there); when the trace gives every kernel the same stream (or none), all but
    the encoder's are taken, and the side stream's small kernels (the slot's cast before each
    encode) stay in: :func:`compare` then leaves them unpaired by count."""
    ks = r["kernels"]
    streams = {k[3] for k in ks}
    if len(streams) > 1 and ks[0][3] is not None:
        return [k for k in ks if k[3] == ks[0][3] and family(k[0]) != "encode"]
    return [k for k in ks if family(k[0]) != "encode"]


def _gaps(ks: list[list]) -> list[float]:
    """Idle time before each kernel of a stream's sequence: its start less the latest end so far."""
    out, last = [], None
    for k in ks:
        out.append(0.0 if last is None else max(0.0, k[1] - last))
        last = k[1] + k[2] if last is None else max(last, k[1] + k[2])
    return out


def compare(plain: dict, freeze: dict) -> dict:
    """What a freeze replay spends beyond a plain replay, kernel by kernel on the step's stream.

    The step's kernels (:func:`_step_kernels`) are paired by name and occurrence: the n-th kernel
    of a name in the freeze step with the n-th of that name in the plain step (the step runs the
    same kernels in the same order; a freeze step's extra kernels are left over, counted apart).
    For each pair: its duration in each, the idle gap before it on the step's stream in each (a
    wait on a side-stream event, or launch latency), and the share of its duration during which an
    encode ran. The sums split the excess into kernels slowed while an encode ran beside them
    ("overlapped": at least half their time), kernels slowed without one, longer gaps, and extra
    kernels.
    """
    mp, mf = _step_kernels(plain), _step_kernels(freeze)
    enc = _union([(k[1], k[1] + k[2]) for k in freeze["kernels"] if family(k[0]) == "encode"])
    gp, gf = _gaps(mp), _gaps(mf)
    by_name: dict = {}
    for i, k in enumerate(mp):
        by_name.setdefault(k[0], []).append(i)
    seen: dict = {}
    # one pair per step-stream kernel: family, encode share, µs plain, µs freeze, gap plain, gap freeze
    rows = []
    extra, extra_names = 0.0, {}
    for j, k in enumerate(mf):
        n = seen.get(k[0], 0)
        seen[k[0]] = n + 1
        if n < len(by_name.get(k[0], ())):
            i = by_name[k[0]][n]
            ov = _covered(k[1], k[1] + k[2], enc) / k[2] if k[2] > 0 else 0.0
            rows.append((family(k[0]), ov, mp[i][2], k[2], gp[i], gf[j]))
        else:
            extra += k[2]
            extra_names[k[0][:60]] = extra_names.get(k[0][:60], 0) + 1
    for name, idx in by_name.items():  # plain kernels the freeze step lacks
        for i in idx[seen.get(name, 0):]:
            extra -= mp[i][2]
            extra_names[name[:60]] = extra_names.get(name[:60], 0) - 1

    def total(sel, col):
        return sum(r[col] for r in rows if sel(r))

    out = {"span_plain_us": plain["span_us"], "span_freeze_us": freeze["span_us"],
           "encode_busy_us": sum(b - a for a, b in enc), "paired": len(rows),
           "step_kernels": [len(mp), len(mf)], "unpaired_extra_us": extra, "families": {}}
    for fam in sorted({r[0] for r in rows}):
        for name, sel in (("overlapped", lambda r, f=fam: r[0] == f and r[1] >= 0.5),
                          ("alone", lambda r, f=fam: r[0] == f and r[1] < 0.5)):
            n = sum(1 for r in rows if sel(r))
            if n:
                out["families"][f"{fam} {name}"] = {"count": n, "plain_us": total(sel, 2),
                                                    "freeze_us": total(sel, 3)}
    out["gaps"] = {"plain_us": sum(gp), "freeze_us": sum(gf)}
    waits = sorted(((r[5] - r[4], r[0]) for r in rows), reverse=True)[:8]
    out["unpaired_kernels"] = {n: c for n, c in sorted(extra_names.items(), key=lambda x: -abs(x[1]))
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
            out.append({"kind": r["kind"], "plain_index": rows.index(ref), "index": n, **compare(ref, r)})
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
