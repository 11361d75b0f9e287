"""Decode attention time against the fp16 tail's length, laid out as the fused cache keeps it.

The fused cache (``attn_implementation="kvarn"``) holds a 128-token fp16 sink, the tiles, and a
tail buffer of G tokens whose length lives on the device and grows by one token a step; the sink
and tail are read in the model frame. Table 1 (``bench_decode_attention.py``) sizes the tail to the
context instead. Here the tail buffer is full-size and only its length changes, so the rows show
how a decode step's attention moves over one tile cycle (tail 4 -> 124 tokens) and how much of it
is the fp programs alone (``fp_only``: no tiles, the sink and the same tail). ``--alt-fp-splits N``
also times N programs over the sink and tail with one tile split fewer (same launch width).
Median of CUDA-graph replays over cold copies (as table 1). Prints a table, writes JSON; asserts
nothing.

    PYTHONPATH=. python benchmarks/bench_decode_tail.py --out benchmarks/results/decode_tail_h200.json
"""

from __future__ import annotations

import argparse
import json

import torch

from bench_decode_attention import bench, cycling, random_fields
from kvarn import kernels
from kvarn.config import KVarNConfig
try:
    from kvarn.kernels.decode_plan import WIDE_BATCH, plan_splits
except ImportError:  # a tree from before decode_plan.py (the script times other trees too)
    from kvarn.kernels.decode import WIDE_BATCH, plan_splits

HQ, HK, D, SINK = 32, 8, 128, 128  # Llama-3.1-8B's attention


def n_tiles(t, cfg):
    """Whole tiles between the sink and a full tail buffer in a ``t``-token context."""
    return (t - SINK) // cfg.tile - 1


def case(b, t, tail, cfg, dev, kw, with_tiles=True):
    """make() for one copy of a fused-cache-like decode: sink, ``t`` tokens in tiles, a G-token
    tail buffer holding ``tail`` tokens."""
    n = n_tiles(t, cfg)

    def make():
        q = torch.randn(b, HQ, 1, D, device=dev, dtype=torch.float16)
        fp = torch.randn(2, b, HK, SINK + cfg.tile, D, device=dev, dtype=torch.float16)
        tiles = random_fields(b, HK, n, D, cfg, dev) if with_tiles else None
        sk, sv = fp[0, :, :, :SINK], fp[1, :, :, :SINK]
        tk, tv = fp[0, :, :, SINK:], fp[1, :, :, SINK:]
        lengths = torch.full((b,), tail, device=dev, dtype=torch.int32)
        return lambda: kernels.decode_attention(q, sk, sv, tiles, tk, tv, cfg, fp_frame="model",
                                                tail_lengths=lengths, **kw)

    nbytes = b * HK * ((n * cfg.record_bytes(D) if with_tiles else 0) + (SINK + cfg.tile) * D * 4)
    return make, nbytes


def run(batches, contexts, tails, preset, alt_fp, cold_bytes):
    dev = torch.device("cuda")
    cfg = KVarNConfig.from_name(preset)
    rows = []
    for b in batches:
        for i, t in enumerate(contexts):
            for tail in tails:
                row = {"batch": b, "context": t, "tail": tail}
                make, nbytes = case(b, t, tail, cfg, dev, {})
                row["planned_us"] = bench(cycling(make, nbytes, cold_bytes)) * 1e6
                if alt_fp and b * HK >= WIDE_BATCH:  # one wave: the default plan's tile splits, minus one
                    splits = plan_splits(b * HK, n_tiles(t, cfg), SINK + cfg.tile, dev, waves=1)[0] - 1
                    make, nbytes = case(b, t, tail, cfg, dev, {"num_splits": splits, "fp_splits": alt_fp})
                    row["alt_fp_us"] = bench(cycling(make, nbytes, cold_bytes)) * 1e6
                if i == 0:  # the fp programs do not depend on the context
                    make, nbytes = case(b, t, tail, cfg, dev, {}, with_tiles=False)
                    row["fp_only_us"] = bench(cycling(make, nbytes, cold_bytes)) * 1e6
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(rows):
    lines = ["| B | context | tail | planned µs | fp programs alone µs | alternative fp split µs |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        fp = f"{r['fp_only_us']:.1f}" if "fp_only_us" in r else ""
        alt = f"{r['alt_fp_us']:.1f}" if "alt_fp_us" in r else ""
        lines.append(f"| {r['batch']} | {r['context'] // 1024}K | {r['tail']} | {r['planned_us']:.1f} | {fp} | {alt} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 16, 32])
    ap.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--tails", nargs="+", type=int, default=[4, 64, 124])
    ap.add_argument("--preset", default="k4v2_g128")
    ap.add_argument("--alt-fp-splits", type=int, default=0)
    ap.add_argument("--cold-bytes", type=int, default=256 << 20)
    ap.add_argument("--out", default="benchmarks/results/decode_tail.json")
    a = ap.parse_args()
    if a.alt_fp_splits < 0:
        raise SystemExit(f"--alt-fp-splits {a.alt_fp_splits}: 0 (off) or a number of fp programs >= 1")
    g = KVarNConfig.from_name(a.preset).tile
    if any(not 1 <= r <= g for r in a.tails):
        raise SystemExit(f"--tails {a.tails}: each must be 1..{g} (the tail buffer holds one tile of {a.preset})")
    props = torch.cuda.get_device_properties(0)
    rows = run(a.batches, a.contexts, a.tails, a.preset, a.alt_fp_splits, a.cold_bytes)
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "preset": a.preset, "timing": "triton do_bench_cudagraph median, cold copies"}
    with open(a.out, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
