"""kvarn-auto in :class:`kvarn.KVarNCache`: layers whose flavours are decided from the sequence's own
queries, keys and values.

The decision (:mod:`kvarn.auto`) needs queries, which a transformers cache never sees: ``update``
receives only K and V. :mod:`kvarn.auto.prompt_capture` delivers them: for the prefill forward, and
for later forwards while some row of some layer is still waiting for its decision, it hands each
layer's query to its :class:`KVarNAutoLayer` (:meth:`~KVarNAutoLayer.observe`).

When each row decides (:mod:`kvarn.auto`, "When"):

- A row whose prompt holds a full tile past the sink (``S + G`` real tokens) decides at the
  prefill's attention call, from the prompt. The first decode step's ``freeze`` stores the prompt's
  tiles with the decided flavours (the decision's trial encodings of them, the same bits the torch
  codec would write; another codec encodes them itself).
- A shorter row waits: the layer keeps the queries of its first ``S + G`` tokens as the forwards
  bring them (``[B, Hq, S + G, D]``, written at each token's position, so a crop and a new token
  overwrite the rejected one's), and the ``freeze`` that is about to store the row's first tile
  past the sink (tokens accepted, no tile of the row quantized yet) decides it first, from those
  queries and the row's own sink and tail K/V (:func:`kvarn.auto.rules.decide_first_tile`).

Every later tile of the row uses the same flavours. A row that reaches its first tile without its
queries (forwards run outside the model the cache was built with) falls back to KVarN, with a
warning. Rule r3's self-test (:mod:`kvarn.auto.self_test_rule`, run by the capture right after the prefill)
may replace a row's prefill decision through :meth:`~KVarNAutoLayer.set_decision`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..cache.layer import KVarNLayer
from ..codec.record import FIELD_ORDER, TileFields
from ..methods import EncodedKV, TileCodec
from .decision import LayerDecision, fallback
from .rules import AutoSettings, decide_first_tile, decide_row, first_tile_tokens

logger = logging.getLogger(__name__)

__all__ = ["KVarNAutoLayer"]


class KVarNAutoLayer(KVarNLayer):
    """A :class:`KVarNLayer` whose tiles use per-(row, KV head) flavours chosen from the prompt."""

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False, decoded_cache: bool = False,
                 settings: AutoSettings = AutoSettings()):
        super().__init__(codec, padding, is_sliding, decoded_cache)
        self.settings = settings
        self.decision: LayerDecision | None = None
        self.expects_queries = False  # set by KVarNCache when it captures the queries
        self._forget_queries()

    def _forget_queries(self) -> None:
        self.pending: list[bool] = []  # per row: waiting to decide at its first tile
        self._queries = None  # [B, Hq, S + G, D]: the waiting rows' queries by position
        self._seen: list[int] = []  # per row: queries held for positions 0 .. seen - 1
        self._scaling = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.decision = None
        self._forget_queries()

    def reset(self) -> None:
        super().reset()
        self.decision = None
        self._forget_queries()

    @property
    def wants_queries(self) -> bool:
        """True until the layer's first query arrives and while a row waits for its first tile."""
        return self.is_initialized and (self.decision is None or any(self.pending))

    def _tokens(self, b: int) -> int:
        """Real tokens row ``b`` holds (sink, tiles, tail)."""
        return self.sink_len[b] + self.store.counts[b] * self.tile + self.tail_len[b]

    def observe(self, query: torch.Tensor, scaling: float | None = None) -> None:
        """The query ``[B, Hq, L, D]`` (pads included) of this layer's last update, at its attention
        call: rows whose prompt holds a full tile past the sink decide now (at the prefill); the
        others keep the queries of their first ``S + G`` tokens until their first tile completes."""
        if not self.wants_queries:
            return
        n = first_tile_tokens(self.codec.config)
        length = query.shape[2]
        if self.decision is None:  # the layer's first forward
            if any(self.store.counts):
                return  # tiles were frozen before any query came: the freeze fell back already
            self.decision = LayerDecision([fallback(self.heads, self._tokens(b), self.device)
                                           for b in range(self.batch)])
            self.pending = [True] * self.batch
            self._seen = [0] * self.batch
            self._scaling = scaling
            for b in range(self.batch):
                t = self._tokens(b)
                if t == self.tail_len[b] and t <= length and t >= n:  # the whole prompt, in this forward
                    self.decision.rows[b] = decide_row(
                        query[b, :, length - t:], self.tail_k[b, :, :t], self.tail_v[b, :, :t], self.codec.config,
                        self.settings, scaling, self.codec.kernels)
                    self.pending[b] = False
            if type(self.codec) is not TileCodec:
                # The trial encodings are the torch codec's; another codec (the Triton flush) stores
                # its own bits, so its tiles are encoded by it, and the trial's are not kept.
                for row in self.decision.rows:
                    row.prompt_tiles = None
            self.set_decision(self.decision)
        if not any(self.pending):
            self._queries = None
            return
        if self._queries is None:
            self._queries = query.new_zeros(self.batch, query.shape[1], n, query.shape[3])
        for b in range(self.batch):
            if not self.pending[b]:
                continue
            end = self._tokens(b)  # this update's tokens are the row's last ones
            start = end - min(length, end)
            if start > self._seen[b]:
                continue  # queries of earlier tokens were never seen: this row cannot decide from them
            stop = min(end, n)
            if stop > start:
                self._queries[b, :, start:stop] = query[b, :, length - (end - start):length - (end - stop)]
            self._seen[b] = stop if stop > start else self._seen[b]

    def _decide_first_tiles(self) -> None:
        """Rows about to freeze their first tile past the sink decide first (module docstring)."""
        n = first_tile_tokens(self.codec.config)
        changed = False
        for b in range(self.batch):
            if not self.pending[b] or self._tokens(b) < n:
                continue
            keys = torch.cat([self.sink_k[b, :, :self.sink_len[b]], self.tail_k[b, :, :self.tail_len[b]]], dim=1)
            values = torch.cat([self.sink_v[b, :, :self.sink_len[b]], self.tail_v[b, :, :self.tail_len[b]]], dim=1)
            if self._seen[b] >= n:
                row = decide_first_tile(self._queries[b], keys, values, self.codec.config, self.settings,
                                        self._scaling, self.codec.kernels,
                                        prompt_tokens=self.decision.rows[b].prompt_tokens)
                if type(self.codec) is not TileCodec:
                    row.prompt_tiles = None  # as at the prefill (observe)
            else:
                logger.warning("kvarn-auto: the queries of row %d's first %d tokens did not all reach this layer; "
                               "the row uses KVarN on every head", b, n)
                row = fallback(self.heads, self.decision.rows[b].prompt_tokens, self.device)
            self.decision.rows[b] = row
            self.pending[b] = False
            changed = True
        if changed:
            self.set_decision(self.decision)
        if not any(self.pending):
            self._queries = None

    def set_decision(self, decision: LayerDecision) -> None:
        """Use ``decision``'s flavours for this layer's tiles (those not yet frozen)."""
        self.decision = decision
        self._set_flavours()

    def _set_flavours(self) -> None:
        self.store.flavours = self.decision.flavours.map(lambda x: x.to(self.device))

    def freeze(self) -> None:
        if self.decision is None and self.is_initialized:
            if self.expects_queries:
                logger.warning("kvarn-auto: no prompt queries reached this layer before its first tile; "
                               "it uses KVarN on every head")
            self.pending = [False] * self.batch
            self.set_decision(LayerDecision([fallback(self.heads, 0) for _ in range(self.batch)]))
        elif self.is_initialized and any(self.pending):
            self._decide_first_tiles()
        super().freeze()
        if self.decision is not None:
            for row in self.decision.rows:
                row.prompt_tiles = None  # used by the row's first freeze (just now, or earlier), or never usable

    def _known_encoding(self, rows: list[int], keys: torch.Tensor, values: torch.Tensor) -> EncodedKV | None:
        """The prompt's tiles, at the first freeze where every row has the decision's trial
        encodings: a row's first tiles are the trial's (the same fields the codec would write: its
        encode is per tile), the ones past the trial are encoded here with the row's flavours."""
        if self.decision is None:
            return None
        counts = {b: rows.count(b) for b in dict.fromkeys(rows)}  # freeze lists each row's tiles together
        decisions = self.decision.rows
        # a row's trial encodings are its first tiles: usable at the row's first freeze only
        trial = {b: decisions[b].prompt_tiles is not None and self.store.counts[b] == 0 for b in counts}
        if not any(trial.values()):
            return None
        parts, trial_at, rest_at, m = [], [], [], 0
        for b, n in counts.items():
            nt = 0
            if trial[b]:
                f = decisions[b].prompt_fields().map(lambda x: x.transpose(0, 1).unsqueeze(2))  # [N, Hk, 1, ...]
                nt = min(n, f.k_codes.shape[0])
                parts.append(f.map(lambda x: x[:nt]))
                trial_at += range(m, m + nt)
            rest_at += range(m + nt, m + n)
            m += n
        flavours = self.store.flavours.select(torch.tensor(rows, device=self.device))
        if rest_at:
            idx = torch.tensor(rest_at, device=keys.device)
            rest = self.codec.encode(keys[idx], values[idx], flavours.select(idx)).tiles
            parts.append(rest)
        tiles = TileFields(**{name: torch.cat([getattr(f, name) for f in parts]) for name in FIELD_ORDER})
        if rest_at:  # back to the order of rows
            order = torch.tensor(trial_at + rest_at).argsort()
            tiles = tiles.map(lambda x: x[order.to(x.device)])
        g, d = self.codec.config.tile, self.head_dim
        nbytes = int(round(self.codec.bytes_per_token(d) * m * self.heads * g))
        return EncodedKV(self.codec.method, (m, self.heads, g, d), nbytes, tiles=tiles, flavours=flavours)

    def _select(self, index: torch.Tensor) -> None:
        super()._select(index)
        idx = index.tolist()
        if self.decision is not None:
            self.decision = self.decision.select(idx)
        self.pending = [self.pending[i] for i in idx] if self.pending else []
        self._seen = [self._seen[i] for i in idx] if self._seen else []
        if self._queries is not None:
            self._queries = self._queries.index_select(0, index.to(self._queries.device))

    def view(self):
        """:meth:`KVarNLayer.view` plus the rotation flags of each (row, KV head)."""
        v = super().view()
        fl = self.store.flavours
        if fl is None:
            return v
        return dataclasses.replace(v, key_rotated=fl.key_rotate, value_rotated=fl.value_rotate)

    def flavours(self) -> list[dict] | None:
        """Per row: ``decided``; ``decided_at`` (:attr:`kvarn.auto.decision.RowDecision.at`: ``"prefill"``,
        ``"first_tile"`` or None), ``tokens`` and ``queries`` (how many of the row's tokens and query
        positions the decision read); ``pending`` (waiting for its first tile); the flavour name
        per KV head (KVarN while pending). None before the layer's first query."""
        if self.decision is None:
            return None
        names = self.decision.flavours.names()
        out = []
        for b, (r, n) in enumerate(zip(self.decision.rows, names)):
            out.append({"decided": r.decided, "decided_at": r.at, "prompt_tokens": r.prompt_tokens,
                        "tokens": r.tokens, "queries": r.queries,
                        "pending": bool(self.pending[b]) if self.pending else False, "heads": n})
            if r.policy is not None:
                out[-1].update(policy=r.policy, self_test_kl=r.self_test_kl)
        return out
