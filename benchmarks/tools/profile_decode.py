"""One decode-attention configuration, launched a few times: the target for Nsight Compute.

    ncu --clock-control none --kernel-name regex:_decode_attention_kernel --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy --section LaunchStats \\
        python benchmarks/tools/profile_decode.py --batch 32 --context 16384 --preset k4v2_g128

The tiles are random (speed does not depend on the values), shaped like Llama-3.1-8B by default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvarn import kernels
from kvarn.config import KVarNConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_decode_attention import SHAPES, random_fields, split_context  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama8b_d128", choices=list(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--launches", type=int, default=5)
    a = ap.parse_args()
    hq, hk, d = SHAPES[a.shape]
    cfg = KVarNConfig.from_name(a.preset)
    s, n, r = split_context(a.context, cfg)
    dev = torch.device("cuda")
    kv = torch.randn(a.batch, hk, s + r, d, device=dev, dtype=torch.float16)
    q = torch.randn(a.batch, hq, 1, d, device=dev, dtype=torch.float16)
    tiles = random_fields(a.batch, hk, n, d, cfg, dev)
    for _ in range(a.launches):
        kernels.decode_attention(q, kv[:, :, :s], kv[:, :, :s], tiles, kv[:, :, s:], kv[:, :, s:], cfg)
    torch.cuda.synchronize()
    print(f"ran {a.launches} launches: {a.shape} B={a.batch} T={a.context} {a.preset}")


if __name__ == "__main__":
    main()
