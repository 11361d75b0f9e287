"""One attention layer of a :class:`kvarn.KVarNCache`: [sink fp | frozen tiles | tail fp] per row.

Row ``b`` of the batch has ``pad[b]`` left-padding slots (excluded from every tile and scale), then
its real tokens: the first ``S`` form the sink (full precision, for the sequence's life), then
``count[b]`` frozen tiles of ``G`` tokens each (encoded once by the method's codec and never
re-encoded), then the tail (full precision). Sink and tail are stored in the model frame and dtype;
the tiles in the method's stored form (see :mod:`kvarn.cache.store`).

Acceptance. Tokens are frozen into tiles lazily, at the start of the next ``update``: by then they
have survived any ``crop`` (speculative tokens that were rejected are cropped right after the
forward that added them). ``crop`` therefore only ever removes tail tokens; a crop that would reach
into the sink or a frozen tile raises ``ValueError``. Prefill tiles are frozen at the start of the
first decode step, before that step reads them.

Read path. ``update`` returns ``[B, Hk, L, D]`` in the model dtype: each row's sink, its tiles
dequantized from the packed storage (re-decoded at every call; there is no full-precision copy of
frozen tiles) and its tail, placed after the row's pads; pad slots are zeros (the attention mask
hides them). The first update of an empty layer (the prefill) returns its input unchanged, so the
prompt's own attention is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import KVarNConfig
from ..methods import TileCodec
from ..record import TileFields
from .memory import dtype_name, empty_entry, memory_entry
from .store import TileStore, grown_capacity


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


class KVarNLayer(CacheLayerMixin):
    """Quantized KV cache of one full-attention layer (or a sliding one when asked to quantize it)."""

    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False, decoded_cache: bool = False):
        super().__init__()
        self.decoded_cache = decoded_cache
        self.codec = codec
        self.tile = codec.config.tile
        self.sink_tokens = codec.config.sink_tokens
        self._padding = padding  # shared object with a ``pads`` attribute (list[int] | None)
        self.is_sliding = is_sliding
        self.length = 0  # sequence length as transformers sees it (pads included)

    # state --------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4:
            raise ValueError(f"keys of shape {tuple(key_states.shape)}; KVarNCache takes [batch, kv_heads, "
                             "tokens, head_dim] key and value states")
        if key_states.shape != value_states.shape:
            raise ValueError(
                f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ in shape; "
                "KVarNCache needs K and V with the same head_dim (MLA-style caches are not supported)"
            )
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch, self.heads, self.head_dim = b, h, d
        pads = None if self._padding is None else self._padding.pads
        if pads is not None and len(pads) != b:
            raise ValueError(f"padding was given for {len(pads)} rows but the batch has {b} rows")
        self.pads = list(pads) if pads is not None else [0] * b
        # Sink and tail buffers grow on demand (see :func:`grown_capacity`): reserved memory stays
        # within 10% (plus one tile) of what is stored.
        self.sink_k = key_states.new_zeros(b, h, 0, d)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.sink_len = [0] * b
        self.store = TileStore(self.codec, b, h, d, self.device, decoded_cache=self.decoded_cache)
        self.tail_k = key_states.new_zeros(b, h, 0, d)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.tail_len = [0] * b
        self.length = 0
        self.is_initialized = True

    def reset(self) -> None:
        self.is_initialized = False
        self.length = 0
        for name in ("sink_k", "sink_v", "tail_k", "tail_v", "store"):
            self.__dict__.pop(name, None)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    @property
    def num_tiles(self) -> list[int]:
        """Frozen tiles per row."""
        return list(self.store.counts) if self.is_initialized else []

    # update -------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self.freeze()
        q = key_states.shape[-2]
        first = self.length == 0
        if first and q < max(self.pads):
            raise ValueError(f"the first update has {q} tokens but a row has {max(self.pads)} padding slots")
        skip = self.pads if first else [0] * self.batch
        self._append(key_states, value_states, skip)
        self.length += q
        if first:
            return key_states, value_states
        return self._assemble()

    def _ensure_tail(self, need: int) -> None:
        cap = self.tail_k.shape[2]
        if need <= cap:
            return
        self._resize_tail(grown_capacity(cap, need))

    def _resize_tail(self, new: int) -> None:
        keep = min(new, self.tail_k.shape[2])
        for name in ("tail_k", "tail_v"):
            old = getattr(self, name)
            buf = old.new_zeros(self.batch, self.heads, new, self.head_dim)
            buf[:, :, :keep] = old[:, :, :keep]
            setattr(self, name, buf)

    def _ensure_sink(self, need: int) -> None:
        cap = self.sink_k.shape[2]
        if need <= cap:
            return
        new = grown_capacity(cap, need, limit=self.sink_tokens)
        for name in ("sink_k", "sink_v"):
            old = getattr(self, name)
            buf = old.new_zeros(self.batch, self.heads, new, self.head_dim)
            buf[:, :, :cap] = old
            setattr(self, name, buf)

    def _append(self, k: torch.Tensor, v: torch.Tensor, skip: list[int]) -> None:
        q = k.shape[-2]
        self._ensure_tail(max(t + q - s for t, s in zip(self.tail_len, skip)))
        k, v = k.to(self.dtype), v.to(self.dtype)
        if len(set(self.tail_len)) == 1 and not any(skip):
            t = self.tail_len[0]
            self.tail_k[:, :, t:t + q] = k
            self.tail_v[:, :, t:t + q] = v
            self.tail_len = [t + q] * self.batch
            return
        if not any(skip):
            # Rows at different tail lengths (left padding): one indexed write for the whole batch.
            rows = torch.arange(self.batch, device=self.device)[:, None]
            cols = torch.tensor(self.tail_len, device=self.device)[:, None] + torch.arange(q, device=self.device)
            self.tail_k.transpose(1, 2)[rows, cols] = k.transpose(1, 2)
            self.tail_v.transpose(1, 2)[rows, cols] = v.transpose(1, 2)
            self.tail_len = [t + q for t in self.tail_len]
            return
        for b in range(self.batch):
            t, n = self.tail_len[b], q - skip[b]
            self.tail_k[b, :, t:t + n] = k[b, :, skip[b]:]
            self.tail_v[b, :, t:t + n] = v[b, :, skip[b]:]
            self.tail_len[b] = t + n

    def freeze(self) -> None:
        """Move accepted tail tokens into the sink until it is full, then encode every complete tile.

        Called at the start of each update; callers may call it to declare every cached token
        accepted (for example before :meth:`memory_report`).
        """
        s_cap, g = self.sink_tokens, self.tile
        rows, ks, vs, plan = [], [], [], []
        for b in range(self.batch):
            t = self.tail_len[b]
            to_sink = min(s_cap - self.sink_len[b], t)
            n = (t - to_sink) // g
            if n:
                blk = slice(to_sink, to_sink + n * g)
                # [Hk, n*G, D] -> [n, Hk, G, D]: one batch row per tile
                ks.append(self.tail_k[b, :, blk].reshape(self.heads, n, g, self.head_dim).transpose(0, 1))
                vs.append(self.tail_v[b, :, blk].reshape(self.heads, n, g, self.head_dim).transpose(0, 1))
                rows += [b] * n
            plan.append((to_sink, to_sink + n * g))
        if rows:
            # cat copies before the tail shifts
            keys, values = torch.cat(ks), torch.cat(vs)
            self.store.append(rows, keys, values, self._known_encoding(rows, keys, values))
        self._ensure_sink(max(s + t for s, (t, _) in zip(self.sink_len, plan)))
        for b, (to_sink, consumed) in enumerate(plan):
            if to_sink:
                s = self.sink_len[b]
                self.sink_k[b, :, s:s + to_sink] = self.tail_k[b, :, :to_sink]
                self.sink_v[b, :, s:s + to_sink] = self.tail_v[b, :, :to_sink]
                self.sink_len[b] = s + to_sink
            if consumed:
                t = self.tail_len[b]
                self.tail_k[b, :, : t - consumed] = self.tail_k[b, :, consumed:t].clone()
                self.tail_v[b, :, : t - consumed] = self.tail_v[b, :, consumed:t].clone()
                self.tail_len[b] = t - consumed
        self._shrink_tail()

    def _known_encoding(self, rows: list[int], keys: torch.Tensor, values: torch.Tensor):
        """The encoding of the tiles :meth:`freeze` stores now (rows, keys and values as
        ``store.append`` takes them), where one is at hand; None: the store encodes them."""
        return None

    def _shrink_tail(self) -> None:
        # A long prefill (or a multi-token step) grows the tail; once its tiles are frozen the tail
        # holds fewer than G tokens per row (more only while the sink fills): give the rest back.
        cap, used = self.tail_k.shape[2], max(self.tail_len, default=0)
        if cap > max(self.tile, grown_capacity(used, used)):
            self._resize_tail(max(used, min(cap, self.tile)))

    def _assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.tile
        dk, dv = self.store.decode()
        dk, dv = dk.to(self.dtype), dv.to(self.dtype)
        layout = list(zip(self.pads, self.sink_len, self.store.counts, self.tail_len))
        if len(set(layout)) == 1:
            p, s, n, t = layout[0]
            parts_k = [self.sink_k[:, :, :s], dk[:, :, : n * g], self.tail_k[:, :, :t]]
            parts_v = [self.sink_v[:, :, :s], dv[:, :, : n * g], self.tail_v[:, :, :t]]
            if p:
                pad = self.sink_k.new_zeros(self.batch, self.heads, p, self.head_dim)
                parts_k.insert(0, pad)
                parts_v.insert(0, pad)
            return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2)
        # Rows differ (left padding): one gather over [sink | decoded tiles | tail] instead of
        # six slice copies per row, which cost thousands of kernel launches per step at batch 128.
        src_k = torch.cat([self.sink_k, dk, self.tail_k], dim=2)
        src_v = torch.cat([self.sink_v, dv, self.tail_v], dim=2)
        s_cap, n_cap = self.sink_k.shape[2], dk.shape[2]
        meta = torch.tensor([[p, s, n * g, t] for p, s, n, t in layout], device=self.device)
        p, s, n, t = (meta[:, i, None] for i in range(4))  # each [B, 1]
        r = torch.arange(self.length, device=self.device)[None, :] - p  # position within the row
        idx = torch.where(r < s, r, torch.where(r < s + n, s_cap + r - s, s_cap + n_cap + r - s - n))
        valid = (r >= 0) & (r < s + n + t)
        idx = torch.where(valid, idx, 0)[:, None, :, None].expand(-1, self.heads, -1, self.head_dim)
        hole = ~valid[:, None, :, None]
        out_k = torch.gather(src_k, 2, idx).masked_fill_(hole, 0)
        out_v = torch.gather(src_v, 2, idx).masked_fill_(hole, 0)
        return out_k, out_v

    # read-only accessors ----------------------------------------------------------------------
    def view(self) -> "LayerView":
        """The stored state without copies (do not write to it). See :class:`LayerView`."""
        if not self.is_initialized:
            raise ValueError("the layer holds nothing yet (no update so far)")
        long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        fields = self.store.view()
        tiles = TileFields(**fields) if fields and "k_codes" in fields else None
        s_max, r_max = max(self.sink_len), max(self.tail_len)
        return LayerView(
            method=self.codec.method.name, config=self.codec.config, length=self.length,
            pads=long(self.pads),
            sink_k=self.sink_k[:, :, :s_max], sink_v=self.sink_v[:, :, :s_max], sink_lengths=long(self.sink_len),
            tiles=tiles, tile_fields=fields, tile_counts=long(self.store.counts),
            tail_k=self.tail_k[:, :, :r_max], tail_v=self.tail_v[:, :, :r_max], tail_lengths=long(self.tail_len),
        )

    def memory(self) -> dict:
        """Bytes actually stored by this layer (see :meth:`kvarn.KVarNCache.memory_report`)."""
        if not self.is_initialized:
            return empty_entry()
        per_token = self.heads * self.head_dim * 2  # K and V elements per token
        esize = self.sink_k.element_size()
        fp_tokens = sum(self.sink_len) + sum(self.tail_len)
        tile_tokens = sum(self.store.counts) * self.tile
        fp_bytes = fp_tokens * per_token * esize
        tile_bytes = self.store.stored_bytes()
        quantized = self.codec.method.fmt != "none"
        reserved = (
            self.sink_k.numel() + self.sink_v.numel() + self.tail_k.numel() + self.tail_v.numel()
        ) * esize + self.store.reserved_bytes()
        tokens = fp_tokens + tile_tokens
        return memory_entry(
            quantized_bytes=tile_bytes if quantized else 0,
            full_precision_bytes=fp_bytes + (0 if quantized else tile_bytes),
            tokens=tokens,
            fp16_equivalent_bytes=tokens * per_token * 2,
            reserved_bytes=reserved,
            quantized_tiles=self.store.num_tile_heads,
            decoded_cache_bytes=self.store.decoded_cache_bytes(),
            baseline_bytes=tokens * per_token * esize,
            baseline_dtype=dtype_name(self.dtype),
        )

    # rollback and batch reordering --------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last tokens: ``-n`` removes n; a positive value keeps that many (legacy)."""
        if not self.is_initialized:
            return
        n = self.length - tokens_to_remove if tokens_to_remove > 0 else -tokens_to_remove
        if n <= 0:
            return
        if n > min(self.tail_len):
            b = self.tail_len.index(min(self.tail_len))
            raise ValueError(
                f"cannot crop {n} tokens: row {b} holds only {self.tail_len[b]} unfrozen tail tokens; "
                "the sink and frozen tiles are never removed or requantized (KVarNCache rolls back "
                "only tokens of updates not yet followed by another update)"
            )
        self.tail_len = [t - n for t in self.tail_len]
        self.length -= n

    def _select(self, index: torch.Tensor) -> None:
        idx = index.tolist()
        for name in ("pads", "sink_len", "tail_len"):
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        index = index.to(self.device)
        for name in ("sink_k", "sink_v", "tail_k", "tail_v"):
            setattr(self, name, getattr(self, name).index_select(0, index))
        self.store.select(index)
        self.batch = len(idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            idx = torch.arange(self.batch)[indices]
            self._select(idx)

    def offload(self):  # no separate keys/values tensors to move
        return None

    def prefetch(self):
        return None
