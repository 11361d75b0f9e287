"""The KVarN KV cache for transformers (docs/algorithm.md section 5); see :class:`KVarNCache`.

Layout per attention layer and row: ``[pads | sink (fp) | frozen tiles (method codec) | tail (fp)]``.
Modules: :mod:`.store` (growable encoded-tile storage), :mod:`.layer` (one layer: freezing,
crop, beam reordering, memory), :mod:`.read` (a layer's read path and :class:`LayerView`),
:mod:`.model_cache` (the ``Cache``: its layers, padding, memory report), :mod:`.layer_types`
(which of a model's layers are cached, and how), :mod:`.hf_baselines` (transformers' quantized
layers as baselines), :mod:`.roundtrip` (a full-precision history whose finished tiles are
replaced by their round trip). kvarn-auto's layer, built on :class:`KVarNLayer`, is
:class:`kvarn.auto.layer.KVarNAutoLayer`.
"""

from .layer import KVarNLayer
from .layer_types import layer_types_of
from .model_cache import KVarNCache, pads_from_mask
from .read import LayerView

__all__ = ["KVarNCache", "KVarNLayer", "LayerView", "layer_types_of", "pads_from_mask"]
