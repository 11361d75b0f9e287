"""Study: two independent 4-warp encodes in one program (Gluon warp_specialize) against one an SM (issue 12)

BENCHMARKS.md's session-29 figures: the encoder costs 16.8 SM-us a tile at 4 warps when two
programs share an SM, 28.4 at 8 warps, and 31-40 beside the decode step, where the step's GEMM
blocks leave each encode program alone on its SM. Session 23's two tiles in one 8-warp program
(one set of barriers for both) took 51-56. This study asks whether one program that runs two
*independent* 4-warp partitions (Gluon's ``warp_specialize``: each partition its own warps, its
own named barriers, its own tiles) gets the two-programs-an-SM figure while holding one SM, as a
launch beside the step must.

Both kernels run the same device code, :func:`kvarn.kernels.encode_tile.encode_one` (the
normalization loop, rounding, packing and stores, shared with the cache's encoder), on fp32 tiles
``[n, R, C]`` already in the rotated frame, in the same tile layout (:data:`TILE_LAYOUT`): the
control runs one 4-warp encode a program, the other two 4-warp partitions a program, each taking
every other tile of its program's share. (The rotation is left out: its MMAs need Gluon's explicit
operand layouts, and it is the loop that holds the SM.) Rows: SM-us a tile = the launch's time x
SMs held / tiles, for the control with one program a tile (two share an SM: the form of the 16.8) and
one an SM, and for the partitions with one program an SM and on half the SMs; and the code bytes
and scales of each launch against the first (the same code and layout: they must be equal).

    PYTHONPATH=. python benchmarks/study_encode_partitions.py --out benchmarks/results/encode_partitions_h200.json

``--compile-only`` compiles both kernels for sm_90 without a GPU and prints their registers, spill
stacks and normalization loops (there is no interpreter for Gluon: this is the script's CPU check).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language._semantic import GluonSemantic

from kvarn.kernels.encode_tile import encode_one
from sass_encoder import backward_branches, disassemble

# Triton 3.6's tl.arange and tl.full, called from Gluon code, reach Gluon's builder without a layout
# argument; Gluon's own arange and full default it to the auto layout, which is what the shared
# device code needs (its vectors take their layouts from the tile's reductions).
_arange, _full = GluonSemantic.arange, GluonSemantic.full
GluonSemantic.arange = lambda self, start, end, layout=None: _arange(self, start, end, layout)
GluonSemantic.full = lambda self, shape, value, dtype, layout=None: _full(self, shape, value, dtype, layout)

# The tile's layout in each 4-warp partition: 4 values a thread along a row, 8 threads of a warp
# along the row and 4 down, the warps down the tile. Offline it compiles each partition's
# normalization loop to 1526 instructions without spills, the Triton encoder's 4-warp loop
# (1515-1523); 32 threads along a row spilled (2080, 136-byte stack).
TILE_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))


@triton.jit
def _encode_at(x, t, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, R: tl.constexpr, C: tl.constexpr,
               BITS: tl.constexpr, ITERS: tl.constexpr, ASM: tl.constexpr):
    """Tile ``t`` of the outputs: codes ``[n, C / P, R]``, row scale and zero ``[n, R]``, column
    scale ``[n, C]`` (fp16), min/max ranges, the non-finite check on."""
    t64 = t.to(tl.int64)
    encode_one(x, c_ptr, t64 * R * (C // (8 // BITS)), s_ptr, t64 * R, z_ptr, t64 * R, cs_ptr, t64 * C, bad_ptr,
               True, R, C, BITS, ITERS, True, False, 0, 0, 0, 0, 0.0, 0.0, ASM)


@gluon.jit
def _tiles(x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, first, step, R: gl.constexpr, C: gl.constexpr,
           BITS: gl.constexpr, ITERS: gl.constexpr, ASM: gl.constexpr):
    """Tiles ``first``, ``first + step``, ... in :data:`TILE_LAYOUT`."""
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, TILE_LAYOUT))
    cols = gl.arange(0, C, layout=gl.SliceLayout(0, TILE_LAYOUT))
    for t in range(first, n_tiles, step):
        x = gl.load(x_ptr + t.to(gl.int64) * R * C + rows[:, None] * C + cols[None, :])
        _encode_at(x, t, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, R, C, BITS, ITERS, ASM)


@gluon.jit
def _one_kernel(x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, R: gl.constexpr, C: gl.constexpr,
                BITS: gl.constexpr, ITERS: gl.constexpr, ASM: gl.constexpr):
    """The control: one 4-warp encode a program, the same code and layout as a partition."""
    _tiles(x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, gl.program_id(0), gl.num_programs(0),
           R, C, BITS, ITERS, ASM)


@gluon.jit
def _partition(x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, part, R: gl.constexpr, C: gl.constexpr,
               BITS: gl.constexpr, ITERS: gl.constexpr, ASM: gl.constexpr):
    """Tiles ``2 p + part``, ``2 (p + programs) + part``, ... of program ``p``."""
    _tiles(x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, 2 * gl.program_id(0) + part,
           2 * gl.num_programs(0), R, C, BITS, ITERS, ASM)


@gluon.jit
def _gluon_kernel(x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, R: gl.constexpr, C: gl.constexpr,
                  BITS: gl.constexpr, ITERS: gl.constexpr, ASM: gl.constexpr):
    # The argument tuples are written in the call: a tuple assigned to a name first turns its
    # constants into tensors. The worker's 4 warps ask for all 256 registers (8 warps x 256 = the
    # SM's 64K), as two 4-warp Triton programs at 255 take.
    gl.warp_specialize([
        (_partition, (x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, 0, R, C, BITS, ITERS, ASM)),
        (_partition, (x_ptr, c_ptr, s_ptr, z_ptr, cs_ptr, bad_ptr, n_tiles, 1, R, C, BITS, ITERS, ASM)),
    ], [4], [256])


def _offline(kernel, warps: int, size: int, bits: int, iters: int) -> dict:
    sig = {"x_ptr": "*fp32", "c_ptr": "*u8", "s_ptr": "*fp16", "z_ptr": "*fp16", "cs_ptr": "*fp16",
           "bad_ptr": "*i32", "n_tiles": "i32", "R": "constexpr", "C": "constexpr", "BITS": "constexpr",
           "ITERS": "constexpr", "ASM": "constexpr"}
    consts = {"R": size, "C": size, "BITS": bits, "ITERS": iters, "ASM": True}
    # The run-time specialization: pointers and the tile count divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if sig[name] != "constexpr"}
    compiled = triton.compile(GluonASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    sass = disassemble(compiled)
    loops = backward_branches(sass["ops"])
    leaves = [lh for lh in loops if not any(o != lh and lh[0] <= o[0] and o[1] <= lh[1] for o in loops)]
    bodies = [[op for addr, op, _ in sass["ops"] if lo <= addr <= hi] for lo, hi in leaves]
    return {"registers": sass["registers"], "stack_bytes": sass["stack_bytes"], "instructions": len(sass["ops"]),
            "loops": sorted((len(b) for b in bodies if len(b) > 100), reverse=True),
            "barriers_a_loop": sorted({sum(op.startswith("BAR") for op in b) for b in bodies if len(b) > 100})}


def compile_only(a) -> None:
    print("| kernel | warps in all | registers | spill stack B | normalization loops | barriers a loop |")
    print("|---|---|---|---|---|---|")
    rows = []
    # Both launch with num_warps=4; the partitions' program adds its worker's 4.
    for name, kernel, total in (("one 4-warp encode a program", _one_kernel, 4),
                                ("two 4-warp partitions", _gluon_kernel, 8)):
        r = _offline(kernel, 4, a.size, a.bits, a.iterations)
        rows.append({"kernel": name, "warps_in_all": total, **r})
        print(f"| {name} | {total} | {r['registers']} | {r['stack_bytes']} | {r['loops']} | {r['barriers_a_loop']} |")
    _write(a, rows, "offline, cuda sm_90")


def tiles(n: int, size: int) -> torch.Tensor:
    """Random fp32 tiles with row offsets and scales (as keys' channels have)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, size, size, generator=g, device="cuda")
    return x * (1 + 4 * torch.rand(n, size, 1, generator=g, device="cuda") ** 4) + 2 * torch.randn(
        n, size, 1, generator=g, device="cuda")


def measure(a) -> None:
    n, size, per = a.tiles, a.size, 8 // a.bits
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = tiles(n, size)

    def outputs():
        return (torch.empty(n, size // per, size, dtype=torch.uint8, device="cuda"),
                torch.empty(n, size, dtype=torch.float16, device="cuda"),
                torch.empty(n, size, dtype=torch.float16, device="cuda"),
                torch.empty(n, size, dtype=torch.float16, device="cuda"),
                torch.zeros(1, dtype=torch.int32, device="cuda"))

    ref = outputs()
    _one_kernel[(n,)](x, *ref, n, size, size, a.bits, a.iterations, True, num_warps=4)
    rows = []
    launches = [("one encode a program, one a tile (two programs share an SM)", _one_kernel, n),
                ("one encode a program, one program an SM", _one_kernel, sms),
                ("two partitions a program, one program an SM", _gluon_kernel, sms),
                ("two partitions a program, half the SMs", _gluon_kernel, sms // 2)]
    for name, kernel, programs in launches:
        out = outputs()
        run = lambda: kernel[(programs,)](x, *out, n, size, size, a.bits, a.iterations, True, num_warps=4)  # noqa: E731
        run()
        torch.cuda.synchronize()
        us = triton.testing.do_bench(run, rep=300, return_mode="median") * 1e3
        held = min(programs, sms)
        flips = (out[0] != ref[0]).sum().item()
        scale_err = max((o.float() - r.float()).abs().max().item() for o, r in zip(out[1:4], ref[1:4]))
        rows.append({"launch": name, "programs": programs, "tiles": n,
                     "us": us, "sm_us_per_tile": us * held / n, "code_bytes_differing": flips,
                     "max_scale_diff": scale_err, "nonfinite_flag": int(out[4].item())})
        print(json.dumps(rows[-1]), flush=True)
    print(f"| launch | programs | µs | SM-µs a tile ({sms} SMs held at most) | code bytes unlike the first row's |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['launch']} | {r['programs']} | {r['us']:.0f} | {r['sm_us_per_tile']:.1f} | {r['code_bytes_differing']} |")
    _write(a, rows, torch.cuda.get_device_name(0))


def _write(a, rows, device: str) -> None:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__, "args": vars(a),
                   "rows": rows}, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=8192, help="tiles a launch (8192: a B 16 freeze's K and V tiles)")
    ap.add_argument("--size", type=int, default=128, choices=[64, 128], help="the tile's rows and columns")
    ap.add_argument("--bits", type=int, default=4, choices=[2, 4])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90 offline; no GPU needed")
    ap.add_argument("--out", default="benchmarks/results/encode_partitions.json")
    a = ap.parse_args()
    if a.tiles < 2:
        raise SystemExit(f"--tiles {a.tiles}: give at least 2 (each program's two partitions take a tile each)")
    if a.iterations < 0:
        raise SystemExit(f"--iterations {a.iterations}: give 0 or more (the spec's T)")
    if a.compile_only:
        compile_only(a)
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --compile-only for the offline check")
    else:
        measure(a)


if __name__ == "__main__":
    main()
