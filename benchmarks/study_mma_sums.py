"""Study: an encode's SM-time a tile, with one or two tiles a program, sums on FMAs or tensor cores (issue 12)

``study_onepass_sums.py`` showed that the loop's sums may be formed as matrix-vector products of
the fixed tile's fp16 pieces within the twin's tolerance; BENCHMARKS.md (session 21) estimated the
speed and did not pursue it, because a larger program seemed to cost the decode step more. Session
22's ncu of the freeze step (``profile_freeze_launches.py``) showed that an encode program never
shares an SM with the step's GEMM blocks anyway, so what counts is the time a tile holds its SM.
This script measures that time for the loop alone, in three prototypes of one form:

- ``fma``: each iteration's column and row sums (``sum y``, ``sum y^2``, ``y = X w`` and ``X v``)
  as ``tl.sum`` on the FMA pipe, the form of the encoder's loop;
- ``fma, two tiles a program``: the same, on two tiles at once (``[2, N, N]``), so that one program
  has two tiles' independent work in flight, as two programs sharing an SM have;
- ``mma``: the same sums as ``tl.dot`` of the tile's fp16 high / low pieces (``X`` and ``X^2``,
  the tile scaled once to a largest magnitude of 1 by a power of two) against ``[R, 16]`` operands
  built from the scale vectors' pieces (each vector scaled to a largest value of 1 by a power of
  two), the products hi hi, hi lo and lo hi accumulated in fp32.

All run T iterations of the spec's updates (log of the clipped unbiased deviation, the clamps) on
random fp32 tiles with row offsets and scales and write the final log-scales, each launched two
ways: one program a tile (programs share SMs as far as their registers let them), and one program
an SM (a grid of the SMs' count, each program looping over tiles: alone on its SM, as beside the
decode step). The script reports the largest difference of the log-scales against the torch codec's
(the one-pass variance cancels where a mean is large; this is a timing check,
``study_onepass_sums`` is the accuracy study) and the SM-time a tile (the launch's time x SMs /
tiles), next to the whole encoder's (``kernels.encode_tiles``, rotating, one program a tile and 66
each for K and V). The prototypes do not track the best iterate or round: compare them with each
other, not with the encoder.

    PYTHONPATH=. python benchmarks/study_mma_sums.py --out benchmarks/results/mma_sums_h200.json

With ``--device cpu`` it runs 4 small tiles under triton's interpreter, to check the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiles", type=int, default=4096, help="tiles a launch (4096: 16 rows x 8 KV heads x 32 layers)")
ap.add_argument("--size", type=int, default=128, help="the tile's rows and columns (D = G)")
ap.add_argument("--iterations", type=int, default=8)
ap.add_argument("--warps", nargs="+", type=int, default=[4, 8, 16])
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
ap.add_argument("--out", default="benchmarks/results/mma_sums.json")
ARGS = ap.parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvarn.normalize import LOG_MAX, LOG_MIN, STD_MAX, STD_MIN, normalize_iterates  # noqa: E402

LO, HI = tl.constexpr(LOG_MIN), tl.constexpr(LOG_MAX)  # the spec's clamp of the log-scales
VMIN, VMAX = tl.constexpr(STD_MIN ** 2), tl.constexpr(STD_MAX ** 2)  # the clip of the deviation, squared


@triton.jit
def _update(s, lg, s1, s2, n: tl.constexpr):
    """The log-scale after one update from the sums of the scaled tile's line (``s`` the line's own
    scale, ``exp(-lg)``, applied to the sums' squares here): the spec's clip, log and clamp."""
    var = (s2 - s1 * s1 / n) / (n - 1) * s * s
    lg = lg + 0.5 * tl.log(tl.minimum(tl.maximum(var, VMIN), VMAX))
    return tl.minimum(tl.maximum(lg, LO), HI)


@triton.jit
def _loop_fma(x_ptr, a_ptr, b_ptr, tiles, T: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        x = tl.load(x_ptr + t * N * N + i[:, None] * N + i[None, :]).to(tl.float32)
        a = tl.zeros([N], tl.float32)
        b = tl.zeros([N], tl.float32)
        for _ in range(T):
            y = x * tl.exp(-b)[:, None]
            a = _update(tl.exp(-a), a, tl.sum(y, 0), tl.sum(y * y, 0), N)
            y = x * tl.exp(-a)[None, :]
            b = _update(tl.exp(-b), b, tl.sum(y, 1), tl.sum(y * y, 1), N)
        tl.store(a_ptr + t * N + i, a)
        tl.store(b_ptr + t * N + i, b)


@triton.jit
def _loop_fma_pair(x_ptr, a_ptr, b_ptr, tiles, T: tl.constexpr, N: tl.constexpr):
    """``_loop_fma`` on two tiles at once, as a ``[2, N, N]`` block: the same work a tile, with two
    independent reductions in flight in each program (as two programs sharing an SM would have)."""
    i = tl.arange(0, N)
    k = tl.arange(0, 2)
    for t in range(tl.program_id(0), tiles // 2, tl.num_programs(0)):
        base = (2 * t + k)[:, None, None] * N * N
        x = tl.load(x_ptr + base + i[None, :, None] * N + i[None, None, :]).to(tl.float32)
        a = tl.zeros([2, N], tl.float32)
        b = tl.zeros([2, N], tl.float32)
        for _ in range(T):
            y = x * tl.exp(-b)[:, :, None]
            a = _update(tl.exp(-a), a, tl.sum(y, 1), tl.sum(y * y, 1), N)
            y = x * tl.exp(-a)[:, None, :]
            b = _update(tl.exp(-b), b, tl.sum(y, 2), tl.sum(y * y, 2), N)
        out = (2 * t + k)[:, None] * N + i[None, :]
        tl.store(a_ptr + out, a)
        tl.store(b_ptr + out, b)


@triton.jit
def _split(v):
    """``v`` (fp32, at most 1) as its fp16 high and low pieces."""
    h = v.to(tl.float16)
    return h, (v - h.to(tl.float32)).to(tl.float16)


@triton.jit
def _operands(s, j, N: tl.constexpr):
    """The four ``[N, 16]`` right-hand sides for a vector ``s`` (scaled to a largest value of 1):
    column 0 gathers hi x hi + lo x hi, column 1 hi x lo, columns 2 and 3 the same for ``s^2``; with
    the scale that undoes the vector's power of two."""
    e = tl.floor(tl.log2(tl.max(s, 0)))
    s = s * tl.exp2(-e)
    sh, sl = _split(s)
    qh, ql = _split(s * s)
    z = tl.zeros([N, 16], tl.float16)
    hi = tl.where(j == 0, sh[:, None], tl.where(j == 1, sl[:, None], z))  # for X's high piece
    lo = tl.where(j == 0, sh[:, None], z)  # for X's low piece
    hi2 = tl.where(j == 2, qh[:, None], tl.where(j == 3, ql[:, None], z))
    lo2 = tl.where(j == 2, qh[:, None], z)
    return hi, lo, hi2, lo2, tl.exp2(e)


@triton.jit
def _sums(acc, j, unit):
    s1 = tl.sum(tl.where((j == 0) | (j == 1), acc, 0.0), 1) * unit
    s2 = tl.sum(tl.where((j == 2) | (j == 3), acc, 0.0), 1) * unit * unit
    return s1, s2


@triton.jit
def _loop_mma(x_ptr, a_ptr, b_ptr, tiles, T: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    j = tl.arange(0, 16)[None, :]
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        x = tl.load(x_ptr + t * N * N + i[:, None] * N + i[None, :]).to(tl.float32)
        m = tl.max(tl.max(tl.abs(x), 1), 0)
        e = tl.where(m > 0, tl.ceil(tl.log2(m)), 0.0)
        x = x * tl.exp2(-e)  # exact: a power of two, so the pieces keep fp16's range
        unit = tl.exp2(e)
        xh, xl = _split(x)
        qh, ql = _split(x * x)
        a = tl.zeros([N], tl.float32)
        b = tl.zeros([N], tl.float32)
        for _ in range(T):
            hi, lo, hi2, lo2, u = _operands(tl.exp(-b), j, N)
            # the columns' sums as [16, R] x [R, C], so that the pieces are the same operand bytes as
            # in the rows' [R, C] x [C, 16] below (one staged copy, not a transposed second one)
            acc = tl.dot(tl.trans(hi), xh, out_dtype=tl.float32)
            acc = tl.dot(tl.trans(lo), xl, acc)
            acc = tl.dot(tl.trans(hi2), qh, acc)
            acc = tl.dot(tl.trans(lo2), ql, acc)
            s1, s2 = _sums(tl.trans(acc), j, unit * u)
            a = _update(tl.exp(-a), a, s1, s2, N)
            hi, lo, hi2, lo2, u = _operands(tl.exp(-a), j, N)
            acc = tl.dot(xh, hi, out_dtype=tl.float32)
            acc = tl.dot(xl, lo, acc)
            acc = tl.dot(qh, hi2, acc)
            acc = tl.dot(ql, lo2, acc)
            s1, s2 = _sums(acc, j, unit * u)
            b = _update(tl.exp(-b), b, s1, s2, N)
        tl.store(a_ptr + t * N + i, a)
        tl.store(b_ptr + t * N + i, b)


def reference(x: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch codec's last iterate (:func:`kvarn.normalize.normalize_iterates`: float64
    two-pass deviations, float32 log-scales), on the CPU, as float64."""
    a, b, _ = normalize_iterates(x.cpu(), iterations)
    return a[..., -1, :].double(), b[..., -1, :].double()


def tiles(n: int, size: int, device: torch.device) -> torch.Tensor:
    """Random fp32 tiles (as the encoder's rotated tiles are) with row offsets and scales, as keys'
    channels have."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, size, size, generator=g, device=device)
    scale = 1 + 4 * torch.rand(n, size, 1, generator=g, device=device) ** 4
    offset = 2 * torch.randn(n, size, 1, generator=g, device=device)
    return x * scale + offset


def main(a) -> None:
    if a.tiles < 2 or a.tiles % 2:
        sys.exit(f"--tiles {a.tiles}: give an even number, at least 2 (the two-tile prototype takes pairs)")
    if a.size < 16 or a.size & (a.size - 1):
        sys.exit(f"--size {a.size}: give a power of two, at least 16 (tl.dot's smallest operand)")
    if a.iterations < 0:
        sys.exit(f"--iterations {a.iterations}: give 0 or more (the spec's T)")
    dev = torch.device(a.device)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device (use --device cpu for a check)")
    n, size = (4, 32) if a.device == "cpu" else (a.tiles, a.size)
    x = tiles(n, size, dev)
    ref_a, ref_b = reference(x, a.iterations)
    rows = []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if a.device == "cuda" else 2

    def timed(form, warps, programs, run, err=None):
        us = triton.testing.do_bench(run, rep=200, return_mode="median") * 1e3 if a.device == "cuda" else None
        rows.append(dict(form=form, warps=warps, programs=programs, tiles=n, size=size, max_log_scale_err=err,
                         us=us, sm_us_per_tile=us * sms / n if us else None))
        print(json.dumps(rows[-1]), flush=True)

    forms = (("fma", _loop_fma), ("fma, two tiles a program", _loop_fma_pair), ("mma", _loop_mma))
    for (name, kernel), warps, programs in [(f, w, p) for f in forms for w in a.warps for p in (n, sms)]:
        programs = min(programs, n // 2) if kernel is _loop_fma_pair else programs
        la = torch.empty(n, size, device=dev)
        lb = torch.empty(n, size, device=dev)
        run = lambda: kernel[(programs,)](x, la, lb, n, T=a.iterations, N=size, num_warps=warps)  # noqa: E731
        try:
            run()
        except Exception as exc:  # a form that does not compile at these warps is reported, not fatal
            print(f"{name} at {warps} warps: {type(exc).__name__}: {repr(exc.__cause__ or exc)[-300:]}", flush=True)
            continue
        err = max((la.cpu().double() - ref_a).abs().max().item(), (lb.cpu().double() - ref_b).abs().max().item())
        timed(name, warps, programs, run, err)
    if a.device == "cuda":
        from kvarn import kernels
        from kvarn.config import KVarNConfig

        cfg = dataclasses.replace(KVarNConfig.from_name("k4v2_g128"), sinkhorn_iters=a.iterations)
        half = n // 2  # K and V tiles, n in all
        k, v = x[:half].half().transpose(-1, -2), x[half:].half()  # model-frame fp16, rotated in the kernel
        out = kernels.encode_tiles(k, v, cfg, rotate=True)
        for programs in (None, sms // 2):  # one a tile; or capped, K and V each on half the SMs
            timed("encoder (k4v2_g128, rotating, whole)", None, programs or n,
                  lambda: kernels.encode_tiles(k, v, cfg, out=out, rotate=True, programs=programs))
    print(f"| form | warps | programs | tiles | us | SM-us a tile ({sms} SMs) | log-scale error vs the codec |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        t = f"{r['us']:.1f} | {r['sm_us_per_tile']:.1f}" if r["us"] else "- | -"
        e = f"{r['max_log_scale_err']:.1e}" if r["max_log_scale_err"] is not None else "-"
        print(f"| {r['form']} | {r['warps'] or '-'} | {r['programs']} | {r['tiles']} | {t} | {e} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                   "torch": torch.__version__, "triton": triton.__version__, "args": vars(a), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(ARGS)
