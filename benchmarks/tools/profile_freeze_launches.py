"""The launches that share the GPU in a freeze step, a few times each: the target for Nsight Compute.

A captured decode step at batch B runs the model's projections as cuBLAS GEMMs of B rows, and the
freeze runs the encoder beside them on a side stream, capped at ``freeze_schedule.beside_programs`` programs
for K and for V. Whether an encode program can share an SM with a GEMM block decides what the freeze
costs the step (BENCHMARKS.md, table 3: the GEMMs' blocks fill an SM each). Weights are random (the
launches' resources do not depend on the values), shaped like ``bench_e2e``'s Llama-3.1-8B. The
launches come in this order, ``--launches`` of each: q and o, k and v, gate and up, down, lm_head
(cuBLAS GEMMs, some with a split-K reduction after them), then the encode.

    ncu --kernel-name regex:'nvjet|gemm|splitK|_encode_tiles' --section LaunchStats --section Occupancy \\
        python benchmarks/tools/profile_freeze_launches.py --batch 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvarn import kernels
from kvarn.config import KVarNConfig
from kvarn.integrations.transformers.freeze_schedule import beside_programs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_e2e import SHAPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--launches", type=int, default=2)
    a = ap.parse_args()
    if a.batch < 1 or a.launches < 1:
        sys.exit(f"--batch {a.batch}, --launches {a.launches}: give 1 or more of each")
    cfg = KVarNConfig.from_name(a.preset)  # an unknown preset is refused before any allocation
    if not torch.cuda.is_available():
        sys.exit("profile_freeze_launches: torch sees no CUDA device (it is a target for ncu on a GPU)")
    dev = torch.device("cuda")
    s = SHAPES["llama8b"]
    h, f, d, hk = s["hidden_size"], s["intermediate_size"], s["head_dim"], s["num_key_value_heads"]
    weights = {"q, o": (h, h), "k, v": (hk * d, h), "gate, up": (f, h), "down": (h, f), "lm_head": (s["vocab_size"], h)}
    for n_out, n_in in weights.values():
        w = torch.randn(n_out, n_in, device=dev, dtype=torch.float16) * 0.02
        x = torch.randn(a.batch, n_in, device=dev, dtype=torch.float16)
        for _ in range(a.launches):
            torch.nn.functional.linear(x, w)
    k = torch.randn(a.batch, hk, cfg.tile, d, device=dev, dtype=torch.float16)
    v = torch.randn(a.batch, hk, cfg.tile, d, device=dev, dtype=torch.float16)
    for _ in range(a.launches):  # one layer's freeze as decode_greedy launches it beside the step
        kernels.encode_tiles(k.transpose(-1, -2), v, cfg, rotate=True, programs=beside_programs(dev))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
