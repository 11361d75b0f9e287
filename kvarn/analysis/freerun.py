"""Free-running comparison: greedy generation with each method's quantized cache against fp16.

For a prompt of ``P`` tokens, fp16 greedily generates ``N`` tokens (its trajectory). Each method then
(a) generates greedily on its own, which gives the first divergent token and the agreement over the
first ``N`` tokens, and (b) is teacher-forced along the fp16 trajectory, which gives
``KL(p_fp16 || p_method)`` of the next-token distribution at every generated position.

Cache semantics follow docs/algorithm.md section 5: the prompt is prefilled with exact attention and its finished
tiles (beyond the sink) are quantized right after; during decoding each tile is quantized when it
fills. Teacher forcing feeds the trajectory in chunks that end on tile boundaries, which reproduces
token-by-token decoding (a token attends to its own unfinished tile in full precision and to
earlier tiles quantized) at a fraction of the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..auto.decision import LayerDecision
from ..auto.rules import decide, decide_first_tile, first_tile_tokens
from ..methods import TileCodec, get_method
from .capture import (
    TileFreezer, attention_modules, drift_attention, freeze_cache, new_cache, observe, sliding_layers,
)
from .errors import kl_and_top1
from .specs import MethodSpec, dedup_key, method_config


@dataclass
class FreeRun:
    key: str
    tokens: list[int]
    first_divergence: int | None  # index of the first generated token that differs from fp16; None if none
    agreement: float  # fraction of the N positions where the token equals fp16's
    kl: list[float]  # KL(fp16 || method) along the fp16 trajectory, one value per generated position
    top1_agreement: float  # teacher-forced top-1 agreement along the fp16 trajectory


def _freezer(model, spec: MethodSpec, sink_tokens, quantize_sliding_window, prompt_ids=None,
             continuation: list[int] | None = None) -> TileFreezer:
    cfg = method_config(spec, sink_tokens, quantize_sliding_window)
    n = len(attention_modules(model))
    layers = set(range(n)) if cfg.quantize_sliding_window else set(range(n)) - sliding_layers(model)
    if get_method(spec.method).fmt == "none":
        layers = set()
    freezer = TileFreezer(TileCodec(spec.method, cfg), frozenset(layers))
    if spec.auto is not None and prompt_ids is not None:
        _decide_on_prompt(model, prompt_ids, freezer, spec.auto, continuation)
    return freezer


def _decide_on_prompt(model, prompt_ids: torch.Tensor, freezer: TileFreezer, settings,
                      continuation: list[int] | None = None) -> None:
    """kvarn-auto: one exact prefill of the prompt sets the freezer's flavours for every quantized layer
    (rule r3: then the self-test on it, :func:`kvarn.auto.self_test_rule.settle`).

    A prompt shorter than ``S + G`` decides at its first tile past the sink instead
    (:func:`kvarn.auto.rules.decide_first_tile`), from the prompt and the first tokens of ``continuation``
    (fp16's greedy tokens): the method generates exactly those up to that tile, nothing being
    quantized before it. Without enough of them, KVarN stays on every head."""
    from ..auto.self_test_rule import self_test_positions, settle

    decisions = {}
    p, n = prompt_ids.shape[1], first_tile_tokens(freezer.config)
    at_tile = p < n
    if at_tile:
        if continuation is None or len(continuation) < n - p:
            return
        extra = torch.tensor([continuation[:n - p]], dtype=prompt_ids.dtype, device=prompt_ids.device)
        prompt_ids = torch.cat([prompt_ids, extra], dim=1)

    def observer(module, q, k, v, mask, kw, out):
        if module.layer_idx in freezer.quantized_layers:
            scaling = kw.get("scaling", getattr(module, "scaling", None))
            if at_tile:
                decisions[module.layer_idx] = LayerDecision([decide_first_tile(
                    q[0], k[0], v[0], freezer.config, settings, scaling, prompt_tokens=p)])
            else:
                decisions[module.layer_idx] = decide(q, k, v, freezer.config, None, settings, scaling)

    cache = new_cache(len(attention_modules(model)))
    with observe(model, observer):
        logits = model(input_ids=prompt_ids, past_key_values=cache, use_cache=True).logits[0]
    if settings.rule == "r3" and not at_tile:
        pos = self_test_positions(freezer.config)
        settle(model, prompt_ids, [(la.keys, la.values) for la in cache.layers], decisions, freezer.codec,
               logits[pos.start:pos.stop])
    for i, d in decisions.items():
        freezer.flavours[i] = d.flavours


def greedy(model, prompt_ids: torch.Tensor, freezer: TileFreezer, n_tokens: int, bar=None) -> list[int]:
    """Greedy continuation of ``prompt_ids [1, P]`` with the freezer's quantized cache."""
    freezer = freezer.fresh()
    cache = new_cache(len(attention_modules(model)))
    logits = model(input_ids=prompt_ids, past_key_values=cache, use_cache=True).logits[0, -1]
    freeze_cache(cache, freezer)
    out = []
    for _ in range(n_tokens):
        tok = int(logits.argmax())
        out.append(tok)
        if bar is not None:
            bar.update(1)
        if len(out) == n_tokens:
            break
        ids = torch.tensor([[tok]], dtype=prompt_ids.dtype, device=prompt_ids.device)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        freeze_cache(cache, freezer)
    return out


def teacher_forced_logits(model, prompt_ids: torch.Tensor, continuation: list[int], freezer: TileFreezer) -> torch.Tensor:
    """Logits ``[N, V]`` predicting each continuation token, decoded in tile-aligned chunks."""
    freezer = freezer.fresh()
    g = freezer.config.tile
    cache = new_cache(len(attention_modules(model)))
    p = prompt_ids.shape[1]
    ids = torch.cat([prompt_ids[0], torch.tensor(continuation, dtype=prompt_ids.dtype, device=prompt_ids.device)])
    end = p + len(continuation) - 1  # the last token's prediction is not needed
    logits = [model(input_ids=prompt_ids, past_key_values=cache, use_cache=True).logits[0, -1:]]
    freeze_cache(cache, freezer)
    s = p
    while s < end:
        e = min((s // g + 1) * g, end)
        logits.append(model(input_ids=ids[None, s:e], past_key_values=cache, use_cache=True).logits[0])
        freeze_cache(cache, freezer)
        s = e
    return torch.cat(logits)


@torch.inference_mode()
def free_run(
    model,
    prompt_ids: torch.Tensor,
    specs: list[MethodSpec],
    n_tokens: int = 128,
    *,
    sink_tokens: int | None = None,
    quantize_sliding_window: bool = False,
    progress: bool = True,
) -> tuple[list[int], dict[str, FreeRun]]:
    """Greedy generation of ``n_tokens`` after ``prompt_ids [1, P]`` by fp16 and every method.

    Returns the fp16 tokens and one :class:`FreeRun` per spec key.
    """
    from tqdm.auto import tqdm

    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be [1, P] with P >= 1, got shape {tuple(prompt_ids.shape)}")
    if n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} must be >= 1")
    unique: dict[tuple, MethodSpec] = {}
    for spec in specs:
        unique.setdefault(dedup_key(spec, method_config(spec, sink_tokens, quantize_sliding_window)), spec)
    tile = method_config(specs[0], sink_tokens, quantize_sliding_window).tile
    fp_spec = MethodSpec("fp16", specs[0].preset)
    bar = tqdm(total=n_tokens * (1 + len(unique)), desc="free-run", unit="tok", disable=not progress)
    results: dict[tuple, FreeRun] = {}
    with drift_attention(model):
        fp_freezer = _freezer(model, fp_spec, sink_tokens, quantize_sliding_window)
        ref = greedy(model, prompt_ids, fp_freezer, n_tokens, bar)
        ref_logits = teacher_forced_logits(model, prompt_ids, ref, fp_freezer)
        for dk, spec in unique.items():
            fz = _freezer(model, spec, sink_tokens, quantize_sliding_window, prompt_ids, ref)
            if fz.config.tile != tile:
                ref_logits_m = teacher_forced_logits(model, prompt_ids, ref, _freezer(model, MethodSpec("fp16", spec.preset), sink_tokens, quantize_sliding_window))
            else:
                ref_logits_m = ref_logits
            toks = greedy(model, prompt_ids, fz, n_tokens, bar)
            diff = [i for i, (a, b) in enumerate(zip(ref, toks)) if a != b]
            kl, top1 = kl_and_top1(ref_logits_m, teacher_forced_logits(model, prompt_ids, ref, fz))
            results[dk] = FreeRun(
                spec.key, toks, diff[0] if diff else None,
                sum(a == b for a, b in zip(ref, toks)) / n_tokens,
                [float(x) for x in kl], float(top1.float().mean()),
            )
    bar.close()
    out = {}
    for spec in specs:
        r = results[dedup_key(spec, method_config(spec, sink_tokens, quantize_sliding_window))]
        out[spec.key] = FreeRun(spec.key, r.tokens, r.first_divergence, r.agreement, r.kl, r.top1_agreement)
    return ref, out
