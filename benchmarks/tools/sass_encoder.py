"""The encoder's instruction counts on sm_90, compiled offline (no GPU needed).

Compiles ``kvarn.kernels.encode._encode_tiles_kernel`` for an H100/H200 (``GPUTarget("cuda", 90,
32)``) with the specialization the cache's flush gets at run time (pointers and strides divisible
by 16, the tiles' unit channel strides as constants, one tile per row and head, the slot and the
scale check on, model-frame tiles rotated in the kernel), disassembles it with the ``cuobjdump``
that comes with triton, and counts instructions: the normalization loop of the K and of the V
path (one iteration each, by opcode; which of the two is K is not told apart) and the rest of a tile, whose 8 iterations plus the rest give the
instructions a thread executes per tile. Register and spill counts come from the same cubin.
BENCHMARKS.md table 2 quotes these. The device runs triton 3.6 (``pip install --target DIR
triton==3.6.0`` and put DIR first on ``PYTHONPATH`` to count what it compiles; another triton
counts its own code). Prints a table, writes JSON.

    PYTHONPATH=. python benchmarks/tools/sass_encoder.py --out benchmarks/results/sass_encoder.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvarn.config import KVarNConfig
from kvarn.kernels import encode
from kvarn.kernels.layout import check_launch_knobs

_POINTERS = {"k_ptr": "*fp16", "v_ptr": "*fp16", "kc_ptr": "*u8", "vc_ptr": "*u8", "flag_ptr": "*i8",
             "slot_ptr": "*i32", "bad_ptr": "*i32"}  # the other pointers are fp16 scale fields
_FLOATS = ("inv_sqrt_d", "k_clo", "k_chi", "v_clo", "v_chi")
_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def compile_encoder(cfg: KVarNConfig, head_dim: int, warps: int, max_registers: int | None):
    """The cubin of the cache's flush launch for ``cfg`` (rotating, slot, check; min/max ranges)."""
    fn = encode._encode_tiles_kernel
    consts = dict(D=head_dim, G=cfg.tile, KB=cfg.key_bits, VB=cfg.value_bits, ITERS=cfg.sinkhorn_iters,
                  HAS_NORM=False, ROTATE=True, HAS_ROT=False, HAS_SLOT=True, CHECK=True,
                  KQ=False, KLO0=0, KLO1=0, KHI0=0, KHI1=0, VQ=False, VLO0=0, VLO1=0, VHI0=0, VHI1=0,
                  ASM=True, PERSIST=False,
                  k_sr=1, v_sc=1, N2=1)  # unit channel strides and one tile per head: constants at run time
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = _POINTERS.get(name, "*fp16") if name.endswith("_ptr") else "fp32" if name in _FLOATS else "i32"
        if name not in _FLOATS and name != "N1":  # N1 = KV heads (8): not a multiple of 16
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": warps}
    if max_registers:
        opts["maxnreg"] = max_registers
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def nvidia_tool(name: str) -> str:
    """A binary that comes with triton's NVIDIA backend (cuobjdump, ptxas)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def disassemble(kernel) -> dict:
    """A compiled kernel's SASS: its instructions as ``(address, opcode, line)``, its registers and its
    spill stack bytes (``cuobjdump -sass`` and ``-res-usage`` of the cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvidia_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return {
        "ops": [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
                if (m := _INSTRUCTION.match(line))],
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
    }


def backward_branches(ops) -> set[tuple[int, int]]:
    """The loops of a listing: ``(target, branch)`` addresses of each branch that jumps back."""
    loops = set()
    for addr, op, line in ops:
        target = re.search(r"0x([0-9a-f]+)", line.split("BRA", 1)[1]) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            loops.add((int(target.group(1), 16), addr))
    return loops


def count(kernel) -> dict:
    """Registers, spill stack, and the instructions of the two loops and of a whole tile."""
    sass = disassemble(kernel)
    ops = sass["ops"]
    # the K and the V normalization loops are the two largest backward branches' bodies (either order)
    loops = sorted(sorted(backward_branches(ops), key=lambda lh: lh[0] - lh[1])[:2])
    bodies = [[op.split(".")[0] for addr, op, _ in ops if lo <= addr <= hi] for lo, hi in loops]
    if len(bodies) != 2:
        raise RuntimeError(f"expected the K and the V loop, found {len(bodies)} backward branches' bodies")
    rest = (len(ops) - sum(map(len, bodies))) / 2  # each program runs one of the two paths
    return {
        "registers": sass["registers"],
        "stack_bytes": sass["stack_bytes"],
        "instructions": len(ops),
        "loops": [len(b) for b in bodies],
        "loop_ops": [dict(collections.Counter(b).most_common(12)) for b in bodies],
        "rest_per_path": rest,
    }


def _launch(text: str) -> tuple[int, int | None]:
    """``warps:cap`` -> (warps, register cap or None), refused by name as the encoder's own knobs are."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise SystemExit(f"--launches {text!r}: give warps:register cap, e.g. 8:128 (cap 0: none)")
    warps, cap = int(parts[0]), int(parts[1]) or None
    try:
        check_launch_knobs(warps, cap)
    except ValueError as exc:
        raise SystemExit(f"--launches {text!r}: {exc}") from None
    return warps, cap


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["k4v2_g128", "k2v2_g128"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--launches", nargs="+", default=["8:128", "8:0", "4:0"],
                    help="warps:register cap (0: none); 8:128 is the cache's B 16 launch, 8:0 its B 1")
    ap.add_argument("--out", default="benchmarks/results/sass_encoder.json")
    a = ap.parse_args()
    launches = [_launch(x) for x in a.launches]
    configs = [KVarNConfig.from_name(p) for p in a.presets]  # an unknown preset is refused by name
    configs[0].record_bytes(a.head_dim)  # a head_dim the codec refuses is refused here
    try:
        encode.check_rotate_dim(a.head_dim)  # the cache's launch rotates in the kernel
    except ValueError as exc:
        raise SystemExit(f"--head-dim {a.head_dim}: {exc}") from None
    rows = []
    print("| preset | warps | register cap | registers | spill stack B | loop, the two paths | rest of a tile | a tile |")
    print("|---|---|---|---|---|---|---|---|")
    for preset, cfg in zip(a.presets, configs):
        for warps, cap in launches:
            r = count(compile_encoder(cfg, a.head_dim, warps, cap))
            tile = r["rest_per_path"] + cfg.sinkhorn_iters * sum(r["loops"]) / 2
            r.update(preset=preset, warps=warps, max_registers=cap, per_tile=tile, iters=cfg.sinkhorn_iters)
            rows.append(r)
            print(f"| {preset} | {warps} | {cap or '-'} | {r['registers']} | {r['stack_bytes']} "
                  f"| {' / '.join(map(str, r['loops']))} | {r['rest_per_path']:.0f} | {tile:.0f} |", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"triton": triton.__version__, "target": "cuda sm_90", "head_dim": a.head_dim, "rows": rows},
                  fh, indent=1)


if __name__ == "__main__":
    main()
