"""Appending decode tokens to a cache's full-precision tail, with its lengths kept on the device.

:func:`append_tail` writes each row's new K/V tokens at the row's tail length as the device holds
it, after the tiles a freeze takes out of the tail, and advances that row's tile count and tail
length, all in one launch. The torch ops it replaces were four launches a layer a step (an index
conversion, two indexed copies, a length add) and six in the step that freezes a tile; in a
captured decode step such tiny launches sit on the critical path one after the other (about a
microsecond each on the H200, BENCHMARKS.md), 64 more in a freezing step of a 32-layer model.

Its torch twin is the indexed write it replaces (``tests/kernels/test_tail.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import check_device

BLOCK = 1024  # values of K (and of V) a program copies an iteration


# FROZEN is not specialized: the step that freezes a tile (1) must run the kernel compiled for the
# plain steps (0), or its first call would compile inside a CUDA-graph capture.
@triton.jit(do_not_specialize=["FROZEN"])
def _append_tail_kernel(
    tk_ptr, tv_ptr, t_sb, t_sh, t_sn, t_sd, R_CAP,
    k_ptr, k_sb, k_sh, k_sn, k_sd, v_ptr, v_sb, v_sh, v_sn, v_sd,
    len_ptr, B, HK, Q, FROZEN, G,
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program a row: it reads the row's lengths before it writes them, and no other program
    # touches that row.
    b = tl.program_id(0).to(tl.int64)
    count = tl.load(len_ptr + B + b)
    start = tl.load(len_ptr + 2 * B + b) - FROZEN * G
    n = HK * Q * D
    for off in range(0, n, BLOCK):
        i = off + tl.arange(0, BLOCK)
        d = i % D
        t = (i // D) % Q
        h = i // (Q * D)
        pos = start + t
        # A position outside the buffer is never written (the host sizes the tail from its own
        # lengths, which the device's equal; a write past the end would corrupt another buffer).
        ok = (i < n) & (pos >= 0) & (pos < R_CAP)
        dst = b * t_sb + h * t_sh + pos.to(tl.int64) * t_sn + d * t_sd
        k = tl.load(k_ptr + b * k_sb + h * k_sh + t * k_sn + d * k_sd, mask=ok)
        v = tl.load(v_ptr + b * v_sb + h * v_sh + t * v_sn + d * v_sd, mask=ok)
        tl.store(tk_ptr + dst, k.to(tk_ptr.dtype.element_ty), mask=ok)
        tl.store(tv_ptr + dst, v.to(tv_ptr.dtype.element_ty), mask=ok)
    tl.store(len_ptr + B + b, count + FROZEN)
    tl.store(len_ptr + 2 * B + b, start + Q)


def append_tail(tail_k: torch.Tensor, tail_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                lengths: torch.Tensor, frozen: int, tile: int) -> None:
    """Write ``k``, ``v`` ``[B, Hk, q, D]`` into ``tail_k``, ``tail_v`` ``[B, Hk, R, D]`` in place.

    ``lengths``: ``int32 [3, B]`` on the device (sink lengths, tile counts, tail lengths; row 0 is
    not read). ``frozen`` complete tiles (``tile`` tokens each) leave the front of every row's
    tail in this update: row ``b``'s tokens go to positions ``lengths[2, b] - frozen * tile + i``,
    then ``lengths[1, b] += frozen`` and ``lengths[2, b] += q - frozen * tile``. Moving the tail's
    remaining tokens to the front (after a multi-token update) is the caller's. The caller also
    sizes the tail: a position outside ``[0, R)`` is not written.
    """
    check_device(tail_k, tail_v, k, v, lengths)
    b, hk, q, d = k.shape
    if v.shape != k.shape or tail_k.shape != tail_v.shape or tail_k.shape[:2] != (b, hk) or tail_k.shape[3] != d:
        raise ValueError(f"append_tail: k, v must be [B, Hk, q, D] and the tails [B, Hk, R, D] alike, got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, tails {tuple(tail_k.shape)}, {tuple(tail_v.shape)}")
    if tail_k.stride() != tail_v.stride():
        raise ValueError(f"append_tail: tail_k and tail_v must have the same strides, got {tail_k.stride()} "
                         f"and {tail_v.stride()}")
    if lengths.dtype != torch.int32 or tuple(lengths.shape) != (3, b) or not lengths.is_contiguous():
        raise ValueError(f"append_tail: lengths must be contiguous int32 [3, {b}], got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if frozen < 0:
        raise ValueError(f"append_tail: frozen must be a tile count >= 0, got {frozen}")
    if b == 0:
        return
    _append_tail_kernel[(b,)](
        tail_k, tail_v, *tail_k.stride(), tail_k.shape[2],
        k, *k.stride(), v, *v.stride(),
        lengths, b, hk, q, frozen, tile,
        D=d, BLOCK=BLOCK, num_warps=4,
    )


__all__ = ["append_tail"]
