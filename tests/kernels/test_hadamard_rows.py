"""The kernels' in-register Hadamard rotation (kvarn.kernels.hadamard) against the torch matrix
(kvarn.codec.hadamard): ``x @ (sqrt(D) H)`` to fp32 rounding, in the forms the decode kernel and the
encoder use it."""

import pytest
import torch
from kernel_data import fast_cases

from kvarn.codec.hadamard import hadamard_matrix

pytest.importorskip("kvarn.kernels", reason="triton is not importable")

import triton  # noqa: E402 (after the skip: kvarn.kernels needs triton)
import triton.language as tl  # noqa: E402

from kvarn.kernels.hadamard import hadamard_rows  # noqa: E402


@triton.jit
def _rotate_rows_kernel(x_ptr, y_ptr, mid, R: tl.constexpr, D: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                        MID: tl.constexpr):
    off = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    if MID:
        y = hadamard_rows(tl.load(x_ptr + off), D, SPLIT_ROWS, mid)
    else:
        y = hadamard_rows(tl.load(x_ptr + off), D, SPLIT_ROWS)
    tl.store(y_ptr + off, y)


@pytest.mark.parametrize("split_rows", [False, True])
@pytest.mark.parametrize("rows,d", fast_cases([(4, 64), (4, 128), (8, 128), (4, 256), (16, 32)], fast=(1,)))
def test_hadamard_rows_is_the_rotation(rows, d, split_rows, kdevice):
    """The kernel's in-register rotation (two small MMAs over the Kronecker factors of H) is
    ``x @ (sqrt(D) H)`` to fp32 rounding, on rows whose channels span three orders of magnitude;
    with the second MMA's rows reordered (``SPLIT_ROWS``, the encoder's form) too."""
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, d, generator=g) * torch.logspace(0, 3, d)
    y = torch.empty_like(x, device=kdevice)
    _rotate_rows_kernel[(1,)](x.to(kdevice), y, 1.0, rows, d, split_rows, False)
    ref = x.double() @ (hadamard_matrix(d, "cpu", torch.float64) * d ** 0.5)
    assert (y.cpu().double() - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("rows,d", fast_cases([(4, 64), (16, 128), (8, 256)], fast=(1,)))
def test_hadamard_rows_of_fp16_rows(rows, d, kdevice):
    """fp16 rows go into the first MMA as they are, and ``mid`` scales its sums before the second
    (the encoder's form for fp16 tiles): still ``x @ (sqrt(D) H)`` to fp32 rounding, times ``mid``;
    without the scale, the first MMA's sums of values near the fp16 maximum would overflow the
    second's fp16 halves."""
    g = torch.Generator().manual_seed(rows + d)
    x = (torch.randn(rows, d, generator=g) * torch.logspace(0, 4.5, d)).clamp(-6e4, 6e4).half()
    mid = 2.0 ** -16
    y = torch.empty(rows, d, device=kdevice)
    _rotate_rows_kernel[(1,)](x.to(kdevice), y, mid, rows, d, True, True)
    ref = x.double() @ (hadamard_matrix(d, "cpu", torch.float64) * d ** 0.5) * mid
    assert torch.isfinite(y).all()
    assert (y.cpu().double() - ref).abs().max() <= 1e-6 * ref.abs().max()
