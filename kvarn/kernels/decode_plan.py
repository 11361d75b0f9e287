"""How a decode-attention launch is cut (:mod:`kvarn.kernels.decode`): warps, register cap, stages
and waves by shape (:func:`launch_plan`, from the H200 sweep), programs per (sequence, KV head) over
the quantized tiles and over the full-precision sink and tail (:func:`plan_splits`), and the
zeroed counters the in-launch merge tree counts its finished splits with (:func:`merge_counters`).
"""

from __future__ import annotations

import torch
import triton.language as tl

from .layout import num_sms

BLOCK_N = tl.constexpr(32)  # full-precision tokens per step
PROGRAMS_PER_SM = 8  # resident programs per multiprocessor (1 warp at ~250 registers, 2 at 128)
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 128
WIDE_BATCH = 64  # (sequence, KV head) pairs from which one-warp programs fill the machine
MERGE_GROUP = tl.constexpr(8)  # splits merged by the first level of the merge tree


def launch_plan(batch_heads: int, d: int, m: int) -> tuple[int, int | None, int, int]:
    """(num_warps, register cap, num_stages, waves) by default, from the H200 sweep
    (``bench_decode_attention.py --sweep``, BENCHMARKS.md).

    D <= 128 and up to 4 query rows per KV head: one warp per program, uncapped (about 250
    registers, no spills, no cross-warp barriers); one wave at many (sequence, head) pairs, two
    waves of splits below that (batch 1), where the merge tree keeps the many short splits cheap
    (B 1 / 16K: 17.7 µs against 19.4 µs for two warps at 168 registers with half the splits).
    D 256, or 8 query rows per KV head (swept at 4 only): two warps uncapped (no spills; one warp
    would spill at 8 rows, as ptxas reports). More than 8 query rows: four warps.
    """
    if m > 8:
        return 4, None, 2, 2
    if d > 128 or m > 4:
        return 2, None, 2, 2
    waves = 1 if batch_heads >= WIDE_BATCH else 2
    return 1, None, 2, waves


_MERGE_COUNTERS: dict = {}


def merge_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters (per (sequence, head): one per merge group and one for the groups); each
    launch leaves them zero again."""
    buf = _MERGE_COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"decode_attention: call once with {n} (sequence, head) pairs before graph capture")
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _MERGE_COUNTERS[device] = buf
    return buf


def plan_splits(batch_heads: int, n_tiles: int, fp_tokens: int, device: torch.device,
                waves: int = 2) -> tuple[int, int]:
    """(tile splits, fp splits) per (sequence, head).

    ``waves`` (1 or 2) waves of PROGRAMS_PER_SM programs per multiprocessor (two measured faster at
    few (sequence, head) pairs on the H200: a program's prologue overlaps another's tiles), at least
    MIN_TILES_PER_SPLIT tiles per split and at most MAX_SPLITS splits: the merge tree takes
    MAX_SPLITS partials in two short levels (groups of MERGE_GROUP, then 16 group results), and
    shorter splits would cost their fixed part (query rotation, prologue) for less than 2 tiles.
    The fp region is split when the tiles alone leave room (at B x Hk >= 64 one fp program per
    pair; two with one tile split fewer measured slower, BENCHMARKS.md table 1).
    """
    full = PROGRAMS_PER_SM * num_sms(device)
    want = max(1, -(-2 * full // batch_heads) if waves == 2 else full // batch_heads)
    tile_splits = max(1, min(want, -(-n_tiles // MIN_TILES_PER_SPLIT), MAX_SPLITS)) if n_tiles else 0
    fp_blocks = -(-fp_tokens // BLOCK_N.value)  # ints: a constexpr here would compile each count in
    fp_splits = min(fp_blocks, max(1, want // 32)) if fp_blocks else 0
    return tile_splits, fp_splits
