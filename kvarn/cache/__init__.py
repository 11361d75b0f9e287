"""The KVarN KV cache for transformers (docs/algorithm.md section 5); see :class:`KVarNCache`.

Layout per attention layer and row: ``[pads | sink (fp) | frozen tiles (method codec) | tail (fp)]``.
Modules: :mod:`.store` (growable encoded-tile storage), :mod:`.layer` (one layer: freezing,
crop, beam reordering, the read path, memory), :mod:`.model_cache` (the ``Cache``: layer types,
padding, memory report).
"""

from .layer import KVarNLayer, LayerView
from .model_cache import KVarNCache, layer_types_of, pads_from_mask

__all__ = ["KVarNCache", "KVarNLayer", "LayerView", "layer_types_of", "pads_from_mask"]
