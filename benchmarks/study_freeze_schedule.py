"""Study: where a decode step's freeze runs, and how much of the GPU its encodes take (issue 12).

On the ``bench_e2e`` model (random-weight Llama-3.1-8B shape, fp16, ``kvarn_graph`` caches, CUDA
graphs), the excess of the fill step (its token completes a tile) and of the flush step (it freezes
the tile) over the median step, for freeze schedules that ``decode_greedy`` chooses internally
(``kvarn.integrations.freeze_schedule``: ``early_layers`` and ``beside_programs``; this script replaces them,
which no user code should do):

- ``early``: how many of the 32 layers start their encodes in the fill step ("all": every layer,
  the schedule before session 14; a number; default: decode_greedy's own choice);
- ``programs``: the encoder's programs for K and for V per launch (None: one per tile, 128 at
  batch 16; default: decode_greedy's, a quarter of the SMs);
- ``options``: the side-stream encodes' warps and register cap (None: the launch's own,
  ``kvarn.kernels.encode._launch_options``), or ``split_norot``'s rotation off (timing only);
- ``spin``: no encoder at all: each side-stream encode launch is replaced by a kernel of P programs
  at 8 warps that holds its SMs for T µs and writes nothing (the tiles are not encoded, so the
  tokens are meaningless: timing only). What the step pays for SMs held for a time, whatever runs
  on them, against what it pays for the encoder's launches. ``spin_pP_tT``: each program holds
  three fp32 tiles in registers, the encoder's footprint (one program fills an SM's register
  file); ``spin1_pP_tT``: one tile, about half the registers (two programs can share an SM, and
  small kernels fit beside one; :func:`_spin_kernel`); ``fork_only``: no kernel at all, the
  side stream's forks and joins alone; ``<schedule>_stamped``: the GPU's clock stamped before
  and after each side-stream launch, which gives each launch's window beside the step (the last
  freeze's replays, no profiler: :func:`windows`); ``<schedule>_gN``: the encodes of N layers
  started together, with one fork of the side stream and one wait (``freeze_schedule.fork_group``);
  ``<schedule>_preT`` / ``_postT``: a one-warp launch that waits T µs before (after) each side-stream
  launch; ``split_rowsR``: each side-stream encode as R launches over parts of the batch's rows,
  the lead-in ahead of each; ``<schedule>_nolead``: without ``freeze_schedule.lead_in``'s empty launch after each fork
  (the schedule before session 31); ``stand_<kind>_pP``: each side-stream encode replaced by
  ``study_encode_partitions``' Gluon kernels on the launch's own tiles, rotated first by a Triton
  pass into an fp32 scratch (timing only, like the spins: what an encoder of two 4-warp
  partitions a program would cost the step); ``split_greenN``: the side stream made a stream of a
  CUDA green context of N SMs (``freeze_schedule.side_stream``), the encodes N programs for K and
  N for V at 4 warps, so that two programs share each of its SMs (alone, two 4-warp programs an
  SM take about half the SM-time a tile of one program an SM: BENCHMARKS.md, sessions 22 and 30),
  where on a plain stream the block scheduler gives each program an SM of its own (``_w8``: 8
  warps, one program an SM, N / 2 programs each); the run's JSON has each green context's
  ``confined`` check (eager and captured: does a launch on its stream stay on its N SMs?);
- ``priority``: the captured step's stream at a higher priority than the side stream, with
  ``CUDA_GRAPHS_USE_NODE_PRIORITY=1`` (set by this script when a schedule asks for it) so that
  graph replays keep the captured streams' priorities: the block scheduler then dispatches the
  step's blocks before the encoder's (measured: no gain beyond the spread of runs; BENCHMARKS.md).

Each schedule is one ``bench_e2e.run_one`` with ``--new`` tokens (400: three tile completions, the
first also captures the graphs and is not reported). Steps are single replays, so a figure moves by
about a percent between runs and more between machines: compare rows of one run. With ``--device
cpu --shape tiny --contexts 300 --batch 2 --new 100`` it runs at toy sizes (kernels under triton's
interpreter, about four minutes a schedule) to check the script, not to measure.

    PYTHONPATH=. python benchmarks/study_freeze_schedule.py --out benchmarks/results/freeze_schedule_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DEFAULT = "default"
W4, W16, R128 = {"num_warps": 4}, {"num_warps": 16}, {"num_warps": 8, "max_registers": 128}
SCHEDULES = {  # name: (early layers, programs, launch options, step stream priority)
    "one_step": ("all", None, None, False),
    "one_step_p33": ("all", 33, None, False),
    "split_uncapped": (DEFAULT, None, None, False),
    "split_p16": (DEFAULT, 16, None, False),
    "split": (DEFAULT, DEFAULT, None, False),
    "split_p20": (DEFAULT, 20, None, False),
    "split_p24": (DEFAULT, 24, None, False),  # p20 .. p28: session 22's grid (BENCHMARKS.md)
    "split_p26": (DEFAULT, 26, None, False),
    "split_p28": (DEFAULT, 28, None, False),
    "split_p44": (DEFAULT, 44, None, False),
    "split_p66": (DEFAULT, 66, None, False),
    "split_r128": (DEFAULT, DEFAULT, R128, False),
    "split_w4": (DEFAULT, DEFAULT, W4, False),
    "split_p66_w4": (DEFAULT, 66, W4, False),
    "split_w16": (DEFAULT, DEFAULT, W16, False),
    "split_p16_w16": (DEFAULT, 16, W16, False),
    "split_p66_w16": (DEFAULT, 66, W16, False),
    "split_e2": (2, DEFAULT, None, False),
    "split_e3": (3, DEFAULT, None, False),
    "split_e4": (4, DEFAULT, None, False),
    "split_e5": (5, DEFAULT, None, False),
    "split_e6": (6, DEFAULT, None, False),
    "split_e6_p44": (6, 44, None, False),
    "split_e8": (8, DEFAULT, None, False),
    "split_e10": (10, DEFAULT, None, False),
    "split_e12": (12, DEFAULT, None, False),  # e5 .. e16: session 21's share study (BENCHMARKS.md)
    "split_e14": (14, DEFAULT, None, False),
    "split_e16": (16, DEFAULT, None, False),
    "split_e8_p24": (8, 24, None, False),
    "split_e8_p44": (8, 44, None, False),
    "split_prio": (DEFAULT, DEFAULT, None, True),
    "split_r128_prio": (DEFAULT, DEFAULT, R128, True),
    "split_uncapped_prio": (DEFAULT, None, None, True),
    "split_uncapped_w4_prio": (DEFAULT, None, W4, True),
    # The side-stream encodes without their rotation (the tail's model-frame tiles taken as rotated:
    # timing only, the tokens are meaningless): what the step would pay if the tail were rotated
    # before the freeze (at the append).
    "split_norot": (DEFAULT, DEFAULT, {"rotate": None}, False),
    "one_step_prio": ("all", None, None, True),
    "one_step_w4_prio": ("all", None, W4, True),
}
SPINS = {  # name: (programs in all, µs each holds its SM, three tiles); otherwise the default split
    f"spin{'' if three else '1'}_p{p}_t{t}": (p, t, three) for three in (True, False)
    for p, t in ((66, 1), (66, 55), (66, 110), (66, 165), (66, 220), (66, 330), (66, 440), (33, 220),
                 (132, 55), (1, 1))
}
SPINS["fork_only"] = (0, 0, False)  # the side stream's forks and joins with no kernel on it
SCHEDULES.update({name: (DEFAULT, DEFAULT, None, False) for name in SPINS})
# "stand_<kind>_pP": each side-stream encode launch replaced by study_encode_partitions' kernels on
# the launch's own tiles (K and V), rotated first by a Triton pass into an fp32 scratch
# (:func:`_rotate_kernel`; "_norot": that pass left out): "parts", P programs of two 4-warp
# warp_specialize partitions; "one4", P programs of one 4-warp encode. A stand-in for a Gluon
# encoder beside the step, timing only: its codes go to a scratch (the tokens are meaningless), and
# both K and V are packed at the preset's key bits (the kernels take one width).
STANDS = {f"stand_{kind}_p{p}{'' if rot else '_norot'}": (kind, p, rot)
          for kind, p, rot in (("parts", 33, True), ("parts", 66, True), ("parts", 33, False),
                               ("one4", 66, True), ("one4", 132, True), ("one4", 66, False))}
SCHEDULES.update({name: (DEFAULT, DEFAULT, None, False) for name in STANDS})
# "<schedule>_gN": the same with the encodes of N layers started together, one fork of the side
# stream and one wait of the step's stream for them (freeze_schedule.fork_group; the default is 1).
GROUPS = {f"{name}_g{g}": (name, g) for name in ("split", "fork_only", "spin1_p1_t1") for g in (2, 4, 8)}
SCHEDULES.update({name: SCHEDULES[base] for name, (base, _) in GROUPS.items()})
# "<schedule>_preT" / "_postT": a one-warp kernel on the side stream before (after) each encode (or
# spin) launch that waits T µs on the GPU's clock (T 0: it only writes the clock, as a stamp does).
# Session 31 found the _stamped schedules cheaper than their plain ones (the encodes' start a
# launch later beside the step's next GEMM): these split the stamps' two launches and try a
# longer start delay.
DELAYS = {f"{name}_{where}{t}": (name, where, t)
          for name, where, t in [("split", "pre", t) for t in (0, 3, 6, 12, 24, 48)]
          + [("split", "post", 0), ("split_p44", "pre", 0), ("split_p66", "pre", 0), ("split_p66", "pre", 6),
             ("split_p24", "pre", 0), ("spin_p66_t220", "pre", 0), ("spin_p66_t220", "pre", 12)]}
SCHEDULES.update({name: SCHEDULES[base] for name, (base, _, _) in DELAYS.items()})
# "split_rowsR": each side-stream encode launch made R launches, one for each R-th of the batch's
# rows (the same tiles into the same slots: the same bits), lead_in's empty launch ahead of each,
# so that between rounds the step's pending GEMM blocks place theirs before the encodes take SMs
# again (session 31's lead-in at every tile round instead of once a fork); "_prio": with the
# step's stream at the higher priority, as "split_prio".
ROWS = {f"split_rows{r}": r for r in (2, 4, 8)}
SCHEDULES.update({name: (DEFAULT, DEFAULT, None, False) for name in ROWS})
ROWS["split_rows4_prio"] = 4
SCHEDULES["split_rows4_prio"] = (DEFAULT, DEFAULT, None, True)
# "split_greenN": the side stream on a green context of N SMs, 4-warp encodes, N programs each for
# K and V (two an SM); "_w8": 8 warps, N / 2 programs each (one an SM); "_pP": P programs each at 4
# warps (128 at batch 16: one a tile, no program loops). name: (SMs, programs, options).
GREEN = {f"split_green{n}": (n, n, W4) for n in (32, 40, 48, 64)}
GREEN.update({f"split_green{n}_w8": (n, n // 2, None) for n in (48, 64)})
GREEN["split_green64_p128"] = (64, 128, W4)
SCHEDULES.update({name: (DEFAULT, p, opts, False) for name, (_, p, opts) in GREEN.items()})
# "<schedule>_stamped": the same, with the GPU's clock stamped on the side stream before and after
# each encode (or spin) launch, so that the row gives each launch's window beside the step in the
# last freeze's replays, without a profiler (two one-thread launches more per encode).
STAMPED = {f"{name}_stamped": name for name in ("split", "spin_p66_t220", "spin1_p66_t220", "spin_p33_t220",
                                                "split_green48", "split_green64", "split_green64_p128")}
SCHEDULES.update({name: SCHEDULES[base] for name, base in STAMPED.items()})
# "<schedule>_nolead": without freeze_schedule.lead_in's empty launch ahead of the side stream's
# encodes (the schedule before session 31).
NOLEAD = {f"{name}_nolead": name for name in ("split", "split_stamped", "split_pre0", "spin_p66_t220")}
SCHEDULES.update({name: SCHEDULES[base] for name, base in NOLEAD.items()})

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--contexts", nargs="+", type=int, default=[32768])
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--presets", nargs="+", default=["k4v2_g128"])
ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
ap.add_argument("--repeats", type=int, default=1, help="passes over the schedules (rows of one run vary)")
ap.add_argument("--new", type=int, default=400)
ap.add_argument("--out", default="benchmarks/results/freeze_schedule.json")
ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                help="cpu: toy sizes under triton's interpreter (--shape tiny), to check the script")
ap.add_argument("--shape", default="llama8b", choices=["llama8b", "tiny"])
ARGS = ap.parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
if ARGS is not None and any(SCHEDULES[n][3] for n in ARGS.schedules):
    os.environ.setdefault("CUDA_GRAPHS_USE_NODE_PRIORITY", "1")  # before CUDA starts

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import globaltimer  # noqa: E402

import bench_e2e as be  # noqa: E402
from kvarn import kernels  # noqa: E402
from kvarn.integrations import hf_attention, hf_graph  # noqa: E402
from kvarn.kernels.encode import _field_offset, _frame_rows, _load_tile  # noqa: E402

try:  # the schedule's choices (this tree)
    from kvarn.integrations import freeze_schedule as SCHED  # noqa: E402
    HOOKS = {"early": "early_layers", "programs": "beside_programs", "group": "fork_group"}
except ImportError:  # an older tree (the A/B comparisons): hf_graph's own functions
    SCHED = hf_graph
    HOOKS = {"early": "_early_layers", "programs": "_beside_programs", "group": "_fork_group"}


def schedule(early, programs, options=None, priority=False, spin=None, stamp=False, group=None,
             stand=None, delay=None, lead=True, rows=None, green=None) -> None:
    """Set decode_greedy's choices (restored to its own by DEFAULT, None, False)."""
    ROUNDS[0] = rows
    if green is not None:  # the green context and its check, outside any capture
        stream = _green_stream(green)
        SCHED.side_stream = lambda device: stream
    elif OWN_SIDE is not None:
        SCHED.side_stream = OWN_SIDE
    if OWN_LEAD is not None:  # a tree before session 31 has no lead-in launch
        SCHED.lead_in = OWN_LEAD if lead else (lambda device: None)
    elif not lead:
        raise ValueError("the _nolead schedules need a kvarn with freeze_schedule.lead_in")
    if early == "all":
        setattr(SCHED, HOOKS["early"], lambda layers: len(layers))
    elif isinstance(early, int):
        setattr(SCHED, HOOKS["early"], lambda layers: min(early, len(layers)))
    else:
        setattr(SCHED, HOOKS["early"], OWN[0])
    if programs == DEFAULT:
        setattr(SCHED, HOOKS["programs"], OWN[1])
    else:
        setattr(SCHED, HOOKS["programs"], lambda device: programs or 1 << 30)
    if OWN[2] is not None:  # a tree before the fork groups (the cast study) has no such hook
        setattr(SCHED, HOOKS["group"], OWN[2] if group is None else (lambda layers: group))
    elif group is not None:
        raise ValueError("the _gN schedules need a kvarn with fork groups (freeze_schedule.fork_group)")
    BESIDE_OPTIONS.clear()
    BESIDE_OPTIONS.update(options or {})
    STEP_PRIORITY[0] = priority
    SPIN[0] = spin
    STAMP[0] = stamp
    if stand is not None:  # the scratches and the kernels' compilation, outside any capture
        _stand_setup()
    STAND[0] = stand
    if spin is not None:  # the scratch output and the kernel's compilation, outside any capture
        if SPIN_OUT[0] is None:
            SPIN_OUT[0] = torch.empty(max(v[0] for v in SPINS.values()), device="cuda")
        _spin(*spin)
        torch.cuda.synchronize()
    DELAY[0] = delay
    if delay is not None:  # the wait's scratch and compilation, outside any capture
        if DELAY_OUT[0] is None:
            DELAY_OUT[0] = torch.zeros(1, dtype=torch.int64, device="cuda")
        _delay()
        torch.cuda.synchronize()
    if stamp:  # the same for the stamps: a fresh buffer, one slot per launch in the run's order
        STAMPS[0] = torch.zeros(STAMP_SLOTS, dtype=torch.int64, device="cuda")
        STAMPS[1] = 0
        _stamp_kernel[(1,)](STAMPS[0], 0, num_warps=1)  # the launch _stamp makes (i is not specialized)
        STAMPS[0].zero_()
        torch.cuda.synchronize()


def _green_stream(sms: int) -> torch.cuda.Stream:
    """A stream of a CUDA green context of ``sms`` SMs (made once per count, kept alive), with
    :func:`_confined`'s check of it in ``GREEN_CHECKS``."""
    if OWN_SIDE is None:
        raise ValueError("the split_greenN schedules need a kvarn with freeze_schedule.side_stream")
    if sms not in GREEN_CTX:
        from torch.cuda.green_contexts import GreenContext

        ctx = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
        stream = ctx.Stream()  # torch 2.11 and later
        GREEN_CTX[sms] = (ctx, stream)
        GREEN_CHECKS[sms] = _confined(stream, sms)
        print(json.dumps({"green_context": sms, **GREEN_CHECKS[sms]}), flush=True)
    return GREEN_CTX[sms][1]


def _confined(stream: torch.cuda.Stream, sms: int, us: float = 200.0) -> dict:
    """Whether launches on ``stream`` stay on ``sms`` SMs: 2 x sms spin programs that fill an SM
    each and hold it ``us`` µs take about two windows there and one on the whole GPU (more SMs
    than 2 x sms), eagerly and replayed from a graph captured on a plain stream that forks to
    ``stream`` (as decode_greedy's steps do)."""
    out = torch.empty(2 * sms, device="cuda")

    def launch(s):  # forked from the current stream (the capture's, in the graph) and joined back
        origin = torch.cuda.current_stream()
        s.wait_stream(origin)
        with torch.cuda.stream(s):
            _spin_kernel[(2 * sms,)](out, NS=int(us * 1000), THREE=True, num_warps=8)
        origin.wait_stream(s)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        fn()
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1) * 1000 / us  # in windows

    plain = torch.cuda.Stream()
    windows_plain = timed(lambda: launch(plain))  # first: the kernel compiled outside the capture
    cap = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=cap):
        launch(stream)
    return {"windows_plain_stream": windows_plain, "windows_green_eager": timed(lambda: launch(stream)),
            "windows_green_graph": timed(graph.replay)}


def _spin(programs: int, us: float, three: bool) -> None:
    if programs:  # fork_only: no kernel
        _spin_kernel[(programs,)](SPIN_OUT[0], NS=int(us * 1000), THREE=three, num_warps=8)


@triton.jit(do_not_specialize=["i"])
def _stamp_kernel(buf_ptr, i, NS: tl.constexpr = 0):
    """buf[i] = the GPU's clock (ns), from one thread: when the launches queued before it on its
    stream are done, or NS ns after that (the _preT / _postT schedules' wait)."""
    t = globaltimer()
    if NS > 0:
        t0 = t
        while t - t0 < NS:
            t = globaltimer()
    tl.store(buf_ptr + i, t)


def _stamp() -> None:
    if STAMPS[1] >= STAMP_SLOTS:
        raise RuntimeError(f"more than {STAMP_SLOTS} stamped launches in one run")
    _stamp_kernel[(1,)](STAMPS[0], STAMPS[1], num_warps=1)
    STAMPS[1] += 1


def _delay() -> None:
    _stamp_kernel[(1,)](DELAY_OUT[0], 0, NS=int(DELAY[0][1] * 1000), num_warps=1)


def windows(stamps: list[int], step_ms: float) -> list[float]:
    """Each stamped launch's window (µs, its end stamp minus its start stamp) in the last freeze's
    replays: graph replays rewrite their launches' slots, so those are the slots with the latest
    clocks (within two steps of the last stamp); the eager steps' slots keep older ones."""
    pairs = [(stamps[i], stamps[i + 1]) for i in range(0, len(stamps) - 1, 2) if stamps[i] and stamps[i + 1]]
    if not pairs:
        return []
    last = max(end for _, end in pairs)
    return [(end - start) / 1000 for start, end in sorted(pairs) if last - start < 2.5 * step_ms * 1e6]


@triton.jit
def _spin_kernel(out_ptr, NS: tl.constexpr, THREE: tl.constexpr):
    """Hold an SM for NS ns with 128 x 128 fp32 tiles live in registers across a wait on the clock.

    THREE: three tiles, 253 registers a thread at 8 warps (triton 3.6 for sm_90, compiled offline;
    the encoder's launch beside the step: 214 under ncu), so that, like an encoder program, one
    program fills its SM's register file (no second program, no GEMM block, and almost no small
    kernel beside it). Else one tile, 128 registers: no GEMM block beside it either, but two
    programs can share an SM, and small kernels fit beside one. (Triton 3.9 compiles the two to
    201 and 80 registers: the counts are the compiler's, so check them with the device's triton.)
    """
    rows = tl.arange(0, 128)
    x = (rows[:, None] * 128 + rows[None, :]).to(tl.float32) * tl.program_id(0).to(tl.float32)
    y = x + 1.0
    z = x * 3.0
    t0 = globaltimer()
    t = t0
    while t - t0 < NS:
        t = globaltimer()
        x = x * 0.5 + 1.0
        if THREE:
            x = x + y
            y = y * 0.25 + z
            z = z * 0.125 + x
    total = tl.sum(tl.sum(x + y + z if THREE else x, axis=1), axis=0)
    tl.store(out_ptr + tl.program_id(0), total + (t - t0).to(tl.float32))


@triton.jit
def _rotate_kernel(k_ptr, k_s0, k_s1, k_s2, k_sr, k_sc, v_ptr, v_s0, v_s1, v_s2, v_sr, v_sc, out_ptr, N1, N2,
                   n_tiles, inv_sqrt_d, D: tl.constexpr, G: tl.constexpr):
    """The stand-ins' rotation: tile ``t`` of K (``[D, G]``) to ``out[t]`` and of V (``[G, D]``) to
    ``out[n_tiles + t]``, fp32 in the rotated frame, as the encoder rotates them in its kernel."""
    tile = tl.program_id(0)
    kv = tl.program_id(1)
    i2 = tile % N2
    i1 = (tile // N2) % N1
    i0 = tile // (N1 * N2)
    if kv == 0:
        off = _field_offset(i0, i1, i2, k_s0, k_s1, k_s2)
        x = tl.trans(_frame_rows(_load_tile(k_ptr, off, k_sc, k_sr, G, D), True, D, inv_sqrt_d))
        rows = tl.arange(0, D)
        cols = tl.arange(0, G)
        dst = out_ptr + tile.to(tl.int64) * D * G + rows[:, None] * G + cols[None, :]
    else:
        off = _field_offset(i0, i1, i2, v_s0, v_s1, v_s2)
        x = _frame_rows(_load_tile(v_ptr, off, v_sr, v_sc, G, D), True, D, inv_sqrt_d)
        rows = tl.arange(0, G)
        cols = tl.arange(0, D)
        dst = out_ptr + (n_tiles + tile).to(tl.int64) * D * G + rows[:, None] * D + cols[None, :]
    tl.store(dst, x)


def _stand_setup() -> None:
    """Scratches for a B 16 llama8b launch (8 KV heads, one tile each, K and V) and one warm-up
    launch of each kernel on a tail of that shape (the compilations, outside any capture); once a
    run, as the spins' scratch."""
    if STAND_BUF:
        return
    import study_encode_partitions as ep  # Gluon (triton 3.6 on the GPU): only the stand-ins need it
    STAND_KERNELS.update(parts=ep._gluon_kernel, one4=ep._one_kernel)
    n = 2 * ARGS.batch * 8
    STAND_BUF.update(x=torch.randn(n, 128, 128, device="cuda"),
                     out=(torch.empty(n, 128 // 2, 128, dtype=torch.uint8, device="cuda"),
                          *(torch.empty(n, 128, dtype=torch.float16, device="cuda") for _ in range(3)),
                          torch.zeros(1, dtype=torch.int32, device="cuda")))
    tail = torch.randn(ARGS.batch, 8, 128, 128, dtype=torch.float16, device="cuda")
    k = tail.reshape(ARGS.batch, 8, 1, 128, 128).transpose(-1, -2)
    for kind in STAND_KERNELS:  # every kernel and width the stand-ins launch (the rotation pass too)
        STAND[0] = (kind, 1, True)
        for bits in (2, 4):
            _stand(k, tail.reshape(ARGS.batch, 8, 1, 128, 128), bits)
    torch.cuda.synchronize()


def _stand(k: torch.Tensor, v: torch.Tensor, bits: int) -> None:
    """The stand-in for one side-stream encode launch of tiles ``k [b, h, n, D, G]``, ``v [b, h, n, G, D]``."""
    kind, programs, rot = STAND[0]
    b, h, n, d, g = k.shape
    tiles = b * h * n
    x = STAND_BUF["x"]
    if 2 * tiles > x.shape[0] or d != 128 or g != 128:
        raise ValueError(f"a stand-in takes at most {x.shape[0] // 2} tiles of 128 x 128, got {tiles} of {d} x {g}")
    if rot:
        _rotate_kernel[(tiles, 2)](k, *k.stride()[:3], k.stride(-2), k.stride(-1), v, *v.stride()[:3],
                                   v.stride(-2), v.stride(-1), x, h, n, tiles, 1.0 / d ** 0.5, D=d, G=g,
                                   num_warps=4)
    STAND_KERNELS[kind][(programs,)](x, *STAND_BUF["out"], 2 * tiles, 128, 128, bits, 8, True,
                                     num_warps=4)


def _encode_tiles(*args, programs=None, **kwargs):
    """kernels.encode_tiles with the schedule's launch options for side-stream (capped) encodes."""
    if programs is not None and STAMP[0]:
        _stamp()
    if programs is not None and DELAY[0] is not None and DELAY[0][0] == "pre":
        _delay()
    if programs is not None and (STAND[0] is not None or SPIN[0] is not None):
        out = kwargs.get("out", args[3] if len(args) > 3 else None)
        if out is None:  # the cache's flush passes its record fields; nothing else is replaced
            raise ValueError("a spin or stand-in schedule replaces encodes that write into given fields only")
        if STAND[0] is not None:
            _stand(args[0], args[1], args[2].key_bits)
        else:
            _spin(*SPIN[0])
    elif programs is not None and ROUNDS[0]:
        out = _encode_rounds(*args, programs=programs, **kwargs)
    else:
        if programs is not None:
            kwargs.update(BESIDE_OPTIONS)
        out = OWN_ENCODE(*args, programs=programs, **kwargs)
    if programs is not None and DELAY[0] is not None and DELAY[0][0] == "post":
        _delay()
    if programs is not None and STAMP[0]:
        _stamp()
    return out


def _encode_rounds(k, v, config, out=None, *, programs, **kwargs):
    """One side-stream encode as ``ROUNDS[0]`` launches over equal parts of the batch's rows (the
    cache's flush passes its fields and a slot), the schedule's lead-in ahead of each but the first
    (the fork's own is ahead of that one): the same tiles into the same slots."""
    rounds, b = ROUNDS[0], k.shape[0]
    if out is None:
        raise ValueError("a rows schedule splits the cache's flush, which passes its fields; got no fields")
    if b % rounds:
        raise ValueError(f"a rows schedule splits the batch's {b} rows into {rounds} equal parts; "
                         f"{b} is not a multiple of {rounds}")
    part = b // rounds
    kwargs.update(BESIDE_OPTIONS)
    for lo in range(0, b, part):
        if lo:
            SCHED.lead_in(k.device)
        rows = slice(lo, lo + part)
        kw = {key: tuple(x[rows] for x in val) if key in ("normalize", "rotate") and isinstance(val, tuple) else val
              for key, val in kwargs.items()}
        OWN_ENCODE(k[rows], v[rows], config, out.map(lambda x: x[rows]), programs=programs, **kw)
    return out


def _graphs_init(self, *args, **kwargs):
    """hf_graph._Graphs with its capture stream at the highest priority when the schedule asks."""
    OWN_GRAPHS_INIT(self, *args, **kwargs)
    if STEP_PRIORITY[0] and self.stream is not None:
        self.stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])


def main(a) -> None:
    if a.repeats < 1:
        sys.exit(f"--repeats {a.repeats}: give at least 1 pass over the schedules")
    own_kernels = (n in SPINS or n in STANDS or n in STAMPED or n in DELAYS or n in ROWS or n in GREEN
                   or GROUPS.get(n, ("",))[0] in SPINS for n in (NOLEAD.get(m, m) for m in a.schedules))
    if a.device == "cpu" and any(own_kernels):
        sys.exit("the spin, stand, fork_only, _stamped, _pre / _post, rows and green schedules run on the GPU only: "
                 "--device cuda only")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device (use --device cpu --shape tiny for a check)")
    torch.manual_seed(0)
    hf_attention.register()
    model = be.build_model(a.shape, a.device)
    meta = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "args": vars(a)}
    rows = []
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    for ctx in a.contexts:
        for preset in a.presets:
            for name in [n for _ in range(a.repeats) for n in a.schedules]:
                lead = name not in NOLEAD
                name_ = NOLEAD.get(name, name)
                base, group = GROUPS.get(name_, (STAMPED.get(name_, name_), None))
                base = DELAYS[name_][0] if name_ in DELAYS else base
                schedule(*SCHEDULES[name], spin=SPINS.get(base), stamp=name_ in STAMPED, group=group,
                         stand=STANDS.get(name_), delay=DELAYS[name_][1:] if name_ in DELAYS else None,
                         lead=lead, rows=ROWS.get(name_), green=GREEN.get(base, (None,))[0])
                t0 = time.time()
                r = be.run_one(model, f"kvarn_graph:{preset}", a.batch, ctx, a.new, 4096, a.device)
                gaps, step = r["gaps_ms"], r["step_ms"]
                done = r.get("flush_steps", [])[1:]  # the first freeze also captured its graphs
                fill = [gaps[i - 2] / step - 1 for i in done]
                flush = [gaps[i - 1] / step - 1 for i in done]
                row = dict(schedule=name, context=ctx, batch=a.batch, preset=preset, step_ms=step,
                           fill_over=fill, flush_over=flush, worst=max(fill + flush, default=None),
                           seconds=time.time() - t0)
                if name_ in STAMPED:
                    w = windows(STAMPS[0][: STAMPS[1]].tolist(), step)
                    row.update(windows_us=w, window_median_us=float(np.median(w)) if w else None)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if GREEN_CHECKS:
                    meta["green_confined"] = {str(k): v for k, v in GREEN_CHECKS.items()}
                with open(a.out, "w") as fh:
                    json.dump({**meta, "rows": rows}, fh, indent=1)
    schedule(DEFAULT, DEFAULT)
    print(f"step stream priorities {torch.cuda.Stream.priority_range() if a.device == 'cuda' else None}, "
          f"CUDA_GRAPHS_USE_NODE_PRIORITY={os.environ.get('CUDA_GRAPHS_USE_NODE_PRIORITY')}")
    print("| context x B | preset | schedule | median step ms | fill step | flush step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        pct = lambda xs: " / ".join(f"{x:+.1%}" for x in xs)  # noqa: E731
        w = r.get("windows_us")
        win = f" (windows: {len(w)}, median {r['window_median_us']:.0f} µs)" if w else ""
        print(f"| {r['context']} x {r['batch']} | {r['preset']} | {r['schedule']}{win} | {r['step_ms']:.2f} "
              f"| {pct(r['fill_over'])} | {pct(r['flush_over'])} |")


OWN = [getattr(SCHED, HOOKS[k], None) for k in ("early", "programs", "group")]  # decode_greedy's own
OWN_LEAD = getattr(SCHED, "lead_in", None)
OWN_SIDE = getattr(SCHED, "side_stream", None)
GREEN_CTX: dict = {}  # SMs: (the green context, its stream), made by _green_stream
GREEN_CHECKS: dict = {}  # SMs: _confined's figures
OWN_ENCODE, OWN_GRAPHS_INIT = kernels.encode_tiles, hf_graph._Graphs.__init__
BESIDE_OPTIONS: dict = {}
SPIN: list = [None]  # (programs, µs, three tiles) of the spin schedules, else None
SPIN_OUT: list = [None]  # the spin kernel's scratch output (allocated by schedule(), then reused)
STAMP: list = [False]  # the schedule stamps its side-stream launches
STAMPS: list = [None, 0]  # the stamps' buffer (int64 ns), the next slot
STAMP_SLOTS = 1 << 16
STEP_PRIORITY = [False]
ROUNDS: list = [None]  # the split_rowsR schedules' rounds, else None
DELAY: list = [None]  # ("pre" or "post", µs) of the _preT / _postT schedules, else None
DELAY_OUT: list = [None]  # the wait's scratch output (its clock)
STAND: list = [None]  # (kind, programs, rotate) of the stand-in schedules, else None
STAND_BUF: dict = {}  # the stand-ins' fp32 tiles and scratch outputs (allocated by schedule())
STAND_KERNELS: dict = {}
kernels.encode_tiles = _encode_tiles
hf_graph._Graphs.__init__ = _graphs_init

if __name__ == "__main__":
    main(ARGS)
