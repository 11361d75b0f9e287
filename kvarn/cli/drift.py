"""``kvarn drift --model M --text FILE [--field F --record I] --tokens N --out DIR``.

Pseudo-decodes a long text in chunks (docs/algorithm.md section 7): after each chunk its KV is quantized by each
method before later chunks attend. Measures static vs accumulated attention-output error per layer
and chunk, K/V error and its magnitude/direction decomposition, next-token KL, top-1 agreement and
perplexity, and (with --new-tokens) greedy generation against fp16. Writes DIR/drift.json,
DIR/summary.md and PNG plots.

--text takes a bundled corpus by name (wikitext2, reasoning, book; see kvarn/data/SOURCES.md) or a
file (.txt, .jsonl, either optionally .gz).

Example: kvarn drift --model smollm2-135m --text wikitext2 --tokens 2048 --out out/drift
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_parser(subparsers) -> None:
    from kvarn.cli import positive_int

    p = subparsers.add_parser("drift", help="error accumulation of quantized KV caches (pseudo-decode)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or local HF folder")
    p.add_argument("--text", default="wikitext2",
                   help="bundled corpus (wikitext2, reasoning, book) or a text / JSONL file (default: wikitext2)")
    p.add_argument("--field", default=None, help="JSONL field holding the text (default 'text')")
    p.add_argument("--record", type=int, default=None, help="JSONL record index (default: all records joined)")
    p.add_argument("--tokens", type=positive_int, default=2048, help="token budget (rounded down to whole chunks)")
    p.add_argument("--chunk", type=positive_int, default=None,
                   help="tokens per pseudo-decode chunk (default: the tile)")
    p.add_argument("--prefill", type=positive_int, default=None,
                   help="tokens of the first, exact pass, like a prompt (default: one chunk); kvarn-auto decides from it, "
                        "or at the first tile past the sink when it is shorter")
    p.add_argument("--auto-rules", type=_csv, default=None,
                   help="kvarn-auto decision rules to run, comma-separated: a2, a3, n2, r3 (the self-test), "
                        "each optionally @margin (default: a2)")
    p.add_argument("--ranges", type=_csv, default=None,
                   help="rounding ranges to run each method with, comma-separated: method (its own: min/max, "
                        "kvarn-auto's 2-bit quantiles for kvarn-auto), auto (kvarn-auto's for every method, key "
                        "suffix +q), minmax (min/max for every method, +minmax) (default: method)")
    p.add_argument("--methods", type=_csv, default=None, help="comma-separated methods (default: all)")
    p.add_argument("--presets", type=_csv, default=None, help="comma-separated presets (default: k2v2_g128,k4v2_g128)")
    p.add_argument("--sink-tokens", type=int, default=None, help="full-precision sink S (default: one tile)")
    p.add_argument("--quantize-sliding-window", action="store_true", help="also quantize sliding-window layers")
    p.add_argument("--prompt-tokens", type=int, default=512, help="free run: prompt = first P tokens of the text")
    p.add_argument("--new-tokens", type=int, default=0, help="free run: greedy tokens to generate (0: no free run)")
    p.add_argument("--bos", choices=["auto", "yes", "no"], default="auto",
                   help="start the ids with BOS (auto: for Gemma models, whose GGUF tokenizer omits it)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default="drift_out", help="output folder")
    p.set_defaults(func=_main)


def _main(args) -> int:
    import torch

    from kvarn import models
    from kvarn.analysis import load_text, parse_specs, run_drift, tokenize
    from kvarn.config import KVarNConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    ranges = [None if r == "method" else r for r in args.ranges] if args.ranges else None
    specs = parse_specs(args.methods, args.presets, args.auto_rules, ranges)
    tile = KVarNConfig.from_name(specs[0].preset).tile
    chunk = args.chunk or tile
    text = load_text(args.text, args.field, args.record)
    model, tokenizer = models.load(args.model)
    bos = args.bos == "yes" or (args.bos == "auto" and model.config.model_type.startswith("gemma"))
    input_ids = tokenize(tokenizer, text, args.tokens, multiple_of=chunk, bos=bos)
    log.info("%s: %d tokens of %s, chunk %d, %d method:preset pairs", args.model, input_ids.shape[1],
             args.text, chunk, len(specs))
    doc = run_drift(
        model, input_ids, specs, args.out, model_name=str(args.model), chunk=chunk,
        sink_tokens=args.sink_tokens, quantize_sliding_window=args.quantize_sliding_window,
        prompt_tokens=args.prompt_tokens if args.new_tokens else 0, new_tokens=args.new_tokens,
        tokenizer=tokenizer, progress=not args.no_progress, plots=not args.no_plots, prefill=args.prefill,
        extra={"text": {"path": str(args.text), "field": args.field, "record": args.record, "bos": bos}},
    )
    log.info("fp16 perplexity %.3f; results in %s", doc["fp16_perplexity"], args.out)
    return 0
