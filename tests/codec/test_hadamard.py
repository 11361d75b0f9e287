import math

import pytest
import torch

from kvarn.config import supported_head_dims
from kvarn.codec.hadamard import hadamard_matrix, rotate


@pytest.mark.parametrize("d", supported_head_dims())
def test_orthonormal_symmetric(d):
    h = hadamard_matrix(d, "cpu", torch.float64)
    assert torch.equal(h, h.T)
    torch.testing.assert_close(h @ h, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    # Sylvester entries are +-1/sqrt(D), no random signs, first row all positive.
    assert torch.all(h.abs() == 1 / math.sqrt(d))
    assert torch.all(h[0] > 0)


def test_sylvester_recursion():
    h = hadamard_matrix(32, "cpu", torch.float64) * math.sqrt(32)
    h16 = hadamard_matrix(16, "cpu", torch.float64) * 4
    # [[H, H], [H, -H]] doubling, starting from [[1]].
    assert torch.equal(h, torch.cat([torch.cat([h16, h16], 1), torch.cat([h16, -h16], 1)], 0))
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64)
    assert torch.equal(h16[:4, :4], expected)


def test_rotate_preserves_dot_products_and_inverts():
    torch.manual_seed(0)
    q, k = torch.randn(5, 128), torch.randn(7, 128)
    qr, kr = rotate(q), rotate(k)
    torch.testing.assert_close(qr @ kr.T, q @ k.T, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(rotate(qr), q, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d", [12, 48, 2048])
def test_rejects_unsupported_sizes(d):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(d)
