"""Which layers of a transformers model hold a K/V cache, and of which kind.

The decoder's ``layer_types`` (or, without them, one kind for every layer from ``sliding_window``,
``use_sliding_window`` and ``attention_chunk_size``) name each layer's attention: full attention
(:data:`FULL_TYPES`) or a window of recent tokens (:data:`SLIDING_TYPES`: sliding-window or chunked
attention, with its window size). The last ``num_kv_shared_layers`` layers reuse earlier layers'
K/V and hold none. Any other type (linear attention, mamba, conv, ...) raises ``ValueError``.
"""

from __future__ import annotations

FULL_TYPES = ("full_attention",)
SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config


def layer_types_of(config) -> list[tuple[str, int | None]]:
    """``[(layer_type, sliding_window or None)]`` per cached layer; ValueError for unsupported types."""
    n = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        if n is None:
            raise ValueError("the model config has neither layer_types nor num_hidden_layers")
        use_window = window is not None and getattr(config, "use_sliding_window", True)
        chunk = getattr(config, "attention_chunk_size", None)
        kind = "sliding_attention" if use_window else "chunked_attention" if chunk else "full_attention"
        types = [kind] * n
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    if shared:
        types = types[:-shared]
    out = []
    for i, kind in enumerate(types):
        if kind in FULL_TYPES:
            out.append((kind, None))
        elif kind in SLIDING_TYPES:
            w = window if kind == "sliding_attention" else getattr(config, "attention_chunk_size", None)
            out.append((kind, w))
        else:
            raise ValueError(
                f"layer {i} has type {kind!r}, which KVarNCache does not support: it caches only softmax "
                f"attention layers with a K/V cache ({', '.join(FULL_TYPES + SLIDING_TYPES)})"
            )
    return out


__all__ = ["FULL_TYPES", "SLIDING_TYPES", "layer_types_of", "text_config"]
