import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvarn.codec.quantize import STEP_MIN, dequantize_rows, row_range, rtn_rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.sampled_from([2, 4, 8]), scale=st.floats(1e-3, 1e3))
def test_error_at_most_half_a_step(seed, bits, scale):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(16, 64, generator=g) * scale
    codes, step, lo = rtn_rows(y, bits)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= (1 << bits) - 1
    err = (dequantize_rows(codes, step, lo) - y).abs()
    assert torch.all(err <= step[:, None] * (0.5 + 1e-4))
    # The extremes of every row are representable exactly (code 0 and 2^b - 1 are used).
    assert torch.all(codes.amin(-1) == 0) and torch.all(codes.amax(-1) == (1 << bits) - 1)


def test_ties_round_half_to_even():
    # Row [0, 3]: 2-bit step 1; values at exactly .5 steps must go to the even code.
    y = torch.tensor([[0.0, 0.5, 1.5, 2.5, 3.0, 1.0, 2.0, 0.0]])
    codes, step, lo = rtn_rows(y, 2)
    assert float(step[0]) == 1.0 and float(lo[0]) == 0.0
    assert codes[0].tolist() == [0, 0, 2, 2, 3, 1, 2, 0]


def test_constant_row_uses_step_floor():
    y = torch.full((2, 8), 3.25)
    codes, step, lo = rtn_rows(y, 4)
    assert torch.all(step == STEP_MIN) and torch.all(codes == 0) and torch.all(lo == 3.25)


def test_quantile_range_clips_outliers():
    y = torch.linspace(-1, 1, 101)[None].clone()
    y[0, 0] = -100.0
    _, step_mm, _ = rtn_rows(y, 4)
    codes, step_q, lo_q = rtn_rows(y, 4, quantile=0.02)
    assert float(step_q[0]) < float(step_mm[0]) / 10
    assert int(codes[0, 0]) == 0  # the outlier clamps to the lowest code


@pytest.mark.parametrize("n", [32, 64, 128, 256])
def test_quantile_range_is_torch_quantile_bit_for_bit(n):
    g = torch.Generator().manual_seed(n)
    y = torch.randn(200, 2, n, generator=g) * torch.rand(200, 2, 1, generator=g) * 5
    y[0, 0, : n // 4] = 2.0  # ties at the rank the quantile reads
    y[1, 1, 3] = float("nan")  # a non-finite row: torch.quantile's own answer (NaN)
    for q in (0.005, 0.03, 0.1, 0.4):
        lo, hi = row_range(y, q)
        ref = torch.quantile(y, torch.tensor([q, 1.0 - q]), dim=-1)
        assert torch.allclose(lo, ref[0], equal_nan=True, rtol=0, atol=0), q
        assert torch.allclose(hi, ref[1], equal_nan=True, rtol=0, atol=0), q
        assert torch.isnan(lo[1, 1]) and not torch.isnan(lo[0, 0])
        assert bool((lo[2:] > y[2:].amin(-1)).all() and (hi[2:] < y[2:].amax(-1)).all())  # inside min/max


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_fill_the_range_uniformly(bits):
    n = (1 << bits)
    y = torch.arange(n, dtype=torch.float32)[None] * 0.37
    codes, _, _ = rtn_rows(y, bits)
    assert codes[0].tolist() == list(range(n))
