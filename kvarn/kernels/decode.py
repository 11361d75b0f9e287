"""Fused decode attention over [fp sink | packed KVarN tiles | fp tail]: twin of
:func:`kvarn.attention.decode_attention` (same signature, same result within fp16 tolerance).

Programs: per (sequence, KV head), ``fp_splits`` programs over the full-precision sink and tail
and ``tile_splits`` programs over ranges of quantized tiles. Each program reads its tiles once for
all ``M = GROUP * Tq`` query rows of the KV head. Every program writes ``(m, l, acc)``; a
two-level tree merges them in the same launch (atomic counters): the last program of each group
of MERGE_GROUP splits to finish merges its group, the last group merges the groups, and the
result is un-rotated. The rotations of the query (every program) and of the merged output are
done in registers (:func:`~kvarn.kernels.hadamard.hadamard_rows`: two 16-wide MMAs over the
Kronecker factors of H), so no program reads H. At batch 1 the merge is the serial tail of the launch; the tree keeps it
short enough that many short splits pay (:mod:`~kvarn.kernels.decode_plan`). A tile's fields are
loaded together (:func:`decode_blocks.tile_load`); with ``num_stages`` >= 2 Triton's pipeline
copies tile n+1's fields to shared memory while tile n is computed, so the loop does not wait on
memory. The sink and tail programs use 32-token K and V blocks as stored
(:func:`decode_blocks.fp_block`) in two loops that end at the sink's and the tail's lengths,
pipelined the same way. :func:`~kvarn.kernels.decode_plan.launch_plan` picks warps, register cap,
stages and waves.

Orientation: both products are transposed, so the packed codes are the left (register) operand
and the small side is the query rows. With the scales folded (spec section 5):

    S^T[g, m]  = rK[g] * ( codes_K^T[g, :] @ (q' * sK)^T[:, m] + q'[m, :] . zK )
    O'^T[d, m] += cV[d] * ( codes_V^T[d, :] @ (p * sV)[:, m] + p[:, m] . zV )

Token and channel order: the codes are never put back in natural order. A K byte holds ``P`` tokens
of one channel (``P = 8 / bits``), so bit plane ``i`` of the K bytes is the token group
``{P t + i}``: its scores, softmax weights, ``rK`` and the matching V rows (loaded with row stride
``P``) stay in that group. A V byte holds ``P`` channels of one token, so bit plane ``j`` of the V
bytes is the channel group ``{P c + j}``, with its own accumulator; only the store of the partial
result puts channels back at ``P c + j``. Softmax and the sum over tokens do not depend on token
order, and the output does not depend on channel order once stored at its index, so the result is
the natural one. The codes only cross shared memory as bytes (the byte transpose into the MMA
operand layout); unpacking is elementwise in that layout (:func:`decode_blocks.code_plane`).

Precision: the fp32 right operands (``q' sK``, ``p sV``) enter the MMA as fp16 high and low halves
in adjacent columns (``hilo``), the rotated rows as two fp16 left operands, so products
are accurate to about 2^-22: codes are exact in fp16 and the dot cancels against the zero-point
term where keys have a large per-channel offset.

Per-head frames (kvarn-auto): ``key_rotated[b, h]`` false means that head's keys are stored in the
model frame, so the unrotated query scores them; ``value_rotated[b, h]`` false means its values
are, so its output is not un-rotated. With ``fp_frame="model"`` the sink and tail are scored by the
unrotated query and their part of the output is added after the un-rotation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..attention import check_decode_inputs, head_flags
from ..codec.record import FIELD_ORDER, TileFields
from ..config import KVarNConfig
from .decode_blocks import fp_block, fp_result, hilo, merge_range, store_output, store_partial, tile_load, tile_step
from .decode_plan import BLOCK_N, MERGE_GROUP, launch_plan, merge_counters, plan_splits
from .hadamard import hadamard_rows
from .layout import check_device, check_launch_knobs, empty_fields, interpreting, lead_strides

LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_kernel(
    q_ptr, q_sb, q_sh, q_st,
    sk_ptr, sv_ptr, s_sb, s_sh, s_sn, s_len_ptr, S_CAP,
    tk_ptr, tv_ptr, t_sb, t_sh, t_sn, t_len_ptr, R_CAP,
    kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
    kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
    vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
    vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn,
    n_len_ptr, krot_ptr, vrot_ptr, slot_ptr, bt_ptr, bt_sb, TILE0,
    o_ptr, o_sb, o_sh, o_st, pacc_ptr, pml_ptr, gacc_ptr, gml_ptr, count_ptr,
    HK, qk_scale, inv_sqrt_d, TILES_PER_SPLIT, FP_SPLITS: tl.constexpr, NS, NT_CAP,
    D: tl.constexpr, G: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
    GROUP: tl.constexpr, TQ: tl.constexpr, M: tl.constexpr,
    CAUSAL: tl.constexpr, FP_ROTATED: tl.constexpr, FLAGS: tl.constexpr, SINGLE: tl.constexpr,
    KSCALE: tl.constexpr, VSCALE: tl.constexpr, ASM: tl.constexpr,
    S_LEN: tl.constexpr, T_LEN: tl.constexpr, N_LEN: tl.constexpr, PAGED: tl.constexpr,
):
    bh = tl.program_id(0)
    sp = tl.program_id(1)
    b = bh // HK
    h = bh % HK
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    PV: tl.constexpr = 8 // VB
    DP: tl.constexpr = D // PV

    rows = tl.arange(0, M)
    row_ok = rows < GROUP * TQ
    qi = rows % TQ  # query token of each row
    qh = h * GROUP + rows // TQ  # query head of each row
    d = tl.arange(0, D)
    q_off = b64 * q_sb + qh.to(tl.int64) * q_sh + qi * q_st
    if FLAGS:
        k_rot = tl.load(krot_ptr + bh).to(tl.int32)
        v_rot = tl.load(vrot_ptr + bh).to(tl.int32)
    else:
        k_rot = bh * 0 + 1
        v_rot = bh * 0 + 1
    FP_ROT: tl.constexpr = 1 if FP_ROTATED else 0
    # Sink and tail have a frame of their own: with fp_frame="model" they are scored unrotated.
    q_rot = tl.where(sp < FP_SPLITS, k_rot * FP_ROT, k_rot)
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    if q_rot != 0:
        q = hadamard_rows(q, D) * inv_sqrt_d
    q = q * qk_scale  # log2 domain
    qt = tl.trans(q)  # [D, M]

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    accs = ()
    for j in tl.static_range(PV):
        accs = accs + (tl.zeros([DP, M], tl.float32),)

    if sp < FP_SPLITS:
        bq = hilo(qt)
        big = tl.full([M], 1 << 30, tl.int32)
        s_len = tl.load(s_len_ptr + b) if S_LEN else S_CAP
        t_len = tl.load(t_len_ptr + b) if T_LEN else R_CAP
        if CAUSAL:
            lim = t_len - TQ + 1 + qi
        else:
            lim = big
        # Blocks past a length are skipped (all their tokens are masked: skipping changes no bit),
        # so a short tail costs only its own blocks. Round robin over the fp splits: sink block j
        # and tail block j go to split j % FP_SPLITS.
        acc = tl.zeros([2 * M, D], tl.float32)
        # Paged (vLLM): the row's sink and tail live in its request's staging slot.
        if PAGED:
            fp_row = tl.load(slot_ptr + b).to(tl.int64)
        else:
            fp_row = b64
        for blk in range(sp, tl.cdiv(s_len, BLOCK_N), FP_SPLITS):
            m_i, l_i, acc = fp_block(bq, sk_ptr, sv_ptr, fp_row * s_sb + h64 * s_sh, s_sn,
                                     blk * BLOCK_N, s_len, big, m_i, l_i, acc, D, BLOCK_N)
        for blk in range(sp, tl.cdiv(t_len, BLOCK_N), FP_SPLITS):
            m_i, l_i, acc = fp_block(bq, tk_ptr, tv_ptr, fp_row * t_sb + h64 * t_sh, t_sn,
                                     blk * BLOCK_N, t_len, lim, m_i, l_i, acc, D, BLOCK_N)
        accs = fp_result(acc, PV)
    else:
        n_len = tl.load(n_len_ptr + b) if N_LEN else NT_CAP
        t_start = (sp - FP_SPLITS) * TILES_PER_SPLIT
        t_end = tl.minimum(t_start + TILES_PER_SPLIT, n_len)
        t = tl.arange(0, G // (8 // KB))
        c = tl.arange(0, DP)
        g = tl.arange(0, G)
        for n in range(t_start, t_end):
            if PAGED:  # tile n is the record in page block_table[b, TILE0 + n] (the fields' n stride: a page)
                pg = tl.load(bt_ptr + b64 * bt_sb + TILE0 + n).to(tl.int64)
                tb64 = b64 * 0
            else:
                pg = n
                tb64 = b64
            fields = tile_load(pg, tb64, h64, t, c, d, g,
                               kc_ptr, kc_sb, kc_sh, kc_sn, ks_ptr, ks_sb, ks_sh, ks_sn,
                               kz_ptr, kz_sb, kz_sh, kz_sn, kr_ptr, kr_sb, kr_sh, kr_sn,
                               vc_ptr, vc_sb, vc_sh, vc_sn, vcs_ptr, vcs_sb, vcs_sh, vcs_sn,
                               vs_ptr, vs_sb, vs_sh, vs_sn, vz_ptr, vz_sb, vz_sh, vz_sn,
                               D, G, VB)
            m_i, l_i, accs = tile_step(fields, qt, m_i, l_i, accs, KB, VB, KSCALE, VSCALE, ASM)

    # Partial result of this program: rows = query rows, channels at their natural index.
    pbase = (bh.to(tl.int64) * NS + sp) * M
    c = tl.arange(0, DP)
    for j in tl.static_range(PV):
        tl.store(pacc_ptr + (pbase + rows[None, :]) * D + (c * PV + j)[:, None], accs[j])
    tl.store(pml_ptr + (pbase + rows) * 2, m_i)
    tl.store(pml_ptr + (pbase + rows) * 2 + 1, l_i)

    base = bh.to(tl.int64) * NS
    if SINGLE:  # this program's own stores: a CTA barrier makes them visible to all its threads
        tl.debug_barrier()
        m_t, l_t, acc = merge_range(pacc_ptr, pml_ptr, base, 0, NS, FP_SPLITS, v_rot * FP_ROT, v_rot,
                                    inv_sqrt_d, rows, D, M, "")
        store_output(o_ptr, o_sb, o_sh, o_st, b64, l_t, acc, row_ok, qi, qh, D)
    else:
        # A two-level tree: the last program of each group of MERGE_GROUP splits to finish (an
        # atomic counter per group) merges the group; the last group merges the groups' results.
        # All threads' stores are done (barrier) before each release; the acquire makes the other
        # programs' stores visible to the merging one, which reads them past L1 (.cg).
        ng = tl.cdiv(NS, MERGE_GROUP)
        grp = sp // MERGE_GROUP
        lo = grp * MERGE_GROUP
        hi = tl.minimum(lo + MERGE_GROUP, NS)
        cbase = bh * (1 + ng)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + cbase + 1 + grp, 1, sem="acq_rel")
        if done == hi - lo - 1:
            tl.store(count_ptr + cbase + 1 + grp, 0)  # ready for the next launch
            m_t, l_t, acc = merge_range(pacc_ptr, pml_ptr, base, lo, hi, FP_SPLITS, v_rot * FP_ROT, v_rot,
                                        inv_sqrt_d, rows, D, M, ".cg")
            if ng == 1:
                store_output(o_ptr, o_sb, o_sh, o_st, b64, l_t, acc, row_ok, qi, qh, D)
            else:
                store_partial(gacc_ptr, gml_ptr, bh.to(tl.int64) * ng + grp, m_t, l_t, acc, rows, D)
                tl.debug_barrier()
                done = tl.atomic_add(count_ptr + cbase, 1, sem="acq_rel")
                if done == ng - 1:
                    tl.store(count_ptr + cbase, 0)
                    # The groups' results are in the model frame already: nothing to un-rotate.
                    m_t, l_t, acc = merge_range(gacc_ptr, gml_ptr, bh.to(tl.int64) * ng, 0, ng, 0, 0, 0,
                                                inv_sqrt_d, rows, D, M, ".cg")
                    store_output(o_ptr, o_sb, o_sh, o_st, b64, l_t, acc, row_ok, qi, qh, D)


def _merge_buffers(pairs: int, ns: int, m: int, d: int, device):
    """The splits' partial results (``acc``, ``m`` and ``l`` of each (pair, split) and of each merge
    group) and the merge tree's counters, for ``pairs`` (sequence, KV head) pairs of ``ns`` splits."""
    groups = -(-ns // MERGE_GROUP.value)
    f32 = dict(dtype=torch.float32, device=device)
    return (torch.empty(pairs * ns * m * d, **f32), torch.empty(pairs * ns * m * 2, **f32),
            torch.empty(pairs * groups * m * d, **f32), torch.empty(pairs * groups * m * 2, **f32),
            merge_counters(pairs * (1 + groups), device))


def _lengths(x, placeholder, device):
    """Per-sequence lengths as int32 on the device; ``placeholder`` (never read) when None."""
    return placeholder if x is None else x.to(device=device, dtype=torch.int32)


def decode_attention(
    query: torch.Tensor,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    tiles: TileFields | None,
    tail_k: torch.Tensor | None,
    tail_v: torch.Tensor | None,
    config: KVarNConfig,
    scaling: float | None = None,
    *,
    sink_lengths: torch.Tensor | None = None,
    tile_counts: torch.Tensor | None = None,
    tail_lengths: torch.Tensor | None = None,
    causal: bool = True,
    fp_frame: str = "rotated",
    key_rotated: torch.Tensor | None = None,
    value_rotated: torch.Tensor | None = None,
    num_splits: int | None = None,
    fp_splits: int | None = None,
    num_warps: int | None = None,
    max_registers: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kvarn.attention.decode_attention` (see there for shapes), on CUDA.

    Requirements beyond the reference: D and G at least 64; the last axis of query, sink and tail
    contiguous; tile fields contiguous within a tile (views of a record buffer are fine).
    Tuning knobs: ``num_splits`` (tile splits per sequence and head) and ``fp_splits`` (programs
    over the sink and tail), both planned from the batch and the SM count by default;
    ``num_warps``, ``max_registers`` per thread and ``num_stages`` (Triton's software pipeline over
    the tile loop: with 2 or more, tile n+1's fields are copied to shared memory asynchronously
    while tile n is computed), chosen by :func:`~kvarn.kernels.decode_plan.launch_plan` by default
    (an explicit ``num_warps`` means two waves of programs and no register cap unless
    ``max_registers`` is given). Lengths
    left as None are the capacities, passed as scalars (no device tensor is made). With ``causal`` and
    Tq > 1 the tail length precondition (R >= Tq) is the caller's: it is not checked on the device,
    to avoid a host synchronization.
    """
    b, hq, tq, d, hk = check_decode_inputs(query, sink_k, sink_v, tiles, tail_k, tail_v, config)
    if fp_frame not in ("rotated", "model"):
        raise ValueError(f"fp_frame={fp_frame!r}; choose 'rotated' or 'model'")
    if d < 64 or config.tile < 64:
        raise ValueError(f"the Triton decode kernel needs D >= 64 and G >= 64, got D={d}, G={config.tile}")
    check_device(query, sink_k, tail_k, None if tiles is None else tiles.k_codes)
    dev = query.device
    group = hq // hk
    m = max(4, triton.next_power_of_2(group * tq))
    scale = (1.0 / math.sqrt(d) if scaling is None else float(scaling)) * LOG2E
    flagged = key_rotated is not None or value_rotated is not None  # else the spec: no flags read
    # Read as bytes through a view (no conversion kernel per call: that was 4-6 µs of a 20 µs call).
    krot, vrot = (head_flags(x, b, hk, name, dev).contiguous().view(torch.int8) if flagged else None
                  for x, name in ((key_rotated, "key_rotated"), (value_rotated, "value_rotated")))

    # An absent sink or tail has capacity 0, so the placeholder (the query) is never read.
    sk, sv = (sink_k, sink_v) if sink_k is not None else (query, query)
    tk, tv = (tail_k, tail_v) if tail_k is not None else (query, query)
    for name, x in (("query", query), ("sink_k", sk), ("sink_v", sv), ("tail_k", tk), ("tail_v", tv)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along D")
    if sk.stride() != sv.stride() or tk.stride() != tv.stride():
        raise ValueError("K and V of the sink (and of the tail) must have the same strides")
    s_cap = 0 if sink_k is None else sink_k.shape[2]
    r_cap = 0 if tail_k is None else tail_k.shape[2]
    n_cap = 0 if tiles is None else tiles.k_codes.shape[2]

    no_tiles = tiles is None or n_cap == 0
    if no_tiles:  # a placeholder, never read
        tiles, n_cap = empty_fields((1, 1, 1), config, d, dev), 0
    tile_args = []
    for name in FIELD_ORDER:  # the kernel's argument order: codes 2-D per tile, scales 1-D
        x = getattr(tiles, name)
        tile_args += [x, *((0, 0, 0) if no_tiles else lead_strides(x, 3, 2 if name.endswith("codes") else 1))]

    check_launch_knobs(num_warps, max_registers)
    if num_stages is not None and int(num_stages) < 1:
        raise ValueError(f"num_stages={num_stages!r}; use 1 (no software pipeline) or more")
    warps, regs, stages, waves = launch_plan(b * hk, d, m)
    if num_warps is not None:  # an explicit choice keeps the two-wave plan and no cap unless asked
        warps, regs, waves = int(num_warps), None, 2
    regs = max_registers if max_registers is not None else regs
    stages = stages if num_stages is None else int(num_stages)
    splits, fps = plan_splits(b * hk, n_cap, s_cap + r_cap, dev, waves)
    if num_splits is not None and n_cap:
        splits = max(1, min(int(num_splits), n_cap))
    if fp_splits is not None and fps:
        fps = max(1, min(int(fp_splits), -(-(s_cap + r_cap) // BLOCK_N.value)))
    per_split = -(-n_cap // splits) if splits else 1
    splits = -(-n_cap // per_split) if splits else 0  # no empty split at the end
    ns = splits + fps
    # What Triton compiles in: FP_SPLITS, a few values (the sink's and tail's 32-token blocks, at
    # most 8 for a 128-token sink and tail), whose constant loop step saves about 500 instructions
    # at B 1; the split count NS is a runtime int, as a cache that grows without max_length takes a
    # new count every few tiles and a compiled-in one cost a compile each (65 over 4K tokens at B 1).
    if ns == 0:  # nothing to attend to: every query sees no key
        return torch.zeros_like(query)

    out = torch.empty_like(query)
    pacc, pml, gacc, gml, counts = _merge_buffers(b * hk, ns, m, d, dev)
    flags = krot if krot is not None else counts
    opts = {} if interpreting() or regs is None else {"maxnreg": int(regs)}
    _decode_attention_kernel[(b * hk, ns)](
        query, query.stride(0), query.stride(1), query.stride(2),
        sk, sv, sk.stride(0), sk.stride(1), sk.stride(2), _lengths(sink_lengths, query, dev), s_cap,
        tk, tv, tk.stride(0), tk.stride(1), tk.stride(2), _lengths(tail_lengths, query, dev), r_cap,
        *tile_args, _lengths(tile_counts, query, dev), flags, vrot if vrot is not None else counts,
        counts, counts, 0, 0,
        out, out.stride(0), out.stride(1), out.stride(2), pacc, pml, gacc, gml, counts,
        hk, scale, 1.0 / math.sqrt(d), per_split, fps, ns, n_cap,
        D=d, G=config.tile, KB=config.key_bits, VB=config.value_bits,
        GROUP=group, TQ=tq, M=m, CAUSAL=causal, FP_ROTATED=fp_frame == "rotated", FLAGS=krot is not None,
        SINGLE=ns == 1,
        KSCALE=1.0 if config.key_bits == 8 else 512.0, VSCALE=1.0 if config.value_bits == 8 else 512.0,
        ASM=not interpreting(),
        S_LEN=sink_lengths is not None, T_LEN=tail_lengths is not None, N_LEN=tile_counts is not None,
        PAGED=False, num_warps=warps, num_stages=stages, **opts,
    )
    return out


def paged_decode_attention(
    query: torch.Tensor,
    staging_k: torch.Tensor,
    staging_v: torch.Tensor,
    slots: torch.Tensor,
    sink_lengths: torch.Tensor,
    tail_lengths: torch.Tensor,
    pages: torch.Tensor,
    block_table: torch.Tensor,
    tile_counts: torch.Tensor,
    config: KVarNConfig,
    scaling: float | None = None,
    *,
    sink_tokens: int,
    max_tiles: int,
    out: torch.Tensor | None = None,
    plan_rows: int | None = None,
) -> torch.Tensor:
    """Decode attention of R query rows over vLLM's pages; twin of :func:`kvarn.paged.paged_decode_attention`.

    query: ``[R, Hq, D]`` (model frame), one query token per row. staging_k, staging_v: ``[P, L, Hk,
    D]`` (rotated frame; views of one buffer are fine): row ``r`` sees the sink
    ``staging[slots[r], :sink_lengths[r]]`` and the tail ``staging[slots[r], S : S + tail_lengths[r]]``
    with ``S = sink_tokens``. pages: uint8 ``[num_blocks, Hk, record_bytes]``; row ``r``'s tile ``n``
    (``n < tile_counts[r] <= max_tiles``) is the record at page ``block_table[r, S / G + n]``. All
    per-row tensors int32 on the device. ``max_tiles`` fixes the launch (splits), so a captured
    graph replays any lengths up to it. ``plan_rows`` (>= R): plan the launch (warps, splits) as for
    that many rows, so that a few row counts share the compiled variants (vLLM's eager steps use its
    graph sizes, whose variants the graph capture compiled). Returns ``out`` (or a new tensor)
    ``[R, Hq, D]``.
    """
    from ..codec.record import record_field_views

    r, hq, d = query.shape
    p, length, hk, _ = staging_k.shape
    if staging_v.shape != staging_k.shape or staging_v.stride() != staging_k.stride():
        raise ValueError("staging_k and staging_v must have one shape and one stride")
    if d < 64 or config.tile < 64 or hq % hk:
        raise ValueError(f"paged decode needs D >= 64, G >= 64 and Hq a multiple of Hk, got D={d}, "
                         f"G={config.tile}, Hq={hq}, Hk={hk}")
    if sink_tokens % config.tile or not 0 <= sink_tokens < length:
        raise ValueError(f"sink_tokens={sink_tokens} must be a multiple of G={config.tile} below the slot length {length}")
    for name, x in (("slots", slots), ("sink_lengths", sink_lengths), ("tail_lengths", tail_lengths),
                    ("tile_counts", tile_counts)):
        if x.dtype != torch.int32 or tuple(x.shape) != (r,):
            raise ValueError(f"{name} must be int32 [{r}], got {x.dtype} {tuple(x.shape)}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be int32 [R, W] with contiguous rows, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    check_device(query, staging_k, pages, block_table)
    dev = query.device
    out = torch.empty_like(query) if out is None else out
    if r == 0:
        return out
    group = hq // hk
    m = max(4, triton.next_power_of_2(group))
    scale = (1.0 / math.sqrt(d) if scaling is None else float(scaling)) * LOG2E
    tail_k, tail_v = staging_k[:, sink_tokens:], staging_v[:, sink_tokens:]
    r_cap = length - sink_tokens
    fields = record_field_views(pages, config, d)  # lead [num_blocks, Hk]
    tile_args = []
    for name in FIELD_ORDER:  # a tile's stride along n is a page; the kernel's b stride is unused
        x = getattr(fields, name)
        tile_args += [x, 0, x.stride(1), x.stride(0)]
    rp = r if plan_rows is None else plan_rows
    if rp < r:
        raise ValueError(f"plan_rows={plan_rows} must be at least the {r} query rows")
    warps, regs, stages, waves = launch_plan(rp * hk, d, m)
    splits, fps = plan_splits(rp * hk, max_tiles, sink_tokens + r_cap, dev, waves)
    per_split = -(-max_tiles // splits) if splits else 1
    splits = -(-max_tiles // per_split) if splits else 0
    ns = splits + fps
    pacc, pml, gacc, gml, counts = _merge_buffers(r * hk, ns, m, d, dev)
    opts = {} if interpreting() or regs is None else {"maxnreg": int(regs)}
    _decode_attention_kernel[(r * hk, ns)](
        query, query.stride(0), query.stride(1), 0,
        staging_k, staging_v, staging_k.stride(0), staging_k.stride(2), staging_k.stride(1), sink_lengths,
        sink_tokens,
        tail_k, tail_v, tail_k.stride(0), tail_k.stride(2), tail_k.stride(1), tail_lengths, r_cap,
        *tile_args, tile_counts, counts, counts, slots, block_table, block_table.stride(0),
        sink_tokens // config.tile,
        out, out.stride(0), out.stride(1), 0, pacc, pml, gacc, gml, counts,
        hk, scale, 1.0 / math.sqrt(d), per_split, fps, ns, max_tiles,
        D=d, G=config.tile, KB=config.key_bits, VB=config.value_bits,
        GROUP=group, TQ=1, M=m, CAUSAL=False, FP_ROTATED=True, FLAGS=False, SINGLE=ns == 1,
        KSCALE=1.0 if config.key_bits == 8 else 512.0, VSCALE=1.0 if config.value_bits == 8 else 512.0,
        ASM=not interpreting(), S_LEN=True, T_LEN=True, N_LEN=True, PAGED=True,
        num_warps=warps, num_stages=stages, **opts,
    )
    return out
