"""The queries kvarn-auto layers decide from: hooks that switch the model's attention function.

A transformers cache never sees queries (``update`` receives only K and V), yet kvarn-auto decides
from them (:mod:`kvarn.auto.layer`). So, for the prefill forward (the first forward with the cache)
and for the forwards after it while some auto layer still waits for a row's first tile past the
sink (a prompt shorter than ``sink_tokens + tile``), :func:`install_prompt_capture`'s pre-hook
switches the model to a registered attention function that hands each layer's query to its
:class:`~kvarn.auto.layer.KVarNAutoLayer` and then calls the model's own attention function,
output unchanged; the forward hook switches the model back. Once every row of every layer has
decided, decode steps run untouched.

Rule r3 (:mod:`kvarn.auto.self_test_rule`) also needs the model itself: the capture keeps each layer's prompt
K/V, the prefill forward is asked for the exact logits at the self-test's positions (through
``logits_to_keep``; the caller still gets the logits it asked for), and right after the prefill the
hook runs the self-test per row and gives every layer of that row the winning policy's flavours.
"""

from __future__ import annotations

import logging
import sys
import weakref

import torch

from ..models import attention_modules
from .layer import KVarNAutoLayer
from .self_test_rule import self_test_positions, self_test_tokens, settle

logger = logging.getLogger(__name__)

__all__ = ["install_prompt_capture"]

CAPTURE_PREFIX = "kvarn_auto_capture__"
_CALLBACK_ATTR = "_kvarn_auto_callback"  # on each attention module while the prefill runs
_INNER_ATTR = "_kvarn_auto_inner"  # the attention function the model itself would call


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    callback = getattr(module, _CALLBACK_ATTR, None)
    if callback is not None:
        callback(module, query, key, value, kwargs)
    inner = getattr(module, _INNER_ATTR, None)
    return inner(module, query, key, value, attention_mask, **kwargs)


def _inner_function(module, name: str):
    """The attention function the model itself would call for implementation ``name``."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _register(previous: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    name = CAPTURE_PREFIX + previous
    AttentionInterface.register(name, _capture_attention)
    mask = ALL_MASK_ATTENTION_FUNCTIONS[previous] if previous in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
    AttentionMaskInterface.register(name, mask)
    return name


def _prompt_of(args, kwargs) -> tuple[torch.Tensor | None, bool]:
    """The prefill's ``input_ids`` (or ``inputs_embeds``, then True) from a forward call."""
    if kwargs.get("input_ids") is not None:
        return kwargs["input_ids"], False
    if kwargs.get("inputs_embeds") is not None:
        return kwargs["inputs_embeds"], True
    return (args[0], False) if args and isinstance(args[0], torch.Tensor) else (None, False)


def _pads_of(kwargs, batch: int, length: int) -> list[int]:
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return (length - mask.to(torch.long).sum(1)).tolist()
    return [0] * batch


def _keep_test_logits(model, cache, prompt, kwargs, state) -> None:
    """Ask the prefill for the exact logits at every row's self-test positions as well as the caller's
    (``prompt``: the prefill's ``input_ids`` or ``inputs_embeds``, from :func:`_prompt_of`)."""
    import inspect

    asked = kwargs.get("logits_to_keep", 0)
    if prompt is None or not isinstance(asked, int) or asked <= 0 or \
            "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return  # all logits come back (asked == 0), or the self-test runs the exact model itself
    b, length = prompt.shape[:2]
    config = cache.config
    keep = set(range(max(length - asked, 0), length))
    for pad in _pads_of(kwargs, b, length):
        if length - pad >= self_test_tokens(config):
            pos = self_test_positions(config)
            keep.update(range(pad + pos.start, pad + pos.stop))
    index = sorted(keep)
    kwargs["logits_to_keep"] = torch.tensor(index, device=prompt.device)
    state["kept"] = (index, asked)


def _run_self_tests(model, cache, prompt, embeds, prompt_kv, logits, kept) -> None:
    """Rule r3 after the prefill: per row, the self-test's policy for every auto layer."""
    layers = {i: la for i, la in enumerate(cache.layers)
              if isinstance(la, KVarNAutoLayer) and la.decision is not None and la.settings.rule == "r3"}
    if not layers:
        return
    if len(prompt_kv) != len(cache.layers) or prompt is None:
        logger.warning("kvarn-auto r3: the prefill's inputs or some layer's K/V were not seen; keeping rule a2")
        return
    first = next(iter(layers.values()))
    need = self_test_tokens(first.codec.config)
    decisions = {i: la.decision for i, la in layers.items()}
    for r, pad in enumerate(first.pads):
        if prompt.shape[1] - pad < need:
            if first.decision.rows[r].candidates is not None:
                logger.info("kvarn-auto r3: row %d has %d prompt tokens, the self-test needs %d; keeping rule a2",
                            r, prompt.shape[1] - pad, need)
            continue
        exact = None
        pos = self_test_positions(first.codec.config)
        if kept is None and logits.shape[1] == prompt.shape[1]:
            exact = logits[r, pad + pos.start:pad + pos.stop]
        elif kept is not None:
            # kept is sorted and holds every test position: they are one slice of it (a view; a
            # gather would copy 256 positions x the vocabulary)
            j = kept[0].index(pad + pos.start)
            exact = logits[r, j:j + len(pos)]
        kv = [(k[r:r + 1, :, pad:], v[r:r + 1, :, pad:]) for k, v in prompt_kv]
        settle(model, prompt[r:r + 1, pad:], kv, decisions, first.codec, exact, row=r, embeds=embeds)
    for la in layers.values():
        la.set_decision(la.decision)


def install_prompt_capture(model: torch.nn.Module, cache) -> list:
    """Hooks on ``model`` that deliver the prefill's queries to ``cache``'s auto layers (and, for rule
    r3, run the self-test right after the prefill).

    Returns the hook handles. The hooks hold the cache weakly and remove themselves once it is gone.
    """
    cache_ref = weakref.ref(cache)
    state = {"previous": None, "r3": False, "kv": {}, "prompt": (None, False), "kept": None}

    def callback(module, query, key, value, kwargs):
        c = cache_ref()
        layer = None if c is None else c.layers[module.layer_idx]
        if state["r3"]:
            state["kv"][module.layer_idx] = (key, value)
        if isinstance(layer, KVarNAutoLayer):
            layer.observe(query, kwargs.get("scaling", getattr(module, "scaling", None)))

    def restore():
        if state["previous"] is None:
            return
        for m in attention_modules(model):
            for attr in (_CALLBACK_ATTR, _INNER_ATTR):
                m.__dict__.pop(attr, None)
        model.set_attn_implementation(state["previous"])
        state["previous"] = None

    def pre_hook(module, args, kwargs):
        c = cache_ref()
        if c is None:
            for h in handles:
                h.remove()
            return None
        restore()  # a previous forward that raised
        if kwargs.get("past_key_values") is not c:
            return None
        prefill = c.get_seq_length() == 0
        if not prefill and not any(isinstance(la, KVarNAutoLayer) and la.wants_queries for la in c.layers):
            return None
        previous = model.config._attn_implementation or "eager"
        name = _register(previous)
        for m in attention_modules(model):
            setattr(m, _CALLBACK_ATTR, callback)
            setattr(m, _INNER_ATTR, _inner_function(m, previous))
        model.set_attn_implementation(name)
        state["previous"] = previous
        state["r3"] = prefill and any(isinstance(la, KVarNAutoLayer) and la.settings.rule == "r3" for la in c.layers)
        state["kv"], state["kept"] = {}, None
        if state["r3"]:
            state["prompt"] = _prompt_of(args, kwargs)
            _keep_test_logits(model, c, state["prompt"][0], kwargs, state)
            return args, kwargs
        return None

    def post_hook(module, args, kwargs, output):
        was_prefill = state["previous"] is not None
        restore()
        if not (was_prefill and state["r3"]):
            return None
        kv, (prompt, embeds), kept = state["kv"], state["prompt"], state["kept"]
        state.update(r3=False, kv={}, prompt=(None, False), kept=None)
        c = cache_ref()
        logits = getattr(output, "logits", None)
        if c is None or logits is None:
            return None
        _run_self_tests(model, c, prompt, embeds, [kv[i] for i in sorted(kv)] if len(kv) == len(c.layers) else [],
                        logits, kept)
        if kept is not None:  # give the caller the logits it asked for
            output.logits = logits[:, -kept[1]:]
            return output
        return None

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True),
        model.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
    ]
    return handles
