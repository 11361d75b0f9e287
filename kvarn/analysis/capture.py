"""Model plumbing for pseudo-decoding: an attention function that lets an observer see every
attention call, beside the full-history cache whose finished tiles are replaced by their quantized
round trip (:mod:`kvarn.cache.roundtrip`, which the library's self-test uses too).

The attention function ``kvarn_drift`` computes exactly what transformers' ``sdpa`` computes and then
hands ``(module, query, key, value, attention_mask, kwargs, output)`` to the observer attached to the
model by :func:`observe` (none by default). ``query`` and ``key`` are after RoPE; ``key``/``value``
are the full history returned by the cache; ``output`` is ``[B, T, Hq, D]``, the attention output
before ``o_proj``.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..cache.roundtrip import TileFreezer, freeze_cache, new_cache
from ..models import attention_modules

__all__ = ["TileFreezer", "attention_modules", "drift_attention", "freeze_cache", "new_cache", "observe",
           "recompute_attention", "sliding_layers"]

ATTN_NAME = "kvarn_drift"
_OBSERVER_ATTR = "_kvarn_drift_observer"


def sliding_layers(model) -> set[int]:
    """Indices of the layers that use sliding-window attention."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    types = getattr(cfg, "layer_types", None)
    if types:
        return {i for i, t in enumerate(types) if "sliding" in str(t)}
    return {m.layer_idx for m in attention_modules(model) if getattr(m, "sliding_window", None)}


def _drift_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    observer = getattr(module, _OBSERVER_ATTR, None)
    if observer is not None:
        observer(module, query, key, value, attention_mask, kwargs, out)
    return out, weights


def recompute_attention(module, query, key, value, attention_mask, kwargs) -> torch.Tensor:
    """The attention output of one recorded call with other ``key``/``value`` (same mask and scaling)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)[0]


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _drift_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


@contextlib.contextmanager
def drift_attention(model):
    """Run ``model`` with the ``kvarn_drift`` attention function; restores the previous one on exit."""
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def observe(model, observer: Callable | None):
    """Attach ``observer`` to every attention module for the duration of the block."""
    mods = attention_modules(model)
    for m in mods:
        setattr(m, _OBSERVER_ATTR, observer)
    try:
        yield
    finally:
        for m in mods:
            if hasattr(m, _OBSERVER_ATTR):
                delattr(m, _OBSERVER_ATTR)
