"""Model plumbing for pseudo-decoding: a full-history cache whose finished tiles are replaced by their
quantized round trip, and an attention function that lets an observer see every attention call.

The attention function ``kvarn_drift`` computes exactly what transformers' ``sdpa`` computes and then
hands ``(module, query, key, value, attention_mask, kwargs, output)`` to the observer attached to the
model by :func:`observe` (none by default). ``query`` and ``key`` are after RoPE; ``key``/``value``
are the full history returned by the cache; ``output`` is ``[B, T, Hq, D]``, the attention output
before ``o_proj``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import KVarNConfig
from ..methods import TileCodec

ATTN_NAME = "kvarn_drift"
_OBSERVER_ATTR = "_kvarn_drift_observer"


def attention_modules(model) -> list:
    """The self-attention modules of a decoder, ordered by ``layer_idx``."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention modules with layer_idx and o_proj")
    return sorted(mods, key=lambda m: m.layer_idx)


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


@dataclass
class TileFreezer:
    """Quantizes finished tiles of a growing per-layer K/V history, once each (docs/algorithm.md section 5).

    ``quantized_layers``: layers whose history is quantized; others stay full precision.
    ``frozen[layer]``: tokens of that layer whose stored form is final (sink + quantized tiles).
    ``flavours[layer]``: kvarn-auto's per-head flavours of that layer (``[B, Hk]``); a layer without
    an entry is quantized with the method's fixed pipeline (KVarN for kvarn-auto).
    """

    codec: TileCodec
    quantized_layers: frozenset[int]
    frozen: dict[int, int] = field(default_factory=dict)
    flavours: dict = field(default_factory=dict)

    def fresh(self) -> "TileFreezer":
        """The same codec, layers and flavours with nothing frozen yet (one freezer per cache)."""
        return TileFreezer(self.codec, self.quantized_layers, flavours=self.flavours)

    @property
    def config(self) -> KVarNConfig:
        return self.codec.config

    def span(self, layer: int, length: int) -> tuple[int, int]:
        """Token range ``[start, end)`` to quantize now, for a history of ``length`` tokens."""
        if layer not in self.quantized_layers:
            return 0, 0
        g = self.config.tile
        start = max(self.frozen.get(layer, 0), self.config.sink_tokens)
        end = length // g * g
        return (start, end) if end > start else (start, start)

    def freeze(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
        """Replace the newly finished tiles of ``keys``/``values`` ``[B, H, T, D]`` in place by their round trip.

        Returns the quantized range ``(start, end)`` (empty when nothing was finished).
        """
        start, end = self.span(layer, keys.shape[2])
        if end > start:
            kq, vq = self.codec.roundtrip(keys[:, :, start:end], values[:, :, start:end], self.flavours.get(layer))
            keys[:, :, start:end] = kq
            values[:, :, start:end] = vq
            self.frozen[layer] = end
        return start, end


def new_cache(num_layers: int):
    """A transformers cache keeping the full history of every layer (masks apply any sliding window)."""
    from transformers.cache_utils import Cache, DynamicLayer

    return Cache(layers=[DynamicLayer() for _ in range(num_layers)])


def freeze_cache(cache, freezer: TileFreezer) -> list[tuple[int, int]]:
    """Quantize the finished tiles of every layer of ``cache`` (after a chunk). Returns each layer's range."""
    spans = []
    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False) or layer.keys.numel() == 0:
            spans.append((0, 0))
            continue
        spans.append(freezer.freeze(i, layer.keys, layer.values))
    return spans
