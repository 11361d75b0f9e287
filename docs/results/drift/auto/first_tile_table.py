"""The goal table of kvarn-auto's first-tile decision from run_first_tile.sh's drift.json files.

    python docs/results/drift/auto/first_tile_table.py docs/results/drift/auto/first_tile

Reads ``<dir>/<model>_<text>_p<prefill>/drift.json`` and writes ``<dir>/goal.md`` and
``<dir>/goal.json``. Every figure is the accumulated regime over positions >= 512, whatever the
prefill: the mean next-token KL(fp || method) of the passes that start at 512 or later (weighted by
the tokens each predicts, as ``kl_after_prefill`` is) and the perplexity of the same tokens (from
the per-pass NLL). With a 512-token prefill they are ``kl_after_prefill`` and
``perplexity_after_prefill``. Goal per cell: kvarn-auto's KL <= 0.97 x min(KIVI, KVarN) and its
perplexity <= both.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

FROM = 512
PRESET = "k2v2_g128"
METHODS = ("kivi", "kvarn", "kvarn-auto")


def window(doc: dict, m: dict) -> tuple[float, float | None]:
    """(KL, perplexity) over the passes that start at FROM or later."""
    ends = m["positions"]
    starts = [0] + ends[:-1]
    targets = doc.get("chunk_targets") or [e - s for s, e in zip(starts, ends)]
    keep = [i for i, s in enumerate(starts) if s >= FROM]
    n = sum(targets[i] for i in keep)
    kl = sum(m["kl"][i] * targets[i] for i in keep) / n
    nll = m.get("chunk_nll")
    ppl = math.exp(sum(nll[i] for i in keep) / n) if nll else None
    if ppl is None and doc["prefill"] == FROM:
        ppl = m["perplexity_after_prefill"]
    return kl, ppl


def decisions(m: dict) -> str:
    """How kvarn-auto's layers decided: ``<at> x<layers>, <tokens> tokens / <queries> queries``."""
    seen = {}
    for d in (m.get("auto_decisions") or {}).values():
        key = (d.get("decided_at"), d.get("tokens"), d.get("queries"))
        seen[key] = seen.get(key, 0) + 1
    return "; ".join(f"{at} x{n}, {t} tokens / {q} queries" for (at, t, q), n in sorted(seen.items(), key=str))


def main(root: Path) -> None:
    rows = []
    for path in sorted(root.glob("*_p*/drift.json")):
        doc = json.loads(path.read_text())
        name, _, prefill = path.parent.name.rpartition("_p")
        figs = {k: window(doc, doc["methods"][f"{k}:{PRESET}"]) for k in METHODS}
        ref_kl = min(figs["kivi"][0], figs["kvarn"][0])
        kl, ppl = figs["kvarn-auto"]
        ppls = [figs[k][1] for k in ("kivi", "kvarn")]
        ppl_ok = None if ppl is None or None in ppls else ppl <= min(ppls)
        rows.append({
            "cell": name, "prefill": int(prefill),
            **{f"{k}_kl": figs[k][0] for k in METHODS}, **{f"{k}_ppl": figs[k][1] for k in METHODS},
            "ratio": kl / ref_kl, "kl_ok": kl <= 0.97 * ref_kl, "ppl_ok": ppl_ok,
            "decisions": decisions(doc["methods"][f"kvarn-auto:{PRESET}"]),
        })
    rows.sort(key=lambda r: (r["prefill"], r["cell"]))
    (root / "goal.json").write_text(json.dumps(rows, indent=1) + "\n")

    def f(x, spec=".4f"):
        return "-" if x is None else format(x, spec)

    lines = [f"Accumulated regime over positions >= {FROM}, {PRESET}: KL / perplexity. Goal: kvarn-auto's KL "
             "<= 0.97 x min(KIVI, KVarN) and its perplexity <= both.", "",
             "| model / text | prefill | KIVI | KVarN | kvarn-auto | KL / min | goal | kvarn-auto decided |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        ok = r["kl_ok"] and r["ppl_ok"]
        verdict = "**yes**" if ok else ("no" + ("" if r["kl_ok"] else ": KL") + (
            ": ppl not recorded" if r["ppl_ok"] is None else "" if r["ppl_ok"] else ": ppl"))
        lines.append(
            f"| {r['cell']} | {r['prefill']} | " + " | ".join(
                f"{f(r[k + '_kl'])} / {f(r[k + '_ppl'], '.2f')}" for k in METHODS)
            + f" | x{r['ratio']:.3f} | {verdict} | {r['decisions']} |")
    met = sum(bool(r["kl_ok"] and r["ppl_ok"]) for r in rows)
    lines += ["", f"{met} of {len(rows)} cells meet the goal."]
    (root / "goal.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/results/drift/auto/first_tile"))
