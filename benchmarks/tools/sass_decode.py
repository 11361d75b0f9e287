"""The decode-attention kernel's SASS on sm_90, compiled offline (no GPU needed).

Compiles ``kvarn.kernels.decode._decode_attention_kernel`` for an H100/H200 (``GPUTarget("cuda",
90, 32)``) as :func:`kvarn.kernels.decode_attention` launches it for the fused cache's decode step
(fp16 query, a 128-token fp16 sink, packed tiles, a G-token tail buffer, the three lengths as device
tensors, sink and tail read in the model frame), with the launch plan the H200's 132 SMs give
(:mod:`kvarn.kernels.decode_plan`). The launch's arguments are taken from a real call under the
Triton interpreter (a child process with ``TRITON_INTERPRET=1``, stopped at the launch), so the
compiled specialization (constants, 16-divisible integers and pointers) is the one the wrapper
produces. Disassembled with the ``cuobjdump`` that comes with triton; prints registers, spill
stack, instructions, the longest loop's body and a digest of the listing: two trees whose digests
match compile to the same code (how a refactor of the kernel's modules is checked without a GPU).
The device runs triton 3.6 (``pip install --target DIR triton==3.6.0`` and put DIR first on
``PYTHONPATH``). Prints a table, writes JSON.

    PYTHONPATH=<triton 3.6 dir>:. python benchmarks/tools/sass_decode.py --out benchmarks/results/sass_decode.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys

H200_SMS = 132
_DTYPES = {"torch.float16": "*fp16", "torch.bfloat16": "*bf16", "torch.float32": "*fp32", "torch.uint8": "*u8",
           "torch.int8": "*i8", "torch.int32": "*i32", "torch.int64": "*i64"}


class _Launched(Exception):
    pass


def capture(preset: str, batch: int, tq: int, context: int) -> dict:
    """Run under the interpreter: the decode launch's arguments (kinds, dtypes, values) and options."""
    import torch
    import triton.language as tl

    from kvarn.config import KVarNConfig
    from kvarn.kernels import decode
    from kvarn.kernels.layout import empty_fields

    try:
        from kvarn.kernels import decode_plan
    except ImportError:  # a tree from before decode_plan.py: the plan lived in decode.py
        decode_plan = decode

    decode_plan.num_sms = lambda device: H200_SMS  # plan the H200's launch, not the interpreter's

    def record(*args, **kwargs):
        kinds = []
        for a in args:
            if isinstance(a, tl.constexpr):  # Triton compiles such a value in, as it does a 1
                kinds.append(["constexpr", a.value])
            elif isinstance(a, torch.Tensor):
                kinds.append(["tensor", str(a.dtype), a.data_ptr() % 16 == 0])
            elif isinstance(a, bool) or not isinstance(a, (int, float)):
                raise TypeError(f"unexpected launch argument {a!r}")
            else:
                kinds.append(["int" if isinstance(a, int) else "float", a])
        consts = {k: (v.value if hasattr(v, "value") else v) for k, v in kwargs.items()}
        raise _Launched(json.dumps({"args": kinds, "kwargs": consts}))

    class Recorder:
        def __getitem__(self, grid):
            return record

    decode._decode_attention_kernel = Recorder()
    cfg = KVarNConfig.from_name(preset)
    hq, hk, d, g, s = 32, 8, 128, cfg.tile, cfg.sink_tokens
    n = max(1, (context - s) // g)
    f16 = torch.float16
    q = torch.zeros(batch, hq, tq, d, dtype=f16)
    sink = torch.zeros(batch, hk, s, d, dtype=f16)
    tail = torch.zeros(batch, hk, g, d, dtype=f16)
    full = lambda v: torch.full((batch,), v, dtype=torch.int32)  # noqa: E731
    try:
        decode.decode_attention(q, sink, sink.clone(), empty_fields((batch, hk, n), cfg, d, "cpu"), tail, tail.clone(),
                                cfg, sink_lengths=full(s), tile_counts=full(n), tail_lengths=full(g // 2),
                                fp_frame="model")
    except _Launched as launched:
        out = json.loads(str(launched))
        warps, regs, stages, _ = decode_plan.launch_plan(batch * hk, d, hq // hk * tq)
        out["options"] = {"num_warps": warps, "num_stages": stages, **({"maxnreg": regs} if regs else {})}
        return out
    raise RuntimeError("decode_attention returned without launching its kernel")


def compile_decode(launch: dict):
    """The cubin of the captured launch for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvarn.kernels import decode

    fn = decode._decode_attention_kernel
    consts = {k: v for k, v in launch["kwargs"].items() if k not in ("num_warps", "num_stages", "maxnreg")}
    consts["ASM"] = True  # the interpreter's launch asks for the portable forms
    runtime = [name for name in fn.arg_names if name not in consts]
    if len(runtime) != len(launch["args"]):
        raise RuntimeError(f"{len(launch['args'])} arguments captured for {len(runtime)} runtime parameters")
    kinds = dict(zip(runtime, launch["args"]))
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        kind = kinds[name]
        if kind[0] == "tensor":
            sig[name] = _DTYPES[kind[1]]
            if kind[2]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif kind[0] == "constexpr" or fn.params[i].is_constexpr or (kind[0] == "int" and kind[1] == 1):
            # compiled in, as Triton does: a constexpr value, a tl.constexpr parameter, an int of 1
            sig[name], consts[name] = "constexpr", kind[1]
        elif kind[0] == "int":
            sig[name] = "i32" if -2 ** 31 <= kind[1] < 2 ** 31 else "i64"
            if kind[1] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=launch["options"])


def count(kernel) -> dict:
    """Registers, spill stack, instructions, the longest loop body, and a digest of the listing."""
    from sass_encoder import backward_branches, disassemble

    sass = disassemble(kernel)
    ops = sass["ops"]
    loops = [sum(1 for a, _, _ in ops if lo <= a <= hi) for lo, hi in backward_branches(ops)]
    return {
        "registers": sass["registers"],
        "stack_bytes": sass["stack_bytes"],
        "instructions": len(ops),
        "longest_loop": max(loops, default=0),
        "sass_sha1": hashlib.sha1("\n".join(line for _, _, line in ops).encode()).hexdigest(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["k4v2_g128", "k2v2_g128"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--tq", type=int, default=1, help="query tokens a step")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default="benchmarks/results/sass_decode.json")
    ap.add_argument("--capture", help=argparse.SUPPRESS)  # the child: PRESET,BATCH -> JSON on stdout
    a = ap.parse_args()
    for name in ("tq", "context"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(a, name)}: give a positive integer")
    if a.capture:
        preset, batch = a.capture.split(",")
        print(json.dumps(capture(preset, int(batch), a.tq, a.context)))
        return
    import triton

    from kvarn.config import KVarNConfig

    for p in a.presets:
        KVarNConfig.from_name(p)  # an unknown preset is refused by name
    for b in a.batches:
        if b < 1:
            raise SystemExit(f"--batches {b}: give positive integers")
    env = dict(os.environ, TRITON_INTERPRET="1")
    rows = []
    print("| preset | B | warps | registers | spill stack B | instructions | longest loop | SASS sha1 |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in a.presets:
        for b in a.batches:
            child = subprocess.run([sys.executable, __file__, "--capture", f"{preset},{b}", "--tq", str(a.tq),
                                    "--context", str(a.context)], env=env, capture_output=True, text=True)
            if child.returncode:
                raise SystemExit(f"capturing the launch of {preset} at B {b} failed:\n{child.stderr[-2000:]}")
            launch = json.loads(child.stdout.strip().splitlines()[-1])
            r = count(compile_decode(launch))
            r.update(preset=preset, batch=b, tq=a.tq, context=a.context, options=launch["options"])
            rows.append(r)
            print(f"| {preset} | {b} | {launch['options']['num_warps']} | {r['registers']} | {r['stack_bytes']} "
                  f"| {r['instructions']} | {r['longest_loop']} | {r['sass_sha1'][:12]} |", flush=True)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"triton": triton.__version__, "target": "cuda sm_90", "sms": H200_SMS, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
