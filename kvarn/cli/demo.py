"""``kvarn demo``: the main job on the bundled SmolLM2-135M.

1. A reasoning prompt answered with fp16, KIVI and KVarN at the same preset, side by side: token
   agreement with fp16, first divergence, KV memory.
2. Reconstruction of real KV captured from the model on a WikiText-2 excerpt, for every preset:
   per-layer SQNR and the worst token-norm error of KVarN against plain per-channel RTN (KIVI),
   and bytes per token with the compression ratio.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

SHOTS = 4  # worked GSM8K examples before the question: a ~500-token prompt, so several tiles freeze


def default_prompt(shots: int = SHOTS) -> str:
    """A few-shot GSM8K prompt: long enough that the cache holds quantized tiles from the prompt on."""
    import re

    from kvarn.eval import load_task

    records = load_task("gsm8k")
    parts = []
    for r in records[:shots]:
        worked = re.sub(r"<<[^>]*>>", "", r["solution"]).replace("####", "The answer is")
        parts.append(f"Question: {r['question']}\nAnswer: {worked}")
    parts.append(f"Question: {records[shots]['question']}\nAnswer: reason step by step, then give the answer.")
    return "\n\n".join(parts)
EXCERPT = Path(__file__).resolve().parents[1] / "data" / "wikitext_excerpt.txt"


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="generation and reconstruction demo on the bundled SmolLM2")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--preset", default="k2v2_g128", help="preset for the generation comparison")
    p.add_argument("--methods", nargs="+", default=["fp16", "kivi", "kvarn"])
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="model dtype; the full-precision sink and tail are stored in it")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--prompt", default=None, help="default: a 4-shot GSM8K prompt")
    p.add_argument("--kv-tokens", type=int, default=512, help="tokens of real KV for the reconstruction tables")
    p.add_argument("--out", type=Path, default=None, help="also write demo.json here")
    p.set_defaults(func=_run)


def reconstruction_tables(kv, presets) -> tuple[str, dict]:
    """Markdown tables + JSON of KVarN vs per-channel RTN (KIVI) reconstruction on real KV."""
    from kvarn import KVarNConfig
    from kvarn.reconstruction import reconstruction_report

    d = kv[0][0].shape[-1]
    data, summary = {}, [
        "| preset | B/token/KV head | x vs fp16 | K SQNR kvarn / kivi (dB) | V SQNR kvarn / kivi (dB) "
        "| worst key-norm err kvarn / kivi | worst-5% key-norm err kvarn / kivi |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in presets:
        cfg = KVarNConfig.from_name(name)
        rows = {m: reconstruction_report(kv, m, cfg) for m in ("kvarn", "kivi")}
        data[name] = rows
        mean = lambda m, f: sum(r[f] for r in rows[m]) / len(rows[m])
        worst = lambda m: max(r["k_norm_err_max"] for r in rows[m])
        summary.append(
            f"| {name} | {cfg.bytes_per_token(d):.0f} | {cfg.compression_ratio(d):.2f} "
            f"| {mean('kvarn', 'k_sqnr_db'):.1f} / {mean('kivi', 'k_sqnr_db'):.1f} "
            f"| {mean('kvarn', 'v_sqnr_db'):.1f} / {mean('kivi', 'v_sqnr_db'):.1f} "
            f"| {worst('kvarn'):.3f} / {worst('kivi'):.3f} "
            f"| {mean('kvarn', 'k_norm_err_top5'):.3f} / {mean('kivi', 'k_norm_err_top5'):.3f} |"
        )
    first = presets[0]
    per_layer = [
        f"Per layer, {first}: SQNR (dB) and worst relative key-norm error, KVarN vs per-channel RTN (KIVI)",
        "",
        "| layer | K kvarn | K kivi | V kvarn | V kivi | worst key-norm err kvarn | kivi |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(data[first]["kvarn"], data[first]["kivi"]):
        per_layer.append(
            f"| {a['layer']} | {a['k_sqnr_db']:.1f} | {b['k_sqnr_db']:.1f} | {a['v_sqnr_db']:.1f} "
            f"| {b['v_sqnr_db']:.1f} | {a['k_norm_err_max']:.3f} | {b['k_norm_err_max']:.3f} |"
        )
    return "\n".join(per_layer) + "\n\n" + "\n".join(summary), data


def _run(args) -> int:
    from kvarn import PRESETS, models
    from kvarn.generation import compare, render_table

    import torch

    model, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype))
    prompt = args.prompt or default_prompt()
    logger.info("generating %d tokens with %s at %s", args.max_new_tokens, ", ".join(args.methods), args.preset)
    result = compare(model, tokenizer, prompt, methods=args.methods, preset=args.preset,
                     max_new_tokens=args.max_new_tokens)
    print(f"\n## Generation on {args.model} ({args.dtype}), preset {args.preset}, greedy, "
          f"{args.max_new_tokens} new tokens\n")
    print(f"Prompt ({result['runs'][0]['prompt_tokens']} tokens, ends with): ...{prompt[-300:]}\n")
    print(render_table(result))
    for r in result["runs"]:
        print(f"\n### {r['method']}\n{r['text'].strip()}")

    text = EXCERPT.read_text(encoding="utf-8")
    kv = models.capture_kv(model, tokenizer, text, args.kv_tokens)
    tables, data = reconstruction_tables(kv, [args.preset] + [p for p in sorted(PRESETS) if p != args.preset])
    print(f"\n## Reconstruction of real KV ({args.model}, {kv[0][0].shape[2]} WikiText-2 tokens)\n")
    print(tables)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "demo.json").write_text(json.dumps({"generation": result, "reconstruction": data}, indent=2))
    return 0
