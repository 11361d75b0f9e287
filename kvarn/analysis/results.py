"""What :func:`kvarn.analysis.drift.pseudo_decode` measured: :class:`MethodDrift` per method and
:class:`DriftRun` for the whole run (:mod:`kvarn.analysis.report` writes them out).

Per-layer lists are ``[layer][chunk]``; per-chunk lists have one entry per pass (the first, exact
pass of ``prefill`` tokens, then one per chunk). ``perplexity = exp(nll_sum / nll_count)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class MethodDrift:
    """Results of one method; per-layer lists are ``[layer][chunk]``."""

    key: str
    quantized_layers: list[int]
    static_mae_layers: list[list[float]]
    accumulated_mae_layers: list[list[float]]
    static_k_rel_layers: list[list[float]]
    static_v_rel_layers: list[list[float]]
    accumulated_k_rel_layers: list[list[float]]
    accumulated_v_rel_layers: list[list[float]]
    kl: list[float]
    top1_agreement: list[float]
    nll_sum: float
    nll_count: int
    k_decomposition: dict[str, float]
    v_decomposition: dict[str, float]
    chunk_nll: list[float] = field(default_factory=list)  # NLL sum per chunk (count: DriftRun.chunk_targets)
    decisions: dict[int, dict] | None = None  # kvarn-auto: layer -> RowDecision.summary() of row 0
    auto_rule: str | None = None  # kvarn-auto: the decision rule's name (AutoSettings.name)
    quantiles: tuple[float, float] | None = None  # integer methods: the rows' ranges (KVarNConfig.quantiles)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.nll_count, 1))


@dataclass
class DriftRun:
    """Everything :func:`~kvarn.analysis.drift.pseudo_decode` measured."""

    tokens: int
    chunk: int
    positions: list[int]
    num_layers: int
    sliding_layers: list[int]
    fp_perplexity: float
    methods: dict[str, MethodDrift] = field(default_factory=dict)
    prefill: int = 0
    chunk_targets: list[int] = field(default_factory=list)
    fp_chunk_nll: list[float] = field(default_factory=list)
    prompt_diagnostics: dict[str, dict[int, dict]] = field(default_factory=dict)  # preset -> layer -> summary


__all__ = ["DriftRun", "MethodDrift"]
