"""kvarn-auto in :class:`kvarn.KVarNCache`: layers whose flavours are decided from the prompt.

The decision (:mod:`kvarn.auto`) needs the prompt's queries, which a transformers cache never sees:
``update`` receives only K and V. :mod:`kvarn.auto.prompt_capture` delivers them: for the prefill
forward only, it hands each layer's query, key and value to its :class:`KVarNAutoLayer`
(:meth:`~KVarNAutoLayer.observe_prompt`).

Order of events per layer: the prefill ``update`` stores the prompt (nothing is encoded yet), the
attention call delivers the query and the layer decides, and the first decode step's ``freeze``
stores the prompt's tiles with the decided flavours (the decision's trial encodings of them, the
same bits the torch codec would write; another codec encodes them itself); every later tile of the
row uses the same flavours. A layer that never saw its queries (for example a prefill run outside
the model the cache was built with) falls back to KVarN, with a warning. Rule r3's self-test
(:mod:`kvarn.auto.self_test_rule`, run by the capture right after the prefill) may replace a row's decision
through :meth:`~KVarNAutoLayer.set_decision`.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..cache.layer import KVarNLayer
from ..codec.record import FIELD_ORDER, TileFields
from ..methods import EncodedKV, TileCodec
from .decision import LayerDecision, fallback
from .rules import AutoSettings, decide

logger = logging.getLogger(__name__)

__all__ = ["KVarNAutoLayer"]


class KVarNAutoLayer(KVarNLayer):
    """A :class:`KVarNLayer` whose tiles use per-(row, KV head) flavours chosen from the prompt."""

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False, decoded_cache: bool = False,
                 settings: AutoSettings = AutoSettings()):
        super().__init__(codec, padding, is_sliding, decoded_cache)
        self.settings = settings
        self.decision: LayerDecision | None = None
        self.expects_queries = False  # set by KVarNCache when it captures the prefill's queries

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.decision = None

    def reset(self) -> None:
        super().reset()
        self.decision = None

    def observe_prompt(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scaling: float | None = None) -> None:
        """Decide from the prefill: query ``[B, Hq, L, D]``, keys/values ``[B, Hk, L, D]`` (pads included)."""
        if self.decision is not None or not self.is_initialized or any(self.store.counts):
            return
        decision = decide(query, keys, values, self.codec.config, self.pads, self.settings, scaling,
                          self.codec.kernels)
        if type(self.codec) is not TileCodec:
            # The trial encodings are the torch codec's; another codec (the Triton flush) stores
            # its own bits, so its tiles are encoded by it, and the trial's are not kept.
            for row in decision.rows:
                row.prompt_tiles = None
        self.set_decision(decision)

    def set_decision(self, decision: LayerDecision) -> None:
        """Use ``decision``'s flavours for this layer's tiles (those not yet frozen)."""
        self.decision = decision
        self.store.flavours = decision.flavours.map(lambda x: x.to(self.device))

    def freeze(self) -> None:
        if self.decision is None and self.is_initialized:
            if self.expects_queries:
                logger.warning("kvarn-auto: no prompt queries reached this layer before its first tile; "
                               "it uses KVarN on every head")
            self.set_decision(LayerDecision([fallback(self.heads, 0) for _ in range(self.batch)]))
        super().freeze()
        if self.decision is not None:
            for row in self.decision.rows:
                row.prompt_tiles = None  # used by the prompt's freeze, or never usable

    def _known_encoding(self, rows: list[int], keys: torch.Tensor, values: torch.Tensor) -> EncodedKV | None:
        """The prompt's tiles, at the first freeze where every row has the decision's trial
        encodings: a row's first tiles are the trial's (the same fields the codec would write: its
        encode is per tile), the ones past the trial are encoded here with the row's flavours."""
        if self.decision is None or any(self.store.counts):
            return None
        counts = {b: rows.count(b) for b in dict.fromkeys(rows)}  # freeze lists each row's tiles together
        decisions = self.decision.rows
        if any(decisions[b].prompt_tiles is None for b in counts):
            return None
        parts, trial_at, rest_at, m = [], [], [], 0
        for b, n in counts.items():
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
        if self.decision is not None:
            self.decision = self.decision.select(index.tolist())

    def view(self):
        """:meth:`KVarNLayer.view` plus the rotation flags of each (row, KV head)."""
        v = super().view()
        fl = self.store.flavours
        if fl is None:
            return v
        return dataclasses.replace(v, key_rotated=fl.key_rotate, value_rotated=fl.value_rotate)

    def flavours(self) -> list[dict] | None:
        """Per row: ``decided`` and the flavour name per KV head (None before the decision)."""
        if self.decision is None:
            return None
        names = self.decision.flavours.names()
        out = []
        for r, n in zip(self.decision.rows, names):
            out.append({"decided": r.decided, "prompt_tokens": r.prompt_tokens, "heads": n})
            if r.policy is not None:
                out[-1].update(policy=r.policy, self_test_kl=r.self_test_kl)
        return out
