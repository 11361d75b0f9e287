"""Trace analysis for ``profile_freeze.py``: replays of CUDA graphs in a torch-profiler Chrome trace,
their kernels by family, and a freeze replay against a plain one kernel by kernel (no GPU needed).
"""

from __future__ import annotations

import statistics

ENCODE = "_encode_tiles_kernel"  # the tile freeze's encoder (kvarn/kernels/encode.py)
FAMILIES = (  # (family, substrings of the kernel name), first match wins
    ("encode", (ENCODE,)),
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
    time from the previous replay's last kernel and to the next replay's first kernel.

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


SIDE = (ENCODE, "_empty_kernel")  # what a fork queues on the side stream: encodes, the lead-in


def _step_kernels(r: dict) -> list[list]:
    """The replay's kernels of the step itself, by start: all but the side stream's (:data:`SIDE`).

    Told apart by name, not by stream: a replayed graph runs its branches on streams of its own,
    and after the first fork the step's kernels go on on another stream than the one it began on
    (an H100, torch 2.11: in an 8K x 16 freeze replay 44 kernels on the first stream, then the
    step on a second one, back and forth at each fork), so the first kernel's stream holds only
    a few of them."""
    return [k for k in r["kernels"] if not any(x in k[0] for x in SIDE)]


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
        m = next((m for m in order if rows[m]["kind"] == "plain"), None)
        if m is not None:
            out.append({"kind": r["kind"], "plain_index": m, "index": n, **compare(rows[m], r)})
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
