"""The read side of a :class:`kvarn.KVarNLayer`: the history its ``update`` returns, and
:class:`LayerView`, its stored state for fused attention paths.

Read path. ``update`` returns ``[B, Hk, L, D]`` in the model dtype: each row's sink, its tiles
dequantized from the packed storage (re-decoded at every call; there is no full-precision copy of
frozen tiles) and its tail, placed after the row's pads; pad slots are zeros (the attention mask
hides them). The first update of an empty layer (the prefill) returns its input unchanged, so the
prompt's own attention is exact.

:func:`assemble` and :func:`layer_view` read the layer's buffers and write nothing; they live apart
from :mod:`kvarn.cache.layer`, which writes them (append, freeze, crop, reorder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..codec.record import TileFields
from ..config import KVarNConfig

if TYPE_CHECKING:
    from .layer import KVarNLayer


@dataclass(frozen=True)
class LayerView:
    """Read-only state of a :class:`KVarNLayer` (for fused attention paths).

    Leading dims are ``[B, Hk]``; per-row counts are long ``[B]``; entries past a row's count are
    unused. Sink and tail are full precision in the *model* frame and dtype (rotate them with
    ``kvarn.codec.rotate_kv`` for the rotated frame, or score them with the un-rotated query, as
    ``q k^T = q' k'^T``). Tiles are in the method's stored form; for kvarn they are in the rotated
    frame. Row ``b`` reads, in sequence order: ``pads[b]`` pad slots, ``sink_lengths[b]`` sink
    tokens, ``tile_counts[b]`` tiles of G tokens, ``tail_lengths[b]`` tail tokens.
    """

    method: str
    config: KVarNConfig
    length: int                      # sequence length as transformers sees it (pads included)
    pads: torch.Tensor               # [B]
    sink_k: torch.Tensor             # [B, Hk, S, D]
    sink_v: torch.Tensor
    sink_lengths: torch.Tensor       # [B]
    tiles: TileFields | None         # integer methods: fields [B, Hk, N, ...]
    tile_fields: dict                # any method: name -> [B, Hk, N, ...]
    tile_counts: torch.Tensor        # [B]
    tail_k: torch.Tensor             # [B, Hk, R, D]
    tail_v: torch.Tensor
    tail_lengths: torch.Tensor       # [B]
    # kvarn-auto: bool [B, Hk], the frame of each head's tiles (None: all rotated, the spec), as
    # kvarn.attention.decode_attention's key_rotated / value_rotated take them.
    key_rotated: torch.Tensor | None = None
    value_rotated: torch.Tensor | None = None


def assemble(layer: KVarNLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The history ``update`` returns: ``[B, Hk, L, D]`` in the model dtype (module docstring)."""
    g = layer.tile
    dk, dv = layer.store.decode()
    dk, dv = dk.to(layer.dtype), dv.to(layer.dtype)
    layout = list(zip(layer.pads, layer.sink_len, layer.store.counts, layer.tail_len))
    if len(set(layout)) == 1:
        p, s, n, t = layout[0]
        parts_k = [layer.sink_k[:, :, :s], dk[:, :, : n * g], layer.tail_k[:, :, :t]]
        parts_v = [layer.sink_v[:, :, :s], dv[:, :, : n * g], layer.tail_v[:, :, :t]]
        if p:
            pad = layer.sink_k.new_zeros(layer.batch, layer.heads, p, layer.head_dim)
            parts_k.insert(0, pad)
            parts_v.insert(0, pad)
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
    # Rows differ (left padding): one gather over [sink | decoded tiles | tail] instead of
    # six slice copies per row, which cost thousands of kernel launches per step at batch 128.
    src_k = torch.cat([layer.sink_k, dk, layer.tail_k], dim=2)
    src_v = torch.cat([layer.sink_v, dv, layer.tail_v], dim=2)
    s_cap, n_cap = layer.sink_k.shape[2], dk.shape[2]
    meta = torch.tensor([[p, s, n * g, t] for p, s, n, t in layout], device=layer.device)
    p, s, n, t = (meta[:, i, None] for i in range(4))  # each [B, 1]
    r = torch.arange(layer.length, device=layer.device)[None, :] - p  # position within the row
    idx = torch.where(r < s, r, torch.where(r < s + n, s_cap + r - s, s_cap + n_cap + r - s - n))
    valid = (r >= 0) & (r < s + n + t)
    idx = torch.where(valid, idx, 0)[:, None, :, None].expand(-1, layer.heads, -1, layer.head_dim)
    hole = ~valid[:, None, :, None]
    out_k = torch.gather(src_k, 2, idx).masked_fill_(hole, 0)
    out_v = torch.gather(src_v, 2, idx).masked_fill_(hole, 0)
    return out_k, out_v


def layer_view(layer: KVarNLayer) -> LayerView:
    """The stored state of ``layer`` without copies (do not write to it)."""
    if not layer.is_initialized:
        raise ValueError("the layer holds nothing yet (no update so far)")
    long = lambda xs: torch.tensor(xs, dtype=torch.long, device=layer.device)  # noqa: E731
    fields = layer.store.view()
    tiles = TileFields(**fields) if fields and "k_codes" in fields else None
    s_max, r_max = max(layer.sink_len), max(layer.tail_len)
    return LayerView(
        method=layer.codec.method.name, config=layer.codec.config, length=layer.length,
        pads=long(layer.pads),
        sink_k=layer.sink_k[:, :, :s_max], sink_v=layer.sink_v[:, :, :s_max], sink_lengths=long(layer.sink_len),
        tiles=tiles, tile_fields=fields, tile_counts=long(layer.store.counts),
        tail_k=layer.tail_k[:, :, :r_max], tail_v=layer.tail_v[:, :, :r_max], tail_lengths=long(layer.tail_len),
    )
