"""Study: where a decode step's freeze runs, and how much of the GPU its encodes take (issue 12).

On the ``bench_e2e`` model (random-weight Llama-3.1-8B shape, fp16, ``kvarn_graph`` caches, CUDA
graphs), the excess of the fill step (its token completes a tile) and of the flush step (it freezes
the tile) over the median step, for freeze schedules that ``decode_greedy`` chooses internally
(``kvarn.integrations.hf_graph._early_layers`` and ``_beside_programs``; this script replaces them,
which no user code should do):

- ``early``: how many of the 32 layers start their encodes in the fill step ("all": every layer,
  the schedule before session 14; default: decode_greedy's own choice);
- ``programs``: the encoder's programs for K and for V per launch (None: one per tile, 128 at
  batch 16; default: decode_greedy's, a quarter of the SMs).

Each schedule is one ``bench_e2e.run_one`` with ``--new`` tokens (400: three tile completions, the
first also captures the graphs and is not reported). Steps are single replays, so a figure moves by
about a percent between runs and more between machines: compare rows of one run. With ``--device
cpu --shape tiny`` it runs at toy sizes (kernels under triton's interpreter) to check the script,
not to measure.

    PYTHONPATH=. python benchmarks/study_freeze_schedule.py --out benchmarks/results/freeze_schedule_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT = "default"
SCHEDULES = {  # name: (early layers, programs)
    "one_step": ("all", None),
    "one_step_p33": ("all", 33),
    "split_uncapped": (DEFAULT, None),
    "split_p16": (DEFAULT, 16),
    "split": (DEFAULT, DEFAULT),
    "split_p66": (DEFAULT, 66),
}

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--presets", nargs="+", default=["k4v2_g128"])
ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
ap.add_argument("--new", type=int, default=400)
ap.add_argument("--out", default="benchmarks/results/freeze_schedule.json")
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                help="cpu: toy sizes under triton's interpreter (--shape tiny), to check the script")
ap.add_argument("--shape", default="llama8b", choices=["llama8b", "tiny"])
ARGS = ap.parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

import bench_e2e as be  # noqa: E402
from kvarn.integrations import hf_attention, hf_graph  # noqa: E402


def schedule(early, programs) -> None:
    """Set decode_greedy's two choices (restored to its own by DEFAULT)."""
    hf_graph._early_layers = (lambda layers: len(layers)) if early == "all" else OWN_EARLY
    if programs == DEFAULT:
        hf_graph._beside_programs = OWN_PROGRAMS
    else:
        hf_graph._beside_programs = lambda device: programs or 1 << 30


def main(a) -> None:
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device (use --device cpu --shape tiny for a check)")
    torch.manual_seed(0)
    hf_attention.register()
    model = be.build_model(a.shape, a.device)
    meta = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "args": vars(a)}
    rows = []
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    for ctx in a.contexts:
        for preset in a.presets:
            for name in a.schedules:
                schedule(*SCHEDULES[name])
                t0 = time.time()
                r = be.run_one(model, f"kvarn_graph:{preset}", a.batch, ctx, a.new, 4096, a.device)
                gaps, step = r["gaps_ms"], r["step_ms"]
                done = r.get("flush_steps", [])[1:]  # the first freeze also captured its graphs
                fill = [gaps[i - 2] / step - 1 for i in done]
                flush = [gaps[i - 1] / step - 1 for i in done]
                row = dict(schedule=name, context=ctx, batch=a.batch, preset=preset, step_ms=step,
                           fill_over=fill, flush_over=flush, worst=max(fill + flush, default=None),
                           seconds=time.time() - t0)
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(a.out, "w") as fh:
                    json.dump({**meta, "rows": rows}, fh, indent=1)
    schedule(DEFAULT, DEFAULT)
    print("| context x B | preset | schedule | median step ms | fill step | flush step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pct = lambda xs: " / ".join(f"{x:+.1%}" for x in xs)  # noqa: E731
        print(f"| {r['context']} x {r['batch']} | {r['preset']} | {r['schedule']} | {r['step_ms']:.2f} "
              f"| {pct(r['fill_over'])} | {pct(r['flush_over'])} |")


OWN_EARLY, OWN_PROGRAMS = hf_graph._early_layers, hf_graph._beside_programs

if __name__ == "__main__":
    main(ARGS)
