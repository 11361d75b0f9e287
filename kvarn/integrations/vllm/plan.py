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
class FreshBatch:
    """Prefill chunks that start their requests, as one varlen attention call sees them."""

    tok: np.ndarray  # int64 the chunks' step tokens, row after row
    cu: np.ndarray  # int32 [R + 1] chunk boundaries in ``tok``
    longest: int
    contiguous: bool  # ``tok`` is one run of consecutive tokens (a slice of the step)


@dataclass
class ContinuedBatch:
    """Prefill chunks that continue their requests, as one varlen attention call sees them: per
    row a key buffer of ``ctx + n`` positions (the history as the cache holds it, then the chunk),
    rows one after another, every index computed on the host."""

    q_tok: np.ndarray  # int64 [Nq] the chunks' step tokens, row after row
    cu_q: np.ndarray  # int32 [R + 1] chunk boundaries in ``q_tok``
    cu_k: np.ndarray  # int32 [R + 1] row boundaries in the key buffer
    max_q: int
    max_k: int
    stage_src: np.ndarray  # int64 flat staging rows of the rows' sinks and tails...
    stage_dst: np.ndarray  # int64 ...and their positions in the key buffer
    rec_pages: np.ndarray  # int64 [P] pages of the rows' records, in order...
    rec_dst: np.ndarray  # int64 [P * G] ...and the buffer position of each of their tokens
    chunk_dst: np.ndarray  # int64 [Nq] buffer positions of the chunks' own tokens


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
    write_rows: np.ndarray  # int64 staging row of each new token staged now (uniform steps: every
    # token in order, padding to the trash slot)
    dec_tok: np.ndarray  # [Rd] int64 token of each decode row
    dec_req: np.ndarray  # [Rd] int64 block-table row of each decode row
    dec_slot: np.ndarray  # [Rd]
    dec_sink: np.ndarray  # [Rd] sink tokens seen
    dec_tail: np.ndarray  # [Rd] tail tokens seen
    dec_tiles: np.ndarray  # [Rd] records seen
    write_tok: np.ndarray | None = None  # int64 the step tokens of ``write_rows`` (None: all, in order)
    prefill: list[PrefillRow] = field(default_factory=list)
    fresh: FreshBatch | None = None  # the prefill rows with ctx = 0...
    continued: ContinuedBatch | None = None  # ...and the others
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
    real = len(req_ids)
    qsl = np.asarray(query_start_loc[: real + 1], dtype=np.int64)
    n = qsl[1:] - qsl[:-1]
    total = np.asarray(seq_lens[:real], dtype=np.int64)
    slots = pool.slots_for(req_ids)
    # With speculative decoding a one-token row may still move accepted drafts, and vLLM captures no
    # one-token graphs then: such steps take the general path.
    if real and (n == 1).all() and num_tokens == num_rows and not spec_tokens:
        return _decode_step(pool, slots, total - 1, block_table, tile, spec_tokens, num_rows)
    return _general_step(pool, slots, qsl, n, total, block_table, tile, spec_tokens, num_tokens, num_rows)


def _commit_accepted(pool: StagingPool, slots: np.ndarray, ctx: np.ndarray, block_table: np.ndarray, tile: int,
                     length: int, rows: np.ndarray):
    """Step 1 for the given rows: the tile each row's accepted tokens completed (at most one: a
    decode row's tokens stay within G + E of its tail). Returns (src, dst, move_src, move_dst) and
    advances the rows' state."""
    g, s = tile, pool.sink_tokens
    st = slots[rows]
    due = np.maximum(ctx[rows] // g, pool.committed[st]) > pool.committed[st]
    r, st, c = rows[due], st[due], ctx[rows][due]
    j = pool.committed[st]
    if (j * g != pool.tail_base[st]).any() or (c // g > j + 1).any():
        raise RuntimeError(f"kvarn: a commit of tiles {j.tolist()} whose tokens are not all staged")
    src = st * length + s
    dst = block_table[r, j]
    nxt = np.maximum(s, (c // g) * g)
    extra = c - nxt  # accepted draft tokens past the tile: to the front of the tail rows
    move_src = [np.arange(a + g, a + g + e) for a, e in zip(src, extra) if e > 0]
    move_dst = [np.arange(a, a + e) for a, e in zip(src, extra) if e > 0]
    pool.committed[st] = j + 1
    pool.tail_base[st] = nxt
    cat = (lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64))
    return src, dst, cat(move_src), cat(move_dst)


def _decode_step(pool, slots, ctx, block_table, tile, spec_tokens, num_rows) -> StepPlan:
    """Every row decodes one token: vector operations over the rows, one commit entry per row."""
    g, s = tile, pool.sink_tokens
    length = s + g + spec_tokens
    real = slots.size
    src, dst, move_src, _ = _commit_accepted(pool, slots, ctx, block_table, tile, length, np.arange(real))
    if move_src.size:
        raise RuntimeError("kvarn: a one-token decode step moved draft tokens")
    tb = pool.tail_base[slots]
    base = slots * length
    commit_src = np.zeros(num_rows, dtype=np.int32)
    commit_dst = np.full(num_rows, -1, dtype=np.int32)
    commit_src[: src.size], commit_dst[: dst.size] = src, dst
    pad = num_rows - real
    write = np.full(num_rows, pool.trash * length, dtype=np.int64)
    write[:real] = np.where(ctx < s, base + ctx, base + s + ctx - tb)
    dslot = np.concatenate([slots, np.full(pad, pool.trash)]).astype(np.int32)
    zeros = np.zeros(pad, dtype=np.int32)
    sink = np.concatenate([np.minimum(ctx + 1, s), zeros]).astype(np.int32)
    tail = np.concatenate([np.where(ctx >= s, ctx + 1 - tb, 0), zeros]).astype(np.int32)
    tiles = np.concatenate([(tb - s) // g, zeros]).astype(np.int32)
    rows = np.arange(num_rows, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return StepPlan(num_tokens=num_rows, uniform=True, commit_src=commit_src, commit_dst=commit_dst,
                    move_src=empty, move_dst=empty, write_rows=write, dec_tok=rows, dec_req=rows, dec_slot=dslot,
                    dec_sink=sink, dec_tail=tail, dec_tiles=tiles)


def _general_step(pool, slots, qsl, n, total, block_table, tile, spec_tokens, num_tokens, num_rows) -> StepPlan:
    """Any mix of decode rows and prefill chunks (eager steps): per row."""
    g, s = tile, pool.sink_tokens
    length = s + g + spec_tokens
    trash_row = pool.trash * length
    ctx = total - n
    active = np.nonzero(n > 0)[0]
    commit_src, commit_dst, move_src, move_dst = _commit_accepted(pool, slots, ctx, block_table, tile, length, active)
    write_rows = np.full(num_tokens, trash_row, dtype=np.int64)
    dec = {k: [] for k in ("tok", "req", "slot", "sink", "tail", "tiles")}
    prefill, post_src, post_dst, post_step_src, post_step_dst, late_tok, late_rows = [], [], [], [], [], [], []
    for r in active.tolist():
        t0, t1, c, end, slot = int(qsl[r]), int(qsl[r + 1]), int(ctx[r]), int(total[r]), int(slots[r])
        base, tb = slot * length, int(pool.tail_base[slot])
        pos = np.arange(c, end)
        if t1 - t0 <= 1 + spec_tokens:  # decode rows
            write_rows[t0:t1] = np.where(pos < s, base + pos, base + s + pos - tb)
            dec["tok"].append(np.arange(t0, t1))
            dec["req"].append(np.full(t1 - t0, r))
            dec["slot"].append(np.full(t1 - t0, slot))
            dec["sink"].append(np.minimum(pos + 1, s))
            dec["tail"].append(np.where(pos >= s, pos + 1 - tb, 0))
            dec["tiles"].append(np.full(t1 - t0, (tb - s) // g))
            continue
        # phase A: the sink and the tile the tail rows hold
        first = (pos < s) | ((pos >= tb) & (pos < tb + g))
        write_rows[t0:t1] = np.where(first, np.where(pos < s, base + pos, base + s + pos - tb), trash_row)
        prefill.append(PrefillRow(r, t0, t1 - t0, c, slot, tb, _i32(block_table[r, pool.sink_tiles:tb // g])))
        # after attention: the tiles the chunk completes, then its unfinished last tile
        done = end // g
        for j in range(max(tb // g, int(pool.committed[slot])), done):
            if j * g == tb:
                post_src.append(base + s)
                post_dst.append(int(block_table[r, j]))
            else:
                post_step_src.append(t0 + j * g - c)
                post_step_dst.append(int(block_table[r, j]))
        if done > pool.committed[slot] and end >= s:
            pool.committed[slot] = done
            new_tb = max(s, done * g)
            late = pos >= max(new_tb, tb + g)
            late_tok.append(np.arange(t0, t1)[late])
            late_rows.append(base + s + pos[late] - new_tb)
            pool.tail_base[slot] = new_tb
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dtype=dt))
    write_tok = np.nonzero(write_rows != trash_row)[0]
    return StepPlan(
        num_tokens=num_tokens, uniform=False, commit_src=_i32(commit_src), commit_dst=_i32(commit_dst),
        move_src=_i64(move_src), move_dst=_i64(move_dst), write_rows=write_rows[write_tok], write_tok=write_tok,
        fresh=fresh_batch([r for r in prefill if r.ctx == 0]),
        continued=continued_batch([r for r in prefill if r.ctx], length, s, g),
        dec_tok=cat(dec["tok"], np.int64), dec_req=cat(dec["req"], np.int64), dec_slot=cat(dec["slot"], np.int32),
        dec_sink=cat(dec["sink"], np.int32), dec_tail=cat(dec["tail"], np.int32),
        dec_tiles=cat(dec["tiles"], np.int32), prefill=prefill, post_src=_i32(post_src), post_dst=_i32(post_dst),
        post_step_src=_i32(post_step_src), post_step_dst=_i32(post_step_dst), late_tok=cat(late_tok, np.int64),
        late_rows=cat(late_rows, np.int64),
    )


def fresh_batch(rows: list[PrefillRow]) -> FreshBatch | None:
    """The chunks that start their requests, for one varlen call (None: there are none)."""
    if not rows:
        return None
    tok = np.concatenate([np.arange(r.t0, r.t0 + r.n) for r in rows])
    return FreshBatch(tok=tok, cu=_i32(np.cumsum([0] + [r.n for r in rows])), longest=max(r.n for r in rows),
                      contiguous=bool((np.diff(tok) == 1).all()))


def continued_batch(rows: list[PrefillRow], length: int, sink: int, tile: int) -> ContinuedBatch | None:
    """The chunks that continue their requests, for one varlen call (None: there are none).

    Row ``i``'s key buffer holds positions ``0 .. ctx + n - 1`` at ``cu_k[i]``: the sink rows of its
    slot, its records (``tile`` tokens each), its tail rows (positions ``tail_base .. ctx - 1``), then
    the chunk."""
    if not rows:
        return None
    q_len = [r.n for r in rows]
    k_len = [r.ctx + r.n for r in rows]
    cu_q, cu_k = np.cumsum([0] + q_len), np.cumsum([0] + k_len)
    stage_src, stage_dst, rec_dst, chunk_dst = [], [], [], []
    for r, k0 in zip(rows, cu_k[:-1].tolist()):
        base = r.slot * length
        sink_n = min(r.ctx, sink)
        stage_src.append(base + np.arange(sink_n))
        stage_dst.append(k0 + np.arange(sink_n))
        first = sink + np.arange(r.tiles.size)[:, None] * tile + np.arange(tile)[None, :]
        rec_dst.append(k0 + first.reshape(-1))
        tail = np.arange(r.tail_base, r.ctx) if r.ctx > r.tail_base else np.zeros(0, dtype=np.int64)
        stage_src.append(base + sink + tail - r.tail_base)
        stage_dst.append(k0 + tail)
        chunk_dst.append(k0 + r.ctx + np.arange(r.n))
    cat = (lambda xs: np.concatenate(xs).astype(np.int64))
    return ContinuedBatch(
        q_tok=cat([np.arange(r.t0, r.t0 + r.n) for r in rows]), cu_q=_i32(cu_q), cu_k=_i32(cu_k), max_q=max(q_len),
        max_k=max(k_len), stage_src=cat(stage_src), stage_dst=cat(stage_dst),
        rec_pages=cat([r.tiles for r in rows]), rec_dst=cat(rec_dst), chunk_dst=cat(chunk_dst))


def padding_plan(pool: StagingPool, tile: int, spec_tokens: int, num_tokens: int, num_rows: int) -> StepPlan:
    """A step with no real rows (warm-up, graph capture): the launches of a one-token decode step
    of ``num_rows`` padded rows, every write to the trash slot, no commit, no key seen."""
    none = np.zeros(0, dtype=np.int64)
    bt = np.zeros((0, 1), dtype=np.int32)
    if num_tokens == num_rows and not spec_tokens:
        return _decode_step(pool, none, none, bt, tile, spec_tokens, num_rows)
    return _general_step(pool, none, np.zeros(1, dtype=np.int64), none, none, bt, tile, spec_tokens, num_tokens,
                         num_rows)


__all__ = ["ContinuedBatch", "FreshBatch", "PrefillRow", "StepPlan", "build_plan", "continued_batch", "fresh_batch",
           "padding_plan"]
