"""Triton ``decode_attention`` against the torch reference (kvarn.attention.decode_attention).

Tolerance: a kernel errs at most twice as much as its torch twin in the same dtype, plus an
absolute floor, ``err(kernel) <= 2 * err(torch in fp16) + atol``, with errors measured against the
fp32 torch reference over the same stored history.
"""

import pytest
import torch

from kvarn.attention import decode_attention as torch_decode
from kvarn.codec import rotate_kv
from kvarn.config import KVarNConfig

from kernel_data import HAS_CUDA, SMALL_DECODE_CASES, fast_cases, full_sweep, history, rel_err

kernels = pytest.importorskip("kvarn.kernels", reason="triton is not importable")
ATOL = 1e-4


def check(q, sink_k, sink_v, tiles, tail_k, tail_v, cfg, num_splits=None, fp_splits=None, kernel_kw=None, **kw):
    """Kernel vs torch twin; ``num_splits``/``fp_splits``/``kernel_kw`` are the kernel's (None: planned)."""
    ref = torch_decode(q.float(), sink_k, sink_v, tiles, tail_k, tail_v, cfg, **kw)
    ref16 = torch_decode(q, sink_k, sink_v, tiles, tail_k, tail_v, cfg, compute_dtype=torch.float16, **kw)
    out = kernels.decode_attention(q, sink_k, sink_v, tiles, tail_k, tail_v, cfg, num_splits=num_splits,
                                   fp_splits=fp_splits, **(kernel_kw or {}), **kw)
    assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()
    e, e16 = rel_err(out, ref), rel_err(ref16, ref)
    assert e <= 2 * e16 + ATOL, f"kernel error {e:.2e} vs torch fp16 {e16:.2e}"
    return e, e16


@pytest.mark.parametrize("bits,tq,splits", fast_cases(SMALL_DECODE_CASES, fast=(0, 2)))  # one token; three
def test_decode_small(bits, tq, splits, kdevice):
    cfg = KVarNConfig(key_bits=bits[0], value_bits=bits[1], tile=64)
    sk, sv, tiles, tk, tv, _, _ = history(1, 2, 2, 64, cfg, kdevice, tail=5)
    q = torch.randn(1, 4, tq, 64, device=kdevice).half()
    kw = {} if splits is None else {"num_splits": splits}
    check(q, sk, sv, tiles, tk, tv, cfg, **kw)


def test_decode_model_frame_and_lengths(kdevice):
    """Sink/tail in the model frame (as KVarNCache keeps them) and per-row valid lengths."""
    cfg = KVarNConfig(key_bits=4, value_bits=2, tile=64)
    sk, sv, tiles, tk, tv, _, _ = history(2, 1, 2, 64, cfg, kdevice, tail=9, seed=1)
    to_model = lambda x: rotate_kv(x.float(), cfg).half()  # noqa: E731 (H is its own inverse)
    q = torch.randn(2, 2, 2, 64, device=kdevice).half()
    lengths = dict(
        sink_lengths=torch.tensor([64, 30], device=kdevice),
        tile_counts=torch.tensor([2, 1], device=kdevice),
        tail_lengths=torch.tensor([9, 3], device=kdevice),
    )
    check(q, to_model(sk), to_model(sv), tiles, to_model(tk), to_model(tv), cfg, fp_frame="model",
          num_splits=2, **lengths)


@pytest.mark.parametrize("given", fast_cases(["sink_lengths", "tile_counts", "tail_lengths"]))
def test_decode_some_lengths_given(given, kdevice):
    """A length left as None is the capacity (a scalar in the kernel, no device tensor); one given
    is read per row. Either way the twin's result, whichever of the three is given."""
    cfg = KVarNConfig(key_bits=2, value_bits=4, tile=64)
    sk, sv, tiles, tk, tv, _, _ = history(2, 1, 3, 64, cfg, kdevice, tail=9, seed=2)
    q = torch.randn(2, 4, 1, 64, device=kdevice).half()
    short = {"sink_lengths": [64, 17], "tile_counts": [3, 1], "tail_lengths": [9, 2]}[given]
    check(q, sk, sv, tiles, tk, tv, cfg, num_splits=2, **{given: torch.tensor(short, device=kdevice)})


def test_decode_no_tiles_no_sink(kdevice):
    cfg = KVarNConfig(tile=64)
    _, _, _, tk, tv, _, _ = history(1, 2, 0, 64, cfg, kdevice, sink=0, tail=70)
    q = torch.randn(1, 2, 1, 64, device=kdevice).half()
    check(q, None, None, None, tk, tv, cfg)


def test_decode_errors(kdevice):
    cfg = KVarNConfig(tile=32)
    kv = torch.zeros(1, 1, 4, 64, device=kdevice, dtype=torch.float16)
    q = torch.zeros(1, 2, 1, 64, device=kdevice, dtype=torch.float16)
    with pytest.raises(ValueError, match="G >= 64"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, cfg)
    with pytest.raises(ValueError, match="fp_frame"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, KVarNConfig(tile=64), fp_frame="x")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name,d,hq,hk,b,n_tiles,tq,tail", full_sweep(
    ["k2v2_g128", "k4v2_g128", "k4v4_g64"],
    [(128, 32, 8), (64, 32, 8), (256, 16, 4)],
    [(2, 32, 4, None), (1, 100, 1, 1), (1, 300, 1, 5), (8, 3, 1, 0), (2, 5, 8, 8)],
))
def test_decode_full(name, d, hq, hk, b, n_tiles, tq, tail):
    """Full size on the GPU; tail None = G - 1 tokens, 0 = no tail (Tq = 1). B 1 with 300 tiles plans
    MAX_SPLITS splits: both levels of the merge tree take several steps."""
    cfg = KVarNConfig.from_name(name)
    tail = cfg.tile - 1 if tail is None else tail
    sk, sv, tiles, tk, tv, _, _ = history(b, hk, n_tiles, d, cfg, "cuda", tail=tail, seed=d + b)
    if tail == 0:
        tk = tv = None
    q = torch.randn(b, hq, tq, d, device="cuda").half()
    check(q, sk, sv, tiles, tk, tv, cfg)
    check(q, sk, sv, tiles, tk, tv, cfg, num_splits=1, fp_splits=1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["k2v2_g128", pytest.param("k4v2_g64", marks=pytest.mark.slow)])
def test_decode_full_model_frame_bf16(name):
    """The transformers path: bf16 query, sink and tail in the model frame, ragged lengths."""
    cfg = KVarNConfig.from_name(name)
    sk, sv, tiles, tk, tv, _, _ = history(4, 8, 40, 128, cfg, "cuda", tail=cfg.tile - 1, seed=7)
    to_model = lambda x: rotate_kv(x.float(), cfg).bfloat16()  # noqa: E731 (H is its own inverse)
    q = torch.randn(4, 32, 1, 128, device="cuda").bfloat16()
    lengths = dict(sink_lengths=torch.tensor([cfg.tile, 5, cfg.tile, cfg.tile], device="cuda"),
                   tile_counts=torch.tensor([40, 0, 17, 39], device="cuda"),
                   tail_lengths=torch.tensor([cfg.tile - 1, 1, 30, 2], device="cuda"))
    check(q, to_model(sk), to_model(sv), tiles, to_model(tk), to_model(tv), cfg, fp_frame="model", **lengths)


@pytest.mark.parametrize("knobs", fast_cases([
    dict(num_warps=1, num_stages=2),  # the default at D <= 128 (one or two waves of splits)
    dict(num_warps=2, num_stages=3, max_registers=168),  # a capped, 3-stage plan (a --sweep knob)
    dict(num_warps=2, num_stages=2),  # D 256 or 8 rows per KV head: uncapped
    dict(num_warps=2, num_stages=1),
    dict(num_warps=4, num_stages=2, num_splits=1),
]))
def test_decode_launch_plans(knobs, kdevice):
    """Every launch plan :func:`launch_plan` picks from, and explicit knobs, give the twin's result
    (on a GPU each is its own compiled kernel: pipelined or not, one or more warps)."""
    cfg = KVarNConfig(key_bits=2, value_bits=2, tile=64)
    sk, sv, tiles, tk, tv, _, _ = history(2, 2, 5, 64, cfg, kdevice, tail=11, seed=7)
    q = torch.randn(2, 8, 1, 64, device=kdevice).half()
    kw = dict(knobs)
    check(q, sk, sv, tiles, tk, tv, cfg, num_splits=kw.pop("num_splits", 2), kernel_kw=kw)


@pytest.mark.parametrize("fp_frame", ["rotated", "model"])
def test_decode_mixed_head_frames(fp_frame, kdevice):
    """kvarn-auto flags: per (row, KV head) keys and values in the rotated or the model frame."""
    cfg = KVarNConfig(key_bits=2, value_bits=4, tile=64)
    sk, sv, tiles, tk, tv, _, _ = history(2, 3, 2, 64, cfg, kdevice, tail=6, seed=5)
    q = torch.randn(2, 6, 1, 64, device=kdevice).half()
    flags = dict(key_rotated=torch.tensor([[True, False, True], [False, False, True]], device=kdevice),
                 value_rotated=torch.tensor([[False, True, True], [True, False, False]], device=kdevice))
    e, _ = check(q, sk, sv, tiles, tk, tv, cfg, num_splits=2, fp_frame=fp_frame, **flags)
    # The flags change the result (a twin that ignored them would not match the kernel).
    plain = torch_decode(q.float(), sk, sv, tiles, tk, tv, cfg, fp_frame=fp_frame)
    assert rel_err(plain, torch_decode(q.float(), sk, sv, tiles, tk, tv, cfg, fp_frame=fp_frame, **flags)) > 0.1


def test_decode_bad_launch_knobs(kdevice):
    cfg = KVarNConfig(tile=64)
    kv = torch.zeros(1, 2, 4, 64, device=kdevice, dtype=torch.float16)
    q = torch.zeros(1, 2, 1, 64, device=kdevice, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"num_stages=0; use 1"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, cfg, num_stages=0)
    with pytest.raises(ValueError, match=r"num_warps=6; use None"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, cfg, num_warps=6)
    with pytest.raises(ValueError, match=r"max_registers=300; use None"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, cfg, max_registers=300)


def test_decode_head_frame_flags_are_checked(kdevice):
    cfg = KVarNConfig(tile=64)
    kv = torch.zeros(1, 2, 4, 64, device=kdevice, dtype=torch.float16)
    q = torch.zeros(1, 2, 1, 64, device=kdevice, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"key_rotated must be a bool tensor \[B=1, Hk=2\]"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, cfg, key_rotated=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="value_rotated"):
        kernels.decode_attention(q, kv, kv, None, kv, kv, cfg, value_rotated=torch.ones(1, 2))
