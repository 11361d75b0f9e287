"""``kvarn generate "PROMPT" --model M --method X --preset P --max-new-tokens N [--compare fp16] [--json]``.

Generates (greedy) with a KVarN cache and prints the text, tokens/s and the cache's memory report.
``--compare REF`` also runs REF on the same prompt and reports token agreement and the first
divergence. ``--json`` prints everything as one JSON object instead.

``--device cuda`` generates on a GPU; there the ``kvarn`` and ``kvarn-auto`` methods decode through
the fused attention (:mod:`kvarn.integrations.transformers.attention`: packed tiles read by the Triton kernel),
the other methods through the cache's own read path.
"""

from __future__ import annotations

import argparse
import json
import sys


# transformers' quantized caches (kvarn.cache.hf_baselines.HF_METHODS), named here so that building the
# parser does not import transformers; tests/cache/test_cache_hf_baselines.py checks the two agree.
HF_BASELINES = ("hf-hqq", "hf-quanto")


def add_parser(subparsers) -> None:
    from kvarn.cli import positive_int, preset_name
    from kvarn.methods import METHODS

    choices = sorted(METHODS) + list(HF_BASELINES)

    p = subparsers.add_parser("generate", help="generate text with a quantized KV cache",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the user prompt (wrapped in the chat template when the model has one)")
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or local HF folder")
    p.add_argument("--method", default="kvarn", choices=choices)
    p.add_argument("--preset", default="k2v2_g128", type=preset_name,
                   help="k2v2_g128, k4v2_g128, k4v4_g128, *_g64 (hf-* methods: k2v2_* or k4v4_* only)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--compare", default=None, choices=choices, help="also run this method and compare")
    p.add_argument("--sink-tokens", type=int, default=None, help="full-precision sink S (default: one tile)")
    p.add_argument("--tile", type=int, default=None, help="override the preset's tile size G")
    p.add_argument("--quantize-sliding-window", action="store_true", help="also quantize sliding-window layers")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu, cuda, cuda:1, ... (kvarn, kvarn-auto fused on CUDA)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_main)


def _overrides(args) -> dict:
    out = {}
    if args.tile is not None:
        out["tile"] = args.tile
    if args.sink_tokens is not None:
        out["sink_tokens"] = args.sink_tokens
    if args.quantize_sliding_window:
        out["quantize_sliding_window"] = True
    return out


def _main(args) -> int:
    import torch

    from kvarn import generation, models
    from kvarn.cli import torch_device
    from kvarn.config import KVarNConfig

    device = torch_device(args.device)
    KVarNConfig.from_name(args.preset, **_overrides(args))  # --tile / --sink-tokens refused before the model loads
    model, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype))
    kw = dict(chat=not args.no_chat, overrides=_overrides(args))
    if device.type == "cuda":
        from kvarn.integrations.transformers import attention as hf_attention

        model.to(device)
        hf_attention.use_fused(model)
        kw["cache_factory"] = hf_attention.cache_for
    if args.compare:
        result = generation.compare(model, tokenizer, args.prompt, methods=[args.method], preset=args.preset,
                                    max_new_tokens=args.max_new_tokens, reference=args.compare, **kw)
        main = result["runs"][0]
    else:
        main = generation.run(model, tokenizer, args.prompt, args.method, args.preset, args.max_new_tokens, **kw)
        result = {"prompt": args.prompt, "preset": args.preset, "runs": [main]}
    result["model"] = args.model
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    total = main["memory"]["total"]
    out = [
        main["text"], "",
        f"method {main['method']} preset {main['preset']} (sink {main['config']['sink_tokens']}, "
        f"tile {main['config']['tile']}): {main['new_tokens']} tokens in {main['seconds']:.1f} s, "
        f"{main['tokens_per_second']:.2f} tokens/s",
        f"KV cache: {total['total_bytes']} bytes stored ({total['quantized_bytes']} quantized, "
        f"{total['full_precision_bytes']} full precision) for {total['tokens']} token-rows; "
        f"the model's own {total['baseline_dtype']} cache would hold {total['baseline_bytes']}: "
        f"{total['compression_ratio']:.2f}x smaller ({total['compression_vs_fp16']:.2f}x smaller than fp16)",
    ]
    if args.compare:
        first = main["first_divergence"]
        out.append(
            f"vs {args.compare}: token agreement {100 * main['agreement']:.1f}% over {main['compared']} tokens, "
            + ("identical" if first is None else f"first divergence at new token {first}")
        )
        out += ["", generation.render_table(result)]
    print("\n".join(out))
    return 0
