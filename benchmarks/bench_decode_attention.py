"""Decode attention: kvarn Triton kernel vs fp16 SDPA (flash) over the same context, on one GPU.

Per shape x batch x context: median time (CUDA-graph replays, so launch gaps and Python are out),
bytes read (kvarn: sink + tail fp16, records of docs/algorithm.md section 4; fp16: K+V) and achieved
bandwidth.
Both sides read cold data: when one copy of a case's data is smaller than ``--cold-bytes``
(default 256 MB, five times the H200's L2), that many copies are made and consecutive calls cycle
through them, as consecutive layers of a model do (a 10 MB case replayed on one copy would be
served from L2 and look faster than it is). Tile contents are random codes and scales: speed does
not depend on the values. ``--sweep`` also times other warps / register caps / split counts and
reports the best beside the default; ``--head-flags`` also times kvarn-auto's decode (per-head
rotation flags, sink and tail in the model frame) against the spec's and against the fused cache's
kvarn path (sink and tail in the model frame, no flags). Prints a table and writes
JSON; asserts nothing.

    PYTHONPATH=. python benchmarks/bench_decode_attention.py --out benchmarks/results/decode_attention_h200.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench_cudagraph

from kvarn import kernels
from kvarn.config import KVarNConfig
try:
    from kvarn.kernels.decode_plan import plan_splits
except ImportError:  # a tree from before decode_plan.py (bench_decode_tail.py times other trees)
    from kvarn.kernels.decode import plan_splits
from kvarn.kernels.layout import empty_fields

SHAPES = {"llama8b_d128": (32, 8, 128), "d64": (32, 8, 64), "d256": (16, 8, 256)}
CONTEXTS = (4096, 16384, 65536, 131072)
BATCHES = (1, 8, 32)
PRESETS = ("k2v2_g128", "k4v2_g128")
# HBM bandwidth by device name (the vendors' figures), for the "% peak" column; other devices get none.
PEAK_BYTES_PER_S = {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H100 PCIe": 2.0e12}
# Knob settings tried with --sweep, by name: "splits" multiplies the two-wave plan's number of splits.
SWEEP = {
    "w2_s2": {"num_warps": 2, "num_stages": 2},
    "w2_s3": {"num_warps": 2, "num_stages": 3},
    "w2_s3_r168": {"num_warps": 2, "num_stages": 3, "max_registers": 168},
    "w2_s2_r144": {"num_warps": 2, "num_stages": 2, "max_registers": 144},
    "w1_s2": {"num_warps": 1, "num_stages": 2},
    "w1_s3": {"num_warps": 1, "num_stages": 3},
    "w1_s2_r168": {"num_warps": 1, "num_stages": 2, "max_registers": 168},
    "w1_s2_r192": {"num_warps": 1, "num_stages": 2, "max_registers": 192},
    "w1_s2_x0.5": {"num_warps": 1, "num_stages": 2, "splits": 0.5},
    "w1_s2_x2": {"num_warps": 1, "num_stages": 2, "splits": 2},
    "w2_s3_r168_x0.5": {"num_warps": 2, "num_stages": 3, "max_registers": 168, "splits": 0.5},
    "w2_s3_r168_x1.5": {"num_warps": 2, "num_stages": 3, "max_registers": 168, "splits": 1.5},
    "w2_s3_r168_x2": {"num_warps": 2, "num_stages": 3, "max_registers": 168, "splits": 2},
    "w2_s3_r168_x3": {"num_warps": 2, "num_stages": 3, "max_registers": 168, "splits": 3},
}


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


def cycling(make, nbytes, cold_bytes):
    """A callable over ``ceil(cold_bytes / nbytes)`` copies of a case, one copy per call in turn."""
    copies = [make() for _ in range(max(1, -(-cold_bytes // nbytes)))]
    state = {"i": 0}

    def call():
        fn = copies[state["i"] % len(copies)]
        state["i"] += 1
        return fn()

    return call


def bench(fn):
    return do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e-3  # seconds


def case_fns(b, hq, hk, d, t, cfg, dev, kw):
    """(make_sdpa, make_kvarn, fp bytes, kvarn bytes) for one cell; each make() builds one copy."""
    s, n, r = split_context(t, cfg)

    def make_sdpa():
        q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
        k = torch.randn(b, hk, t, d, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def make_kvarn():
        q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.float16)
        fp = torch.randn(2, b, hk, s + r, d, device=dev, dtype=torch.float16)
        tiles = random_fields(b, hk, n, d, cfg, dev)
        sk, sv, tk, tv = fp[0, :, :, :s], fp[1, :, :, :s], fp[0, :, :, s:], fp[1, :, :, s:]
        extra = dict(kw)
        if extra.pop("head_flags", False):  # kvarn-auto's path: per-head frames, about half unrotated
            extra.update(key_rotated=torch.rand(b, hk, device=dev) < 0.5,
                         value_rotated=torch.rand(b, hk, device=dev) < 0.5, fp_frame="model")
        return lambda: kernels.decode_attention(q, sk, sv, tiles, tk, tv, cfg, **extra)

    fp_bytes = b * hk * t * d * 2 * 2
    kv_bytes = b * hk * (n * cfg.record_bytes(d) + (s + r) * d * 2 * 2)
    return make_sdpa, make_kvarn, fp_bytes, kv_bytes


def run(shapes, batches, contexts, presets, sweep, cold_bytes, head_flags=False, peak=None):
    """The table's rows; ``peak``: the device's HBM bytes/s for the "% peak" column (None: "-" there)."""
    dev = torch.device("cuda")
    rows = []
    for shape in shapes:
        hq, hk, d = SHAPES[shape]
        for b in batches:
            for t in contexts:
                cfg0 = KVarNConfig.from_name(presets[0])
                make_sdpa, _, fp_bytes, _ = case_fns(b, hq, hk, d, t, cfg0, dev, {})
                if 2 * fp_bytes > 40e9:
                    continue
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    t_fp = bench(cycling(make_sdpa, fp_bytes, cold_bytes))
                row = {"shape": shape, "hq": hq, "hk": hk, "d": d, "batch": b, "context": t,
                       "sdpa_us": t_fp * 1e6, "sdpa_tbps": fp_bytes / t_fp / 1e12}
                for name in presets:
                    cfg = KVarNConfig.from_name(name)
                    s, n, r = split_context(t, cfg)
                    _, make_kv, _, kv_bytes = case_fns(b, hq, hk, d, t, cfg, dev, {})
                    t_kv = bench(cycling(make_kv, kv_bytes, cold_bytes))
                    cell = {"us": t_kv * 1e6, "bytes": kv_bytes, "tbps": kv_bytes / t_kv / 1e12,
                            "peak_frac": kv_bytes / t_kv / peak if peak else None, "speedup": t_fp / t_kv}
                    if head_flags:  # kvarn-auto, against the spec's kernel and against the fused cache's
                        _, make_fl, _, _ = case_fns(b, hq, hk, d, t, cfg, dev, {"head_flags": True})
                        _, make_mf, _, _ = case_fns(b, hq, hk, d, t, cfg, dev, {"fp_frame": "model"})
                        t_fl = bench(cycling(make_fl, kv_bytes, cold_bytes))
                        t_mf = bench(cycling(make_mf, kv_bytes, cold_bytes))
                        cell.update(flags_us=t_fl * 1e6, flags_vs_spec=t_fl / t_kv, model_frame_us=t_mf * 1e6,
                                    flags_vs_model_frame=t_fl / t_mf)
                    if sweep:
                        base_splits = plan_splits(b * hk, n, s + r, dev)[0]
                        tried = {}
                        for label, knobs in SWEEP.items():
                            kw = {k: v for k, v in knobs.items() if k != "splits"}
                            if "splits" in knobs:
                                kw["num_splits"] = max(1, round(base_splits * knobs["splits"]))
                            _, make_kv, _, _ = case_fns(b, hq, hk, d, t, cfg, dev, kw)
                            tried[label] = bench(cycling(make_kv, kv_bytes, cold_bytes)) * 1e6
                        best = min(tried, key=tried.get)
                        cell.update(sweep=tried, best=best, best_speedup=t_fp / (tried[best] * 1e-6))
                    row[name] = cell
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    return rows


def table(rows, presets):
    head = "| shape | B | context | fp16 SDPA µs (TB/s) | " + " | ".join(
        f"{p} µs (TB/s, % peak) | {p} speedup" for p in presets) + " |"
    lines = [head, "|" + "---|" * (4 + 2 * len(presets))]
    for r in rows:
        cells = [r["shape"], str(r["batch"]), f"{r['context'] // 1024}K", f"{r['sdpa_us']:.1f} ({r['sdpa_tbps']:.2f})"]
        for p in presets:
            x = r[p]
            best = f" (best {x['best_speedup']:.2f}x: {x['best']})" if "best" in x else ""
            flags = (f"; per-head flags {x['flags_us']:.1f} µs ({x['flags_vs_spec']:.3f}x, "
                     f"{x['flags_vs_model_frame']:.3f}x of the model frame)") if "flags_us" in x else ""
            frac = "-" if x["peak_frac"] is None else f"{100 * x['peak_frac']:.0f}%"
            cells += [f"{x['us']:.1f} ({x['tbps']:.2f}, {frac}){flags}", f"{x['speedup']:.2f}x{best}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--sweep", action="store_true", help="also try other warps/register caps/splits")
    ap.add_argument("--head-flags", action="store_true",
                    help="also time kvarn-auto's path (per-head rotation flags, sink and tail in the model frame)")
    ap.add_argument("--cold-bytes", type=int, default=256 << 20)
    ap.add_argument("--out", default="benchmarks/results/decode_attention.json")
    a = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    peak = PEAK_BYTES_PER_S.get(props.name)
    rows = run(a.shapes, a.batches, a.contexts, a.presets, a.sweep, a.cold_bytes, a.head_flags, peak)
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "peak_bytes_per_s": peak, "timing": "triton do_bench_cudagraph median, cold copies",
            "cold_bytes": a.cold_bytes}
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(table(rows, a.presets))


if __name__ == "__main__":
    main()
