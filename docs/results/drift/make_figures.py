"""Study-level figure for docs/results/drift.md from the four drift.json files beside this script.

fig5_k2v2.png: attention-output MAE vs context at K2/V2 (paper Fig. 5): KIVI, HK (hkivi), VarN and
KVarN, static dashed, accumulated solid, one panel per model and text.
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvarn.analysis.plots import COLORS  # noqa: E402

HERE = Path(__file__).parent
RUNS = ["smollm2-135m_wikitext2", "smollm2-135m_reasoning", "gemma3-270m_wikitext2", "gemma3-270m_reasoning"]


def main():
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), squeeze=False)
    for ax, run in zip(axes.flat, RUNS):
        doc = json.loads((HERE / run / "drift.json").read_text())
        for method in ("kivi", "hkivi", "varn", "kvarn"):
            m = doc["methods"][f"{method}:k2v2_g128"]
            xs = m["positions"][2:]
            ax.plot(xs, m["accumulated_mae"][2:], "-", marker=".", color=COLORS[method], label=f"{method} accumulated")
            ax.plot(xs, m["static_mae"][2:], "--", color=COLORS[method], label=f"{method} static")
        ax.set_yscale("log")
        ax.set_title(run.replace("_", ", "))
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("attention output MAE")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle("K2/V2 (k2v2_g128): static (dashed) vs accumulated (solid), mean over all attention layers")
    fig.tight_layout()
    fig.savefig(HERE / "fig5_k2v2.png", dpi=110)


if __name__ == "__main__":
    main()
