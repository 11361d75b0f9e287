"""Accuracy of ``kvarn.kernels.decode_attention`` over many random queries, per split plan.

For each case of ``tests/kernels/test_decode_attention.py::test_decode_small`` and each seed, the
error of the kernel against the fp32 torch reference is divided by the test bound
``2 * err(torch fp16) + 1e-4``; the table prints the worst ratio over the seeds (a ratio above 1 is
a failing query). Runs on CUDA, or on CPU under triton's interpreter (``TRITON_INTERPRET=1``, set
here when no GPU is present; slow: about a minute for 30 seeds). Asserts nothing.

    python benchmarks/bench_decode_accuracy.py --seeds 30 --out benchmarks/results/decode_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

from kernel_data import SMALL_DECODE_CASES, history, rel_err  # noqa: E402

from kvarn import kernels  # noqa: E402
from kvarn.attention import decode_attention as torch_decode  # noqa: E402
from kvarn.config import KVarNConfig  # noqa: E402

# The default plan, and every tile and fp token in one program (no merge of partials).
VARIANTS = {"planned splits": {}, "one program": {"num_splits": 1, "fp_splits": 1}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/decode_accuracy.json")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for bits, tq, splits in SMALL_DECODE_CASES:
        cfg = KVarNConfig(key_bits=bits[0], value_bits=bits[1], tile=64)
        sk, sv, tiles, tk, tv, _, _ = history(1, 2, 2, 64, cfg, dev, tail=5)
        worst = dict.fromkeys(VARIANTS, 0.0)
        for seed in range(a.seeds):
            torch.manual_seed(seed)
            q = torch.randn(1, 4, tq, 64, device=dev).half()
            ref = torch_decode(q.float(), sk, sv, tiles, tk, tv, cfg)
            bound = 2 * rel_err(torch_decode(q, sk, sv, tiles, tk, tv, cfg, compute_dtype=torch.float16), ref) + 1e-4
            for name, kw in VARIANTS.items():
                out = kernels.decode_attention(q, sk, sv, tiles, tk, tv, cfg, **({"num_splits": splits} | kw))
                worst[name] = max(worst[name], rel_err(out, ref) / bound)
        rows.append({"key_bits": bits[0], "value_bits": bits[1], "tq": tq, "splits": splits, "seeds": a.seeds,
                     "worst_error_over_bound": worst})
        print(json.dumps(rows[-1]), flush=True)
    with open(a.out, "w") as fh:
        json.dump({"device": dev, "rows": rows}, fh, indent=1)
    print("| K/V bits | Tq | splits | " + " | ".join(f"worst err / bound, {v}" for v in VARIANTS) + " |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for r in rows:
        cells = " | ".join(f"{r['worst_error_over_bound'][v]:.2f}" for v in VARIANTS)
        print(f"| {r['key_bits']}/{r['value_bits']} | {r['tq']} | {r['splits'] or 'auto'} | {cells} |")


if __name__ == "__main__":
    main()
