"""``kvarn demo``: the point of KVarN in one run on the bundled SmolLM2-135M.

1. Pseudo-decode of a WikiText-2 passage (docs/algorithm.md section 7) with each method of
   :data:`DEMO_METHODS`: attention-output error against a full-precision shadow, static (local)
   and accumulated (what decoding with the quantized cache really sees), drawn over context length
   as ``drift/mae_vs_context.png`` by :mod:`kvarn.analysis`.
2. A greedy generation from the start of the passage with each method, side by side, with the KV
   bytes each cache held.
3. ``demo.md``: one screen with the memory saved, the error after N tokens and the figure's path.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import textwrap
import time
from pathlib import Path

logger = logging.getLogger(__name__)

#: The methods the demo compares, in order; fp16 is the reference. Append a method name to show it.
DEMO_METHODS = ["fp16", "kivi", "kvarn", "kvarn-auto"]
# An exact first pass of two tiles: kvarn-auto decides from it (sink + one full tile past it).
PREFILL = 256
INSTRUCTION = "\n\nSummarize the text above in two sentences."


def add_parser(sub) -> None:
    from kvarn.cli import positive_int, preset_name

    p = sub.add_parser("demo", help="error accumulation and generation on the bundled SmolLM2, with a PNG")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--preset", default="k2v2_g128", type=preset_name)
    p.add_argument("--methods", nargs="+", default=DEMO_METHODS, help="first one is the reference")
    p.add_argument("--text", default="wikitext2", help="bundled corpus name or a text file")
    p.add_argument("--tokens", type=positive_int, default=1024, help="pseudo-decode length (whole tiles)")
    p.add_argument("--prompt-chars", type=positive_int, default=1500,
                   help="characters of the text in the generation prompt")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=Path("demo_out"))
    p.set_defaults(func=_run)


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def error_rows(doc: dict, methods: list[str], preset: str) -> list[dict]:
    """Per method: static and accumulated attention-output MAE at the last chunk and on average over
    the chunks that attend to quantized history (the first chunks only see the full-precision sink)."""
    rows = []
    for m in methods:
        entry = doc["methods"][f"{m}:{preset}"]
        s, a = entry["static_mae"], entry["accumulated_mae"]
        live = [i for i, x in enumerate(a) if x] or list(range(len(a)))
        rows.append({"method": m, "static_last": s[-1], "accumulated_last": a[-1],
                     "static_mean": _mean([s[i] for i in live]), "accumulated_mean": _mean([a[i] for i in live]),
                     "kl_last": entry["kl"][-1], "top1": _mean(entry["top1_agreement"])})
    return rows


def projected_bytes(method: str, preset: str, *, layers: int, kv_heads: int, head_dim: int, tokens: int,
                    esize: int) -> int:
    """Stored KV bytes of one sequence of ``tokens`` tokens with the accounting of
    ``KVarNCache.memory_report`` (sink and tail at ``esize`` bytes per element, tiles at the method's
    bytes), once every complete tile is frozen."""
    from kvarn import KVarNConfig
    from kvarn.methods import TileCodec

    cfg = KVarNConfig.from_name(preset)
    codec = TileCodec(method, cfg)
    fp_token = kv_heads * head_dim * 2 * esize
    if codec.method.fmt == "none":
        return layers * tokens * fp_token
    sink = min(tokens, cfg.sink_tokens)
    tiles = (tokens - sink) // cfg.tile
    tail = tokens - sink - tiles * cfg.tile
    return layers * ((sink + tail) * fp_token + round(tiles * cfg.tile * kv_heads * codec.bytes_per_token(head_dim)))


def summary_markdown(*, model: str, preset: str, dtype: str, tokens: int, text: str, errors: list[dict],
                     generation: dict, figure: Path, seconds: float, projected: dict | None = None) -> str:
    """The one-screen summary: memory, error after ``tokens`` tokens, figure path."""
    from kvarn.config import KVarNConfig

    ref = generation["reference"]
    cfg = KVarNConfig.from_name(preset)  # the sink and the pseudo-decode's chunk (one tile) of the preset
    lines = [
        f"# kvarn demo: {model}, {preset}, model dtype {dtype}",
        "",
        f"## Memory: the KV cache after a {generation['runs'][0]['prompt_tokens']}-token prompt and "
        f"{generation['max_new_tokens']} new tokens",
        "",
        f"| method | KV bytes | x smaller than the model's {dtype} cache | x smaller than fp16 "
        f"| tokens identical to {ref} | first divergence |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in generation["runs"]:
        t = r["memory"]["total"]
        first = "none" if r["first_divergence"] is None else str(r["first_divergence"])
        lines.append(f"| {r['method']} | {t['total_bytes'] / 1024:.0f} KiB | {t['compression_ratio']:.2f} "
                     f"| {t['compression_vs_fp16']:.2f} | {100 * r['agreement']:.0f}% | {first} |")
    if projected:
        ctx = sorted(next(iter(projected.values())))
        ref_bytes = projected.get(ref)
        lines += ["", f"The sink (first {cfg.sink_tokens} tokens) and the unfinished last tile stay in {dtype}, "
                  "so the saving grows with the context; the same accounting for one longer sequence, x smaller "
                  f"than the model's {dtype} cache:", "",
                  "| method | " + " | ".join(f"{n} tokens" for n in ctx) + " |",
                  "|---|" + "---:|" * len(ctx)]
        for m, by_len in projected.items():
            cells = [f"{by_len[n] / 2**20:.1f} MiB ({ref_bytes[n] / by_len[n]:.2f}x)" if ref_bytes else
                     f"{by_len[n] / 2**20:.1f} MiB" for n in ctx]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "See docs/algorithm.md section 4 for the bytes per token of each preset.",
        "",
        f"## Error after {tokens} tokens of {text} (pseudo-decode, chunks of {cfg.tile} tokens)",
        "",
        "Attention-output mean absolute error against a full-precision shadow, mean over layers. *Static*: "
        "the exact activations meet the quantized history (the local error). *Accumulated*: the model runs "
        "on its quantized cache, so errors feed into later layers and tokens.",
        "",
        f"| method | static @ {tokens} | accumulated @ {tokens} | accumulated / static "
        f"| next-token KL @ {tokens} | top-1 = {ref} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for e in errors:
        ratio = e["accumulated_last"] / e["static_last"] if e["static_last"] else float("nan")
        lines.append(f"| {e['method']} | {e['static_last']:.4f} | {e['accumulated_last']:.4f} "
                     f"| {_fmt(ratio, '.2f')} | {e['kl_last']:.4f} | {100 * e['top1']:.1f}% |")
    by = {e["method"]: e for e in errors}
    if "kivi" in by and "kvarn" in by and by["kvarn"]["accumulated_last"]:
        lines += ["", f"KVarN's accumulated error at {tokens} tokens is "
                      f"{by['kivi']['accumulated_last'] / by['kvarn']['accumulated_last']:.2f}x lower than KIVI's "
                      "at the same bits."]
    lines += ["", f"Figure (static and accumulated error over context): `{figure}`", "",
              f"Run time {seconds:.0f} s."]
    return "\n".join(lines) + "\n"


def _fmt(x: float, spec: str) -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


def side_by_side(generation: dict, width: int | None = None, max_lines: int = 14) -> str:
    """The generated texts in columns, one per method, wrapped to the terminal width."""
    runs = generation["runs"]
    width = width or shutil.get_terminal_size((120, 24)).columns
    col = max(20, (width - 3 * (len(runs) - 1)) // len(runs))
    heads, bodies = [], []
    for r in runs:
        first = "same as " + generation["reference"] if r["first_divergence"] is None else \
            f"differs from token {r['first_divergence']}"
        # Wrapped, not cut: "differs from token 16" cut to the column would read "token 1".
        heads.append(textwrap.wrap(f"{r['method']} ({first})", col))
        bodies.append(textwrap.wrap(" ".join(r["text"].split()), col)[:max_lines])
    n_head = max(len(h) for h in heads)
    cols = [h + [""] * (n_head - len(h)) + ["-" * col] + b for h, b in zip(heads, bodies)]
    height = max(len(c) for c in cols)
    return "\n".join(" | ".join(c[i].ljust(col) if i < len(c) else " " * col for c in cols).rstrip()
                     for i in range(height))


def _run(args) -> int:
    import torch

    from kvarn import models
    from kvarn.analysis import load_text, parse_specs, run_drift, tokenize
    from kvarn.generation import compare

    if args.tokens < PREFILL + 128:  # the text is cut to whole 128-token chunks; the prefill is exact
        raise SystemExit(f"kvarn demo: --tokens {args.tokens} leaves nothing to measure after the exact "
                         f"{PREFILL}-token prefill; use --tokens {PREFILL + 128} or more")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    methods = list(dict.fromkeys(args.methods))
    specs = parse_specs(methods, [args.preset])  # unknown methods are refused before the model loads
    model, tokenizer = models.load(args.model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    text = load_text(args.text)
    ids = tokenize(tokenizer, text, args.tokens, multiple_of=128)
    out = Path(args.out)
    doc = run_drift(model, ids, specs, out / "drift", model_name=args.model,
                    progress=not args.no_progress, extra={"text": str(args.text)}, prefill=PREFILL)
    figure = out / "drift" / "mae_vs_context.png"
    prompt = text[: args.prompt_chars].rsplit(" ", 1)[0] + INSTRUCTION
    generation = compare(model, tokenizer, prompt, methods=methods, preset=args.preset,
                         max_new_tokens=args.max_new_tokens, reference=methods[0], progress=not args.no_progress)
    cfg = model.config
    shape = dict(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                 head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                 esize=next(model.parameters()).element_size())
    projected = {m: {n: projected_bytes(m, args.preset, tokens=n, **shape) for n in (int(ids.shape[1]), 8192)}
                 for m in methods}
    seconds = time.perf_counter() - start
    summary = summary_markdown(model=args.model, preset=args.preset, dtype=dtype, tokens=int(ids.shape[1]),
                               text=str(args.text), errors=error_rows(doc, methods, args.preset),
                               generation=generation, figure=figure, seconds=seconds, projected=projected)
    (out / "demo.md").write_text(summary, encoding="utf-8")
    (out / "generation.json").write_text(json.dumps(generation, indent=1), encoding="utf-8")
    print("\n" + summary)
    print(f"## Generation, greedy, {args.max_new_tokens} new tokens (prompt: the first {args.prompt_chars} "
          f"characters of {args.text} and \"{INSTRUCTION.strip()}\")\n")
    print(side_by_side(generation))
    print(f"\nSummary: {out / 'demo.md'}   figure: {figure}")
    return 0
