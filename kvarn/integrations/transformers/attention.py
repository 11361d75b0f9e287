"""Fused decode attention for transformers (5.17 - 5.19): ``attn_implementation="kvarn"``.

Decode steps read the packed tiles of :class:`kvarn.KVarNCache` directly with
:func:`kvarn.kernels.decode_attention` (no dequantized or full-precision copy of the history is
made); the prefill, and layers the cache keeps in full precision, go through transformers' SDPA.

    from kvarn.integrations.transformers.attention import fused_cache, register
    register()                                   # once: AttentionInterface + mask under "kvarn"
    model.set_attn_implementation("kvarn")       # or from_pretrained(..., attn_implementation="kvarn")
    cache = fused_cache(model, "k4v2_g128")
    model.generate(ids, past_key_values=cache, ...)

The ``kvarn`` and ``kvarn-auto`` methods are fused (their layers become
:class:`~kvarn.integrations.transformers.fused_layer.FusedKVarNLayer`, whose decode-step ``update`` hands the
attention function markers that carry the layer); other methods keep the cache's ordinary read path.

A decode step of rows in lockstep reads no value back to the host and copies none to the device
(lengths live on the device, see :class:`FusedKVarNLayer`), so it can be captured in a CUDA graph:
:func:`kvarn.integrations.transformers.graph.decode_greedy` does that, with ``fused_cache(...,
max_length=...)``. :func:`cache_for` picks the cache the CLI generates with.
"""

from __future__ import annotations

import torch

from ...auto.layer import KVarNAutoLayer
from ...cache import KVarNCache, KVarNLayer
from .fused_layer import FusedKVarNAutoLayer, FusedKVarNLayer
from .triton_codec import TritonTileCodec

NAME = "kvarn"
FUSED_METHODS = ("kvarn", "kvarn-auto")


def fused_cache(model, preset="k4v2_g128", *, max_length: int | None = None, method: str = "kvarn",
                auto=None, **overrides) -> KVarNCache:
    """A :class:`KVarNCache` of ``method`` (``kvarn`` or ``kvarn-auto``) whose quantized layers decode
    through the kernels. ``auto``: kvarn-auto's :class:`kvarn.auto.AutoSettings`.

    ``max_length``: tokens per row to reserve tile storage for (see :class:`FusedKVarNLayer`);
    required for :func:`kvarn.integrations.transformers.graph.decode_greedy` with CUDA graphs.
    """
    if method not in FUSED_METHODS:
        raise ValueError(f"method {method!r} has no fused path; fused methods: {list(FUSED_METHODS)}")
    cache = KVarNCache(model, method, preset, **({"auto": auto} if auto is not None else {}), **overrides)
    codec = TritonTileCodec(cache.method, cache.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is KVarNLayer:
            cache.layers[i] = FusedKVarNLayer(codec, layer._padding, layer.is_sliding, max_length=max_length)
        elif type(layer) is KVarNAutoLayer:
            fused = FusedKVarNAutoLayer(codec, layer._padding, layer.is_sliding, max_length=max_length,
                                        settings=layer.settings)
            fused.expects_queries = layer.expects_queries
            cache.layers[i] = fused
    return cache


def cache_for(model, method: str, preset: str | None, *, device: torch.device | None = None,
              **overrides) -> KVarNCache:
    """The cache to generate with: fused for ``kvarn`` and ``kvarn-auto`` on CUDA, :class:`KVarNCache`
    otherwise.

    ``device``: where the model runs (default: its parameters' device). The fused cache needs the
    model's attention set to ``"kvarn"`` (:func:`use_fused`); other methods are unaffected by that
    setting (it falls back to SDPA for them). Off CUDA the reference read path keeps frozen tiles
    dequantized once (``decoded_cache``), as the CLI always did.
    """
    preset = preset or "k4v2_g128"
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if method in FUSED_METHODS and device.type == "cuda":
        if model.config._attn_implementation != NAME:
            raise ValueError("the fused kvarn cache needs the model's attention set to 'kvarn': "
                             "call use_fused(model) first")
        return fused_cache(model, preset, method=method, **overrides)
    return KVarNCache(model, method, preset, decoded_cache=True, **overrides)


def use_fused(model) -> None:
    """Register the fused attention and switch ``model`` to it (SDPA for everything but fused layers)."""
    register()
    model.set_attn_implementation(NAME)


def kvarn_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: fused decode for marker inputs, SDPA otherwise.

    query: ``[B, Hq, Tq, D]``; returns ``([B, Tq, Hq, D], None)``.
    """
    layer = getattr(key, "kvarn_layer", None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    from ... import kernels

    out = kernels.decode_attention(query, scaling=scaling, **layer.fused_inputs())
    layer.read_done()
    return out.transpose(1, 2), None


def register(name: str = NAME) -> None:
    """Register the attention function and its mask under ``name`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, kvarn_attention)
    AttentionMaskInterface.register(name, sdpa_mask)


__all__ = ["register", "use_fused", "fused_cache", "cache_for", "kvarn_attention", "FusedKVarNLayer",
           "FusedKVarNAutoLayer", "TritonTileCodec"]
