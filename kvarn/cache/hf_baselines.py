"""transformers' own quantized cache layers as baselines of :class:`~kvarn.cache.KVarNCache`:
``hf-quanto`` (``QuantoQuantizedLayer``, optimum-quanto) and ``hf-hqq`` (``HQQQuantizedLayer``, hqq).

They are not kvarn codecs (no ``TileCodec``) and keep transformers' policy, not kvarn's tiles: the
prompt is quantized at prefill, new tokens go to a full-precision residual of ``tile`` tokens, and
whenever it fills the whole cache is dequantized and quantized again; groups of :data:`HF_GROUP` = 64
elements along axis 0, transformers' default (quanto: 64 channels of one token, for K and V alike;
hqq: the flattened K or V viewed as ``[64, -1]``, so each group takes 64 elements strided
``numel / 64`` apart); one bit width for K and V (``k2v2_*`` or ``k4v4_*``); no sink; pads quantized
like tokens; sliding-window layers stay in full precision. Memory (:func:`hf_memory`) counts their
packed codes, scales and shifts/zeros as ``quantized_bytes`` and the residual as
``full_precision_bytes``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import QuantizedLayer

from ..config import KVarNConfig
from ..methods import Method
from .memory import dtype_name, empty_entry, memory_entry

HF_GROUP = 64  # q_group_size of transformers' quantized layers (its default)

#: transformers' own quantized cache layers, as extra baselines; not kvarn codecs (no TileCodec).
HF_METHODS: dict[str, Method] = {m.name: m for m in (
    Method("hf-quanto", False, False, False, "int",
           "transformers QuantizedCache with optimum-quanto (per-token K and V in groups of 64 channels, "
           "quanto axis 0; re-quantizes the whole cache whenever its fp residual of `tile` tokens fills; no sink)"),
    Method("hf-hqq", False, False, False, "int",
           "transformers QuantizedCache with HQQ (axis 0 as transformers uses it: the flattened K or V is "
           "viewed as [64, -1], so each group takes 64 elements strided numel/64 apart; HQQ-optimized "
           "zero/scale; re-quantizes the whole cache whenever its fp residual of `tile` tokens fills; no sink)"),
)}


def hf_layer_factory(method: Method, config: KVarNConfig):
    """A no-argument constructor of the transformers quantized layer for ``method``."""
    if config.key_bits != config.value_bits:
        raise ValueError(
            f"method {method.name!r} uses one bit width for K and V, but preset {config.name!r} has "
            f"key_bits={config.key_bits}, value_bits={config.value_bits}; use a k2v2_* or k4v4_* preset"
        )
    if config.quantize_sliding_window:
        raise ValueError(f"method {method.name!r} cannot quantize sliding-window layers "
                         "(transformers' quantized layers are full-attention only)")
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    # axis 0 for both, transformers' default. quanto: rows of 64 contiguous elements, i.e. 64 channels of
    # one token. hqq: a [64, -1] view (strided groups); its axis 1 (contiguous groups) packs along the
    # group count and fails when that is not a multiple of 8 / nbits, so it is not usable here.
    cls = QuantoQuantizedLayer if method.name == "hf-quanto" else HQQQuantizedLayer
    kw = dict(nbits=config.key_bits, axis_key=0, axis_value=0, q_group_size=HF_GROUP,
              residual_length=config.tile)
    cls(**kw)  # fail now (missing backend, unsupported bits), not at the first forward
    return lambda: cls(**kw)


def hf_memory(layer: QuantizedLayer) -> dict:
    """Stored bytes of a transformers quantized layer: packed codes + scales/shifts, fp residual."""
    if not layer.is_initialized:
        return empty_entry()
    qbytes = elements = 0
    rows = 0
    for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
        if q is None:
            continue
        if isinstance(q, tuple):  # hqq: (packed uint8 codes, meta with scale and zero)
            codes, meta = q
            qbytes += _nbytes(codes) + _nbytes(meta.get("scale")) + _nbytes(meta.get("zero"))
            shape = meta["shape"]
        else:  # quanto WeightQBitsTensor: _data (PackedTensor of uint8), _scale, _shift
            data = q._data
            qbytes += _nbytes(getattr(data, "_data", data)) + _nbytes(q._scale) + _nbytes(q._shift)
            shape = q.shape
        elements += _numel(shape)
        rows = shape[0] * shape[2]
    fp_bytes = 0
    for t in (layer.keys, layer.values):
        if isinstance(t, torch.Tensor) and t.dim() == 4:
            fp_bytes += _nbytes(t)
            elements += t.numel()
    dtype = layer.keys.dtype if isinstance(layer.keys, torch.Tensor) else torch.float16
    if isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4:
        rows += layer.keys.shape[0] * layer.keys.shape[2]
    return memory_entry(qbytes, fp_bytes, rows, elements * 2, qbytes + fp_bytes,
                        baseline_bytes=elements * dtype.itemsize, baseline_dtype=dtype_name(dtype))


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["HF_GROUP", "HF_METHODS", "hf_layer_factory", "hf_memory"]
