"""The fused path's cache layer: a :class:`kvarn.KVarNLayer` whose decode steps read no value back
to the host, for :mod:`kvarn.integrations.transformers.attention` (transformers 5.17 - 5.19).

A fused layer's ``update`` returns, for decode steps, two empty marker tensors that carry the layer
(transformers passes ``update``'s return values to the attention function as ``key``/``value``; it
does not pass the cache), and the attention function reads the packed tiles through
:meth:`FusedKVarNLayer.fused_inputs`. Complete tiles are encoded with the Triton encoder
(:func:`kvarn.kernels.encode_tiles`) into the cache's tile store, in the step's update or, under
:func:`kvarn.integrations.transformers.graph.decode_greedy`, ahead of it on a side stream
(:meth:`FusedKVarNLayer.read_done`, :func:`kvarn.integrations.transformers.freeze_schedule.start_encodes`).
For kvarn-auto the per-(row, KV head) flavours (:mod:`kvarn.auto`) are encoded by the same kernel
(rotation applied per head before it, normalization switched per tile inside it) and read by the
decode kernel through its ``key_rotated`` / ``value_rotated`` flags. A row whose prompt is shorter
than the sink plus a tile decides when its first tile past the sink completes: until then the
layer is not steady, so those steps take the host plan (eager, outside any captured graph), and
the step that freezes the tile makes the decision on the host first (:mod:`kvarn.auto.layer`);
the steps after it are steady and captured as any.
"""

from __future__ import annotations

import contextlib

import torch

from ...auto.layer import KVarNAutoLayer
from ...cache import KVarNLayer
from ...codec.record import TileFields, record_layout
from ...methods import TileCodec
from . import freeze_schedule


class FusedKVarNLayer(KVarNLayer):
    """A KVarNLayer whose decode-step ``update`` returns markers instead of the dequantized history.

    Lengths. The host keeps the per-row lengths (lists, as in :class:`KVarNLayer`: they follow from
    the update sizes alone, so the host never reads them back), and the device keeps a copy,
    ``int32 [3, B]`` (sink lengths, tile counts, tail lengths), that the kernels read. A decode step
    of rows in lockstep (same sink, tile and tail lengths, sink full: any batch without left
    padding, after its first decode step) touches only the device copy with device ops: the new
    K/V is written at the tail position read on the device, a completed tile is encoded into the
    slot read on the device, and the lengths are advanced in place. Nothing is read back and no
    host value is copied to the device, so such a step can be captured in a CUDA graph and
    replayed at later positions (see :mod:`kvarn.integrations.transformers.graph`). Other steps (the first
    decode step, which freezes the prompt's tiles; rows at different lengths) run the host plan of
    :meth:`KVarNLayer.freeze` and refresh the device copy with a non-blocking pinned copy.

    ``max_length``: reserve tile storage for that many tokens per row (pads included) up front, so
    that no buffer moves during decoding (needed for graph capture); None grows on demand.
    """

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False, max_length: int | None = None):
        super().__init__(codec, padding, is_sliding)
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be a positive token count or None, got {max_length}")
        self.max_length = max_length
        self._dev_len = None
        self._lockstep = False
        self._ahead = None  # (length, True or freeze_schedule.Started): the encode started at that length
        # decode_greedy's hook: False, off; else the stream (None: at once) on which the step that
        # completes a tile starts encoding it (see flush_ahead)
        self.ahead_stream = False
        self.ahead_in_fill = True  # the step that completes this layer's tile starts its encode
        self.ahead_starts = ()  # the layers whose due encodes this layer's read starts, one fork (decode_greedy)
        self.ahead_programs = None  # the grid cap of encodes started on a side stream (codec.beside)
        self._read_pending = False  # a steady one-token update's attention read is still to come

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._dev_len = torch.zeros(3, self.batch, dtype=torch.int32, device=self.device)
        if self.max_length is not None:
            g, s = self.tile, self.sink_tokens
            cap = max(1, -(-max(0, self.max_length - s) // g))
            self.store.reserve(record_layout(self.codec.config, self.head_dim), cap)
            # The tail a steady step writes into holds up to a tile. Reserved now: grown on demand
            # it could still be shorter than that when a step is captured (a prompt shorter than
            # the sink leaves it at the prompt's length), and a captured step writes past its end.
            self._ensure_tail(min(g, self.max_length))

    def reset(self) -> None:
        super().reset()
        self._dev_len, self._lockstep, self._ahead = None, False, None

    # host plan -> device copy -------------------------------------------------------------------
    def _sync_lengths(self) -> None:
        """Copy the host lengths to the device copy (ordered on the stream; no wait) and re-check lockstep."""
        rows = [self.sink_len, self.store.counts, self.tail_len]
        host = torch.tensor(rows, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._dev_len.copy_(host, non_blocking=True)
        self._lockstep = all(len(set(x)) == 1 for x in rows) and self.sink_len[0] == self.sink_tokens

    def freeze(self) -> None:
        super().freeze()
        self._sync_lengths()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._ahead = None  # a tile encoded ahead may hold tokens just removed (the length can come back)
        if self.is_initialized:
            self._sync_lengths()

    def _select(self, index: torch.Tensor) -> None:
        super()._select(index)
        self._ahead = None
        self._dev_len = torch.zeros(3, self.batch, dtype=torch.int32, device=self.device)
        self._sync_lengths()

    # decode step ----------------------------------------------------------------------------------
    @property
    def steady(self) -> bool:
        """True when the next decode step runs on device state alone (rows in lockstep, sink full)."""
        return self.is_initialized and self.length > 0 and self._lockstep

    def tiles_due(self) -> int:
        """Tiles the next update of a steady layer encodes (complete tiles in the tail)."""
        return self.tail_len[0] // self.tile if self.steady else 0

    def fills(self) -> bool:
        """True when the next one-token update of a steady layer completes a tile."""
        return self.steady and (self.tail_len[0] + 1) % self.tile == 0

    def advance(self, q: int = 1) -> None:
        """The host side of one steady step of ``q`` tokens (the device side is in the step itself).

        A replayed CUDA graph runs the device side only; its caller advances the host with this.
        """
        n = self.tiles_due()
        if n:
            self.store.counts = [c + n for c in self.store.counts]
        self.tail_len = [t - n * self.tile + q for t in self.tail_len]
        self.length += q

    def host_state(self) -> tuple:
        return self.length, list(self.sink_len), list(self.store.counts), list(self.tail_len)

    def set_host_state(self, state: tuple) -> None:
        self.length, sink, counts, tail = state
        self.sink_len, self.store.counts, self.tail_len = list(sink), list(counts), list(tail)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized or self.length == 0:
            self.codec.raise_deferred()  # a new sequence: report what the last one deferred
            out = super().update(key_states, value_states, *args, **kwargs)  # prefill: exact K/V
            self._sync_lengths()
            return out
        q = key_states.shape[-2]
        if self.max_length is not None and self.length + q > self.max_length:
            raise ValueError(f"the cache holds at most max_length={self.max_length} tokens per row; "
                             f"{self.length} + {q} would exceed it")
        steady = self.steady
        # The room the append needs is counted from the tail after this update's flush, which moves
        # only the device lengths (the host's are advanced below): counted from the host tail, the
        # update that freezes a full tail would grow its buffer by a token, and a buffer resized in
        # a captured step is a new address that the other captured steps never see.
        due = self.tiles_due()
        frozen = due * self.tile
        if steady:
            self._flush_device()
        else:
            self._ahead = None  # the host plan encodes every complete tile itself
            moved = sum(self.sink_len) + sum(self.store.counts)
            # The host plan (rows at different lengths, or the sink still filling): the next freeze in
            # the MRO (kvarn-auto's, then KVarNLayer's); this one syncs the device lengths below.
            super().freeze()
            if sum(self.sink_len) + sum(self.store.counts) != moved:  # a freeze only ever moves tail tokens
                self._sync_lengths()
        self._ensure_tail(max(self.tail_len) - frozen + q)
        self._append_device(key_states, value_states, due)
        self._read_pending = steady and q == 1  # read_done starts the encode if this token completed a tile
        if steady:
            self.advance(q)
        else:
            self.tail_len = [t + q for t in self.tail_len]
            self.length += q
        marker = key_states.new_empty(0)
        marker.kvarn_layer = self
        return marker, marker

    def read_done(self) -> None:
        """Called by the attention function after its decode read: with :attr:`ahead_stream` set,
        the due encodes of the layers in :attr:`ahead_starts` start now, together (one fork of the
        side stream, see :meth:`flush_ahead`): tiles that this step's token completed in this layer
        or in earlier ones, or tiles of later layers, due since their updates in the step before
        (a freeze that decode_greedy spreads over two steps).

        Not in the update: there the encode runs beside the layer's decode kernel, a short launch of
        a few waves that it slows by holding SMs (on the H200 at 8K x 1 the fill step was 0.44 ms
        over a plain step that way, 0.18 ms with the encode after the read, beside the projections).
        """
        if self._read_pending and self.ahead_stream is not False:
            freeze_schedule.start_encodes(self.ahead_starts, self.ahead_stream)
        self._read_pending = False

    def due_ahead(self) -> int:
        """The complete tiles :meth:`flush_ahead` would start encoding now: a steady layer whose tail
        is exactly its complete tiles, not yet started at this length; else 0."""
        n = self.tiles_due()
        if not n or self.tail_len[0] != n * self.tile or (self._ahead and self._ahead[0] == self.length):
            return 0
        return n

    def flush_ahead(self, stream: torch.cuda.Stream | None) -> None:
        """Start the next update's flush now (on ``stream``, a side CUDA stream, when given; at once
        otherwise), for a steady layer whose tail is exactly its complete tiles: the same bits the
        update would encode, written into the same slots, only earlier and on another stream.
        :meth:`read_done` starts encodes this way after the read of the step whose token completes a
        tile, so that they overlap the rest of that step (the step joins the stream at its end,
        :meth:`joined`, and the next update, which freezes the tile, only advances the lengths), or
        in the step that freezes the tile, before this layer's update, which then waits for them.
        decode_greedy calls it for every layer at the start of a freeze no fill step prepared.
        On a side stream the grid is capped at :attr:`ahead_programs` when set.
        See :func:`kvarn.integrations.transformers.graph.decode_greedy`.
        """
        freeze_schedule.start_encodes((self,), stream)

    def ahead_pending(self) -> bool:
        """True while an encode started on a side stream (freeze_schedule.start_encodes) has not
        been waited for."""
        return self._ahead is not None and self._ahead[1] is not True and not self._ahead[1].waited

    def joined(self) -> None:
        """The step joined the side stream: a started flush needs no wait any more (and must not wait
        on an event recorded in another captured graph)."""
        if self._ahead is not None:
            self._ahead = (self._ahead[0], True)

    def encoded_ahead(self, started=True) -> None:
        """The tiles the next update freezes were encoded ahead (see flush_ahead): True, done (by the
        step before, or at once); a :class:`~kvarn.integrations.transformers.freeze_schedule.Started`, started on
        a side stream, whose event the next update waits for unless another layer's has."""
        self._ahead = (self.length, started)

    def encode_due(self, n: int, programs: int | None = None) -> None:
        """Encode the ``n`` complete tiles at the start of the tail into the next slots (read on the
        device); ``programs``: the encoder's grid cap (TritonTileCodec.beside), None for none."""
        g = self.tile
        codec = self.store.codec
        beside = codec.beside(programs) if programs else contextlib.nullcontext()
        with codec.deferred(), beside:  # no host read in this step (see TritonTileCodec)
            # The tile count as it is (int32, a view): read by the encoder when it runs, which is
            # before this layer's next update advances it (the step joins or waits first).
            self.store.encode_into(self.tail_k[:, :, : n * g], self.tail_v[:, :, : n * g], self._dev_len[1, :1])

    def _flush_device(self) -> None:
        """Encode the complete tiles at the start of the tail (same count in every row) into the
        next slots, unless they were started ahead (:meth:`read_done`, :meth:`flush_ahead`). The
        device lengths are advanced by the append that follows (:meth:`_append_device`), the host
        lists by :meth:`advance`."""
        n = self.tiles_due()
        ahead, self._ahead = self._ahead, None
        if not n:
            return
        g = self.tile
        t = self.tail_len[0]
        if ahead is None or ahead[0] != self.length:  # not started for this state (or a stale start)
            self.encode_due(n)
        elif ahead[1] is not True and not ahead[1].waited:
            # Wait for the side stream before the tail is overwritten and read: for every encode
            # started with this one (the first of them to get here waits, the others need not).
            torch.cuda.current_stream(self.device).wait_event(ahead[1].event)
            ahead[1].waited = True
        r = t - n * g
        if r:  # only after a multi-token update; a decode step of one token leaves nothing behind
            self.tail_k[:, :, :r] = self.tail_k[:, :, n * g:t].clone()
            self.tail_v[:, :, :r] = self.tail_v[:, :, n * g:t].clone()

    def _append_device(self, k: torch.Tensor, v: torch.Tensor, frozen: int) -> None:
        """Write ``[B, Hk, q, D]`` at each row's tail length as the device holds it, less the
        ``frozen`` tiles this update's flush took out of the tail, and advance the device lengths:
        one launch (:func:`kvarn.kernels.tail.append_tail`; as torch ops it was four a step, six
        in a freezing one, each on a captured step's critical path)."""
        from ...kernels.tail import append_tail

        append_tail(self.tail_k, self.tail_v, k, v, self._dev_len, frozen, self.tile)

    def fused_inputs(self) -> dict:
        """Arguments of :func:`kvarn.kernels.decode_attention` for the current state.

        With ``max_length`` the whole reserved buffers are passed (fixed shapes and addresses, as a
        captured graph needs; the lengths mark what is valid), else the used prefix.
        """
        fields = self.store.fields if self.max_length is not None else self.store.view()
        tiles = TileFields(**fields) if fields else None
        r = self.tail_k.shape[2] if self.max_length is not None else max(self.tail_len)
        fl = self.store.flavours  # kvarn-auto: each head's frame; None: all rotated, no flags read
        return dict(
            sink_k=self.sink_k, sink_v=self.sink_v, tiles=tiles,
            tail_k=self.tail_k[:, :, :r], tail_v=self.tail_v[:, :, :r],
            config=self.codec.config, sink_lengths=self._dev_len[0], tile_counts=self._dev_len[1],
            tail_lengths=self._dev_len[2], fp_frame="model",
            key_rotated=None if fl is None else fl.key_rotate, value_rotated=None if fl is None else fl.value_rotate,
        )


class FusedKVarNAutoLayer(FusedKVarNLayer, KVarNAutoLayer):
    """kvarn-auto on the fused path: :class:`KVarNAutoLayer`'s decision, :class:`FusedKVarNLayer`'s
    decode step; the tiles are encoded with the decided flavours and read with their frame flags."""

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False, max_length: int | None = None,
                 settings=None):
        super().__init__(codec, padding, is_sliding, max_length)
        if settings is not None:
            self.settings = settings

    @property
    def steady(self) -> bool:
        """As :attr:`FusedKVarNLayer.steady`, and no row waits for its decision: the step that
        freezes a waiting row's first tile decides it on the host (host plan, not captured)."""
        return FusedKVarNLayer.steady.fget(self) and not any(self.pending)
