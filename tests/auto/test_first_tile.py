"""kvarn-auto decides at a row's first tile past the sink when its prompt is shorter than ``S + G``
(kvarn.auto.layer), on constructed queries, keys and values fed to one cache layer."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from kvarn.auto import AutoSettings, decide_first_tile, decide_row  # noqa: E402
from kvarn.auto.layer import KVarNAutoLayer  # noqa: E402
from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.auto.decision import AT_FIRST_TILE, AT_PREFILL  # noqa: E402
from kvarn.methods import TileCodec  # noqa: E402

S = G = 32
N = S + G  # the first tile past the sink is complete at N tokens
HQ, HK, D = 4, 2, 64
CODEC = TileCodec("kvarn-auto", KVarNConfig.from_name("k2v2_g128", tile=G, sink_tokens=S), kernels="torch")
FLAGS = ("key_rotate", "key_normalize", "value_rotate", "value_normalize")


def _sequence(t: int, seed: int = 0):
    """Queries ``[1, HQ, t, D]``, keys and values ``[1, HK, t, D]``: keys with a few large channels
    and queries that look at the small ones on one head and at the large ones on the other, so
    that the two heads choose differently."""
    g = torch.Generator().manual_seed(seed)
    std = torch.full((HK, 1, D), 0.05)
    std[:, :, :6] = 8.0
    k = (std * torch.randn(HK, t, D, generator=g) + 0.5)[None]
    v = torch.randn(1, HK, t, D, generator=g)
    energy = torch.zeros(HQ, 1, D)
    energy[:2, :, 6:] = 1.0  # KV head 0's queries
    energy[2:, :, :6] = 1.0  # KV head 1's
    q = (energy * torch.randn(HQ, t, D, generator=g))[None]
    return q, k, v


def _layer(pads=None) -> KVarNAutoLayer:
    return KVarNAutoLayer(CODEC, SimpleNamespace(pads=pads))


def _feed(layer, q, k, v, bounds) -> None:
    """Updates of ``[a, b)`` for each bound, each followed by its attention call's ``observe``."""
    for a, b in bounds:
        layer.update(k[:, :, a:b], v[:, :, a:b], 0)
        layer.observe(q[:, :, a:b], None)


def _steps(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, stop)) for a in range(start, stop, chunk)]


def _assert_same_decision(a, b) -> None:
    for name in FLAGS:
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert torch.equal(a.key_logit_error, b.key_logit_error)
    assert torch.equal(a.value_output_error, b.value_output_error)


@pytest.mark.parametrize("prompt, chunk", [(10, 1), (10, 7), (1, 40), (S + 5, 1)])
def test_the_first_tile_decision_equals_the_prefill_decision_of_the_same_tokens(prompt, chunk):
    q, k, v = _sequence(N + 3)
    at_prefill = _layer()
    _feed(at_prefill, q, k, v, [(0, N)])
    row = at_prefill.decision.rows[0]
    assert row.decided and row.at == AT_PREFILL and not at_prefill.pending[0]
    assert not at_prefill.wants_queries  # nothing waits: the capture can stop after the prefill

    late = _layer()
    _feed(late, q, k, v, [(0, prompt)] + _steps(prompt, N, chunk))
    assert late.pending == [True] and not late.decision.rows[0].decided and late.wants_queries
    assert late.store.counts == [0]
    for layer in (at_prefill, late):
        _feed(layer, q, k, v, [(N, N + 3)])  # the freeze at the start of this update stores the tile
    got = late.decision.rows[0]
    assert got.decided and got.at == AT_FIRST_TILE and late.pending == [False] and not late.wants_queries
    assert (got.tokens, got.queries, got.prompt_tokens) == (N, G, prompt)
    _assert_same_decision(got, row)
    assert not bool(got.key_rotate[0]) and bool(got.key_rotate[1])  # the heads chose differently
    assert late.store.counts == [1]
    for name, x in at_prefill.store.fields.items():  # the same tile, bit for bit
        assert torch.equal(x, late.store.fields[name]), name
    report = late.flavours()[0]
    assert report["decided_at"] == "first_tile" and report["queries"] == G and report["tokens"] == N
    assert report["pending"] is False and report["heads"] == late.decision.flavours.names()[0]


def test_the_decision_reads_exactly_the_first_tile_whatever_comes_with_it():
    """A forward that carries the row past ``S + G`` (a long chunk) decides from the first ``S + G``
    tokens only: as :func:`decide_first_tile` on them, and as a prefill of exactly those tokens."""
    q, k, v = _sequence(N + 50)
    layer = _layer()
    _feed(layer, q, k, v, [(0, 20), (20, N + 40), (N + 40, N + 50)])
    want = decide_row(q[0, :, :N], k[0, :, :N], v[0, :, :N], CODEC.config, AutoSettings(), None, "torch")
    _assert_same_decision(layer.decision.rows[0], want)
    direct = decide_first_tile(q[0], k[0], v[0], CODEC.config, kernels="torch")
    _assert_same_decision(direct, want)
    assert direct.tokens == N and direct.at == AT_FIRST_TILE
    with pytest.raises(ValueError, match="first S \\+ G = 64 tokens"):
        decide_first_tile(q[0, :, :N - 1], k[0], v[0], CODEC.config)


def test_a_crop_replaces_the_queries_of_rejected_tokens():
    """Speculative tokens cropped before the tile completes leave no trace in the decision."""
    q, k, v = _sequence(N + 3)
    junk_q, junk_k, junk_v = _sequence(N + 3, seed=5)
    ref = _layer()
    _feed(ref, q, k, v, [(0, 12)] + _steps(12, N + 3, 1))
    layer = _layer()
    _feed(layer, q, k, v, [(0, 12)] + _steps(12, 40, 1))
    _feed(layer, junk_q, junk_k, junk_v, [(40, 44)])  # four drafted tokens ...
    layer.crop(-4)  # ... rejected
    _feed(layer, q, k, v, _steps(40, N + 3, 1))
    _assert_same_decision(layer.decision.rows[0], ref.decision.rows[0])
    assert layer.decision.rows[0].at == AT_FIRST_TILE


def test_left_padded_rows_decide_alone_each_at_its_own_first_tile():
    """Two short rows and a long one in a left-padded batch: the long row decides at the prefill,
    each short row when its own first tile completes, as that row would alone."""
    length, real = 70, [40, 70, 50]  # row 1 is the longest, not padded, and holds a tile past the sink
    pads = [length - r for r in real]
    seqs = [_sequence(120, seed=i) for i in range(3)]
    steps = 30  # decode steps, one token per row each: rows 0 and 2 freeze their first tile
    # The batch: each row's real tokens right-aligned in the prefill, then the same decode tokens.
    q = torch.zeros(3, HQ, length + steps, D)
    k, v = torch.zeros(3, HK, length + steps, D), torch.zeros(3, HK, length + steps, D)
    for b, (sq, sk, sv) in enumerate(seqs):
        n = real[b] + steps
        q[b, :, length + steps - n:], k[b, :, length + steps - n:], v[b, :, length + steps - n:] = \
            sq[0, :, :n], sk[0, :, :n], sv[0, :, :n]
    k[:, :, :min(pads)] = 1e4  # pads never enter a decision or a tile
    batch = _layer(pads)
    _feed(batch, q, k, v, [(0, length)])
    assert batch.pending == [True, False, True]
    for b in (0, 2):  # while a row waits, its heads report KVarN
        assert batch.flavours()[b]["heads"] == ["kvarn"] * HK and batch.flavours()[b]["pending"]
    _feed(batch, q, k, v, _steps(length, length + steps, 1))
    assert batch.pending == [False] * 3
    for b, (sq, sk, sv) in enumerate(seqs):
        alone = _layer()
        _feed(alone, sq, sk, sv, [(0, real[b])] + _steps(real[b], real[b] + steps, 1))
        got, want = batch.decision.rows[b], alone.decision.rows[0]
        _assert_same_decision(got, want)
        assert got.at == want.at == (AT_PREFILL if b == 1 else AT_FIRST_TILE)
        assert got.prompt_tokens == real[b]
    rows = batch.flavours()
    assert [r["decided_at"] for r in rows] == ["first_tile", "prefill", "first_tile"]


def test_a_row_whose_queries_were_missed_falls_back_with_a_warning(caplog):
    q, k, v = _sequence(N + 2)
    layer = _layer()
    _feed(layer, q, k, v, [(0, 10)] + _steps(10, 30, 1))
    layer.update(k[:, :, 30:31], v[:, :, 30:31], 0)  # a forward whose attention call was not seen
    _feed(layer, q, k, v, _steps(31, N, 1))
    assert layer.pending == [True]
    with caplog.at_level(logging.WARNING):
        _feed(layer, q, k, v, [(N, N + 2)])
    assert "did not all reach this layer" in caplog.text
    row = layer.decision.rows[0]
    assert not row.decided and row.at is None and layer.pending == [False]
    assert layer.decision.flavours.names()[0] == ["kvarn"] * HK and layer.store.counts == [1]


def test_beam_reorder_takes_the_waiting_rows_queries_along():
    q, k, v = _sequence(N + 2)
    ref = _layer()
    _feed(ref, q, k, v, [(0, 10)] + _steps(10, N + 2, 1))
    layer = _layer()
    _feed(layer, q, k, v, [(0, 10)])
    layer.batch_repeat_interleave(2)  # two beams of the one row
    q2, k2, v2 = (x.expand(2, -1, -1, -1) for x in (q, k, v))
    _feed(layer, q2, k2, v2, _steps(10, N + 2, 1))
    assert layer.pending == [False, False]
    for b in range(2):
        _assert_same_decision(layer.decision.rows[b], ref.decision.rows[0])
