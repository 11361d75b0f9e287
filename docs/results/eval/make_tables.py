"""Tables of docs/results/eval.md from the runs stored here (gpu_bf16/, cpu_fp32/).

    python docs/results/eval/make_tables.py > /tmp/tables.md   # also rewrites docs/results/eval.json

Per run: the runner's summary (kvarn.eval.report.summarize) plus the passed / correct count and
the number of problems whose output is identical to the fp16 cache's output (same folder).
"""

import json
from pathlib import Path

from kvarn.eval.report import summarize_dir

HERE = Path(__file__).resolve().parent
FOLDERS = {"gpu_bf16": "H200, bf16 weights", "cpu_fp32": "CPU, fp32 weights"}


def identical_to_fp16(folder: Path, summary: dict) -> int | None:
    if summary["method"] == "fp16":
        return None
    ref = folder / f"{summary['task']}__{summary['model']}__fp16__none.jsonl"
    if not ref.exists():
        return None
    rows = lambda p: {(r["id"], r["seed"], r["sample"]): r["output"] for r in map(json.loads, p.read_text().splitlines())}  # noqa: E731
    a, b = rows(ref), rows(folder / summary["file"])
    return sum(1 for k, v in b.items() if a.get(k) == v)


def main():
    out, lines = {}, []
    lines.append("| where | task | method | preset | problems | correct | accuracy % | identical to fp16 | mean gen. tokens | truncated % |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, label in FOLDERS.items():
        folder = HERE / name
        sums = summarize_dir(folder)
        for s in sums:
            s["identical_to_fp16"] = identical_to_fp16(folder, s)
            correct = round(s["accuracy_mean"] * s["rows"])
            same = "(reference)" if s["method"] == "fp16" else (
                "-" if s["identical_to_fp16"] is None else f"{s['identical_to_fp16']}/{s['rows']}")
            task = s["task"] + (" (" + ", ".join(f"{g}: {100 * v:.0f}%" for g, v in s["groups"].items()) + ")"
                                if s.get("groups") else "")
            lines.append(f"| {label} | {task} | {s['method']} | {s['preset'] or '-'} | {s['problems']} | "
                         f"{correct} | {100 * s['accuracy_mean']:.1f} | {same} | {s['mean_generated_tokens']:.0f} | "
                         f"{100 * s['truncation_rate']:.0f} |")
        out[name] = sums
    (HERE.parent / "eval.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
