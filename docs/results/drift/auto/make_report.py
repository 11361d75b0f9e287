"""The kvarn-auto goal table, flavour statistics and figure from the study's drift.json files.

    python docs/results/drift/auto/make_report.py docs/results/drift/auto [MORE_DIRS...]

Reads ``<dir>/<model>_<text>/drift.json`` (written by run_study.sh; further folders, such as the
probe of other decision rules, run_rule3.sh's, run_ranges.sh's or run_a2.sh's, add their methods to
the same pairs) and writes ``<dir>/goal.md``,
``<dir>/goal.json`` and ``<dir>/auto_k2v2.png`` into the first folder. The figures are the accumulated regime after the
exact 512-token prefill: mean next-token KL(fp || method) over positions 512-2047, and the
perplexity of the same positions.

Every kvarn-auto entry is shown under its rule, ``kvarn-auto-<rule>``: the rule recorded in the entry
(``auto_rule``), else the key's suffix, else a2 (files written before the rule was recorded, when a2
was the default and its key had no suffix). Entries whose rows were rounded over min/max get
``-minmax``: those without a ``quantiles`` record (written before kvarn-auto's 2-bit quantile
ranges, ``kvarn.auto.auto_ranges``) and ``kvarn drift --ranges minmax`` ones. ``kivi+q`` /
``kvarn+q`` are the baselines with kvarn-auto's ranges (``--ranges auto``); ``kvarn-auto+q`` is
kvarn-auto's own and is dropped.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

BASELINES = ("kivi", "varn", "kvarn", "kivi+q", "kvarn+q")
AUTO: tuple[str, ...] = ("kvarn-auto-r3",)  # extended by main() with every kvarn-auto rule found
GOAL_RULES = ("kvarn-auto-r3", "kvarn-auto-a2")  # the verdict columns of the doc's table
# The doc's table and figure: the reference methods, their ranges ablation, r3 and a2 (the default)
# with the ranges.
COMPACT = ("kivi", "kvarn", "kivi+q", "kvarn+q", "kvarn-auto-r3", "kvarn-auto-a2")
SHOWN: tuple[str, ...] = BASELINES + AUTO
COLORS = {"kivi": "tab:red", "varn": "tab:olive", "kvarn": "tab:blue", "kivi+q": "lightcoral",
          "kvarn+q": "lightsteelblue", "kvarn-auto-r3-minmax": "tab:gray", "kvarn-auto-r3": "tab:gray",
          "kvarn-auto-a2": "black",
          "kvarn-auto-a2-minmax": "tab:green", "kvarn-auto-a3-minmax": "tab:cyan",
          "kvarn-auto-n2-minmax": "tab:pink", "kvarn-auto-n2@0.1-minmax": "tab:purple",
          "kvarn-auto-a2@0.1-minmax": "tab:brown"}


def _labelled(methods: dict[str, dict]) -> dict[str, dict]:
    """kvarn-auto keys renamed ``kvarn-auto-<rule>:<preset>`` (module docstring)."""
    out = {}
    for key, m in methods.items():
        name, _, preset = key.partition(":")
        if name.startswith("kvarn-auto"):
            if name.endswith("+q"):
                continue  # kvarn-auto's own ranges: the plain key's run
            minmax = "quantiles" not in m or not any(m["quantiles"])
            name = name.removesuffix("+minmax")
            if name == "kvarn-auto" or (name.startswith("kvarn-auto-") and "auto_rule" in m):
                name = f"kvarn-auto-{m.get('auto_rule') or 'a2'}"
            name += "-minmax" if minmax else ""
        out[f"{name}:{preset}"] = m
    return out


def _load(roots: list[Path]) -> dict[str, dict]:
    docs: dict[str, dict] = {}
    for root in roots:
        for p in sorted(root.glob("*/drift.json")):
            doc = json.loads(p.read_text())
            doc["methods"] = _labelled(doc["methods"])
            if p.parent.name in docs:
                docs[p.parent.name]["methods"].update(doc["methods"])
            else:
                docs[p.parent.name] = doc
    return docs


def _fig(x: float, spec: str = ".4f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def goal_rows(docs: dict[str, dict]) -> list[dict]:
    rows = []
    for name, doc in docs.items():
        m = doc["methods"]
        row = {"pair": name, "fp16_ppl": doc["fp16_perplexity_after_prefill"]}
        for preset in ("k2v2_g128", "k4v2_g128"):
            for meth in SHOWN:
                e = m.get(f"{meth}:{preset}")
                if e:
                    row[f"{meth}:{preset}"] = (e["kl_after_prefill"], e["perplexity_after_prefill"])
        for rule in AUTO:
            a2, k2, v2 = (row.get(f"{x}:k2v2_g128") for x in (rule, "kivi", "kvarn"))
            a4, k4 = (row.get(f"{x}:k4v2_g128") for x in (rule, "kvarn"))
            if a2 and k2 and v2:
                row[f"{rule}:kl_ratio_k2v2"] = a2[0] / min(k2[0], v2[0])
                row[f"{rule}:goal_k2v2"] = a2[0] <= 0.97 * min(k2[0], v2[0]) and a2[1] <= min(k2[1], v2[1])
            if a4 and k4:
                row[f"{rule}:kl_ratio_k4v2"] = a4[0] / k4[0]
                row[f"{rule}:goal_k4v2"] = a4[0] <= 1.02 * k4[0] and a4[1] <= 1.02 * k4[1]
        rows.append(row)
    return rows


def flavour_stats(docs: dict[str, dict]) -> list[dict]:
    """Per pair and rule at k2v2: heads deciding, share with rotated keys / values, normalization."""
    out = []
    for name, doc in docs.items():
        for rule in AUTO:
            e = doc["methods"].get(f"{rule}:k2v2_g128")
            if not e or "auto_decisions" not in e:
                continue
            flags = {k: [] for k in ("key_rotate", "key_normalize", "value_rotate", "value_normalize")}
            for d in e["auto_decisions"].values():
                for k in flags:
                    flags[k] += d[k]
            n = len(flags["key_rotate"])
            out.append({"pair": name, "rule": rule, "heads": n,
                        **{k: sum(v) / n for k, v in flags.items()},
                        "key_choices": [e["auto_decisions"][str(i)]["key_rotate"]
                                        for i in sorted(map(int, e["auto_decisions"]))]})
    return out


def _kl_ppl_cells(row: dict, methods, preset: str) -> list[str]:
    """One "KL / ppl" cell per method of a table row ("-" where the study has no figure)."""
    cells = []
    for m in methods:
        v = row.get(f"{m}:{preset}")
        cells.append("-" if not v else f"{_fig(v[0])} / {_fig(v[1], '.2f')}")
    return cells


def markdown(rows: list[dict], stats: list[dict]) -> str:
    lines = ["| model / text | fp ppl | " + " | ".join(f"{m} KL / ppl" for m in SHOWN) + " | "
             + " | ".join(f"goal {m}" for m in AUTO) + " |",
             "|---|---:|" + "---:|" * len(SHOWN) + "---|" * len(AUTO)]
    for preset in ("k2v2_g128", "k4v2_g128"):
        lines.append(f"| **{preset}** |" + " |" * (len(SHOWN) + len(AUTO) + 1))
        key = "k2v2" if preset.startswith("k2") else "k4v2"
        for r in rows:
            cells = _kl_ppl_cells(r, SHOWN, preset)
            goals = []
            for rule in AUTO:
                ok, ratio = r.get(f"{rule}:goal_{key}"), r.get(f"{rule}:kl_ratio_{key}")
                goals.append("-" if ok is None else f"{'yes' if ok else 'NO'} ({ratio:.3f})")
            lines.append(f"| {r['pair']} | {_fig(r['fp16_ppl'], '.2f')} | " + " | ".join(cells) + " | "
                         + " | ".join(goals) + " |")
    lines += ["", "| model / text | rule | heads | K rotated | K normalized | V rotated | V normalized |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for s in stats:
        lines.append(f"| {s['pair']} | {s['rule']} | {s['heads']} | {s['key_rotate']:.2f} | {s['key_normalize']:.2f} "
                     f"| {s['value_rotate']:.2f} | {s['value_normalize']:.2f} |")
    return "\n".join(lines) + "\n"


def compact_markdown(rows: list[dict]) -> str:
    """The doc's goal table: one row per pair and preset, the goal verdict cell by cell."""
    cols = [m for m in COMPACT if m in SHOWN]
    lines = ["| model / text | preset | fp ppl | " + " | ".join(f"{m}<br>KL / ppl" for m in cols)
             + "".join(f" | goal ({r.removeprefix('kvarn-auto-')})" for r in GOAL_RULES) + " |",
             "|---|---|---:|" + "---:|" * len(cols) + "---|" * len(GOAL_RULES)]
    for preset, key in (("k2v2_g128", "k2v2"), ("k4v2_g128", "k4v2")):
        for r in rows:
            cells = _kl_ppl_cells(r, cols, preset)
            verdict = []
            for rule in GOAL_RULES:
                ok, ratio = r.get(f"{rule}:goal_{key}"), r.get(f"{rule}:kl_ratio_{key}")
                if ok is None:
                    verdict.append("-")
                    continue
                a = r[f"{rule}:{preset}"]
                refs = ("kivi", "kvarn") if key == "k2v2" else ("kvarn",)
                ppl_ref = min(r[f"{x}:{preset}"][1] for x in refs)
                verdict.append(f"{'**yes**' if ok else 'no'}: KL x{ratio:.3f}, ppl {a[1] - ppl_ref:+.2f}")
            lines.append(f"| {r['pair']} | {key} | {_fig(r['fp16_ppl'], '.2f')} | " + " | ".join(cells) + " | "
                         + " | ".join(verdict) + " |")
    return "\n".join(lines) + "\n"


def self_test_markdown(docs: dict[str, dict]) -> str:
    """Rule r3 per pair and preset: the policy the self-test kept, its KL per candidate on the prompt,
    and the end-to-end KL of each candidate (KVarN, a2, a3) measured on its own."""
    lines = ["| model / text | preset | ranges | r3 kept | self-test KL kvarn / a2 / a3 | end-to-end KL kvarn / a2 / a3 "
             "| end-to-end best |", "|---|---|---|---|---:|---:|---|"]
    for name, doc in docs.items():
        for preset, suffix in [(p, x) for x in ("-minmax", "") for p in ("k2v2_g128", "k4v2_g128")]:
            e = doc["methods"].get(f"kvarn-auto-r3{suffix}:{preset}")
            if not e:
                continue
            d = next(iter(e["auto_decisions"].values()))
            if d.get("self_test_kl") is None:
                continue
            # Each candidate measured on its own with the same ranges (KVarN: kvarn / kvarn+q).
            keys = {"kvarn": "kvarn" if suffix else "kvarn+q", "a2": f"kvarn-auto-a2{suffix}",
                    "a3": f"kvarn-auto-a3{suffix}"}
            e2e = {p: doc["methods"].get(f"{k}:{preset}", {}).get("kl_after_prefill") for p, k in keys.items()}
            known = {p: x for p, x in e2e.items() if x is not None}
            best = min(known, key=known.get) if len(known) > 1 else "-"
            lines.append(f"| {name} | {preset.split('_')[0]} | {'min/max' if suffix else 'q 2-bit'} | {d['policy']} | "
                         + " / ".join(f"{d['self_test_kl'][p]:.4f}" for p in keys) + " | "
                         + " / ".join(_fig(e2e[p]) for p in keys) + f" | {best} |")
    return "\n".join(lines) + "\n"


def figure(docs: dict[str, dict], rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(19, 5), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    shown = [m for m in COMPACT if m in SHOWN]
    width = 0.8 / len(shown)
    for ax, preset, refs, goal in ((axes[0], "k2v2_g128", ("kivi", "kvarn"), 0.97),
                                   (axes[1], "k4v2_g128", ("kvarn",), 1.02)):
        for i, m in enumerate(shown):
            ys = []
            for r in rows:
                base = [r[f"{x}:{preset}"][0] for x in refs if r.get(f"{x}:{preset}")]
                v = r.get(f"{m}:{preset}")
                ys.append(v[0] / min(base) if v and base else float("nan"))
            ax.bar([j + i * width for j in range(len(rows))], ys, width, label=m, color=COLORS.get(m))
        ax.axhline(goal, color="black", lw=1, ls="--", label=f"goal {goal}")
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
        ax.set_xticklabels([r["pair"].replace("_", "\n") for r in rows], fontsize=8)
        ax.set_ylabel(f"KL / min({', '.join(refs)}), positions 512-2047")
        ax.set_title(f"{preset}: accumulated KL after a 512-token exact prefill")
        ax.legend(fontsize=7)
    ax = axes[2]
    for name, doc in docs.items():
        if not name.endswith("wikitext2"):
            continue
        diag = doc["prompt_diagnostics"].get("k2v2_g128", {})
        xs, ys = [], []
        for d in diag.values():
            for r, u, c in zip(d["key_logit_error_rotated"], d["key_logit_error_unrotated"],
                               d["log_key_variance_vs_log_query_energy_corr"]):
                xs.append(c)
                ys.append(r / u)
        ax.scatter(xs, ys, s=14, label=doc["model"])
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("corr(log key variance, log query energy) over channels, per KV head")
    ax.set_ylabel("key logit error: rotated / unrotated (prompt)")
    ax.set_title("Why: where queries look vs where keys vary (WikiText-2, K2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(roots: list[str]) -> None:
    global AUTO, SHOWN
    root_path = Path(roots[0])
    docs = _load([Path(r) for r in roots])
    found = sorted({k.partition(":")[0] for d in docs.values() for k in d["methods"] if k.startswith("kvarn-auto")},
                   key=lambda m: (m not in GOAL_RULES, GOAL_RULES.index(m) if m in GOAL_RULES else 0, m))
    AUTO = tuple(found)
    SHOWN = BASELINES + AUTO
    rows, stats = goal_rows(docs), flavour_stats(docs)
    (root_path / "goal.md").write_text(compact_markdown(rows) + "\n" + self_test_markdown(docs) + "\n"
                                       + markdown(rows, stats), encoding="utf-8")
    (root_path / "goal.json").write_text(json.dumps({"goal": rows, "flavours": stats}, indent=1) + "\n")
    figure(docs, rows, root_path / "auto_k2v2.png")
    print(compact_markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:] or ["docs/results/drift/auto"])
