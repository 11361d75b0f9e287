"""The KVarN KV cache for transformers (docs/algorithm.md section 5); see :class:`KVarNCache`.

Layout per attention layer and row: ``[pads | sink (fp) | frozen tiles (method codec) | tail (fp)]``.
Modules: :mod:`.store` (growable encoded-tile storage), :mod:`.layer` (one layer: freezing,
crop, beam reordering, the read path, memory), :mod:`.model_cache` (the ``Cache``: its layers,
padding, memory report), :mod:`.layer_types` (which of a model's layers are cached, and how),
:mod:`.auto` (kvarn-auto's layer), :mod:`.hf_baselines` (transformers' quantized layers as baselines).
"""

from .layer import KVarNLayer, LayerView
from .layer_types import layer_types_of
from .model_cache import KVarNCache, pads_from_mask

__all__ = ["KVarNCache", "KVarNLayer", "LayerView", "layer_types_of", "pads_from_mask"]
