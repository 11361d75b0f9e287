"""Flush: encode one tile of every layer and KV head (K and V), Llama-3.1-8B shape.

32 layers x 8 KV heads x batch rows of one G=128 tile each; D = 128. Times, on the same GPU:
the Triton encoder over all of them in one launch (rotated tiles in; and model-frame fp16 tiles
that it rotates itself); the same in 32 launches, one per layer; the cache's whole per-layer flush
path (``TileStore.encode_into``: one launch per layer that rotates, encodes, flags a non-finite
scale and writes the reserved slots) for the 32 layers, captured in one CUDA graph as a captured
decode step runs it; and the torch codec (one call). The rotating one-launch form is also timed at
2, 4, 8 and 16 warps (``triton_rotating_us_by_warps``; the encoder's default depends on the launch size).
Beside the decode step (``flush_ahead``) a layer's encode is one launch capped at
``freeze_schedule.beside_programs`` programs for K and for V, each program alone on its SM: its
time, and the SM-time a tile costs there (time x programs / tiles), are ``beside_*``.
The share of a decode step is in bench_e2e.py's flush column. ``--ranges auto`` also times each
preset with kvarn-auto's rounding ranges (2-bit rows over their quantiles: a sort per row).
Prints a table, writes JSON.

    PYTHONPATH=. python benchmarks/bench_flush.py --out results/flush.json
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench, do_bench_cudagraph

from kvarn import kernels
from kvarn.auto import auto_ranges
from kvarn.cache.store import TileStore
from kvarn.codec import encode_tiles as torch_encode
from kvarn.codec.record import record_layout
from kvarn.config import KVarNConfig
from kvarn.integrations.transformers.freeze_schedule import beside_programs
from kvarn.integrations.transformers.triton_codec import TritonTileCodec

LAYERS, HK, D = 32, 8, 128


def cache_path_us(cfg, b, dev):
    """The cache's flush of one tile per row and KV head in each of LAYERS layers, as a captured
    decode step runs it (:meth:`TileStore.encode_into` in deferred mode), timed as one CUDA graph."""
    codec = TritonTileCodec("kvarn", cfg)
    stores, tails = [], []
    for i in range(LAYERS):
        st = TileStore(codec, b, HK, D, dev)
        st.reserve(record_layout(cfg, D), 2)
        stores.append(st)
        g = torch.Generator(device=dev).manual_seed(100 + i)
        tails.append(tuple(torch.randn(b, HK, cfg.tile, D, device=dev, generator=g, dtype=torch.float16)
                           for _ in range(2)))
    slot = torch.zeros(1, dtype=torch.long, device=dev)

    def flush():
        with codec.deferred():
            for st, (tk, tv) in zip(stores, tails):
                st.encode_into(tk, tv, slot)

    flush()  # compile and first-write bookkeeping before capture
    return do_bench_cudagraph(flush, rep=100, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32])
    ap.add_argument("--presets", nargs="+", default=["k2v2_g128", "k4v2_g128"])
    ap.add_argument("--ranges", nargs="+", choices=["minmax", "auto"], default=["minmax"],
                    help="rows' ranges: minmax (the spec), auto (kvarn-auto's: quantiles for 2-bit rows)")
    ap.add_argument("--out", default="benchmarks/results/flush.json")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, ranges in [(n, r) for n in a.presets for r in a.ranges]:
        cfg = KVarNConfig.from_name(name)
        cfg = auto_ranges(cfg) if ranges == "auto" else cfg
        for b in a.batches:
            m = LAYERS * HK * b
            g = torch.Generator(device=dev).manual_seed(b)
            tok = torch.randn(m, cfg.tile, D, device=dev, generator=g, dtype=torch.float16)
            k = (tok * (1 + 4 * torch.rand(1, 1, D, device=dev) ** 4)).transpose(-1, -2)  # [M, D, G] view
            v = torch.randn(m, cfg.tile, D, device=dev, generator=g, dtype=torch.float16)
            out = kernels.encode_tiles(k, v, cfg)
            t_tr = do_bench(lambda: kernels.encode_tiles(k, v, cfg, out=out), rep=100, return_mode="median") * 1e-3
            # The warp count (a launch knob, same bits) for the flush's form; the default is 4 here.
            warps = {nw: do_bench(lambda: kernels.encode_tiles(k, v, cfg, out=out, rotate=True, num_warps=nw),
                                  rep=50, return_mode="median") * 1e3 for nw in (2, 4, 8, 16)}
            # The flush's form: fp16 model-frame tiles (k is a transposed view, as the tail's), rotated here.
            t_rot = do_bench(lambda: kernels.encode_tiles(k, v, cfg, out=out, rotate=True), rep=100,
                             return_mode="median") * 1e-3
            t_th = do_bench(lambda: torch_encode(k, v, cfg), rep=100, return_mode="median") * 1e-3
            per = m // LAYERS  # one layer's K (or V) tiles
            layers = [(k[i * per:(i + 1) * per], v[i * per:(i + 1) * per]) for i in range(LAYERS)]
            outs = [kernels.encode_tiles(lk, lv, cfg) for lk, lv in layers]

            def per_layer():
                for (lk, lv), o in zip(layers, outs):
                    kernels.encode_tiles(lk, lv, cfg, out=o, rotate=True)

            t_layers = do_bench_cudagraph(per_layer, rep=100, return_mode="median") * 1e-3
            # One layer's encode as the side stream launches it beside the step (capped grid).
            capped = beside_programs(dev)
            lk, lv = layers[0]
            t_beside = do_bench(lambda: kernels.encode_tiles(lk, lv, cfg, out=outs[0], rotate=True, programs=capped),
                                rep=100, return_mode="median") * 1e-3
            held = min(2 * capped, 2 * per)  # programs (each alone on an SM: fewer than the SMs)
            t_path = cache_path_us(cfg, b, dev) * 1e-6
            row = {"preset": name, "ranges": ranges, "batch": b, "tiles": 2 * m, "triton_us": t_tr * 1e6, "torch_us": t_th * 1e6,
                   "triton_rotating_us": t_rot * 1e6,
                   "triton_per_layer_launches_us": t_layers * 1e6, "cache_path_us": t_path * 1e6,
                   "triton_rotating_us_by_warps": warps,
                   "beside_programs": held, "beside_layer_us": t_beside * 1e6,
                   "beside_sm_us_per_tile": t_beside * 1e6 * held / (2 * per),
                   "triton_us_per_tile": t_tr * 1e6 / (2 * m)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)
    print("| preset | ranges | B | K+V tiles | Triton, one launch µs | same, rotating model-frame tiles µs | Triton, a launch "
          "per layer µs | cache flush path (32 layers, captured) µs | torch codec µs | beside the step: a layer µs "
          "(programs), SM-µs a tile |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['ranges']} | {r['batch']} | {r['tiles']} | {r['triton_us']:.0f} | {r['triton_rotating_us']:.0f} | "
              f"{r['triton_per_layer_launches_us']:.0f} | {r['cache_path_us']:.0f} | {r['torch_us']:.0f} | "
              f"{r['beside_layer_us']:.0f} ({r['beside_programs']}), {r['beside_sm_us_per_tile']:.1f} |")


if __name__ == "__main__":
    main()
