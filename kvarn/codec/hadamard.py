"""Orthonormal Sylvester-Hadamard rotation along head_dim (docs/algorithm.md section 1).

``H = sylvester(D) / sqrt(D)`` with ``sylvester(1) = [[1]]`` and ``[[H, H], [H, -H]]`` doubling.
H is symmetric and orthonormal, so ``H = H^T = H^-1``: rotating twice is the identity.
"""

from __future__ import annotations

import functools
import math

import torch

from ..config import check_head_dim


@functools.lru_cache(maxsize=64)
def hadamard_matrix(dim: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[dim, dim]`` normalized Hadamard matrix; cached per (dim, device, dtype)."""
    check_head_dim(dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ H`` along the last axis, computed in ``dtype``. x: ``[..., D]`` -> ``[..., D]`` in dtype.

    The same call un-rotates, since H is its own inverse.
    """
    h = hadamard_matrix(x.shape[-1], x.device, dtype)
    return x.to(dtype) @ h
