"""kvarn-auto rule r3 (an option; the default rule is a2): choose a row's policy by a short self-test
of the model on its own prompt.

The per-head rules of :mod:`kvarn.auto` score each head's local error; what decides quality is how
the errors accumulate through the layers and the following tokens, which no local score sees (keys
without normalization look as good as VarN locally, win end to end on Gemma-3 and lose on SmolLM2).
So rule r3 measures it, on the prompt, for each candidate policy (:data:`kvarn.auto.POLICIES`:
KVarN, a2, a3, each a set of flavours per (layer, KV head)):

1. History: the prompt's first ``S + G`` tokens, exact (the prefill's own K/V), with the tile past
   the sink ``[S, S + G)`` quantized with the candidate's flavours.
2. Run the next ``chunks * G`` prompt tokens through the model in chunks of ``G``, quantizing each
   finished tile before the next chunk reads it (the decode cache's semantics, :mod:`kvarn.cache.roundtrip`).
3. Score: KL(exact || candidate) of the next-token distributions over those tokens, against the
   exact prefill's logits at the same positions.

The lowest KL wins (ties: the earlier policy in :data:`kvarn.auto.POLICIES`); the choice is fixed for
the rest of the sequence. Candidates run as the rows of one batch, and candidates with the same
flavours on every layer are run once. Needs ``S + G + chunks * G`` prompt tokens
(:func:`self_test_tokens`); shorter prompts keep a2's flavours.

Cost: ``chunks * G`` tokens per distinct candidate through the model (two to three candidates:
about 1.5x a 512-token prefill's forward, 0.4x a 2048-token one), their full next-token
distributions (on a large vocabulary the head costs as much again), and the freeze of the first
chunk's tile per candidate (the history's tile comes decoded from the decision's trial encodings
where they are given, and the last chunk's tile is read by no later chunk); nothing at decode.
Measured: docs/results/drift.md, "Cost".
"""

from __future__ import annotations

import torch

from ..cache.roundtrip import TileFreezer, freeze_cache, new_cache
from ..codec.flavour import Flavours, decode_flavoured, option_index, select_options
from ..codec.record import TileFields
from ..config import KVarNConfig
from ..methods import TileCodec
from .rules import POLICIES

CHUNKS = 2  # self-test chunks of one tile each


def self_test_tokens(config: KVarNConfig, chunks: int = CHUNKS) -> int:
    """Prompt tokens the self-test needs: sink, one quantized tile, ``chunks`` tiles to score."""
    return config.sink_tokens + config.tile * (1 + chunks)


def self_test_positions(config: KVarNConfig, chunks: int = CHUNKS) -> range:
    """Prompt positions whose next-token logits the self-test compares."""
    start = config.sink_tokens + config.tile
    return range(start, start + chunks * config.tile)


def _same(a: dict[int, Flavours], b: dict[int, Flavours]) -> bool:
    return all(torch.equal(getattr(a[i], n), getattr(b[i], n)) for i in a
               for n in ("key_rotate", "key_normalize", "value_rotate", "value_normalize"))


def kl_per_position(exact: torch.Tensor, got: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """KL(exact || got) per row and position, ``[C, T]``. exact: ``[T, V]``, got: ``[C, T, V]``.

    ``chunk`` positions at a time: over a 262K-token vocabulary the whole ``[C, T, V]`` in float32
    is 0.8 GB per temporary, and fresh tensors that large cost more in page faults on CPU than the
    arithmetic (measured: 15.8 s of a 21 s Gemma-3 self-test at 512 tokens, 0.9 s in chunks).
    """
    per_pos = []
    for t0 in range(0, exact.shape[0], chunk):
        p = torch.log_softmax(exact[t0:t0 + chunk].to(torch.float32), dim=-1)
        q = torch.log_softmax(got[:, t0:t0 + chunk].to(torch.float32), dim=-1)
        per_pos.append((p.exp() * (p - q)).sum(-1))
    return torch.cat(per_pos, dim=-1)


@torch.no_grad()
def self_test(
    model, prompt: torch.Tensor, prompt_kv: list[tuple[torch.Tensor, torch.Tensor]],
    candidates: dict[str, dict[int, Flavours]], codec: TileCodec, exact_logits: torch.Tensor | None = None,
    *, embeds: bool = False, chunks: int = CHUNKS, prompt_tiles: dict[int, TileFields] | None = None,
) -> dict[str, float]:
    """KL of each candidate policy on one row's prompt (module docstring).

    prompt: ``[1, T]`` token ids (``[1, T, E]`` embeddings with ``embeds=True``), the row's real tokens.
    prompt_kv: per layer of the model, the prefill's exact ``(keys, values)`` ``[1, Hk, >= S + G, D]``
        (K after RoPE, the model frame).
    candidates: policy -> {layer: Flavours ``[1, Hk]``}; the layers listed are quantized, the others
        stay exact (sliding-window layers). Every candidate lists the same layers.
    exact_logits: ``[chunks * G, V]`` the exact prefill's logits at :func:`self_test_positions`;
        None runs the exact model on the test chunks instead.
    prompt_tiles: per quantized layer, the decision's trial encodings ``[4, Hk, N >= 1, ...]``
        (:attr:`kvarn.auto.decision.RowDecision.prompt_tiles`) of this codec; given, the history's first
        tile is decoded from them instead of encoded again.
    Returns policy -> KL, in the order of ``candidates``.
    """
    config = codec.config
    need = self_test_tokens(config, chunks)
    if prompt.shape[1] < need:
        raise ValueError(f"the self-test needs {need} prompt tokens (sink + {1 + chunks} tiles), got {prompt.shape[1]}")
    if not candidates:
        raise ValueError("candidates is empty: give at least one policy")
    start, g = config.sink_tokens + config.tile, config.tile

    # Distinct flavour sets, one batch row each.
    rows: list[dict[int, Flavours]] = []
    row_of: dict[str, int] = {}
    for name, fl in candidates.items():
        row_of[name] = next((r for r, other in enumerate(rows) if _same(fl, other)), len(rows))
        if row_of[name] == len(rows):
            rows.append(fl)
    c = len(rows)
    layers = sorted(rows[0])
    flavours = {i: Flavours(*(torch.cat([getattr(fl[i], n) for fl in rows]) for n in
                              ("key_rotate", "key_normalize", "value_rotate", "value_normalize")))
                for i in layers}

    def run(batch: int, freezer: TileFreezer | None) -> torch.Tensor:
        cache = new_cache(len(prompt_kv))
        for i, (k, v) in enumerate(prompt_kv):
            cache.update(k[:, :, :start].expand(batch, -1, -1, -1).clone(),
                         v[:, :, :start].expand(batch, -1, -1, -1).clone(), i)
        if freezer is not None and prompt_tiles is not None:
            _first_tile_from_trials(cache, freezer, prompt_tiles)
        elif freezer is not None:
            freeze_cache(cache, freezer)
        out = []
        for a in range(start, start + chunks * g, g):
            x = prompt[:, a:a + g].expand(batch, *prompt[:, a:a + g].shape[1:])
            kw = {"inputs_embeds": x} if embeds else {"input_ids": x}
            out.append(model(**kw, past_key_values=cache, use_cache=True).logits)
            if freezer is not None and a + g < start + chunks * g:  # no later chunk reads the last tile
                freeze_cache(cache, freezer)
        return out  # chunks x [batch, G, V]: not concatenated (over a large vocabulary, a copy of 0.4 GB)

    positions = self_test_positions(config, chunks)
    if exact_logits is not None and exact_logits.shape[0] != len(positions):
        raise ValueError(f"exact_logits cover {exact_logits.shape[0]} positions; the self-test compares "
                         f"{len(positions)} (positions {positions.start}..{positions.stop - 1})")
    got = run(c, TileFreezer(codec, frozenset(layers), flavours=flavours))
    exact = exact_logits.split(g) if exact_logits is not None else [x[0] for x in run(1, None)]
    kl = torch.cat([kl_per_position(e, x) for e, x in zip(exact, got)], dim=-1).mean(-1).tolist()
    return {name: kl[row_of[name]] for name in candidates}


def _first_tile_from_trials(cache, freezer, prompt_tiles: dict[int, TileFields]) -> None:
    """The history's tile past the sink, in each quantized layer and batch row, decoded from the
    decision's trial encodings with that row's flavours: what ``freeze_cache`` would write (the
    encode is per tile), without encoding it again."""
    s, g = freezer.config.sink_tokens, freezer.config.tile
    for i in freezer.quantized_layers:
        fl = freezer.flavours[i]  # [C, Hk]
        tiles = select_options(prompt_tiles[i], option_index(fl.key_rotate, fl.key_normalize),
                               option_index(fl.value_rotate, fl.value_normalize)).map(lambda x: x[:, :, :1])
        k, v = decode_flavoured(tiles, fl, freezer.config)
        layer = cache.layers[i]
        layer.keys[:, :, s:s + g] = k.to(layer.keys.dtype)
        layer.values[:, :, s:s + g] = v.to(layer.values.dtype)
        freezer.frozen[i] = s + g


def choose(kl: dict[str, float]) -> str:
    """The policy with the lowest KL; ties go to the earlier one in :data:`kvarn.auto.POLICIES`."""
    order = sorted(kl, key=lambda n: (kl[n], POLICIES.index(n) if n in POLICIES else len(POLICIES)))
    return order[0]


def settle(
    model, prompt: torch.Tensor, prompt_kv: list[tuple[torch.Tensor, torch.Tensor]], decisions: dict, codec: TileCodec,
    exact_logits: torch.Tensor | None = None, *, row: int = 0, embeds: bool = False,
) -> dict[str, float] | None:
    """Rule r3 for one row: self-test the candidates of ``decisions`` (layer -> :class:`kvarn.auto.decision.LayerDecision`)
    and adopt the winner in that row of every layer. Arguments as :func:`self_test`, for this row alone.

    Returns the KL per policy, or None where the row cannot be self-tested (too short to decide at
    all: KVarN stays; shorter than :func:`self_test_tokens`: rule a2's flavours stay).
    """
    if not decisions or any(d.rows[row].candidates is None for d in decisions.values()):
        return None
    if prompt.shape[1] < self_test_tokens(codec.config):
        return None
    candidates = {name: {i: d.candidate(row, name) for i, d in decisions.items()} for name in POLICIES}
    trials = {i: d.rows[row].prompt_tiles for i, d in decisions.items()}
    trials = trials if all(t is not None for t in trials.values()) else None
    kl = self_test(model, prompt, prompt_kv, candidates, codec, exact_logits, embeds=embeds, prompt_tiles=trials)
    best = choose(kl)
    for d in decisions.values():
        d.rows[row].adopt(best, kl)
    return kl
