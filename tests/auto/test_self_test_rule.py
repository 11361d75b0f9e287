"""kvarn-auto rule r3: the self-test on a constructed one-layer model whose answer is known."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from kvarn.auto import POLICIES, AutoSettings, decide  # noqa: E402
from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.codec.flavour import Flavours  # noqa: E402
from kvarn.methods import TileCodec  # noqa: E402
from kvarn.auto.self_test_rule import choose, self_test, self_test_positions, self_test_tokens  # noqa: E402

D = 16
G = S = 32
# Min/max ranges (explicit: kvarn-auto's own 2-bit quantiles would clip the exact grid below).
CFG = KVarNConfig(key_bits=2, value_bits=2, tile=G, sink_tokens=S, key_quantile=0.0, value_quantile=0.0)
CODEC = TileCodec("kvarn-auto", CFG)
T = S + 3 * G  # exactly what the self-test needs


class _OneLayer(torch.nn.Module):
    """Token ``i`` has key ``keys[i]`` and value ``values[i]``; one fixed query; logits = out @ W.

    Keys: a constant per channel, exactly representable in fp16, except channel 0, which varies
    across tokens and which the query ignores. Values: ``a_i * u_i`` with ``u_i`` in {0, 1, 2, 3}^D and
    ``a_i`` a multiple of 1/8. So KIVI's flavour (no rotation, no normalization) stores both exactly
    and leaves the logits exact; a rotation spreads channel 0's error into the channels the query
    reads, and the value rotation breaks the exact grid.
    """

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        const = torch.randint(-16, 17, (D,), generator=g).float() / 4
        self.keys = const.repeat(T, 1)
        self.keys[:, 0] = 6 * torch.randn(T, generator=g)
        u = torch.randint(0, 4, (T, D), generator=g).float()
        u[:, :2] = torch.tensor([0.0, 3.0])  # every row spans the grid 0..3
        a = torch.randint(4, 17, (T, 1), generator=g).float() / 8
        self.values = a * u
        self.query = 30 * torch.randn(D, generator=g)
        self.query[0] = 0.0
        self.lm = 0.2 * torch.randn(D, 32, generator=g)

    def qkv(self, ids):
        b, t = ids.shape
        return self.query.expand(b, 1, t, D), self.keys[ids][:, None], self.values[ids][:, None]

    def forward(self, input_ids, past_key_values, use_cache=True):
        q, k, v = self.qkv(input_ids)
        keys, values = past_key_values.update(k, v, 0)
        t, n = input_ids.shape[1], keys.shape[2]
        mask = torch.ones(t, n, dtype=torch.bool).tril(n - t)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return SimpleNamespace(logits=out[:, 0] @ self.lm)


def _setup():
    model = _OneLayer()
    ids = torch.arange(T)[None]
    q, k, v = model.qkv(ids)
    decision = decide(q, k, v, CODEC.config, settings=AutoSettings(rule="r3"))
    candidates = {p: {0: decision.candidate(0, p)} for p in POLICIES}
    return model, ids, (k, v), decision, candidates


def test_exact_flavour_is_the_policy_kept():
    model, ids, kv, decision, candidates = _setup()
    row = decision.rows[0]
    assert row.policy == "a2"  # a2's flags until the self-test has run
    a3 = row.candidates["a3"]
    assert not bool(a3[0][0]) and not bool(a3[1][0])  # a3: keys unrotated, unnormalized
    kl = self_test(model, ids, [kv], candidates, CODEC)
    assert choose(kl) == "a3"
    assert kl["a3"] < 1e-6 < kl["a2"] and kl["a3"] < kl["kvarn"]
    row.adopt("a3", kl)
    assert torch.equal(decision.flavours.key_normalize[0], a3[1]) and row.summary()["policy"] == "a3"


def test_given_exact_logits_match_the_exact_run():
    model, ids, kv, _, candidates = _setup()
    from kvarn.analysis.capture import new_cache

    exact = model(ids, new_cache(1)).logits[0]  # the exact prefill of the whole prompt
    pos = self_test_positions(CFG)
    with_logits = self_test(model, ids, [kv], candidates, CODEC, exact[pos.start:pos.stop])
    without = self_test(model, ids, [kv], candidates, CODEC)
    for p in POLICIES:
        assert with_logits[p] == pytest.approx(without[p], rel=1e-4, abs=1e-7)
    with pytest.raises(ValueError, match="exact_logits cover"):
        self_test(model, ids, [kv], candidates, CODEC, exact[pos.start:pos.stop - 1])


def test_a_constructed_winner_whatever_its_name_and_ties_go_to_kvarn():
    model, ids, kv, _, candidates = _setup()
    kivi = Flavours.named("kivi", 1, 1)
    kvarn = Flavours.named("kvarn", 1, 1)
    swapped = {"kvarn": {0: kvarn}, "a2": {0: kivi}, "a3": {0: kvarn}}
    kl = self_test(model, ids, [kv], swapped, CODEC)
    assert choose(kl) == "a2" and kl["kvarn"] == kl["a3"]  # same flavours: one run, one figure
    same = {p: {0: kvarn} for p in POLICIES}
    assert choose(self_test(model, ids, [kv], same, CODEC)) == "kvarn"
    assert choose({"kvarn": 0.1, "a2": 0.1, "a3": 0.1}) == "kvarn"


def test_prompt_too_short_for_the_self_test():
    model, ids, kv, _, candidates = _setup()
    assert self_test_tokens(CFG) == T and list(self_test_positions(CFG)) == list(range(S + G, T))
    with pytest.raises(ValueError, match=f"needs {T} prompt tokens"):
        self_test(model, ids[:, :T - 1], [kv], candidates, CODEC)


def test_kl_in_chunks_is_the_whole_kl():
    """The chunked KL (memory-bounded) equals the KL over all positions at once, for any chunk size."""
    from kvarn.auto.self_test_rule import kl_per_position

    torch.manual_seed(0)
    exact, got = torch.randn(11, 50) * 3, torch.randn(3, 11, 50) * 3
    p = torch.log_softmax(exact, -1)
    want = (p.exp() * (p - torch.log_softmax(got, -1))).sum(-1).mean(-1)
    for chunk in (1, 4, 11, 64):
        torch.testing.assert_close(kl_per_position(exact, got, chunk).mean(-1), want, rtol=1e-6, atol=1e-7)
    assert (want > 0).all()  # distinct distributions: a KL of zero would not test anything


def test_the_decisions_trial_encodings_give_the_same_self_test():
    """The history's first tile decoded from the decision's trial encodings is the tile the freeze
    would write: the same KL, to the bit."""
    model, ids, kv, decision, candidates = _setup()
    trials = {0: decision.rows[0].prompt_tiles}
    assert trials[0] is not None and trials[0].k_codes.shape[:2] == (4, 1)
    assert self_test(model, ids, [kv], candidates, CODEC, prompt_tiles=trials) == \
        self_test(model, ids, [kv], candidates, CODEC)
