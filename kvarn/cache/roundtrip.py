"""A full-history transformers cache whose finished tiles are replaced by their quantized round trip.

The decode cache's semantics without its storage: every layer keeps its K/V at full precision, and
once a tile of ``G`` tokens past the sink is finished, :func:`freeze_cache` overwrites it with what
the method's codec decodes from it (docs/algorithm.md section 5). kvarn-auto's self-test
(:mod:`kvarn.auto.self_test_rule`) and the drift analysis (:mod:`kvarn.analysis`) read the model's
next-token distributions over such a history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import KVarNConfig
from ..methods import TileCodec

__all__ = ["TileFreezer", "freeze_cache", "new_cache"]


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
