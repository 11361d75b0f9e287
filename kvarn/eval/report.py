r"""Summaries of JSONL runs: accuracy mean ± std over seeds, pass@k, length, truncation.

For each seed the accuracy is the mean over problems of the fraction of correct samples; the
table reports the mean and sample standard deviation (ddof 1) of that over seeds (± 0 with one
seed). pass@k uses the unbiased estimator of Chen et al. (2021), ``1 - C(n-c, k) / C(n, k)`` per
problem with n samples of which c are correct, averaged over problems and then over seeds.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: n samples, c correct (numerically stable product form)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, 0.0
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def summarize(rows: list[dict]) -> dict:
    """Summary of the rows of one run (one task, model, method, preset)."""
    if not rows:
        raise ValueError("no rows to summarize")
    by_seed: dict[int, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_seed[r["seed"]][r["id"]].append(bool(r["correct"]))
    n_samples = min(len(v) for per in by_seed.values() for v in per.values())
    accs = [sum(sum(v) / len(v) for v in per.values()) / len(per) for per in by_seed.values()]
    mean, std = _mean_std(accs)
    out = {
        "task": rows[0]["task"], "model": rows[0]["model"], "method": rows[0]["method"],
        "preset": rows[0]["preset"], "problems": len({r["id"] for r in rows}),
        "seeds": sorted(by_seed), "samples_per_problem": n_samples, "rows": len(rows),
        "accuracy_mean": mean, "accuracy_std": std, "accuracy_per_seed": accs,
        "mean_generated_tokens": sum(r["generated_tokens"] for r in rows) / len(rows),
        "truncation_rate": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
        "reasons": dict(sorted(_count(r["reason"] for r in rows).items())),
    }
    ks = [k for k in (1, 2, 5, 10, 20, 50, 100) if k <= n_samples]
    if rows[0]["task"] == "humaneval":
        out["pass_at_k"] = {
            str(k): _mean_std([
                sum(pass_at_k(len(v), sum(v), k) for v in per.values()) / len(per)
                for per in by_seed.values()
            ])[0]
            for k in ks
        }
    groups = sorted({r.get("group") for r in rows if r.get("group")}, key=_natural)
    if groups:
        out["groups"] = {
            g: sum(r["correct"] for r in rows if r.get("group") == g)
            / sum(1 for r in rows if r.get("group") == g)
            for g in groups
        }
    return out


def _count(items) -> dict:
    c: dict = defaultdict(int)
    for x in items:
        c[x] += 1
    return c


def _natural(s: str):
    head = s.split()[0]
    return (int(head), s) if head.isdigit() else (math.inf, s)


def summarize_dir(out_dir) -> list[dict]:
    """One summary per JSONL file of ``out_dir``, sorted by task, model, method, preset."""
    summaries = []
    for path in sorted(Path(out_dir).glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if rows:
            summaries.append(summarize(rows) | {"file": path.name})
    return summaries


def markdown_table(summaries: list[dict]) -> str:
    """A Markdown table of summaries (accuracy in %, mean ± std over seeds)."""
    head = ("| task | model | method | preset | problems | samples x seeds | accuracy % | "
            "by length | mean gen. tokens | truncated % |")
    lines = [head, "|" + "---|" * 10]
    for s in summaries:
        acc = f"{100 * s['accuracy_mean']:.1f} ± {100 * s['accuracy_std']:.1f}"
        if "pass_at_k" in s:
            acc += " (" + ", ".join(f"pass@{k} {100 * v:.1f}" for k, v in s["pass_at_k"].items()) + ")"
        groups = ", ".join(f"{g}: {100 * v:.0f}" for g, v in s.get("groups", {}).items()) or "-"
        lines.append(
            f"| {s['task']} | {s['model']} | {s['method']} | {s['preset'] or '-'} | {s['problems']} | "
            f"{s['samples_per_problem']} x {len(s['seeds'])} | {acc} | {groups} | "
            f"{s['mean_generated_tokens']:.0f} | {100 * s['truncation_rate']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def write_summary(out_dir) -> tuple[Path, Path]:
    """``summary.json`` and ``summary.md`` in ``out_dir`` from all its JSONL runs."""
    summaries = summarize_dir(out_dir)
    jpath, mpath = Path(out_dir) / "summary.json", Path(out_dir) / "summary.md"
    jpath.write_text(json.dumps(summaries, indent=1) + "\n", encoding="utf-8")
    mpath.write_text(markdown_table(summaries), encoding="utf-8")
    return jpath, mpath
