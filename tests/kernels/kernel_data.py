"""Shared data for the kernel tests (imported by name: pytest puts this folder on sys.path).

Real-looking synthetic KV: channel outliers and token-scale spread.
"""

import itertools

import pytest
import torch

from kvarn.codec import encode_tiles, kv_to_tiles, rotate_kv


# Small decode cases ((K bits, V bits), query tokens, tile splits or None): the CPU-interpreter
# tests and benchmarks/bench_decode_accuracy.py both use them.
SMALL_DECODE_CASES = [((4, 2), 1, None), ((2, 2), 1, 2), ((4, 4), 3, 2), ((8, 2), 2, None)]


def synthetic_kv(b, h, t, d, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    chan = 1 + 4 * torch.rand(1, h, 1, d, generator=g) ** 4  # a few large channels
    tok = torch.exp(0.5 * torch.randn(b, h, t, 1, generator=g))  # token-scale spread
    k = torch.randn(b, h, t, d, generator=g) * chan * tok + 0.5 * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g) * tok
    return k.to(device), v.to(device)


def rotated_tiles(k, v, config):
    """Rotated fp32 tiles ``([..., D, G], [..., G, D])`` of model-frame K/V ``[B, H, T, D]``."""
    return kv_to_tiles(rotate_kv(k, config), rotate_kv(v, config), config.tile)


def history(b, hk, n_tiles, d, config, device, sink=None, tail=5, seed=0, dtype=torch.float16):
    """(sink_k, sink_v, tiles, tail_k, tail_v) in the rotated frame; tiles from the torch codec."""
    s = config.tile if sink is None else sink
    k, v = synthetic_kv(b, hk, s + n_tiles * config.tile + tail, d, device, seed)
    kr, vr = rotate_kv(k, config), rotate_kv(v, config)
    body = slice(s, s + n_tiles * config.tile)
    tiles = encode_tiles(*kv_to_tiles(kr[:, :, body], vr[:, :, body], config.tile), config) if n_tiles else None
    rest = slice(s + n_tiles * config.tile, None)
    return (kr[:, :, :s].to(dtype), vr[:, :, :s].to(dtype), tiles,
            kr[:, :, rest].to(dtype), vr[:, :, rest].to(dtype), k, v)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


HAS_CUDA = torch.cuda.is_available()


def fast_cases(cases, fast=(0,)):
    """pytest params of ``cases`` (a tuple case spreads over several arguments) whose indices in
    ``fast`` run in the fast tier; the others, the same path with other constants (bits, shapes,
    launch knobs), are marked ``slow``: on a GPU each costs a kernel compile of its own."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=() if i in fast else pytest.mark.slow)
            for i, c in enumerate(cases)]


def full_sweep(*axes):
    """pytest params over the product of ``axes`` (lists of values; a tuple value spreads over
    several arguments). The fast tier keeps the diagonal, case i taking value i of every axis, for
    as many cases as the shortest axis has values (so every value of that axis runs once at full
    size); the other cases are marked ``slow``."""
    n = min(len(a) for a in axes)
    fast = {(i,) * len(axes) for i in range(n)}
    params = []
    for index in itertools.product(*(range(len(a)) for a in axes)):
        values = [a[i] for a, i in zip(axes, index)]
        flat = [x for v in values for x in (v if isinstance(v, tuple) else (v,))]
        params.append(pytest.param(*flat, marks=() if index in fast else pytest.mark.slow))
    return params
