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

Read path: :mod:`kvarn.cache.read` (what ``update`` returns, and :class:`LayerView` for fused
attention paths).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..methods import TileCodec
from .memory import dtype_name, empty_entry, memory_entry
from .read import LayerView, assemble, layer_view
from .store import TileStore, grown_capacity


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
        """The dequantized history (:func:`kvarn.cache.read.assemble`)."""
        return assemble(self)

    # read-only accessors ----------------------------------------------------------------------
    def view(self) -> LayerView:
        """The stored state without copies (do not write to it). See :class:`LayerView`."""
        return layer_view(self)

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
