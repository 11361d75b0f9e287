"""CPU throughput of the reference codec: tiles (one K tile + one V tile) per second.

The pure-torch codec (``quantize_kv`` / ``dequantize_kv``), the baseline for the GPU kernels, and the
encode of the caches' codec (``TileCodec.encode``, rotation included) with each of its kernels:
torch operations, and numba's loops (``kernels="numba"``, the CPU default where numba is installed;
the same bits). Prints a Markdown table and writes JSON.

    python benchmarks/bench_codec_cpu.py --out benchmarks/results/codec_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvarn import KVarNConfig, dequantize_kv, quantize_kv
from kvarn.cpu import numba_available
from kvarn.methods import TileCodec


def _time(fn, min_seconds: float) -> float:
    fn()  # warm-up
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n


def run(head_dims, presets, batch_tiles: int, min_seconds: float) -> list[dict]:
    rows = []
    for name in presets:
        cfg = KVarNConfig.from_name(name)
        for d in head_dims:
            g = torch.Generator().manual_seed(0)
            # batch_tiles tiles as [1, batch_tiles, G, D] so one call encodes all of them.
            k = torch.randn(1, batch_tiles, cfg.tile, d, generator=g) * torch.exp(torch.randn(d, generator=g))
            v = torch.randn(1, batch_tiles, cfg.tile, d, generator=g)
            qkv = quantize_kv(k, v, cfg)
            t_enc = _time(lambda: quantize_kv(k, v, cfg), min_seconds)
            t_dec = _time(lambda: dequantize_kv(qkv), min_seconds)
            codec_rate = {}
            for kernels in ("torch", "numba") if numba_available() else ("torch",):
                codec = TileCodec("kvarn", cfg, kernels)
                codec_rate[kernels] = batch_tiles / _time(lambda: codec.encode(k, v), min_seconds)
            rows.append({
                "preset": name, "head_dim": d, "tiles_per_call": batch_tiles,
                "encode_tiles_per_s": batch_tiles / t_enc, "decode_tiles_per_s": batch_tiles / t_dec,
                "encode_tokens_per_s": batch_tiles * cfg.tile / t_enc,
                "decode_tokens_per_s": batch_tiles * cfg.tile / t_dec,
                "codec_encode_tiles_per_s": codec_rate,
            })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--presets", nargs="+", default=["k2v2_g128", "k4v2_g128", "k4v4_g128"])
    p.add_argument("--tiles", type=int, default=32, help="tiles per call (one K + one V tile each)")
    p.add_argument("--min-seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = run(a.head_dims, a.presets, a.tiles, a.min_seconds)
    machine = f"{platform.processor() or platform.machine()}, {a.threads} threads, torch {torch.__version__}"
    print(f"CPU reference codec ({machine}); a tile = one K tile + one V tile of G tokens, one KV head\n")
    print("| preset | D | encode tiles/s | decode tiles/s | encode tokens/s | decode tokens/s "
          "| TileCodec encode tiles/s, torch | same, numba | numba / torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = r["codec_encode_tiles_per_s"]
        fast = f"{rate['numba']:.0f} | {rate['numba'] / rate['torch']:.2f}x" if "numba" in rate else "- | -"
        print(f"| {r['preset']} | {r['head_dim']} | {r['encode_tiles_per_s']:.0f} | {r['decode_tiles_per_s']:.0f} "
              f"| {r['encode_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} | {rate['torch']:.0f} | {fast} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
