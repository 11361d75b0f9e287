"""kvarn-auto: the flavour of every (row, KV head) of a layer, chosen once from the prompt.

No calibration data: the choice uses only what the cache sees at prefill, the prompt's own queries,
keys (after RoPE) and values, of its first ``S + 3G`` tokens (``TRIAL_TILES = 3``; 512 at G = 128,
what the self-test reads too; all of a shorter prompt). For one row and one KV head, with ``S``
sink tokens, tile ``G`` and the ``n = min((T - S) // G, TRIAL_TILES)`` full tiles past the sink:

1. Trial-quantize those tiles with each candidate flavour (:mod:`kvarn.codec.flavour`): for a candidate
   ``c``, ``e_j = k_j - k^_j`` and ``f_j = v_j - v^_j`` for every quantized position ``j``.
2. Key score: the mean logit error ``|q_i . e_j| * scale`` over the causal pairs ``j <= i`` of the
   prompt, over the query heads that read this KV head. This is what a key error costs attention:
   queries that put their energy where keys vary least (Gemma-3's global layers) are served best
   by per-channel quantization in the model frame, which the rotation would spread error into.
3. Value score: the attention-weighted output error ``mean_i |sum_j p_ij f_j|``, with the exact
   prompt attention ``p = softmax(q K^T * scale)`` (causal, sink included).
4. Rule ``"a2"`` (default): keys choose KVarN (rotated) or VarN (model frame), both normalized;
   values choose among {rotation on/off} x {normalization on/off}. Rule ``"a3"``: keys also choose
   among all four. Rule ``"n2"``: normalization stays on for keys and values, only the rotation
   is chosen for each. Ties go to KVarN; with ``margin`` m > 0, another flavour must beat KVarN's
   score by the fraction m (score < (1 - m) x KVarN's) to be chosen.
5. Rule ``"r3"``: the three policies KVarN, a2 and a3 (each with the margin) are this row's
   candidates (:attr:`kvarn.auto.decision.RowDecision.candidates`); a short self-test of the model on the
   prompt (:mod:`kvarn.auto.self_test_rule`) keeps the one whose logits stay closest to the exact prefill's.
   Until it has run, and where the prompt is too short for it, the row holds a2's flavours. It sees
   what no local score does (how the errors accumulate through layers and tokens), at the price of
   768 token-forwards of the model per prompt: with its 2-bit ranges, a2 meets every goal cell of
   docs/results/drift.md on its own, at a fraction of r3's prefill cost (SmolLM2, 512 tokens, one
   thread: 3.9 against 10.8 s, the fp16 prefill 2.4 s), hence the default.

Cost: the trial is one encode and decode of its tiles per option it measures (a2: two for the keys,
four for the values; two of each normalized), and its encodings are kept
(:attr:`kvarn.auto.decision.RowDecision.prompt_tiles`) so that the freeze of those tiles and the
self-test's first tile need no encode of their own; a longer prompt's later tiles are encoded once,
with the chosen flavours, by the freeze. Reading only the first ``S + 3G`` tokens keeps the
decision's cost flat in the prompt's length (at 2048 tokens on SmolLM2 the trial and error sums over
the whole prompt were 4.4 s against a 5.3 s prefill, one thread), and a longer prompt decides
exactly as its first ``S + 3G`` tokens would. Queries are sampled at ``max_queries`` evenly spaced
positions past the sink (128: the errors are means over tens of thousands of (query, key) pairs per
head, and 256 took the error sums from about 0.33 to 0.55 s of a 512-token SmolLM2 prefill), and
each block of them reads only the keys it can see (about half the pairs), so the options' key and
value errors together cost about ``(Ck + Cv) * Hq * max_queries * T * D / 2`` multiply-adds
(``T <= S + 3G``; a2: ``Ck + Cv = 6``), plus one attention pass of ``max_queries`` queries for
``p``. Measured: docs/results/drift.md, "Cost".

Ranges: kvarn-auto rounds its 2-bit rows over their [q, 1 - q] quantiles (:func:`auto_ranges`,
:data:`LOW_BIT_QUANTILE`), in the trial as in the stored tiles; the flavour scores above are taken
with those ranges.

When: a row whose prompt holds a full tile past the sink (``T >= S + G``) decides at the prefill,
from the prompt (:func:`decide_row`). A shorter prompt, a reasoning prompt of 60-200 tokens for
example, leaves nothing to decide from there; no tile of the row is quantized before its first tile
past the sink is complete either, so the row decides then, whoever wrote that tile (prompt or
generated tokens), from the sink's and the tile's ``S + G`` tokens and the queries of the tile's
own tokens (:func:`decide_first_tile`: :func:`decide_row` on exactly those tokens, so it equals the
prefill's decision of a prompt of ``S + G`` tokens). Still calibration-free: nothing but the
sequence's own activations. :attr:`kvarn.auto.decision.RowDecision.at` says which.

Fallback: a row that reached its first tile without its queries having been seen (a layer whose
forwards ran outside the capture) keeps the spec's KVarN on every head (``decided = False``). Rule
r3 on a row with ``S + G <= T < S + 3G`` (too short for the self-test), or deciding at the first
tile, keeps rule a2's flavours (``policy = "a2"``, ``self_test_kl = None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..codec.flavour import NAMED, OPTIONS, roundtrip_options
from ..config import KVarNConfig
from ..cpu import tile_passes
from .decision import AT_FIRST_TILE, AT_PREFILL, LayerDecision, RowDecision, fallback

RULES = ("a2", "a3", "n2", "r3")
#: Rule r3's candidate policies, in the order ties are broken.
POLICIES = ("kvarn", "a2", "a3")
#: How many of :data:`kvarn.codec.flavour.OPTIONS` (the first ones) each local rule chooses among, for
#: the keys and for the values; the trial measures those only (r3: its candidates' most).
CHOICES = {"a2": (2, 4), "a3": (4, 4), "n2": (2, 2)}
# Sampled queries per block of the error sums: smaller blocks skip more of the non-causal pairs, and
# below 32 the per-block overhead wins (measured on CPU at 512 and 2048 tokens).
QUERY_BLOCK = 32
#: Tiles past the sink the trial quantizes (module docstring, "Cost").
TRIAL_TILES = 3
#: kvarn-auto rounds each row of 2-bit codes over its [q, 1 - q] quantiles instead of min/max.
#: With four levels, the row's extremes stretch the step over values that few entries reach; after
#: the normalization has balanced the rows, clipping them helps every measured cell (SmolLM2 on the
#: R1 trace at K2/V2, KVarN's KL by q: 0 0.129, 0.01 0.088, 0.02 0.064, 0.03 0.061, 0.05 0.082,
#: 0.1 0.233; docs/results/drift.md). 4-bit rows keep min/max: clipping them cost there (q 0.03 on
#: the keys as well at K4/V2: 0.043 against 0.012 with the values' alone).
LOW_BIT_QUANTILE = 0.03


def auto_ranges(config: KVarNConfig) -> KVarNConfig:
    """``config`` with kvarn-auto's row ranges where it leaves them to the method (None):
    :data:`LOW_BIT_QUANTILE` for 2-bit rows, min/max (0) for wider ones. Explicit values stay."""
    def pick(q, bits):
        return q if q is not None else (LOW_BIT_QUANTILE if bits == 2 else 0.0)

    return replace(config, key_quantile=pick(config.key_quantile, config.key_bits),
                   value_quantile=pick(config.value_quantile, config.value_bits))


@dataclass(frozen=True)
class AutoSettings:
    """How kvarn-auto decides. rule: one of :data:`RULES` (module docstring; default a2, r3 adds
    the self-test); margin: the fraction by which a flavour must beat KVarN's score, in [0, 1);
    max_queries: query positions sampled per row (>= 1)."""

    rule: str = "a2"
    margin: float = 0.0
    max_queries: int = 128

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"kvarn-auto rule={self.rule!r}; choose one of {list(RULES)}")
        if not (isinstance(self.margin, (int, float)) and 0.0 <= self.margin < 1.0):
            raise ValueError(f"kvarn-auto margin={self.margin!r} must be a number in [0, 1)")
        if not isinstance(self.max_queries, int) or self.max_queries < 1:
            raise ValueError(f"kvarn-auto max_queries={self.max_queries!r} must be an integer >= 1")

    @classmethod
    def parse(cls, text: str) -> "AutoSettings":
        """``"<rule>"`` or ``"<rule>@<margin>"`` (for example ``"n2@0.1"``), as the CLI takes it."""
        rule, _, margin = text.partition("@")
        try:
            return cls(rule=rule, margin=float(margin) if margin else 0.0)
        except ValueError as exc:
            raise ValueError(f"kvarn-auto rule {text!r}: {exc}") from None

    @property
    def name(self) -> str:
        return self.rule if not self.margin else f"{self.rule}@{self.margin:g}"


def _choose(scores: torch.Tensor, candidates: int, margin: float) -> torch.Tensor:
    """Index of the best of the first ``candidates`` columns of ``scores [Hk, 4]``; column 0 (KVarN)
    unless another is lower than ``(1 - margin)`` times it."""
    sc = scores[:, :candidates].clone()
    sc[:, 1:] = sc[:, 1:] / (1.0 - margin)
    return sc.argmin(-1)  # ties: the first candidate, KVarN


def _log_corr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of ``log x`` and ``log y`` along the last axis. x, y: ``[H, D]`` > 0."""
    a = torch.log(x.clamp_min(1e-20))
    b = torch.log(y.clamp_min(1e-20))
    a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-20)


def error_sums(q, k, k_err, v_err, pos, s, scale):
    """Sums of the key logit errors ``|q_i . e_j| * scale`` over causal pairs and of the value output
    errors ``|sum_j p_ij f_j|``, per KV head and option, for the sampled queries ``pos``.

    q: ``[Hq, T, D]``, k: ``[Hk, T, D]``; k_err ``[Hk, nK, Ck, D]``, v_err ``[Hk, nK, Cv, D]``: the
    errors of the body keys ``s .. s + nK - 1`` under each of the options measured; pos: sorted
    query positions, all ``>= s``.
    Returns ``(key_sum [Hk, Ck], value_sum [Hk, Cv], causal pairs x query heads per KV head)``.

    Queries go in blocks, and a block reads only the keys its last query sees: the causal half of
    the products is never computed, the options share one matrix product per tensor, and only the
    block's last keys, which some of its queries do not see, are masked.
    """
    hq, t, d = q.shape
    hk, nk, ck, _ = k_err.shape
    cv = v_err.shape[2]
    grp = hq // hk
    key_sum = q.new_zeros(hk, ck)
    value_sum = q.new_zeros(hk, cv)
    pairs = 0.0
    for block in pos.split(QUERY_BLOCK):
        first, last, nb = int(block[0]), int(block[-1]), len(block)
        m = min(last - s + 1, nk)  # body keys visible to some query of the block (queries are >= s)
        seen = min(first - s + 1, m)  # body keys every query of the block sees
        # [Hk, grp * nb, D]: a KV head's query heads as rows of one product (no broadcast copies)
        qs = q[:, block].reshape(hk, grp * nb, d)
        visible = torch.arange(last + 1, device=q.device)[None, :] <= block[:, None]  # [nb, last + 1]
        logits = (qs @ k[:, : last + 1].transpose(-1, -2)).mul_(scale).view(hk, grp, nb, last + 1)
        p = torch.softmax(logits.masked_fill_(~visible, float("-inf")), dim=-1)[..., s:s + m]  # [Hk, grp, nb, m]
        causal = visible[:, s + seen:s + m].to(q.dtype)  # [nb, m - seen]: the masked tail
        pairs += (seen * nb + float(causal.sum())) * grp
        logit_err = (qs @ k_err[:, :m].reshape(hk, m * ck, d).transpose(-1, -2)).abs_().view(hk, grp, nb, m, ck)
        key_sum += logit_err[:, :, :, :seen].sum(dim=(1, 2, 3))
        key_sum += torch.einsum("hgbmc,bm->hc", logit_err[:, :, :, seen:], causal)
        out_err = p.reshape(hk, grp * nb, m) @ v_err[:, :m].reshape(hk, m, cv * d)  # [Hk, grp * nb, Cv * D]
        value_sum += out_err.abs_().sum(dim=1).view(hk, cv, d).sum(-1)
    return key_sum * scale, value_sum, pairs


@torch.no_grad()
def decide_row(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, config: KVarNConfig,
    settings: AutoSettings = AutoSettings(), scaling: float | None = None, kernels: str = "auto",
    at: str = AT_PREFILL,
) -> RowDecision:
    """The flavour of each KV head of one row from its prompt.

    query: ``[Hq, T, D]`` (after RoPE), keys, values: ``[Hk, T, D]``: the row's real prompt tokens.
    scaling: the attention's softmax scale (default ``1 / sqrt(D)``). kernels: who makes the trial
    encode's passes (:func:`kvarn.cpu.tile_passes`; the same bits). at: recorded as
    :attr:`kvarn.auto.decision.RowDecision.at`.
    """
    hq, t, d = query.shape
    hk = keys.shape[0]
    if keys.shape != (hk, t, d) or values.shape != keys.shape or hq % hk:
        raise ValueError(f"query {tuple(query.shape)} and keys {tuple(keys.shape)} / values "
                         f"{tuple(values.shape)} must be [Hq, T, D] and [Hk, T, D] with Hk dividing Hq")
    s, g = config.sink_tokens, config.tile
    n = (t - s) // g if t > s else 0
    if n < 1:
        return fallback(hk, t, keys.device)
    n = min(n, TRIAL_TILES)
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    q = query.to(torch.float32)
    k, v = keys.to(torch.float32), values.to(torch.float32)
    body = slice(s, s + n * g)

    # Trial quantization: the options the rule can pick (CHOICES), each applied to every tile of K and V.
    rules = POLICIES[1:] if settings.rule == "r3" else (settings.rule,)
    key_options, value_options = (max(CHOICES[r][i] for r in rules) for i in (0, 1))
    passes = tile_passes(kernels, keys.device)
    tiles, kh, vh = roundtrip_options(k[:, body], v[:, body], config, passes, key_options, value_options)
    # Errors laid out [Hk, nK, C, D]: a prefix of the keys is a contiguous [Hk, m * C, D] view.
    k_err = (k[None, :, body] - kh).permute(1, 2, 0, 3).contiguous()
    v_err = (v[None, :, body] - vh).permute(1, 2, 0, 3).contiguous()

    # Sampled query positions past the sink, each seeing the quantized keys j <= i, within the
    # prompt's first S + TRIAL_TILES * G tokens (module docstring, "Cost").
    horizon = min(t, s + TRIAL_TILES * g)
    nq = min(settings.max_queries, horizon - s)
    pos = torch.linspace(s, horizon - 1, nq, device=k.device).round().long().unique()
    key_sum, value_sum, pairs = error_sums(q, k, k_err, v_err, pos, s, scale)
    grp = hq // hk
    key_scores = key_sum / pairs  # [Hk, Ck]: mean over causal (query, key) pairs and query heads
    value_scores = value_sum / (grp * len(pos) * d)  # [Hk, Cv]: mean over queries, heads, channels

    opt = torch.tensor(OPTIONS, dtype=torch.bool, device=k.device)  # [4, 2]

    def flags(rule):
        ki = _choose(key_scores, CHOICES[rule][0], settings.margin)
        vi = _choose(value_scores, CHOICES[rule][1], settings.margin)
        return opt[ki, 0], opt[ki, 1], opt[vi, 0], opt[vi, 1]

    candidates = policy = None
    if settings.rule == "r3":
        kvarn = tuple(torch.full((hk,), x, dtype=torch.bool, device=k.device) for x in NAMED["kvarn"])
        candidates = {"kvarn": kvarn, "a2": flags("a2"), "a3": flags("a3")}
        chosen, policy = candidates["a2"], "a2"
    else:
        chosen = flags(settings.rule)

    energy = (q.reshape(hk, grp, t, d)[:, :, s:] ** 2).mean(dim=(1, 2))  # [Hk, D]
    variance = k[:, s:].var(dim=1)  # [Hk, D]
    return RowDecision(
        True, *chosen,
        key_logit_error=key_scores.cpu(), value_output_error=value_scores.cpu(),
        variance_energy_corr=_log_corr(variance, energy).cpu(), prompt_tokens=t, tokens=horizon,
        queries=len(pos), at=at, candidates=candidates, policy=policy, prompt_tiles=tiles,
    )


def first_tile_tokens(config: KVarNConfig) -> int:
    """Tokens a row holds when its first tile past the sink is complete: ``S + G``."""
    return config.sink_tokens + config.tile


@torch.no_grad()
def decide_first_tile(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, config: KVarNConfig,
    settings: AutoSettings = AutoSettings(), scaling: float | None = None, kernels: str = "auto",
    prompt_tokens: int = 0,
) -> RowDecision:
    """The decision of a row whose prompt was shorter than ``S + G``, made when its first tile past
    the sink is complete: :func:`decide_row` on the row's first ``S + G`` tokens exactly (module
    docstring, "When"), whatever the caller holds past them.

    query: ``[Hq, >= S + G, D]``, keys, values: ``[Hk, >= S + G, D]``, from the row's first real
    token; prompt_tokens: the row's prompt length, recorded. ValueError if fewer tokens are given.
    """
    n = first_tile_tokens(config)
    if min(query.shape[1], keys.shape[1], values.shape[1]) < n:
        raise ValueError(f"deciding at the first tile needs the first S + G = {n} tokens' queries, keys and values; "
                         f"got {query.shape[1]} queries and {keys.shape[1]} keys")
    row = decide_row(query[:, :n], keys[:, :n], values[:, :n], config, settings, scaling, kernels, at=AT_FIRST_TILE)
    row.prompt_tokens = prompt_tokens
    return row


def decide(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, config: KVarNConfig,
    pads: list[int] | None = None, settings: AutoSettings = AutoSettings(), scaling: float | None = None,
    kernels: str = "auto",
) -> LayerDecision:
    """Every row of a (left-padded) batch decides alone from its own real tokens.

    query: ``[B, Hq, L, D]``, keys, values: ``[B, Hk, L, D]``; pads: left-padding slots per row;
    kernels: as :func:`decide_row`.
    """
    b = query.shape[0]
    pads = [0] * b if pads is None else list(pads)
    if len(pads) != b or keys.shape[0] != b or values.shape[0] != b:
        raise ValueError(f"query, keys, values and pads must all have the batch size {b}")
    return LayerDecision([
        decide_row(query[i, :, p:], keys[i, :, p:], values[i, :, p:], config, settings, scaling, kernels)
        for i, p in enumerate(pads)
    ])
