"""kvarn-auto's decisions: what :mod:`kvarn.auto` chose for one row of a layer and for a layer's rows.

A :class:`RowDecision` holds a row's per-KV-head flags (rotation and normalization, for keys and
for values), the scores they were chosen from, rule r3's candidate flags, and the trial encodings of
the prompt's first tiles that the freeze and the self-test reuse. :class:`LayerDecision` gathers a
layer's rows into :class:`kvarn.codec.flavour.Flavours` ``[B, Hk]``. They live apart from the scoring so
that the cache layers and the self-test (:mod:`kvarn.auto.layer`, :mod:`kvarn.auto.self_test_rule`) read a
decision without the code that makes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec.flavour import NAMED, Flavours, option_index, select_options
from ..codec.record import TileFields

#: :attr:`RowDecision.at`: decided from the prompt, at the prefill.
AT_PREFILL = "prefill"
#: :attr:`RowDecision.at`: decided when the row's first tile past the sink completed after the
#: prefill (a prompt shorter than ``sink_tokens + tile``), from the sink's and that tile's tokens.
AT_FIRST_TILE = "first_tile"


@dataclass
class RowDecision:
    """The decision of one row of one layer; per-head tensors are ``[Hk]`` (scores ``[Hk, C]``, one
    column per option the rule measured, in :data:`kvarn.codec.flavour.OPTIONS` order: RN, -N, R-, --;
    rules a2 and n2 measure the keys' first two, n2 the values' too, the others all four).

    Rule r3: ``candidates`` maps each of :data:`kvarn.auto.POLICIES` to its four flag tensors;
    ``policy`` is the one the flags hold (``"a2"`` until the self-test picks one) and
    ``self_test_kl`` the self-test's KL per policy (None when it did not run).

    When and from what: ``at`` is :data:`AT_PREFILL` (from the prompt, at the prefill),
    :data:`AT_FIRST_TILE` (when the row's first tile past the sink completed later, from the
    sink's and that tile's tokens) or None (not decided); ``tokens`` is how many of the row's
    tokens the decision read and ``queries`` how many query positions its scores average over."""

    decided: bool
    key_rotate: torch.Tensor
    key_normalize: torch.Tensor
    value_rotate: torch.Tensor
    value_normalize: torch.Tensor
    key_logit_error: torch.Tensor | None = None
    value_output_error: torch.Tensor | None = None
    variance_energy_corr: torch.Tensor | None = None
    prompt_tokens: int = 0
    tokens: int = 0
    queries: int = 0
    at: str | None = None
    candidates: dict[str, tuple[torch.Tensor, ...]] | None = None
    policy: str | None = None
    self_test_kl: dict[str, float] | None = None
    # The trial encodings of the prompt's first N <= kvarn.auto.TRIAL_TILES tiles past the sink,
    # fields [C, Hk, N, ...] (one row per option measured, K's and V's counts as the scores'): the
    # freeze of those tiles and the self-test's first tile reuse them, so no prompt tile is encoded
    # twice; the freeze drops them.
    prompt_tiles: TileFields | None = field(default=None, repr=False)

    def prompt_fields(self, flags: tuple[torch.Tensor, ...] | None = None) -> TileFields:
        """The prompt's tiles encoded with ``flags`` (key_rotate, key_normalize, value_rotate,
        value_normalize ``[Hk]``; default: this row's own flags): fields ``[Hk, N, ...]``."""
        if self.prompt_tiles is None:
            raise ValueError("this row keeps no trial encodings of its prompt (fallback, or already frozen)")
        kr, kn, vr, vn = flags if flags is not None else \
            (self.key_rotate, self.key_normalize, self.value_rotate, self.value_normalize)
        return select_options(self.prompt_tiles, option_index(kr, kn), option_index(vr, vn))

    def adopt(self, policy: str, kl: dict[str, float] | None = None) -> None:
        """Take the flags of candidate ``policy`` (rule r3); ``kl``: the self-test's figures."""
        if self.candidates is None or policy not in self.candidates:
            raise ValueError(f"policy {policy!r} is not a candidate of this row; candidates: "
                             f"{sorted(self.candidates or {})}")
        (self.key_rotate, self.key_normalize, self.value_rotate, self.value_normalize) = self.candidates[policy]
        self.policy, self.self_test_kl = policy, kl

    def summary(self) -> dict:
        """JSON-ready: flags, and per head the rotated/unrotated key logit errors and correlation."""
        out = {"decided": self.decided, "prompt_tokens": self.prompt_tokens, "decided_at": self.at,
               "tokens": self.tokens, "queries": self.queries}
        if self.policy is not None:
            out["policy"] = self.policy
            out["self_test_kl"] = self.self_test_kl
        for name in ("key_rotate", "key_normalize", "value_rotate", "value_normalize"):
            out[name] = getattr(self, name).tolist()
        if self.key_logit_error is not None:
            out["key_logit_error_rotated"] = self.key_logit_error[:, 0].tolist()
            out["key_logit_error_unrotated"] = self.key_logit_error[:, 1].tolist()
            out["key_logit_error"] = self.key_logit_error.tolist()
            out["value_output_error"] = self.value_output_error.tolist()
            out["log_key_variance_vs_log_query_energy_corr"] = self.variance_energy_corr.tolist()
        return out


def fallback(heads: int, prompt_tokens: int = 0, device=None) -> RowDecision:
    """KVarN on every head: the spec's method, for prompts too short to decide."""
    f = [torch.full((heads,), x, dtype=torch.bool, device=device) for x in NAMED["kvarn"]]
    return RowDecision(False, *f, prompt_tokens=prompt_tokens)


@dataclass
class LayerDecision:
    """The rows' decisions of one layer, and their flags as :class:`Flavours` ``[B, Hk]``."""

    rows: list[RowDecision] = field(default_factory=list)

    @property
    def flavours(self) -> Flavours:
        return Flavours(*(torch.stack([getattr(r, n) for r in self.rows]) for n in
                          ("key_rotate", "key_normalize", "value_rotate", "value_normalize")))

    def select(self, index: list[int]) -> "LayerDecision":
        return LayerDecision([self.rows[i] for i in index])

    def candidate(self, row: int, policy: str) -> Flavours:
        """Rule r3: the flags of ``policy`` for row ``row`` alone, as :class:`Flavours` ``[1, Hk]``."""
        return Flavours(*(x[None] for x in self.rows[row].candidates[policy]))
