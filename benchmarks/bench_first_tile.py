"""The cost of kvarn-auto's decision at the first tile past the sink (a prompt shorter than ``S + G``).

After a prompt of ``--prompt`` tokens, decode one token per step, eagerly, until a few steps past the
one that freezes the first tile past the sink, with ``kvarn`` and with ``kvarn-auto`` (rule a2), and
time every step (wall time; on CUDA with a synchronization per step). Per method, the median step
while kvarn-auto's rows wait (its steps run the query capture), the freezing step (kvarn-auto's
decides there, on the host plan), and the median step after it; and the decision's own time
(``decide_first_tile``, summed over the layers, synchronized around each call). On CUDA the caches are the fused ones (``hf_attention.fused_cache``; the steps after the
decision are the ones ``decode_greedy`` captures, see bench_e2e.py ``kvarn_auto_graph``).

    python benchmarks/bench_first_tile.py --model smollm2-135m --device cpu --out benchmarks/results/first_tile_cpu.json
    python benchmarks/bench_first_tile.py --shape llama8b --device cuda --out benchmarks/results/first_tile_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def load(args):
    if args.shape:
        import sys

        sys.path.insert(0, str(Path(__file__).parent))
        from bench_e2e import build_model

        return build_model(args.shape, args.device)
    from kvarn import models

    return models.load(args.model)[0].to(args.device).eval()


def make_cache(model, method: str, args, max_length: int):
    from kvarn import KVarNCache

    if args.device == "cuda":
        from kvarn.integrations.transformers import attention as hf_attention

        hf_attention.use_fused(model)
        return hf_attention.fused_cache(model, args.preset, method=method, max_length=max_length)
    return KVarNCache(model, method, args.preset, decoded_cache=True)


@torch.no_grad()
def run(model, method: str, args, ids: torch.Tensor) -> dict:
    from kvarn.auto import first_tile_tokens
    from kvarn.config import KVarNConfig

    import kvarn.auto.layer as cache_auto

    n = first_tile_tokens(KVarNConfig.from_name(args.preset))
    decide, spent = cache_auto.decide_first_tile, []

    def timed(*a, **kw):  # the decision's own time, apart from the rest of its step
        sync()
        t0 = time.perf_counter()
        row = decide(*a, **kw)
        sync()
        spent.append(time.perf_counter() - t0)
        return row
    steps = n + 4 - args.prompt
    cache = make_cache(model, method, args, args.prompt + steps + 1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    cache_auto.decide_first_tile = timed
    try:
        return _steps(model, cache, ids, steps, sync, method, spent)
    finally:
        cache_auto.decide_first_tile = decide


def _steps(model, cache, ids, steps, sync, method, spent) -> dict:
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1:].argmax(-1)
    times, frozen_at = [], None
    for i in range(steps):
        sync()
        t0 = time.perf_counter()
        out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1:].argmax(-1)
        sync()
        times.append(time.perf_counter() - t0)
        layer = next(la for la in cache.layers if hasattr(la, "store") and getattr(la, "is_initialized", False))
        if frozen_at is None and layer.store.counts[0] > 0:
            frozen_at = i
    decided = {r[0]["decided_at"] for r in cache.flavours().values() if r} if method == "kvarn-auto" else None
    ms = [t * 1e3 for t in times]
    return {"waiting_ms": statistics.median(ms[2:frozen_at]), "freeze_step_ms": ms[frozen_at],
            "after_ms": statistics.median(ms[frozen_at + 1:]), "frozen_at_step": frozen_at,
            "decided_at": sorted(decided) if decided else None, "decision_ms": sum(spent) * 1e3,
            "decided_layers": len(spent)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="bundled model (ignored with --shape)")
    ap.add_argument("--shape", default=None, choices=[None, "tiny", "llama8b"], help="bench_e2e's random model")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", default="k2v2_g128")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per method (medians reported)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load(args)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(args.device)
    rows = {}
    for method in ("kvarn", "kvarn-auto"):
        run(model, method, args, ids)  # warm-up: kernel compilation, numba's cache, allocator
    for method in ("kvarn", "kvarn-auto"):
        runs = [run(model, method, args, ids) for _ in range(args.repeats)]
        rows[method] = {k: statistics.median(r[k] for r in runs) if isinstance(runs[0][k], float) else runs[0][k]
                        for k in runs[0]}
    cost = rows["kvarn-auto"]["decision_ms"]
    print(f"{args.shape or args.model} on {args.device}, {args.preset}, prompt {args.prompt}: step ms "
          "(waiting / the step that freezes the first tile / after)")
    for method, r in rows.items():
        print(f"  {method:10s} {r['waiting_ms']:8.2f} {r['freeze_step_ms']:8.2f} {r['after_ms']:8.2f}"
              f"  decided: {r['decided_at']}")
    print(f"  the decision itself (decide_first_tile, {rows['kvarn-auto']['decided_layers']} layers): {cost:.2f} ms; "
          f"its step over kvarn's: {rows['kvarn-auto']['freeze_step_ms'] - rows['kvarn']['freeze_step_ms']:+.2f} ms")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "decision_ms": cost}, indent=1) + "\n")


if __name__ == "__main__":
    main()
