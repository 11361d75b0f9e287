"""Growable, per-row storage of encoded tiles for one cache layer.

Every stored field is one preallocated tensor ``[B, Hk, capacity, *per_tile_shape]``; row ``b`` uses
slots ``0 .. count[b]-1`` (rows may hold different numbers of tiles: left padding shifts where a
row's tiles start). Capacity grows geometrically (by at least 10%, see
:func:`grown_capacity`) when a row needs more slots, so appends stay amortized
O(1) while reserved slots stay within 10% of the used ones. Unused slots are zeros, which decode to zeros.

Fields per (row, KV head, tile), by method format (see :mod:`kvarn.methods`):

- integer methods (kvarn, kivi, rtn, quarot, hkivi, varn): the :class:`kvarn.codec.record.TileFields`
  ``k_codes, k_row_scale, k_row_zero, k_col_scale, v_codes, v_col_scale, v_row_scale, v_row_zero``
  (K tile ``[D, G]`` for per-channel keys, ``[G, D]`` for per-token keys);
- ``fp8``: ``k_fp8 [G, D]`` float8_e4m3fn, ``k_scale [G]`` fp16, and the same for V;
- ``fp16`` (no quantization): ``keys``/``values``, the K/V tile ``[G, D]`` in the model dtype.
"""

from __future__ import annotations

import torch

from ..codec.flavour import Flavours
from ..codec.record import FIELD_ORDER, TileFields
from ..methods import RECORD_METHODS, EncodedKV, TileCodec

def grown_capacity(capacity: int, need: int, limit: int | None = None) -> int:
    """Capacity for ``need`` slots: ``need``, or 10% more than ``capacity`` when that is larger
    (geometric growth keeps appends amortized O(1)); at most ``limit`` (unless ``need`` is larger).
    A buffer sized this way is never more than 10% (plus one slot) above what it holds."""
    new = max(need, capacity + max(capacity // 10, 1))
    return new if limit is None else min(new, max(limit, need))


_FLOAT_FIELDS = ("keys", "values", "k_fp8", "k_scale", "v_fp8", "v_scale")


_COL_FIELDS = ("k_col_scale", "v_col_scale")


def _split(enc: EncodedKV, g: int) -> dict[str, torch.Tensor]:
    """EncodedKV of ``[M, Hk, n*G, D]`` -> fields ``[M, Hk, n, *per_tile]``.

    Methods without normalization have column scales of exactly 1: they are not stored.
    """
    if enc.tiles is not None:
        return {
            name: getattr(enc.tiles, name) for name in FIELD_ORDER
            if enc.method.normalize or name not in _COL_FIELDS
        }
    out = {}
    for name in _FLOAT_FIELDS:
        x = getattr(enc, name)
        if x is not None:
            m, h, t = x.shape[:3]
            out[name] = x.reshape(m, h, t // g, g, *x.shape[3:])
    return out


def _one_tile(enc: EncodedKV) -> EncodedKV:
    """A copy of the first tile of ``enc`` (``[1, Hk, G, D]``) that shares no storage with it."""
    first = lambda x: None if x is None else x[:1].clone()  # noqa: E731
    tiles = None if enc.tiles is None else enc.tiles.map(first)
    return EncodedKV(enc.method, (1, *enc.shape[1:]), 0, tiles=tiles,
                     **{name: first(getattr(enc, name)) for name in _FLOAT_FIELDS})


def device_index(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints -> long tensor on ``device`` without waiting for the device.

    A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and blocks until the
    GPU has finished all queued work; a pinned, non-blocking copy is ordered on the stream instead.
    """
    device = torch.device(device)
    host = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _join(fields: dict[str, torch.Tensor], enc_template: EncodedKV, shape: tuple[int, ...],
          flavours: Flavours | None = None) -> EncodedKV:
    """Fields ``[B, Hk, n, *per_tile]`` -> EncodedKV of ``[B, Hk, n*G, D]`` (for TileCodec.decode)."""
    b, h, t, _ = shape
    if enc_template.tiles is not None:
        full = dict(fields)
        for name in _COL_FIELDS:
            if name not in full:  # the unit column scales that were not stored
                like = getattr(enc_template.tiles, name)
                full[name] = like.new_ones(b, h, t // enc_template.shape[2], like.shape[-1])
        return EncodedKV(enc_template.method, shape, 0, tiles=TileFields(**full), flavours=flavours)
    flat = {name: x.reshape(b, h, t, *x.shape[4:]) for name, x in fields.items()}
    return EncodedKV(enc_template.method, shape, 0, **flat)


class TileStore:
    """Encoded tiles of one layer, per row. Encode with :meth:`append`, read with :meth:`decode`."""

    def __init__(self, codec: TileCodec, batch: int, heads: int, head_dim: int, device: torch.device,
                 decoded_cache: bool = False):
        self.codec = codec
        # Tiles are immutable, so the reference read path may keep each tile's dequantized float32
        # K/V from the moment it is frozen instead of re-decoding the whole history every step.
        # This is a working copy for CPU speed, reported apart from the stored bytes.
        self.decoded_cache = decoded_cache
        self._dec: tuple[torch.Tensor, torch.Tensor] | None = None
        self.batch, self.heads, self.head_dim, self.device = batch, heads, head_dim, device
        self.counts = [0] * batch
        self.fields: dict[str, torch.Tensor] | None = None
        self._template: EncodedKV | None = None
        self.capacity = 0
        # kvarn-auto: per-(row, KV head) flavours [B, Hk], fixed before the first tile is encoded.
        self.flavours: Flavours | None = None

    # stored bytes -------------------------------------------------------------------------------
    def bytes_per_tile_head(self) -> int:
        """Stored bytes of one (tile, KV head): the fields' own bytes; kvarn pads to its record size."""
        if self.fields is None:
            return 0
        raw = sum(x[0, 0, 0].numel() * x.element_size() for x in self.fields.values())
        if self.codec.method.name in RECORD_METHODS:
            return self.codec.config.record_bytes(self.head_dim)
        return raw

    @property
    def num_tile_heads(self) -> int:
        return sum(self.counts) * self.heads

    def stored_bytes(self) -> int:
        return self.num_tile_heads * self.bytes_per_tile_head()

    def reserved_bytes(self) -> int:
        if self.fields is None:
            return 0
        return sum(x.numel() * x.element_size() for x in self.fields.values())

    def decoded_cache_bytes(self) -> int:
        """Bytes of the optional dequantized working copy (0 when ``decoded_cache`` is off)."""
        return 0 if self._dec is None else sum(x.numel() * x.element_size() for x in self._dec)

    # writing ------------------------------------------------------------------------------------
    def _grow(self, need: int) -> None:
        new = grown_capacity(self.capacity, need)  # +10% at least: geometric, little slack
        for name, x in self.fields.items():
            y = x.new_zeros(x.shape[0], x.shape[1], new, *x.shape[3:])
            y[:, :, : self.capacity] = x
            self.fields[name] = y
        if self.decoded_cache:
            g = self.codec.config.tile
            old = self._dec
            self._dec = tuple(
                torch.zeros(self.batch, self.heads, new * g, self.head_dim, dtype=torch.float32, device=self.device)
                for _ in range(2)
            )
            if old is not None:
                for o, n_ in zip(old, self._dec):
                    n_[:, :, : o.shape[2]] = o
        self.capacity = new

    def append(self, rows: list[int], keys: torch.Tensor, values: torch.Tensor,
               encoded: EncodedKV | None = None) -> None:
        """Encode ``M`` complete tiles and store tile ``m`` as the next slot of row ``rows[m]``.

        keys, values: ``[M, Hk, G, D]`` in the model frame and dtype. encoded: their encoding by
        this store's codec where the caller has it already (kvarn-auto's trial of the prompt).
        """
        if encoded is not None:
            enc = encoded
        elif self.flavours is None:
            enc = self.codec.encode(keys, values)
        else:  # kvarn-auto: the flavours of the tiles' rows
            rows_t = torch.tensor(rows, device=self.flavours.key_rotate.device)
            enc = self.codec.encode(keys, values, self.flavours.select(rows_t))
        new = {name: x[:, :, 0] for name, x in _split(enc, self.codec.config.tile).items()}
        self._first_write(enc, new)
        slots = []
        for b in rows:
            slots.append(self.counts[b])
            self.counts[b] += 1
        if max(self.counts) > self.capacity:
            self._grow(max(self.counts))
        r = device_index(rows, self.device)
        s = device_index(slots, self.device)
        for name, x in new.items():
            self.fields[name][r, :, s] = x
        if self.decoded_cache:
            g = self.codec.config.tile
            dk, dv = self.codec.decode(enc)  # [M, Hk, G, D]: only the new tiles
            for m, (b, slot) in enumerate(zip(rows, slots)):
                self._dec[0][b, :, slot * g:(slot + 1) * g] = dk[m]
                self._dec[1][b, :, slot * g:(slot + 1) * g] = dv[m]

    def _first_write(self, enc: EncodedKV, per_tile: dict[str, torch.Tensor]) -> None:
        if self._template is None:
            # The template only tells _join the format: keep a one-tile copy, not a reference to
            # this first batch (a whole prefill's tiles would otherwise stay allocated twice).
            self._template = _one_tile(enc)
        if self.fields is None:
            self.fields = {
                name: x.new_zeros(self.batch, self.heads, 0, *x.shape[2:]) for name, x in per_tile.items()
            }

    def reserve(self, layout: list[tuple[str, tuple[int, ...], torch.dtype]], capacity: int) -> None:
        """Allocate every field for ``capacity`` slots per row before the first tile is written.

        layout: ``(field, per-tile shape, dtype)`` as :func:`kvarn.codec.record.record_layout` gives them.
        The fields then never move while the count stays within ``capacity`` (a captured CUDA
        graph keeps their addresses).
        """
        if self.fields is not None:
            raise ValueError("reserve must be called before the first tile is stored")
        self.fields = {name: torch.zeros(self.batch, self.heads, capacity, *shape, dtype=dtype, device=self.device)
                       for name, shape, dtype in layout}
        self.capacity = capacity

    def encode_into(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor) -> int:
        """Encode ``n`` complete tiles of every row into slots ``start .. start + n - 1``; returns n.

        keys, values: ``[B, Hk, n*G, D]`` in the model frame and dtype. ``start``: int32 or long ``[1]``
        on the device, the slot of every row (rows hold the same number of tiles). The position is read on
        the device, so a CUDA graph that captured this call writes each replay's tile at the next
        slot. ``counts`` is left to the caller, which advances it by n (it keeps the host's view).
        """
        if self.decoded_cache:
            raise ValueError("encode_into does not maintain decoded_cache")
        if len(set(self.counts)) != 1:
            raise ValueError(f"encode_into needs every row at the same tile count, got {self.counts}")
        g = self.codec.config.tile
        n = keys.shape[2] // g
        # The Triton codec writes the slots itself (one launch); the first write also sets the
        # format template, so it goes the general way.
        direct = getattr(self.codec, "encode_into", None)
        if self._template is not None and direct is not None:
            if self.counts[0] + n > self.capacity:
                self._grow(self.counts[0] + n)
            if direct(keys, values, self.flavours, TileFields(**self.fields), start):
                return n
        enc = self.codec.encode(keys, values, self.flavours)
        new = _split(enc, g)  # [B, Hk, n, *per_tile]
        self._first_write(enc, {name: x[:, :, 0] for name, x in new.items()})
        if self.counts[0] + n > self.capacity:
            self._grow(self.counts[0] + n)
        idx = start.long() + torch.arange(n, device=self.device)
        for name, x in new.items():
            self.fields[name].index_copy_(2, idx, x)
        return n

    # reading ------------------------------------------------------------------------------------
    def decode(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` slots of every row (default: the largest count), dequantized.

        Returns ``(keys, values)`` float32 ``[B, Hk, n*G, D]`` in the model frame.
        """
        n = max(self.counts) if n is None else n
        g, d = self.codec.config.tile, self.head_dim
        shape = (self.batch, self.heads, n * g, d)
        if n == 0 or self.fields is None:
            empty = torch.zeros(shape, dtype=torch.float32, device=self.device)
            return empty, empty.clone()
        if self.decoded_cache:
            return self._dec[0][:, :, : n * g], self._dec[1][:, :, : n * g]
        view = {name: x[:, :, :n] for name, x in self.fields.items()}
        return self.codec.decode(_join(view, self._template, shape, self.flavours))

    def view(self) -> dict[str, torch.Tensor]:
        """Read-only views of the used slots: fields ``[B, Hk, max(count), *per_tile]``."""
        if self.fields is None:
            return {}
        n = max(self.counts)
        return {name: x[:, :, :n] for name, x in self.fields.items()}

    # batch reordering ---------------------------------------------------------------------------
    def select(self, index: torch.Tensor) -> None:
        """Rows become ``rows[index]`` (beam reorder, repeat or select); index: long ``[B']``."""
        idx = index.tolist()
        self.counts = [self.counts[i] for i in idx]
        self.batch = len(idx)
        if self.flavours is not None:
            self.flavours = self.flavours.select(index)
        if self.fields is not None:
            index = index.to(self.device)
            self.fields = {name: x.index_select(0, index) for name, x in self.fields.items()}
            if self._dec is not None:
                self._dec = tuple(x.index_select(0, index) for x in self._dec)
