"""Fused decode attention for transformers (5.17 - 5.19): ``attn_implementation="kvarn"``.

Decode steps read the packed tiles of :class:`kvarn.KVarNCache` directly with
:func:`kvarn.kernels.decode_attention` (no dequantized or full-precision copy of the history is
made); the prefill, and layers the cache keeps in full precision, go through transformers' SDPA.

    from kvarn.integrations.hf_attention import fused_cache, register
    register()                                   # once: AttentionInterface + mask under "kvarn"
    model.set_attn_implementation("kvarn")       # or from_pretrained(..., attn_implementation="kvarn")
    cache = fused_cache(model, "k4v2_g128")
    model.generate(ids, past_key_values=cache, ...)

How the attention function finds the packed storage: a fused layer's ``update`` returns, for decode
steps, two empty marker tensors that carry the layer (transformers passes ``update``'s return values
to the attention function as ``key``/``value``; it does not pass the cache). Complete tiles are
encoded with the Triton encoder (:func:`kvarn.kernels.encode_tiles`) into the cache's preallocated
tile store. Only the ``kvarn`` method is fused; other methods keep the cache's ordinary read path.
"""

from __future__ import annotations

import torch

from ..cache import KVarNCache, KVarNLayer
from ..codec import TileFields, check_encoded, rotate_kv
from ..methods import EncodedKV, TileCodec

NAME = "kvarn"


class TritonTileCodec(TileCodec):
    """The kvarn method's codec with the Triton flush (same fields as the torch codec)."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> EncodedKV:
        from .. import kernels

        if self.method.name != "kvarn":
            return super().encode(keys, values)
        b, h, t, d = keys.shape
        c = self.config
        n = t // c.tile
        k = rotate_kv(keys, c).reshape(b, h, n, c.tile, d).transpose(-1, -2)
        v = rotate_kv(values, c).reshape(b, h, n, c.tile, d)
        tiles = kernels.encode_tiles(k, v, c)
        # The kernel has no range guard of its own; tiles that underflow fp16 are not flagged as
        # zero tiles here (their subnormal scales decode close to zero): docs/algorithm.md.
        check_encoded(tiles, k, v)
        nbytes = int(round(self.bytes_per_token(d) * b * h * t))
        return EncodedKV(self.method, tuple(keys.shape), nbytes, tiles=tiles)


class _Lengths:
    """Device copies of a layer's per-row lengths.

    A decode step only lengthens every tail by the same count: that is an in-place add on the
    device. Anything else (a freeze, a crop, a reorder) rebuilds them from the host lists; a host to
    device copy waits for the GPU, so it must not happen at every step.
    """

    def __init__(self):
        self.key, self.tensors = None, None

    def get(self, layer: KVarNLayer):
        key = (tuple(layer.sink_len), tuple(layer.store.counts), tuple(layer.tail_len))
        old = self.key
        if old is not None and key[:2] == old[:2] and len(key[2]) == len(old[2]):
            grown = {a - b for a, b in zip(key[2], old[2])}
            if len(grown) == 1:
                step = grown.pop()
                if step:
                    self.tensors[2].add_(step)
                self.key = key
                return self.tensors
        self.key = key
        self.tensors = tuple(torch.tensor(x, dtype=torch.int32, device=layer.device) for x in key)
        return self.tensors


class FusedKVarNLayer(KVarNLayer):
    """A KVarNLayer whose decode-step ``update`` returns markers instead of the dequantized history."""

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False):
        super().__init__(codec, padding, is_sliding)
        self._lengths = _Lengths()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.length == 0:
            return super().update(key_states, value_states, *args, **kwargs)  # prefill: exact K/V
        self.freeze()
        self._append(key_states, value_states, [0] * self.batch)
        self.length += key_states.shape[-2]
        marker = key_states.new_empty(0)
        marker.kvarn_layer = self
        return marker, marker

    def fused_inputs(self) -> dict:
        """Arguments of :func:`kvarn.kernels.decode_attention` for the current state."""
        s_len, n_len, r_len = self._lengths.get(self)
        fields = self.store.view()
        tiles = TileFields(**fields) if fields else None
        return dict(
            sink_k=self.sink_k, sink_v=self.sink_v, tiles=tiles,
            tail_k=self.tail_k[:, :, : max(self.tail_len)], tail_v=self.tail_v[:, :, : max(self.tail_len)],
            config=self.codec.config, sink_lengths=s_len, tile_counts=n_len, tail_lengths=r_len,
            fp_frame="model",
        )


def fused_cache(model, preset="k4v2_g128", **overrides) -> KVarNCache:
    """A :class:`KVarNCache` (method ``kvarn``) whose quantized layers decode through the kernels."""
    cache = KVarNCache(model, "kvarn", preset, **overrides)
    codec = TritonTileCodec(cache.method, cache.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is KVarNLayer:
            cache.layers[i] = FusedKVarNLayer(codec, layer._padding, layer.is_sliding)
    return cache


def kvarn_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: fused decode for marker inputs, SDPA otherwise.

    query: ``[B, Hq, Tq, D]``; returns ``([B, Tq, Hq, D], None)``.
    """
    layer = getattr(key, "kvarn_layer", None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    from .. import kernels

    out = kernels.decode_attention(query, scaling=scaling, **layer.fused_inputs())
    return out.transpose(1, 2), None


def register(name: str = NAME) -> None:
    """Register the attention function and its mask under ``name`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, kvarn_attention)
    AttentionMaskInterface.register(name, sdpa_mask)


__all__ = ["register", "fused_cache", "kvarn_attention", "FusedKVarNLayer", "TritonTileCodec"]
