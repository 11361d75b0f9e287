"""PNG plots of a ``drift.json`` document (matplotlib, Agg backend, imported lazily).

- ``mae_vs_context.png``: attention-output MAE against context length, static and accumulated, one
  line per method, one row per preset (the paper's Fig. 5 a-c).
- ``kl_vs_position.png``: next-token KL(fp16 || method) against position (accumulated regime).
- ``magnitude_direction.png``: magnitude and direction parts of the K and V token errors, all tokens
  and the worst 5%.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {
    "fp16": "black", "fp8": "tab:gray", "rtn": "tab:brown", "quarot": "tab:purple", "kivi": "tab:red",
    "hkivi": "tab:orange", "varn": "tab:olive", "kvarn": "tab:blue", "kvarn-auto": "tab:green",
    "kvarn-auto-a3": "tab:cyan", "kvarn-auto-r3": "tab:pink",
}


def _by_preset(doc: dict) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for key, m in doc["methods"].items():
        if "positions" not in m:
            continue
        method, _, preset = key.partition(":")
        out.setdefault(preset, {})[method] = m
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _positive(xs, ys):
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_mae(doc: dict, path: Path) -> None:
    plt = _plt()
    groups = _by_preset(doc)
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.6 * len(groups)), squeeze=False, sharey=True)
    for row, (preset, methods) in enumerate(groups.items()):
        for col, regime in enumerate(("static", "accumulated")):
            ax = axes[row][col]
            for method, m in methods.items():
                xs, ys = _positive(m["positions"], m[f"{regime}_mae"])
                if xs:
                    ax.plot(xs, ys, marker=".", label=method, color=COLORS.get(method))
            ax.set_yscale("log")
            ax.set_title(f"{preset}: {regime}")
            ax.set_xlabel("context length (tokens)")
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("attention output MAE")
        axes[row][1].legend(fontsize=8)
    fig.suptitle(f"{doc['model']}: attention-output MAE vs fp shadow (mean over layers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kl(doc: dict, path: Path) -> None:
    plt = _plt()
    groups = _by_preset(doc)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.8), squeeze=False, sharey=True)
    for col, (preset, methods) in enumerate(groups.items()):
        ax = axes[0][col]
        for method, m in methods.items():
            xs, ys = _positive(m["positions"], m["kl"])
            if xs:
                ax.plot(xs, ys, marker=".", label=method, color=COLORS.get(method))
        ax.set_yscale("log")
        ax.set_title(preset)
        ax.set_xlabel("position (chunk end)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("next-token KL(fp16 || method), nats")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{doc['model']}: output drift, accumulated regime")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decomposition(doc: dict, path: Path) -> None:
    plt = _plt()
    groups = _by_preset(doc)
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.6 * len(groups)), squeeze=False)
    for row, (preset, methods) in enumerate(groups.items()):
        names = [n for n in methods if n != "fp16"]
        for col, kind in enumerate(("k", "v")):
            ax = axes[row][col]
            bars = (
                ("magnitude", "mean", "magnitude (all)", "tab:red", None),
                ("direction", "mean", "direction (all)", "tab:blue", None),
                ("magnitude", "top5", "magnitude (worst 5%)", "tab:red", "//"),
                ("direction", "top5", "direction (worst 5%)", "tab:blue", "//"),
            )
            for j, (part, suffix, label, color, hatch) in enumerate(bars):
                ys = [methods[n].get(f"{kind}_{part}_error_{suffix}") or 0.0 for n in names]
                xs = [i + (j - 1.5) * 0.2 for i in range(len(names))]
                ax.bar(xs, ys, width=0.19, color=color, hatch=hatch, alpha=0.6 if suffix == "mean" else 1.0,
                       label=label)
            ax.set_yscale("log")
            ax.set_xticks(range(len(names)), names, rotation=30)
            ax.set_title(f"{preset}: {kind.upper()} token error parts (squared, / mean ||x||^2)")
            ax.grid(alpha=0.3, axis="y")
        axes[row][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(doc: dict, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    paths = [out_dir / "mae_vs_context.png", out_dir / "kl_vs_position.png", out_dir / "magnitude_direction.png"]
    plot_mae(doc, paths[0])
    plot_kl(doc, paths[1])
    plot_decomposition(doc, paths[2])
    return paths
