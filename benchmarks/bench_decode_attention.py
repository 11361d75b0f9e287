"""Decode attention: kvarn Triton kernel vs fp16 SDPA (flash) over the same context, on one GPU.

Per shape x batch x context: median time (CUDA-graph replays, so launch gaps and Python are out),
bytes read (kvarn: sink + tail fp16, records of docs/algorithm.md section 4; fp16: K+V) and achieved bandwidth.
Tile contents are random codes and scales: speed does not depend on the values. The kernel runs with
its defaults (``precise=True``: fp32 operands split into two fp16 halves for the matrix units,
stacked as extra rows of one MMA). Where B >= 8 and the context >= 16K (the targets' range) two
variants are timed too: ``two_mma`` (the halves as two MMAs, ``split_rows=False``) and ``fast``
(``precise=False``: one fp16 MMA per product, less accurate).
Prints tables and writes JSON; asserts nothing.

    PYTHONPATH=. python benchmarks/bench_decode_attention.py --out results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench_cudagraph

from kvarn import kernels
from kvarn.config import KVarNConfig
from kvarn.kernels.layout import empty_fields

SHAPES = {"llama8b_d128": (32, 8, 128), "d64": (32, 8, 64), "d256": (16, 8, 256)}
CONTEXTS = (1024, 4096, 16384, 65536, 131072)
BATCHES = (1, 8, 32)
PRESETS = ("k2v2_g128", "k4v2_g128")
PEAK = 4.8e12


def split_context(t, cfg):
    """T = sink S + N tiles + tail R (1 <= R <= G)."""
    s = cfg.sink_tokens
    n = (t - s - 1) // cfg.tile
    return s, n, t - s - n * cfg.tile


def random_fields(b, hk, n, d, cfg, dev):
    f = empty_fields((b, hk, n), cfg, d, dev)
    f.k_codes.random_(0, 256)
    f.v_codes.random_(0, 256)
    for name in ("k_row_scale", "v_row_scale"):
        getattr(f, name).uniform_(0.01, 0.2)
    for name in ("k_row_zero", "v_row_zero"):
        getattr(f, name).uniform_(-1.0, -0.1)
    for name in ("k_col_scale", "v_col_scale"):
        getattr(f, name).uniform_(0.7, 1.4)
    return f


def bench(fn):
    return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e-3  # seconds


def run(shapes, batches, contexts, presets, sweep):
    dev = torch.device("cuda")
    rows = []
    for shape in shapes:
        hq, hk, d = SHAPES[shape]
        for b in batches:
            tmax = max(contexts)
            kf = torch.randn(b, hk, tmax, d, device=dev, dtype=torch.float16)
            vf = torch.randn_like(kf)
            q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
            stores = {}
            for name in presets:
                cfg = KVarNConfig.from_name(name)
                s, n, r = split_context(tmax, cfg)
                stores[name] = (cfg, random_fields(b, hk, n, d, cfg, dev))
            for t in contexts:
                k, v = kf[:, :, :t], vf[:, :, :t]
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    t_fp = bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                fp_bytes = b * hk * t * d * 2 * 2
                row = {"shape": shape, "hq": hq, "hk": hk, "d": d, "batch": b, "context": t,
                       "sdpa_us": t_fp * 1e6, "sdpa_tbps": fp_bytes / t_fp / 1e12}
                for name, (cfg, fields) in stores.items():
                    s, n, r = split_context(t, cfg)
                    tiles = fields.map(lambda x: x[:, :, :n])
                    sk, sv = kf[:, :, :s], vf[:, :, :s]
                    tk, tv = kf[:, :, s:s + r], vf[:, :, s:s + r]
                    kw = {}
                    if sweep:
                        best = None
                        from kvarn.kernels.decode import plan_splits
                        for nw, mult, st in ((4, 1, 1), (8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 1)):
                            ns = plan_splits(b * hk, n, dev) * mult
                            tt = bench(lambda: kernels.decode_attention(
                                q, sk, sv, tiles, tk, tv, cfg, num_splits=ns, num_warps=nw, num_stages=st))
                            print("sweep", shape, b, t, name, nw, ns, st, round(tt * 1e6, 1), flush=True)
                            if best is None or tt < best[0]:
                                best = (tt, nw, ns, st)
                        tk_s, kw = best[0], {"num_warps": best[1], "num_splits": best[2], "num_stages": best[3]}
                    else:
                        tk_s = bench(lambda: kernels.decode_attention(q, sk, sv, tiles, tk, tv, cfg))
                    variants = {}
                    if b >= 8 and t >= 16384:
                        for vname, vkw in (("two_mma", {"split_rows": False}), ("fast", {"precise": False})):
                            tv_s = bench(lambda: kernels.decode_attention(q, sk, sv, tiles, tk, tv, cfg, **vkw))
                            variants[f"{vname}_us"] = tv_s * 1e6
                            variants[f"{vname}_speedup"] = t_fp / tv_s
                    kb = b * hk * (n * cfg.record_bytes(d) + (s + r) * d * 2 * 2)
                    row[name] = {"us": tk_s * 1e6, "bytes": kb, "tbps": kb / tk_s / 1e12,
                                 "peak_frac": kb / tk_s / PEAK, "speedup": t_fp / tk_s, **variants, **kw}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del kf, vf, stores
            torch.cuda.empty_cache()
    return rows


def table(rows, presets):
    head = "| shape | B | context | fp16 SDPA µs (TB/s) | " + " | ".join(
        f"{p} µs (TB/s, % peak) | {p} speedup | {p} two-MMA / fast speedup" for p in presets) + " |"
    lines = [head, "|" + "---|" * (3 + 1 + 3 * len(presets))]
    for r in rows:
        cells = [r["shape"], str(r["batch"]), f"{r['context'] // 1024}K", f"{r['sdpa_us']:.1f} ({r['sdpa_tbps']:.2f})"]
        for p in presets:
            x = r[p]
            cells += [f"{x['us']:.1f} ({x['tbps']:.2f}, {100 * x['peak_frac']:.0f}%)", f"{x['speedup']:.2f}x",
                      f"{x['two_mma_speedup']:.2f}x / {x['fast_speedup']:.2f}x" if "fast_speedup" in x else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--sweep", action="store_true", help="also try other warps/splits/stages, keep the best")
    ap.add_argument("--out", default="benchmarks/results/decode_attention.json")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    rows = run(a.shapes, a.batches, a.contexts, a.presets, a.sweep)
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "peak_bytes_per_s": PEAK, "timing": "triton do_bench_cudagraph median"}
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(table(rows, a.presets))


if __name__ == "__main__":
    main()
