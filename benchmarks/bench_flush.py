"""Flush: encode one tile of every layer and KV head (K and V) in one launch, Llama-3.1-8B shape.

32 layers x 8 KV heads x batch rows of one G=128 tile each; D = 128. Times the Triton encoder
(one launch) and the torch codec on the same GPU. The share of a decode step is computed by
bench_e2e.py from these numbers and its measured step time. Prints a table, writes JSON.

    PYTHONPATH=. python benchmarks/bench_flush.py --out results/flush.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from kvarn import kernels
from kvarn.codec import encode_tiles as torch_encode
from kvarn.config import KVarNConfig

LAYERS, HK, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32])
    ap.add_argument("--presets", nargs="+", default=["k2v2_g128", "k4v2_g128"])
    ap.add_argument("--out", default="benchmarks/results/flush.json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name in a.presets:
        cfg = KVarNConfig.from_name(name)
        for b in a.batches:
            m = LAYERS * HK * b
            g = torch.Generator(device=dev).manual_seed(b)
            tok = torch.randn(m, cfg.tile, D, device=dev, generator=g, dtype=torch.float16)
            k = (tok * (1 + 4 * torch.rand(1, 1, D, device=dev) ** 4)).transpose(-1, -2)  # [M, D, G] view
            v = torch.randn(m, cfg.tile, D, device=dev, generator=g, dtype=torch.float16)
            out = kernels.encode_tiles(k, v, cfg)
            t_tr = do_bench(lambda: kernels.encode_tiles(k, v, cfg, out=out), rep=100, return_mode="median") * 1e-3
            warps = {nw: do_bench(lambda: kernels.encode_tiles(k, v, cfg, out=out, num_warps=nw), rep=50,
                                  return_mode="median") * 1e6 for nw in (4, 16)}
            t_th = do_bench(lambda: torch_encode(k, v, cfg), rep=100, return_mode="median") * 1e-3
            row = {"preset": name, "batch": b, "tiles": 2 * m, "triton_us": t_tr * 1e6, "torch_us": t_th * 1e6,
                   "triton_us_by_warps": {8: t_tr * 1e6, **warps},
                   "triton_us_per_tile": t_tr * 1e6 / (2 * m)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)
    print("| preset | B | K+V tiles | Triton flush µs | torch codec µs |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['batch']} | {r['tiles']} | {r['triton_us']:.0f} | {r['torch_us']:.0f} |")


if __name__ == "__main__":
    main()
