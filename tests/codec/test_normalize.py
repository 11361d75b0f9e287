import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.codec.normalize import LOG_MAX, LOG_MIN, imbalance, variance_normalize


def _tile(seed, r=64, c=32, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g)
    x = x * torch.exp(spread * torch.rand(r, 1, generator=g)) * torch.exp(spread * torch.rand(1, c, generator=g))
    return x


def _reference(x, iters):
    """Literal transcription of docs/algorithm.md section 2 for one tile (independent of the batched code)."""
    r, c = x.shape
    a, b = torch.zeros(c), torch.zeros(r)

    def cur(a, b):
        return x / (torch.exp(b)[:, None] * torch.exp(a)[None, :])

    best, ba, bb = float(imbalance(x)), a.clone(), b.clone()
    for _ in range(iters):
        a = torch.clamp(a + torch.log(torch.clamp(torch.std(cur(a, b), dim=0), 1e-3, 1e3)), -0.3, 10.0)
        b = torch.clamp(b + torch.log(torch.clamp(torch.std(cur(a, b), dim=1), 1e-3, 1e3)), -0.3, 10.0)
        m = float(imbalance(cur(a, b)))
        if m <= best:
            best, ba, bb = m, a.clone(), b.clone()
    return cur(ba, bb), torch.exp(ba), torch.exp(bb)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), iters=st.sampled_from([0, 1, 3, 8, 16]), spread=st.floats(0.0, 6.0))
def test_never_worse_than_identity_and_clamped(seed, iters, spread):
    x = _tile(seed, spread=spread)
    y, col, row = variance_normalize(x, iters)
    assert float(imbalance(y)) <= float(imbalance(x)) * (1 + 1e-6)
    for s in (col, row):
        assert torch.all(s >= torch.exp(torch.tensor(LOG_MIN)) * (1 - 1e-6))
        assert torch.all(s <= torch.exp(torch.tensor(LOG_MAX)) * (1 + 1e-6))
    torch.testing.assert_close(y, x / (row[:, None] * col[None, :]), rtol=1e-6, atol=0)


@pytest.mark.parametrize("iters", [1, 8, 16])
def test_batched_matches_literal_spec(iters):
    xs = torch.stack([_tile(s, 128, 64) for s in range(6)])
    y, col, row = variance_normalize(xs, iters)
    for i in range(len(xs)):
        ry, rc, rr = _reference(xs[i], iters)
        torch.testing.assert_close(col[i], rc, rtol=1e-6, atol=0)
        torch.testing.assert_close(row[i], rr, rtol=1e-6, atol=0)
        torch.testing.assert_close(y[i], ry, rtol=1e-6, atol=1e-7)


def test_balances_a_skewed_tile():
    x = _tile(1, 128, 128, spread=5.0)
    y, _, _ = variance_normalize(x, 8)
    assert float(imbalance(x)) > 50
    assert float(imbalance(y)) < 0.2 * float(imbalance(x))


def test_ties_go_to_the_later_iterate():
    # A +-1e12 checkerboard: every row and every column holds the same multiset of values, so every
    # iterate (uniform scales) scores exactly 2, the same as the identity. Every comparison ties,
    # so the result must be the LAST iterate, not the identity and not the first.
    i = torch.arange(32)
    x = 1e12 * (1 - 2 * ((i[:, None] + i[None, :]) % 2)).to(torch.float32)
    assert float(imbalance(x)) == 2.0
    iters = 2  # large entries push the log-scales through the std clamp, then the 10.0 clamp
    y, col, row = variance_normalize(x, iters)
    a, b, seen = torch.zeros(32), torch.zeros(32), []
    for _ in range(iters):
        a = torch.clamp(a + torch.log(torch.clamp(torch.std(x / (torch.exp(b)[:, None] * torch.exp(a)), 0), 1e-3, 1e3)), -0.3, 10.0)
        b = torch.clamp(b + torch.log(torch.clamp(torch.std(x / (torch.exp(b)[:, None] * torch.exp(a)), 1), 1e-3, 1e3)), -0.3, 10.0)
        assert float(imbalance(x / (torch.exp(b)[:, None] * torch.exp(a)))) == 2.0
        seen.append((a.clone(), b.clone()))
    assert not torch.equal(seen[0][1], seen[-1][1])  # iterates differ, so the choice is visible
    torch.testing.assert_close(col, torch.exp(seen[-1][0]), rtol=0, atol=0)
    torch.testing.assert_close(row, torch.exp(seen[-1][1]), rtol=0, atol=0)


def test_keeps_identity_when_every_iterate_is_worse():
    # A balanced tile with one tiny column: the clamp at -0.3 prevents the column update from
    # fully fixing it while row updates add imbalance; whatever happens, the result is never
    # worse than the identity, and if no iterate beats it the scales are exactly 1.
    x = _tile(3, 32, 16, spread=0.0)
    y, col, row = variance_normalize(x, 8)
    if float(imbalance(y)) == float(imbalance(x)) and torch.equal(y, x):
        assert torch.all(col == 1) and torch.all(row == 1)
    assert float(imbalance(y)) <= float(imbalance(x))


def test_rejects_non_float32():
    with pytest.raises(TypeError, match="float32"):
        variance_normalize(torch.randn(4, 4, dtype=torch.float64))


def _hard_tiles(seed):
    """Tiles where a float32 std is easy to get wrong: offsets far above the spread, constants,
    subnormal-sized and huge values, heavy tails."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randn(24, 64, 128, generator=g)
    return torch.stack([
        *(n[:6] * torch.exp(4 * torch.randn(6, 64, 1, generator=g)) + 1e3 * torch.randn(6, 64, 1, generator=g)),
        *(n[6:12] * 1e-3 + 7.0),  # offset 7000x the spread
        *(n[12:16] * 1e-38), *(n[16:20] * 1e30),
        *(torch.full((2, 64, 128), 3.25)), *(n[22:24] ** 5),
    ])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ustd_is_torch_std_bit_for_bit(seed):
    from kvarn.codec.normalize import ustd

    x = _hard_tiles(seed)
    for dim in (-1, -2):
        assert torch.equal(ustd(x, dim), x.std(dim=dim, correction=1))
    assert torch.equal(ustd(x.transpose(-1, -2), -1), x.std(dim=-2))  # strided input
    assert not torch.equal(ustd(x, -1), x.std(dim=-1, correction=0))  # the n - 1 matters
