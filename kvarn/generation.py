"""Generation with a :class:`kvarn.KVarNCache`, and side-by-side comparison of methods.

``run(model, tokenizer, prompt, method, preset, max_new_tokens)`` generates once (greedy by default)
and returns the text, the new token ids, the speed and the cache's memory report.
``compare(...)`` runs several methods on the same prompt and scores each against a reference
method (``fp16`` by default) with :func:`agreement`; ``render_table`` formats the result as Markdown.

Agreement of a token sequence ``y`` with the reference ``r``: the fraction of positions
``i < max(len(r), len(y))`` where both have a token and ``y[i] == r[i]``; ``first_divergence`` is the
first such ``i`` where they differ (None when identical). After a divergence the two texts usually
go separate ways, so ``first_divergence`` is the sharper measure.
"""

from __future__ import annotations

import logging
import time

import torch

from .cache import KVarNCache

logger = logging.getLogger(__name__)

__all__ = ["encode_prompt", "run", "agreement", "compare", "render_table"]


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> dict:
    """Token ids ``{"input_ids", "attention_mask"}`` ``[1, T]``; the chat template when available."""
    if chat and getattr(tokenizer, "chat_template", None):
        return dict(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True,
        ))
    return dict(tokenizer(prompt, return_tensors="pt"))


@torch.no_grad()
def run(model, tokenizer, prompt: str, method: str = "kvarn", preset: str = "k2v2_g128",
        max_new_tokens: int = 256, *, chat: bool = True, do_sample: bool = False,
        overrides: dict | None = None, decoded_cache: bool = True, cache_factory=None,
        **generate_kwargs) -> dict:
    """Generate with one method. Returns ``{"method", "preset", "config", "text", "token_ids",
    "prompt_tokens", "new_tokens", "seconds", "tokens_per_second", "memory"}``.

    ``decoded_cache`` keeps frozen tiles dequantized once (see :class:`kvarn.KVarNCache`): same
    tokens, much faster on CPU; the memory report counts it apart as ``decoded_cache_bytes``.
    ``cache_factory(model, method, preset, **overrides)``: builds the cache instead (for example
    :func:`kvarn.integrations.transformers.attention.cache_for`, the fused cache on a GPU); ``decoded_cache``
    is then the factory's business.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if cache_factory is not None:
        cache = cache_factory(model, method, preset, **(overrides or {}))
    else:
        cache = KVarNCache(model, method, preset, decoded_cache=decoded_cache, **(overrides or {}))
    inputs = encode_prompt(tokenizer, prompt, chat)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    n_prompt = inputs["input_ids"].shape[1]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens,
                         do_sample=do_sample, pad_token_id=pad, **generate_kwargs)
    seconds = time.perf_counter() - start
    ids = out[0, n_prompt:].tolist()
    logger.info("%s: %d tokens in %.1f s", method, len(ids), seconds)
    return {
        "method": cache.method.name,
        "preset": preset if isinstance(preset, str) else cache.config.name,
        "config": {k: getattr(cache.config, k) for k in ("key_bits", "value_bits", "tile", "sink_tokens",
                                                         "sinkhorn_iters", "quantize_sliding_window")},
        "text": tokenizer.decode(ids, skip_special_tokens=True),
        "token_ids": ids,
        "prompt_tokens": n_prompt,
        "new_tokens": len(ids),
        "seconds": seconds,
        "tokens_per_second": len(ids) / seconds if seconds > 0 else float("inf"),
        "memory": cache.memory_report(),
    }


def agreement(reference: list[int], tokens: list[int]) -> dict:
    """``{"agreement", "first_divergence", "compared"}`` of ``tokens`` against ``reference``."""
    n = max(len(reference), len(tokens))
    same = sum(1 for a, b in zip(reference, tokens) if a == b)
    first = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if first is None and len(reference) != len(tokens):
        first = min(len(reference), len(tokens))
    return {"agreement": same / n if n else 1.0, "first_divergence": first, "compared": n}


def compare(model, tokenizer, prompt: str, methods=("fp16", "kivi", "kvarn"), preset: str = "k2v2_g128",
            max_new_tokens: int = 256, *, reference: str = "fp16", chat: bool = True,
            overrides: dict | None = None, cache_factory=None, progress: bool = False) -> dict:
    """Run every method (and the reference, once) on ``prompt``; score each against the reference.

    Returns ``{"prompt", "preset", "reference", "max_new_tokens", "runs": [run + agreement +
    "memory_vs_reference"]}`` in the order of ``methods``; ``memory_vs_reference`` is the method's
    stored bytes over the reference's. ``progress``: a progress bar over the methods.
    """
    from tqdm.auto import tqdm

    order = list(dict.fromkeys([reference, *methods]))
    runs = {}
    for m in tqdm(order, desc="generate", unit="method", disable=not progress):
        runs[m] = run(model, tokenizer, prompt, m, preset, max_new_tokens, chat=chat, overrides=overrides,
                      cache_factory=cache_factory)
    ref = runs[reference]
    ref_bytes = ref["memory"]["total"]["total_bytes"]
    out = []
    for m in dict.fromkeys(methods):
        r = dict(runs[m])
        r.update(agreement(ref["token_ids"], r["token_ids"]))
        total = r["memory"]["total"]["total_bytes"]
        r["memory_vs_reference"] = total / ref_bytes if ref_bytes else 1.0
        out.append(r)
    return {"prompt": prompt, "preset": preset, "reference": reference,
            "max_new_tokens": max_new_tokens, "runs": out}


def render_table(result: dict) -> str:
    """Markdown table of a :func:`compare` result: one row per method."""
    ref = result["reference"]
    dtype = result["runs"][0]["memory"]["total"].get("baseline_dtype") if result["runs"] else None
    lines = [
        f"| method | tokens | tok/s | agreement vs {ref} | first divergence | KV bytes "
        f"| x smaller than the model's {dtype} cache | x smaller than fp16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        total = r["memory"]["total"]
        first = "-" if r["first_divergence"] is None else str(r["first_divergence"])
        lines.append(
            f"| {r['method']} | {r['new_tokens']} | {r['tokens_per_second']:.1f} | {100 * r['agreement']:.1f}% "
            f"| {first} | {total['total_bytes'] / 1024:.0f} KiB | {total['compression_ratio']:.2f} "
            f"| {total['compression_vs_fp16']:.2f} |"
        )
    return "\n".join(lines)
