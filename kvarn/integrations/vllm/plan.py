"""One step's work for every KVarN layer of a KV-cache group, planned on the host with no device read.

Inputs are what the host knows before the step runs: the rows' request ids, ``query_start_loc``
and ``seq_lens`` (host copies), and the host block table. Per request (``ctx`` tokens before the
step, ``n`` new ones, ``L = ctx + n``, sink ``S``, tile ``G``, draft room ``E``):

1. **Commit at the start of the step** the tiles that ``ctx`` accepts and no record holds yet:
   the unfinished tile of the last step is complete once ``ctx`` passes its end (a decode step
   completes it; under speculative decoding its last tokens may have been drafts, so only tokens
   before ``ctx`` count). Its accepted tokens past it (drafts beyond the tile) *move* to the front
   of the tail rows. A tile is encoded once, from tokens that can no longer be rejected.
2. **Stage** each new token at its row of the request's slot (:mod:`.staging`).
3. **Attention.** *Decode rows* (``n <= 1 + E``: decoding, verifying drafts, or a chunk that fits
   the tail rows): every new token is one row of the paged decode attention over [sink | records |
   tail up to its own position]. *Prefill rows* (longer chunks): exact attention over the chunk,
   and for a chunk that continues a prompt, over what the cache holds of the tokens before it.
4. **After attention** (prefill rows only; their tokens are prompt tokens, never drafts): commit
   every tile the chunk completed (the first from the tail rows, the others from the step's own
   keys and values), then stage the chunk's unfinished last tile at the front of the tail rows.

A step whose rows all decode one token (the graphs' case) moves nothing and has a commit entry
per row (``-1`` where a row commits nothing), so its launches have the same sizes every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .staging import StagingPool


@dataclass
class PrefillRow:
    """A prefill row: its tokens ``t0 .. t0 + n - 1`` of the step, ``ctx`` before them."""

    row: int
    t0: int
    n: int
    ctx: int
    slot: int
    tail_base: int  # after the step-start commit: the first position in the tail rows
    tiles: np.ndarray  # pages of its committed tiles (records), in order


@dataclass
class StepPlan:
    """Host arrays of one step (int32 unless noted); :class:`~.backend.KVarNMetadata` carries them
    to the device."""

    num_tokens: int  # tokens of the step, padding included
    uniform: bool  # every row decodes one token and nothing moves: the graphs' shape
    commit_src: np.ndarray  # [C] first staging row of each tile committed at the start
    commit_dst: np.ndarray  # [C] its page (-1: none)
    move_src: np.ndarray  # [M] int64 staging rows moved to the front of a tail
    move_dst: np.ndarray  # [M] int64
    write_rows: np.ndarray  # [T] int64 staging row of each new token (the trash slot: not staged now)
    dec_tok: np.ndarray  # [Rd] int64 token of each decode row
    dec_req: np.ndarray  # [Rd] int64 block-table row of each decode row
    dec_slot: np.ndarray  # [Rd]
    dec_sink: np.ndarray  # [Rd] sink tokens seen
    dec_tail: np.ndarray  # [Rd] tail tokens seen
    dec_tiles: np.ndarray  # [Rd] records seen
    prefill: list[PrefillRow] = field(default_factory=list)
    post_src: np.ndarray | None = None  # [P] staging row of the first tile of a prefill chunk to commit
    post_dst: np.ndarray | None = None
    post_step_src: np.ndarray | None = None  # [Q] token of the step starting each other tile to commit
    post_step_dst: np.ndarray | None = None
    late_tok: np.ndarray | None = None  # int64 tokens of prefill chunks' unfinished last tiles...
    late_rows: np.ndarray | None = None  # ...and their staging rows, written after the commits


def _i32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def build_plan(pool: StagingPool, req_ids: list[str], query_start_loc: np.ndarray, seq_lens: np.ndarray,
               block_table: np.ndarray, tile: int, spec_tokens: int, num_tokens: int, num_rows: int) -> StepPlan:
    """Plan the step and advance ``pool``'s per-request state as the step will leave it.

    ``req_ids``: the real rows' requests (rows past them are padding); ``query_start_loc``
    ``[>= rows + 1]``, ``seq_lens`` ``[>= rows]``, ``block_table`` ``[>= rows, W]``: host arrays;
    ``num_tokens`` / ``num_rows``: the step's sizes with padding.
    """
    g, s = tile, pool.sink_tokens
    length = s + g + spec_tokens  # rows of a slot
    trash_row = pool.trash * length
    write_rows = np.full(num_tokens, trash_row, dtype=np.int64)
    commit_src, commit_dst, move_src, move_dst = [], [], [], []
    dec = {k: [] for k in ("tok", "req", "slot", "sink", "tail", "tiles")}
    prefill, post_src, post_dst, post_step_src, post_step_dst, late_tok, late_rows = [], [], [], [], [], [], []
    uniform = num_tokens == num_rows
    for r, req_id in enumerate(req_ids):
        t0, t1 = int(query_start_loc[r]), int(query_start_loc[r + 1])
        n, total = t1 - t0, int(seq_lens[r])
        ctx = total - n
        if n <= 0:
            uniform = False
            continue
        st = pool.stage_of(req_id)
        base = st.slot * length
        # 1. the tile the last step completed (at most one: a decode row's tokens stay within G + E)
        accepted = max(ctx // g, st.committed)
        for j in range(st.committed, accepted):
            if j * g != st.tail_base:
                raise RuntimeError(f"kvarn: request {req_id} would commit tile {j} whose tokens are not staged "
                                   f"(tail at {st.tail_base})")
            commit_src.append(base + s)
            commit_dst.append(int(block_table[r, j]))
            st.committed = j + 1
            nxt = max(s, (ctx // g) * g)
            if ctx > nxt:  # accepted draft tokens past the tile: to the front of the tail rows
                move_src.extend(range(base + s + g, base + s + g + ctx - nxt))
                move_dst.extend(range(base + s, base + s + ctx - nxt))
                uniform = False
            st.tail_base = nxt
        tb = st.tail_base
        pos = np.arange(ctx, total)
        if n <= 1 + spec_tokens:  # decode rows
            if n != 1:
                uniform = False
            rows = np.where(pos < s, base + pos, base + s + pos - tb)
            write_rows[t0:t1] = rows
            dec["tok"].append(np.arange(t0, t1))
            dec["req"].append(np.full(n, r))
            dec["slot"].append(np.full(n, st.slot))
            dec["sink"].append(np.minimum(pos + 1, s))
            dec["tail"].append(np.maximum(pos + 1 - tb, 0) if total > s else np.zeros(n, dtype=np.int64))
            dec["tiles"].append(np.full(n, (tb - s) // g))
            continue
        uniform = False
        # 2. phase A: the sink and the tile the tail rows hold
        first = (pos < s) | ((pos >= tb) & (pos < tb + g))
        write_rows[t0:t1] = np.where(first, np.where(pos < s, base + pos, base + s + pos - tb), trash_row)
        prefill.append(PrefillRow(r, t0, n, ctx, st.slot, tb, _i32(block_table[r, pool.sink_tiles:tb // g])))
        # 4. after attention: the tiles the chunk completes, then its unfinished last tile
        done = total // g
        for j in range(max(tb // g, st.committed), done):
            if j * g == tb:
                post_src.append(base + s)
            else:
                post_step_src.append(t0 + j * g - ctx)
                post_step_dst.append(int(block_table[r, j]))
                continue
            post_dst.append(int(block_table[r, j]))
        if done > st.committed and total >= s:
            st.committed = done
            new_tb = max(s, done * g)
            late = pos >= max(new_tb, tb + g)
            late_tok.append(np.arange(t0, t1)[late])
            late_rows.append(base + s + pos[late] - new_tb)
            st.tail_base = new_tb
    real_rows = len(req_ids)
    if uniform:  # one commit entry per row, padding included: the launch has the graph's size
        src = np.zeros(num_rows, dtype=np.int32)
        dst = np.full(num_rows, -1, dtype=np.int32)
        for i, (a, b) in enumerate(zip(commit_src, commit_dst)):
            src[i], dst[i] = a, b
        commit_src, commit_dst = src, dst
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt))
    dec_arrays = {k: cat(v, np.int64 if k in ("tok", "req") else np.int32) for k, v in dec.items()}
    if uniform and num_rows > real_rows:  # padded rows: a decode row that sees no key
        pad = num_rows - real_rows
        dec_arrays["tok"] = np.concatenate([dec_arrays["tok"], np.arange(real_rows, num_rows)])
        dec_arrays["req"] = np.concatenate([dec_arrays["req"], np.arange(real_rows, num_rows)])
        dec_arrays["slot"] = np.concatenate([dec_arrays["slot"], np.full(pad, pool.trash, dtype=np.int32)])
        for k in ("sink", "tail", "tiles"):
            dec_arrays[k] = np.concatenate([dec_arrays[k], np.zeros(pad, dtype=np.int32)])
    return StepPlan(
        num_tokens=num_tokens, uniform=uniform, commit_src=_i32(commit_src), commit_dst=_i32(commit_dst),
        move_src=_i64(move_src), move_dst=_i64(move_dst), write_rows=write_rows,
        dec_tok=dec_arrays["tok"], dec_req=dec_arrays["req"], dec_slot=dec_arrays["slot"],
        dec_sink=dec_arrays["sink"], dec_tail=dec_arrays["tail"], dec_tiles=dec_arrays["tiles"],
        prefill=prefill, post_src=_i32(post_src), post_dst=_i32(post_dst), post_step_src=_i32(post_step_src),
        post_step_dst=_i32(post_step_dst), late_tok=cat(late_tok, np.int64), late_rows=cat(late_rows, np.int64),
    )


def padding_plan(pool: StagingPool, tile: int, spec_tokens: int, num_tokens: int, num_rows: int) -> StepPlan:
    """A step with no real rows (warm-up, graph capture): the launches of :func:`build_plan` for
    ``num_rows`` padded rows, every write to the trash slot, no commit, no key seen."""
    return build_plan(pool, [], np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                      np.zeros((0, 1), dtype=np.int32), tile, spec_tokens, num_tokens, num_rows)


__all__ = ["PrefillRow", "StepPlan", "build_plan", "padding_plan"]
