"""Pseudo-decode drift analysis (docs/algorithm.md section 7, paper section 3 and Fig. 5).

A text of ``T`` tokens is fed through the model in chunks of ``b`` tokens. After each chunk, the
finished tiles of its K/V (beyond the full-precision sink) are replaced by the method's round trip,
so later chunks attend to quantized history; the chunk's own attention uses its exact K/V (prefill
semantics). With ``b`` equal to the tile this is exactly teacher-forced decoding with the quantized
cache of docs/algorithm.md section 5.

Two regimes, measured against one full-precision shadow run that is shared by every method:

- **static**: the shadow's own queries, keys and values are propagated; at every layer and chunk
  the attention output is recomputed with the method's quantized history. Only the local error of
  that layer and chunk is measured.
- **accumulated**: the model runs on the method's quantized cache, so a layer's error changes the
  next layer's K/V and every later chunk; its attention outputs and logits are compared with the
  shadow's.

Per layer and chunk: mean absolute error of the attention output (before ``o_proj``), relative L2
error of the chunk's stored K and V. Per token (static): the magnitude/direction decomposition of
:mod:`kvarn.analysis.errors`. Output level (accumulated): KL(fp || method) of the next-token
distribution, top-1 agreement, perplexity.

Prefill: the first pass may be longer or shorter than a chunk (``prefill`` tokens, exact, like a
prompt); its finished tiles are quantized after it and later chunks attend to them. The chunks after
it end on multiples of ``chunk``, so that with ``chunk`` equal to the tile every tile is still
frozen by the pass after the one that completes it, as in decoding. kvarn-auto decides its flavours
as the cache does (:mod:`kvarn.auto.layer`): from the first pass when it holds a full tile past the
sink, else when the pass that completes that tile has run, from the sink's and the tile's ``S + G``
tokens (:func:`kvarn.auto.decide_first_tile`), before the tile is frozen. It reads the shadow's
queries, keys and values, which equal the method's own up to that point (nothing is quantized
before that tile). Every quantized layer reports the prompt diagnostics of :mod:`kvarn.auto` (logit
error of rotated vs unrotated keys, correlation of log key variance with log query energy, per KV
head) of the first pass.
"""

from __future__ import annotations

import math

import torch

from ..auto.decision import LayerDecision
from ..auto.rules import AutoSettings, decide, decide_first_tile, first_tile_tokens
from ..config import KVarNConfig
from ..methods import TileCodec, get_method
from .capture import (
    TileFreezer, attention_modules, drift_attention, freeze_cache, new_cache, observe, recompute_attention,
    sliding_layers,
)
from .errors import DecompositionAccumulator, kl_and_top1, mean_abs_error, relative_l2, token_nll
from .results import DriftRun, MethodDrift
from .specs import MethodSpec, dedup_key, method_config


class _MethodState:
    def __init__(self, key: str, codec: TileCodec, layers: frozenset[int], num_layers: int, worst: float,
                 auto: AutoSettings | None = None):
        self.key, self.codec, self.layers, self.auto = key, codec, layers, auto
        self.decisions: dict[int, dict] = {}
        self.layer_decisions: dict[int, object] = {}  # kvarn-auto: layer -> LayerDecision
        self.waiting: dict[int, torch.Tensor] = {}  # kvarn-auto: layer -> queries so far, until its first tile
        self.first_pass = 0
        self.chunk_nll: list[float] = []
        self.static_freezer = TileFreezer(codec, layers)
        self.acc_freezer = TileFreezer(codec, layers)
        self.cache = new_cache(num_layers)
        self.static_k: dict[int, torch.Tensor] = {}
        self.static_v: dict[int, torch.Tensor] = {}
        L = num_layers
        self.static_mae = [[] for _ in range(L)]
        self.acc_mae = [[] for _ in range(L)]
        self.s_krel, self.s_vrel = [[] for _ in range(L)], [[] for _ in range(L)]
        self.a_krel, self.a_vrel = [[] for _ in range(L)], [[] for _ in range(L)]
        self.kl, self.top1 = [], []
        self.nll_sum, self.nll_count = 0.0, 0
        self.k_dec, self.v_dec = DecompositionAccumulator(), DecompositionAccumulator()
        self.worst = worst

    def result(self) -> MethodDrift:
        return MethodDrift(
            self.key, sorted(self.layers), self.static_mae, self.acc_mae, self.s_krel, self.s_vrel,
            self.a_krel, self.a_vrel, self.kl, self.top1, self.nll_sum, self.nll_count,
            self.k_dec.summary(self.worst), self.v_dec.summary(self.worst),
            list(self.chunk_nll), dict(self.decisions) if self.auto is not None else None,
            self.auto.name if self.auto is not None else None,
            self.codec.config.quantiles if self.codec.method.fmt == "int" else None,
        )

    def set_flavours(self, layer: int, decision) -> None:
        """kvarn-auto: quantize ``layer`` with ``decision``'s flavours in both regimes."""
        fl = decision.flavours
        self.static_freezer.flavours[layer] = fl
        self.acc_freezer.flavours[layer] = fl
        self.decisions[layer] = decision.rows[0].summary()
        self.layer_decisions[layer] = decision


def chunk_bounds(tokens: int, chunk: int, prefill: int | None = None) -> list[tuple[int, int]]:
    """``[(start, end)]``: a first pass of ``prefill`` tokens (default: one chunk), then chunks that
    end on multiples of ``chunk`` (the first of them shorter after a prefill that is not one)."""
    bounds = [(0, min(prefill or chunk, tokens))]
    while bounds[-1][1] < tokens:
        s = bounds[-1][1]
        bounds.append((s, min((s // chunk + 1) * chunk, tokens)))
    return bounds


@torch.inference_mode()
def pseudo_decode(
    model,
    input_ids: torch.Tensor,
    specs: list[MethodSpec],
    chunk: int | None = None,
    *,
    sink_tokens: int | None = None,
    quantize_sliding_window: bool = False,
    layers: list[int] | None = None,
    worst_fraction: float = 0.05,
    reuse_shadow_for_fp16: bool = True,
    prefill: int | None = None,
    progress: bool = True,
) -> DriftRun:
    """Static and accumulated drift of every method in ``specs`` over ``input_ids`` ``[1, T]``.

    chunk: tokens per pseudo-decode step (default: the first spec's tile).
    sink_tokens: full-precision sink (default: one tile, docs/algorithm.md section 5).
    layers: restrict quantization to these layer indices (default: all but sliding-window layers,
        which are kept in full precision unless ``quantize_sliding_window``).
    reuse_shadow_for_fp16: the fp16 method stores the exact history, so its accumulated run is the
        shadow itself; skip that forward pass (False runs it, a check of the machinery).
    prefill: tokens of the first, exact pass (default: one chunk); kvarn-auto decides from it, or
        at the first tile past the sink when it is shorter than that (module docstring).
    """
    from tqdm.auto import tqdm

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, T], got shape {tuple(input_ids.shape)}")
    if not specs:
        raise ValueError("specs is empty: give at least one method:preset")
    configs = [method_config(s, sink_tokens, quantize_sliding_window) for s in specs]
    chunk = chunk or configs[0].tile
    if chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive number of tokens")
    if prefill is not None and prefill < 1:
        raise ValueError(f"prefill={prefill!r} must be a positive number of tokens")
    num_layers = len(attention_modules(model))
    sliding = sliding_layers(model)
    all_layers = set(range(num_layers)) if layers is None else set(layers)
    if not all_layers <= set(range(num_layers)):
        raise ValueError(f"layers={sorted(all_layers)} must be within 0..{num_layers - 1}")

    states: dict[tuple, _MethodState] = {}
    owner: dict[str, tuple] = {}
    for spec, cfg in zip(specs, configs):
        dk = dedup_key(spec, cfg)
        owner[spec.key] = dk
        if dk not in states:
            q = all_layers if cfg.quantize_sliding_window else all_layers - sliding
            if get_method(spec.method).fmt == "none":
                q = set()  # fp16 stores nothing quantized; its cache is the exact history
            states[dk] = _MethodState(spec.key, TileCodec(spec.method, cfg), frozenset(q), num_layers,
                                      worst_fraction, spec.auto)
    run_states = list(states.values())
    # Prompt diagnostics once per integer preset (kvarn-auto's default rule reuses them).
    probes: dict[str, tuple[KVarNConfig, frozenset[int]]] = {}
    for spec, cfg in zip(specs, configs):
        if get_method(spec.method).fmt == "int" and spec.preset not in probes:
            probes[spec.preset] = (cfg, frozenset(all_layers if cfg.quantize_sliding_window else all_layers - sliding))
    diagnostics: dict[str, dict[int, dict]] = {p: {} for p in probes}

    T = input_ids.shape[1]
    bounds = chunk_bounds(T, chunk, prefill)
    shadow = new_cache(num_layers)
    nll_fp, n_fp = 0.0, 0
    fp_chunk_nll, chunk_targets = [], []
    bar = tqdm(total=len(bounds) * (1 + len(run_states)), desc="pseudo-decode", unit="pass", disable=not progress)
    with drift_attention(model):
        for s, e in bounds:
            ids = input_ids[:, s:e]
            targets = input_ids[0, s + 1:e + 1]
            shadow_out: dict[int, torch.Tensor] = {}

            def static_observer(module, q, k, v, mask, kw, out, s=s):
                layer = module.layer_idx
                shadow_out[layer] = out
                if s == 0:
                    _decide_prompt(module, q, k, v, kw, run_states, probes, diagnostics)
                else:
                    _decide_first_tile(module, q, k, v, kw, run_states)
                for st in run_states:
                    if layer not in st.layers or s == 0:
                        st.static_mae[layer].append(0.0)
                        continue
                    kh = torch.cat([st.static_k[layer], k[:, :, s:]], dim=2)
                    vh = torch.cat([st.static_v[layer], v[:, :, s:]], dim=2)
                    st.static_mae[layer].append(mean_abs_error(recompute_attention(module, q, kh, vh, mask, kw), out))

            with observe(model, static_observer):
                fp_logits = model(input_ids=ids, past_key_values=shadow, use_cache=True).logits[0]
            fp_nll = token_nll(fp_logits[: len(targets)], targets)
            nll_fp += float(fp_nll.sum())
            n_fp += fp_nll.numel()
            fp_chunk_nll.append(float(fp_nll.sum()))
            chunk_targets.append(fp_nll.numel())
            if s == 0:
                for st in run_states:
                    if st.auto is not None and st.auto.rule == "r3":
                        _self_test_policy(model, input_ids[:, :e], shadow, fp_logits, st)
            for st in run_states:
                _static_update(st, shadow, s, e)
            bar.update(1)

            for st in run_states:
                if reuse_shadow_for_fp16 and st.codec.method.fmt == "none":
                    _record_exact(st, num_layers, float(fp_nll.sum()), fp_nll.numel())
                    st.chunk_nll.append(float(fp_nll.sum()))
                    bar.update(1)
                    continue
                acc_out: dict[int, torch.Tensor] = {}
                with observe(model, lambda module, q, k, v, m, kw, out: acc_out.__setitem__(module.layer_idx, out)):
                    logits = model(input_ids=ids, past_key_values=st.cache, use_cache=True).logits[0]
                freeze_cache(st.cache, st.acc_freezer)
                for layer in range(num_layers):
                    st.acc_mae[layer].append(mean_abs_error(acc_out[layer], shadow_out[layer]))
                    ref, got = shadow.layers[layer], st.cache.layers[layer]
                    st.a_krel[layer].append(relative_l2(ref.keys[:, :, s:e], got.keys[:, :, s:e]))
                    st.a_vrel[layer].append(relative_l2(ref.values[:, :, s:e], got.values[:, :, s:e]))
                kl, top1 = kl_and_top1(fp_logits, logits)
                st.kl.append(float(kl.mean()))
                st.top1.append(float(top1.float().mean()))
                nll = token_nll(logits[: len(targets)], targets)
                st.nll_sum += float(nll.sum())
                st.nll_count += nll.numel()
                st.chunk_nll.append(float(nll.sum()))
                bar.update(1)
    bar.close()

    run = DriftRun(T, chunk, [e for _, e in bounds], num_layers, sorted(sliding), math.exp(nll_fp / max(n_fp, 1)),
                   prefill=bounds[0][1], chunk_targets=chunk_targets, fp_chunk_nll=fp_chunk_nll,
                   prompt_diagnostics=diagnostics)
    results = {dk: st.result() for dk, st in states.items()}
    for spec in specs:
        r = results[owner[spec.key]]
        run.methods[spec.key] = MethodDrift(**{**r.__dict__, "key": spec.key})
    return run


def _decide_prompt(module, q, k, v, kw, run_states, probes, diagnostics) -> None:
    """At the first pass: prompt diagnostics per preset, and kvarn-auto's flavours per state."""
    layer = module.layer_idx
    scaling = kw.get("scaling", getattr(module, "scaling", None))
    done: dict[tuple, object] = {}

    def get(cfg, settings):
        key = (cfg, settings)
        if key not in done:
            done[key] = decide(q, k, v, cfg, None, settings, scaling)
        return done[key]

    for preset, (cfg, layers) in probes.items():
        if layer in layers:
            diagnostics[preset][layer] = get(cfg, AutoSettings()).rows[0].summary()
    for st in run_states:
        if st.auto is not None and layer in st.layers:
            if k.shape[2] < first_tile_tokens(st.codec.config):
                st.waiting[layer] = q.clone()  # no full tile past the sink yet: decide at the first one
                st.first_pass = k.shape[2]
            else:
                st.set_flavours(layer, get(st.codec.config, st.auto))


def _decide_first_tile(module, q, k, v, kw, run_states) -> None:
    """After the first pass: each kvarn-auto state's layers still waiting gather the chunk's queries
    and decide once the history holds the first tile past the sink, before it is frozen."""
    layer = module.layer_idx
    scaling = kw.get("scaling", getattr(module, "scaling", None))
    done: dict[tuple, object] = {}
    for st in run_states:
        if layer not in st.waiting:
            continue
        cfg = st.codec.config
        st.waiting[layer] = queries = torch.cat([st.waiting[layer], q], dim=2)[:, :, :first_tile_tokens(cfg)]
        if k.shape[2] < first_tile_tokens(cfg):
            continue
        key = (cfg, st.auto)
        if key not in done:
            done[key] = LayerDecision([decide_first_tile(queries[0], k[0], v[0], cfg, st.auto, scaling,
                                                         prompt_tokens=st.first_pass)])
        st.set_flavours(layer, done[key])
        del st.waiting[layer]


def _self_test_policy(model, prompt, shadow, fp_logits, st: _MethodState) -> None:
    """kvarn-auto rule r3: the self-test (:mod:`kvarn.auto.self_test_rule`) on the first pass picks the policy."""
    from ..auto.self_test_rule import self_test_positions, settle

    kv = [(la.keys, la.values) for la in shadow.layers]
    pos = self_test_positions(st.codec.config)
    if settle(model, prompt, kv, st.layer_decisions, st.codec, fp_logits[pos.start:pos.stop]) is not None:
        for i, d in st.layer_decisions.items():
            st.set_flavours(i, d)


def _record_exact(st: _MethodState, num_layers: int, nll_sum: float, nll_count: int) -> None:
    """Accumulated-regime results of a lossless method: identical to the shadow."""
    for layer in range(num_layers):
        for lst in (st.acc_mae, st.a_krel, st.a_vrel):
            lst[layer].append(0.0)
    st.kl.append(0.0)
    st.top1.append(1.0)
    st.nll_sum += nll_sum
    st.nll_count += nll_count


def _static_update(st: _MethodState, shadow, s: int, e: int) -> None:
    """Append the shadow's new K/V to the method's static history and quantize its finished tiles."""
    for layer, cl in enumerate(shadow.layers):
        if layer not in st.layers:
            for lst in (st.s_krel[layer], st.s_vrel[layer]):
                lst.append(0.0)
            continue
        k_new, v_new = cl.keys[:, :, s:e], cl.values[:, :, s:e]
        if layer in st.static_k:
            st.static_k[layer] = torch.cat([st.static_k[layer], k_new], dim=2)
            st.static_v[layer] = torch.cat([st.static_v[layer], v_new], dim=2)
        else:
            st.static_k[layer], st.static_v[layer] = k_new.clone(), v_new.clone()
        a, b = st.static_freezer.freeze(layer, st.static_k[layer], st.static_v[layer])
        st.s_krel[layer].append(relative_l2(k_new, st.static_k[layer][:, :, s:e]))
        st.s_vrel[layer].append(relative_l2(v_new, st.static_v[layer][:, :, s:e]))
        if b > a:
            st.k_dec.add(layer, cl.keys[:, :, a:b], st.static_k[layer][:, :, a:b])
            st.v_dec.add(layer, cl.values[:, :, a:b], st.static_v[layer][:, :, a:b])
