"""Outputs of ``kvarn drift``: ``drift.json`` (stable shape, read by other tools), PNG plots and a
Markdown summary.

``drift.json``::

    {"model": str, "tokens": int, "chunk": int,
     "methods": {"<method>:<preset>": {
         "positions": [chunk end positions], "static_mae": [...], "accumulated_mae": [...],
         "kl": [...], "top1_agreement": [...],
         "k_magnitude_error_top5": float, "k_direction_error_top5": float,
         "v_magnitude_error_top5": float, "v_direction_error_top5": float, ...more fields}},
     ...more fields}

``*_mae`` are averaged over all attention layers (layers kept in full precision included), one value
per chunk; ``*_quantized_layers`` variants average over the quantized layers only. Magnitude and
direction errors are per-token squared errors divided by the mean squared norm of the tokens of the
same layer and head (static regime); ``*_top5`` average them over the worst 5% of tokens by total
error, ``*_mean`` over all tokens.

``kl_after_prefill`` / ``perplexity_after_prefill`` cover only the chunks after the exact first pass
(``prefill`` tokens), the accumulated-regime figures. ``chunk_targets`` (per pass: the tokens it
predicts), ``fp16_chunk_nll`` and each method's ``chunk_nll`` (per pass: the summed negative
log-likelihood) give the same over any later range of passes. ``prompt_diagnostics[preset][layer]`` and, for
kvarn-auto, ``auto_decisions[layer]`` hold :meth:`kvarn.auto.decision.RowDecision.summary` per quantized layer:
per KV head the prompt's key logit error with rotated (KVarN) and unrotated (VarN) keys, the
correlation of log key variance with log query energy over channels, and the chosen flags.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .freerun import FreeRun
from .results import DriftRun, MethodDrift


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _layer_mean(per_layer: list[list[float]], layers: list[int] | None = None) -> list[float]:
    rows = per_layer if layers is None else [per_layer[i] for i in layers]
    if not rows:
        return [0.0] * (len(per_layer[0]) if per_layer else 0)
    return [_mean(col) for col in zip(*rows)]


def _clean(x):
    """NaN/inf -> None, recursively, so the JSON is standard."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _after_prefill(run: DriftRun, kl: list[float], chunk_nll: list[float]) -> tuple[float, float]:
    """Mean KL over the chunks after the first pass, and the perplexity of their targets."""
    if len(run.chunk_targets) < 2 or len(chunk_nll) != len(run.chunk_targets):
        return float("nan"), float("nan")
    n = sum(run.chunk_targets[1:])
    weights = run.chunk_targets[1:]
    kl_mean = sum(k * w for k, w in zip(kl[1:], weights)) / n if n else float("nan")
    return kl_mean, math.exp(sum(chunk_nll[1:]) / n) if n else float("nan")


def method_entry(run: DriftRun, r: MethodDrift) -> dict:
    q = r.quantized_layers
    kd, vd = r.k_decomposition, r.v_decomposition
    kl_after, ppl_after = _after_prefill(run, r.kl, r.chunk_nll)
    extra = {"auto_rule": r.auto_rule, "auto_decisions": {str(k): v for k, v in r.decisions.items()}} \
        if r.decisions is not None else {}
    if r.quantiles is not None:  # (keys, values): 0 is min/max, q the rows' [q, 1 - q] quantiles
        extra["quantiles"] = list(r.quantiles)
    return {
        "kl_after_prefill": kl_after,
        "perplexity_after_prefill": ppl_after,
        **extra,
        "positions": run.positions,
        "static_mae": _layer_mean(r.static_mae_layers),
        "accumulated_mae": _layer_mean(r.accumulated_mae_layers),
        "kl": r.kl,
        "chunk_nll": r.chunk_nll,
        "top1_agreement": r.top1_agreement,
        "k_magnitude_error_top5": kd["magnitude_top"],
        "k_direction_error_top5": kd["direction_top"],
        "v_magnitude_error_top5": vd["magnitude_top"],
        "v_direction_error_top5": vd["direction_top"],
        "k_magnitude_error_mean": kd["magnitude"],
        "k_direction_error_mean": kd["direction"],
        "v_magnitude_error_mean": vd["magnitude"],
        "v_direction_error_mean": vd["direction"],
        "decomposed_tokens": kd["tokens"],
        "perplexity": r.perplexity,
        "quantized_layers": q,
        "static_mae_quantized_layers": _layer_mean(r.static_mae_layers, q),
        "accumulated_mae_quantized_layers": _layer_mean(r.accumulated_mae_layers, q),
        "k_rel_l2_static": _layer_mean(r.static_k_rel_layers, q),
        "v_rel_l2_static": _layer_mean(r.static_v_rel_layers, q),
        "k_rel_l2_accumulated": _layer_mean(r.accumulated_k_rel_layers),
        "v_rel_l2_accumulated": _layer_mean(r.accumulated_v_rel_layers),
        "static_mae_per_layer": r.static_mae_layers,
        "accumulated_mae_per_layer": r.accumulated_mae_layers,
        "k_rel_l2_static_per_layer": r.static_k_rel_layers,
        "v_rel_l2_static_per_layer": r.static_v_rel_layers,
        "k_rel_l2_accumulated_per_layer": r.accumulated_k_rel_layers,
        "v_rel_l2_accumulated_per_layer": r.accumulated_v_rel_layers,
    }


def build_report(
    model: str, run: DriftRun, free: tuple[list[int], dict[str, FreeRun]] | None = None,
    free_settings: dict | None = None, extra: dict | None = None,
) -> dict:
    """The ``drift.json`` document."""
    doc = {
        "model": model,
        "tokens": run.tokens,
        "chunk": run.chunk,
        "num_layers": run.num_layers,
        "sliding_layers": run.sliding_layers,
        "fp16_perplexity": run.fp_perplexity,
        "prefill": run.prefill,
        "fp16_perplexity_after_prefill": _after_prefill(run, [0.0] * len(run.fp_chunk_nll), run.fp_chunk_nll)[1],
        "chunk_targets": run.chunk_targets,
        "fp16_chunk_nll": run.fp_chunk_nll,
        "prompt_diagnostics": {p: {str(k): v for k, v in d.items()} for p, d in run.prompt_diagnostics.items()},
        **(extra or {}),
        "methods": {k: method_entry(run, r) for k, r in run.methods.items()},
    }
    if free is not None:
        ref, runs = free
        doc["free_run"] = {**(free_settings or {}), "fp16_tokens": ref}
        for k, fr in runs.items():
            doc["methods"].setdefault(k, {})["free_run"] = {
                "first_divergence": fr.first_divergence, "agreement": fr.agreement,
                "kl": fr.kl, "kl_mean": _mean(fr.kl), "top1_agreement": fr.top1_agreement, "tokens": fr.tokens,
            }
    return _clean(doc)


def write_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _fmt(x, spec=".4f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def _div(fr: dict) -> str:
    if not fr:
        return "-"
    return "none" if fr.get("first_divergence") is None else str(fr["first_divergence"])


def summary_markdown(doc: dict) -> str:
    """One row per method:preset: chunk-averaged MAEs, their ratio, last-chunk MAE, KL, top-1, perplexity,
    worst-5% decomposition, and the free run when present."""
    lines = [
        f"# Drift: {doc['model']}, {doc['tokens']} tokens, chunk {doc['chunk']}",
        "",
        f"fp16 perplexity {doc['fp16_perplexity']:.3f}. MAE: attention output before o_proj against the fp "
        "shadow, mean over layers and chunks (static | accumulated), and at the last chunk. Magnitude share: "
        "magnitude / (magnitude + direction) of the squared K (V) error over the worst 5% of tokens.",
        "",
        "| method:preset | static MAE | accum. MAE | accum./static | accum. MAE @last | KL mean | top-1 | ppl "
        "| KL after prefill | ppl after prefill "
        "| K top5 mag / dir | K mag share top5 (all) | V top5 mag / dir | V mag share top5 (all) | 1st div. | agree@N | free KL |",
        "|---|" + "---:|" * 17,
    ]
    for key, m in doc["methods"].items():
        if "static_mae" not in m:
            continue
        s, a = _mean(m["static_mae"]), _mean(m["accumulated_mae"])
        ratio = a / s if s else float("nan")

        def share(kind, suffix):
            mag, dirn = m.get(f"{kind}_magnitude_error_{suffix}"), m.get(f"{kind}_direction_error_{suffix}")
            if mag is None or dirn is None or mag + dirn == 0:
                return float("nan")
            return mag / (mag + dirn)

        fr = m.get("free_run", {})
        lines.append(
            f"| {key} | {_fmt(s)} | {_fmt(a)} | {_fmt(ratio, '.2f')} | {_fmt(m['accumulated_mae'][-1])} "
            f"| {_fmt(_mean(m['kl']))} | {_fmt(_mean(m['top1_agreement']), '.3f')} | {_fmt(m['perplexity'], '.3f')} "
            f"| {_fmt(m.get('kl_after_prefill'))} | {_fmt(m.get('perplexity_after_prefill'), '.3f')} "
            f"| {_fmt(m['k_magnitude_error_top5'], '.3f')} / {_fmt(m['k_direction_error_top5'], '.3f')} "
            f"| {_fmt(share('k', 'top5'), '.2f')} ({_fmt(share('k', 'mean'), '.2f')}) "
            f"| {_fmt(m['v_magnitude_error_top5'], '.3f')} / {_fmt(m['v_direction_error_top5'], '.3f')} "
            f"| {_fmt(share('v', 'top5'), '.2f')} ({_fmt(share('v', 'mean'), '.2f')}) "
            f"| {_div(fr)} | {_fmt(fr.get('agreement'), '.3f') if fr else '-'} "
            f"| {_fmt(fr.get('kl_mean')) if fr else '-'} |"
        )
    lines += _diagnostics_markdown(doc)
    return "\n".join(lines) + "\n"


def _diagnostics_markdown(doc: dict) -> list[str]:
    """Per layer and KV head: the prompt's key logit error rotated vs unrotated, the log-variance /
    log-energy correlation, and kvarn-auto's choice where it ran."""
    out = []
    for preset, layers in (doc.get("prompt_diagnostics") or {}).items():
        auto = (doc["methods"].get(f"kvarn-auto:{preset}") or {}).get("auto_decisions", {})
        out += [
            "", f"## Prompt diagnostics at {preset} (first {doc.get('prefill')} tokens)", "",
            "Key logit error: mean |q.(k - k^)| x scale over the prompt's causal pairs, KVarN (rotated) and "
            "VarN (model frame) keys. corr: correlation over channels of log key variance and log query "
            "energy. kvarn-auto: the flavour it chose (K rot/norm, V rot/norm).",
            "", "| layer | head | key err rotated | key err unrotated | rotated/unrotated | corr | kvarn-auto |",
            "|---:|---:|---:|---:|---:|---:|---|",
        ]
        for layer, d in sorted(layers.items(), key=lambda kv: int(kv[0])):
            if "key_logit_error_rotated" not in d:
                continue
            a = auto.get(layer)
            for h, (r, u, c) in enumerate(zip(d["key_logit_error_rotated"], d["key_logit_error_unrotated"],
                                              d["log_key_variance_vs_log_query_energy_corr"])):
                choice = "-"
                if a is not None:
                    f = lambda x: "R" if x else "-"  # noqa: E731
                    g = lambda x: "N" if x else "-"  # noqa: E731
                    choice = (f"K{f(a['key_rotate'][h])}{g(a['key_normalize'][h])} "
                              f"V{f(a['value_rotate'][h])}{g(a['value_normalize'][h])}")
                out.append(f"| {layer} | {h} | {_fmt(r)} | {_fmt(u)} | {_fmt(r / u if u else float('nan'), '.2f')} "
                           f"| {_fmt(c, '.2f')} | {choice} |")
    return out
