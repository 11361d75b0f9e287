"""One step's work for every KVarN layer of a KV-cache group, built once per step as tensors.

Per request (``ctx`` cached tokens, ``n`` new ones, ``L = ctx + n``, ``sb = S / G`` sink blocks):

1. **Commit** (before attention, one encode call for every layer of the group at once, made by
   the step's first layer: every layer's tokens of those tiles were staged by the previous
   step): a request past its prompt has every
   full tile in ``[sb, ctx // G)`` accepted; the ones not committed yet (tiles completed by the
   previous step, or a prompt that just finished) are encoded into their records. Deferring the
   commit of a tile completed at step t to the start of step t+1 changes nothing that is read:
   step t attends to it in fp either way, step t+1 reads the record. Tokens of a request that is
   still prefilling are never committed, so the prompt's own attention stays exact across chunks.
2. **Stage** every new token (rotated) at ``slot * G + offset`` of the flattened staging.
3. **Attention**, by kind of request:
   - *decode* (past its prompt, one new token): one batched attention call over
     [sink fp | records | tail fp]: on CPU :func:`kvarn.folded.folded_decode_attention` over the
     ragged list of every record the rows read (``dec_tile_list`` / ``dec_tile_row``) and their
     staged sink and tail (``dec_fp_slots`` / ``dec_fp_valid``); the Triton kernel takes padded
     ``[B, N]`` tile tables in at most :data:`MAX_CALLS` groups of similar tile counts;
   - *prefill* (prompt tokens in this step): batched exact causal attention over the staged fp
     tokens (a prefilling request has no committed tile), rows sorted by length and split into at
     most :data:`MAX_CALLS` calls (:func:`prefill_groups`) so that short prompts are not padded to
     the longest; prompts that start in this step and chunks that continue a prompt are grouped
     apart (the first need no explicit mask);
   - *extend* (past its prompt, several new tokens: speculative verification, a preempted request
     recomputed in chunks): exact attention over [sink fp | dequantized records | fp], per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .staging import StagingIndex


@dataclass
class StepPlan:
    """Index tensors of one step (host tensors; moved to the cache's device by the backend)."""

    num_actual_tokens: int
    write_idx: torch.Tensor  # [T] rows of the flattened staging [(slots + 1) * G, Hk, D]
    commit_blocks: torch.Tensor  # [C] blocks encoded into records before attention
    commit_slots: torch.Tensor  # [C]
    # decode: B requests, one query token each
    dec_tok: torch.Tensor  # [B] query token index
    dec_sink_slots: torch.Tensor  # [B, sb]
    dec_sink_len: torch.Tensor  # [B]
    dec_tile_blocks: torch.Tensor  # [B, N] record blocks (padded with a committed block)
    dec_tile_counts: torch.Tensor  # [B]
    dec_tail_slot: torch.Tensor  # [B]
    dec_tail_len: torch.Tensor  # [B]
    dec_groups: list[tuple[int, int, int]]  # (first, stop, tiles): rows sorted by tile count, one call each
    dec_fp_slots: torch.Tensor  # [B, sb + 1] staging slots of the sink blocks, then of the tail block
    dec_fp_valid: torch.Tensor  # [B, (sb + 1) * G] bool: staged positions each row sees
    dec_tile_list: torch.Tensor  # [T] every committed block a decode row reads (ragged, no padding)
    dec_tile_row: torch.Tensor  # [T] the decode row of each
    # prefill: P requests, up to M query tokens each
    pre_tok: torch.Tensor  # [P, M] query token index (0 where padded)
    pre_valid: torch.Tensor  # [P, M]
    pre_qpos: torch.Tensor  # [P, M] position of each query token
    pre_slots: torch.Tensor  # [P, K] staging slots of blocks 0..K-1 (zero slot where absent)
    # (first, stop, queries, key blocks, all rows start at position 0): rows sorted by length
    pre_groups: list[tuple[int, int, int, int, bool]]
    # extend: (first token, number of tokens, length, block row) per request
    extend: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    num_layers: int = 0  # KVarN layers of the group
    commit_pending: bool = False  # commit_blocks not encoded yet (the step's first layer does it for all)
    index: StagingIndex | None = None  # host-side; the slot table these indices came from
    scratch: dict = field(default_factory=dict)  # buffers the layers of this step share (same shapes)
    host_commit_blocks: torch.Tensor | None = None

    def to(self, device: torch.device) -> "StepPlan":
        if device.type == "cpu":
            return self
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and not k.startswith("host_")
                     else v) for k, v in self.__dict__.items()}
        return StepPlan(**moved)

    def committed(self) -> None:
        """Every layer's ``commit_blocks`` are encoded: their staging slots are free."""
        self.commit_pending = False
        if self.index is not None:
            self.index.release_slots_of(self.host_commit_blocks)


def _empty(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.int64)


MAX_CALLS = 3
CALL_COST = 4  # fixed cost of one decode call, in units of one request's tile (measured on CPU: a few ms)
PREFILL_CALL_COST = 4  # fixed cost of one prefill call, in units of one block of queries x one block of keys


def split_sorted(values: list[int], cost, max_calls: int = MAX_CALLS) -> list[tuple[int, int, int]]:
    """Split rows sorted by ``values`` into at most ``max_calls`` contiguous groups, one padded call each.

    ``cost(rows, value)`` is the work of one call over ``rows`` rows padded to ``value``; the split
    minimises the summed cost over cuts at the distinct values. Returns ``(first row, stop row,
    largest value)`` per group.
    """
    if not values:
        return []
    distinct = sorted(set(values))
    stops = [sum(1 for t in values if t <= v) for v in distinct]  # rows up to each distinct value

    def group_cost(i: int, j: int) -> int:  # distinct[i..j] in one call
        return cost(stops[j] - (stops[i - 1] if i else 0), distinct[j])

    m = len(distinct)
    best = {(0, j): (group_cost(0, j), [j]) for j in range(m)}  # (calls - 1, last value) -> (cost, ends)
    for k in range(1, max_calls):
        for j in range(m):
            for i in range(j):
                prev = best.get((k - 1, i))
                if prev is not None:
                    c = prev[0] + group_cost(i + 1, j)
                    if (k, j) not in best or c < best[(k, j)][0]:
                        best[(k, j)] = (c, prev[1] + [j])
    _, ends = min((best[(k, m - 1)] for k in range(max_calls) if (k, m - 1) in best), key=lambda x: x[0])
    groups, first = [], 0
    for j in ends:
        groups.append((first, stops[j], distinct[j]))
        first = stops[j]
    return groups


def decode_groups(tiles: list[int], sink_blocks: int, max_calls: int = MAX_CALLS) -> list[tuple[int, int, int]]:
    """Decode rows sorted by tile count -> groups for the Triton kernel's padded ``[B, N]`` tile tables.

    One batched call pads every row to the group's largest tile count; with prompts of 75 to 900
    tokens a single call would read about 2.5x the tiles that exist. Cost of a call:
    ``rows * (max tiles + sink and tail blocks) + CALL_COST``.
    """
    fixed = sink_blocks + 1
    return split_sorted(tiles, lambda rows, n: rows * (n + fixed) + CALL_COST, max_calls)


def prefill_groups(key_blocks: list[int], max_calls: int = MAX_CALLS) -> list[tuple[int, int, int]]:
    """Prefill rows sorted by key blocks -> groups of one padded exact-attention call each.

    A call's work grows with its rows times its padded queries times its padded keys; a prompt's
    queries grow with its keys, so a row costs ``(max key blocks)^2``: with prompts of 75 to 900
    tokens in one call, padding would triple the work.
    """
    return split_sorted(key_blocks, lambda rows, kb: rows * kb * kb + PREFILL_CALL_COST, max_calls)


def commit_chunks(num_layers: int, blocks: int, per_call: int) -> list[list[tuple[int, int, int]]]:
    """The (layer, first block, stop block) pieces of a group commit, one list per encode call.

    Every layer's ``blocks`` tiles are encoded once; a call holds at most ``per_call`` tiles (at
    least one whole layer's when that is fewer): whole layers are grouped while they fit, and a
    layer with more tiles than that is split.
    """
    if blocks == 0:
        return []
    if blocks <= per_call:
        per = per_call // blocks
        return [[(i, 0, blocks) for i in range(first, min(first + per, num_layers))]
                for first in range(0, num_layers, per)]
    return [[(i, b0, min(b0 + per_call, blocks))] for i in range(num_layers) for b0 in range(0, blocks, per_call)]


def build_plan(index: StagingIndex, tile: int, sink_tokens: int, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, prefilling: torch.Tensor,
               slot_mapping: torch.Tensor, num_actual_tokens: int, num_layers: int) -> StepPlan:
    """Update ``index`` for this step and return its plan. All inputs are host tensors.

    query_start_loc: ``[R + 1]``; seq_lens, prefilling: ``[R]``; block_table: ``[R, max_blocks]``;
    slot_mapping: ``[>= T]`` (``block * G + offset`` per new token).
    """
    g, sb = tile, sink_tokens // tile
    qsl = query_start_loc.long()
    n = qsl[1:] - qsl[:-1]
    length = seq_lens.long()
    ctx = length - n
    bt = block_table.long()
    active = n > 0
    past_prompt = active & ~prefilling.bool()
    r_count, width = bt.shape
    if r_count and bt.numel():
        index.reserve_blocks(int(bt.max()))
    col = torch.arange(width)[None, :]
    in_seq = col * g < length[:, None]  # block j holds tokens of the request

    # 1. commits: full accepted tiles after the sink of requests past their prompt
    want = past_prompt[:, None] & (col >= sb) & (col < (ctx // g)[:, None])
    blocks = torch.unique(bt[want])
    commit_blocks = blocks[~index.committed[blocks]]
    commit_slots = index.block_to_slot[commit_blocks]
    if bool((commit_slots < 0).any()):
        lost = commit_blocks[commit_slots < 0].tolist()
        raise RuntimeError(f"kvarn: the staged tokens of KV blocks {lost} are gone before their commit")
    index.committed[commit_blocks] = True

    # 2. staging rows of the new tokens
    sm = slot_mapping[:num_actual_tokens].long()
    tok_block, tok_off = sm // g, sm % g
    index.allocate(torch.unique(tok_block))
    write_idx = index.block_to_slot[tok_block] * g + tok_off

    # 3a. decode requests, sorted by their number of committed tiles
    dec = torch.nonzero(past_prompt & (n == 1)).flatten()
    tiles = (ctx[dec] // g - sb).clamp_min(0)
    order = torch.argsort(tiles, stable=True)
    dec, tiles = dec[order], tiles[order]
    b_len = length[dec]
    tail0 = torch.where(b_len > sink_tokens, sb * g + tiles * g, b_len)
    n_max = int(tiles.max()) if dec.numel() else 0
    if sb:
        sink_blocks = bt[dec, :sb]
        sink_slots = torch.where(in_seq[dec, :sb], index.slots_of(sink_blocks), index.zero_slot)
    else:
        sink_slots = _empty(dec.numel(), 0)
    if n_max:
        tcol = torch.arange(n_max)[None, :]
        tile_blocks = bt[dec, sb:sb + n_max]
        pad = tile_blocks[tiles > 0][:, 0][0]  # a committed block: padding stays finite
        tile_blocks = torch.where(tcol < tiles[:, None], tile_blocks, pad)
        if not bool(index.committed[tile_blocks].all()):
            raise RuntimeError("kvarn: a decode step would read a tile that is not committed")
    else:
        tile_blocks = _empty(dec.numel(), 0)
    tail_len = b_len - tail0
    tail_col = (tail0 // g).clamp_max(width - 1)
    tail_slot = torch.where(tail_len > 0, index.slots_of(bt[dec, tail_col]), index.zero_slot)
    sink_len = b_len.clamp_max(sink_tokens)
    fp_pos = torch.arange((sb + 1) * g)[None, :]
    fp_valid = torch.where(fp_pos < sb * g, fp_pos < sink_len[:, None], fp_pos - sb * g < tail_len[:, None])
    have = torch.arange(n_max)[None, :] < tiles[:, None]  # [B, n_max]

    # 3b. prefill requests: prompts that start in this step first, then chunks that continue one.
    # A call over fresh prompts uses the kernel's own causal mask, which skips the key blocks past
    # each query block; one continuing chunk in a call would give every row of it an explicit mask
    # (twice the work, and a mask to read), so the two kinds never share a call.
    pre = torch.nonzero(active & prefilling.bool()).flatten()
    pre_kb = (length[pre] + g - 1) // g
    cont = ctx[pre] > 0
    order = torch.argsort(pre_kb + cont * (int(pre_kb.max()) + 1 if pre.numel() else 0), stable=True)
    pre, pre_kb, cont = pre[order], pre_kb[order], cont[order]
    pre_groups = []
    n_fresh = int((~cont).sum())
    for offset, kbs, fresh in ((0, pre_kb[:n_fresh], True), (n_fresh, pre_kb[n_fresh:], False)):
        for first, stop, kb in prefill_groups(kbs.tolist()):
            rows = pre[offset + first:offset + stop]
            pre_groups.append((offset + first, offset + stop, int(n[rows].max()), kb, fresh))
    if pre.numel():
        if bool((index.committed[bt[pre]] & in_seq[pre]).any()):
            raise RuntimeError("kvarn: a prefilling request reads a committed tile")
        m = int(n[pre].max())
        qcol = torch.arange(m)[None, :]
        pre_valid = qcol < n[pre][:, None]
        pre_tok = torch.where(pre_valid, qsl[pre][:, None] + qcol, 0)
        pre_qpos = ctx[pre][:, None] + qcol
        k_blocks = int(((length[pre] + g - 1) // g).max())
        pre_slots = torch.where(in_seq[pre, :k_blocks], index.slots_of(bt[pre, :k_blocks]), index.zero_slot)
    else:
        pre_tok = pre_valid = pre_qpos = pre_slots = _empty(0, 0)
        pre_valid = pre_valid.bool()

    # 3c. extend requests (rare): per request
    ext = torch.nonzero(past_prompt & (n > 1)).flatten().tolist()
    extend = [(int(qsl[r]), int(n[r]), int(length[r]), bt[r, : -(-int(length[r]) // g)]) for r in ext]

    return StepPlan(
        num_actual_tokens=num_actual_tokens, write_idx=write_idx,
        commit_blocks=commit_blocks, commit_slots=commit_slots,
        dec_tok=qsl[dec], dec_sink_slots=sink_slots, dec_sink_len=sink_len,
        dec_tile_blocks=tile_blocks, dec_tile_counts=tiles, dec_tail_slot=tail_slot, dec_tail_len=tail_len,
        dec_groups=decode_groups(tiles.tolist(), sb),
        dec_fp_slots=torch.cat([sink_slots, tail_slot[:, None]], 1), dec_fp_valid=fp_valid,
        dec_tile_list=tile_blocks[have], dec_tile_row=torch.nonzero(have)[:, 0],
        pre_tok=pre_tok, pre_valid=pre_valid, pre_qpos=pre_qpos, pre_slots=pre_slots, pre_groups=pre_groups,
        extend=extend, num_layers=num_layers, commit_pending=bool(commit_blocks.numel()),
        index=index, host_commit_blocks=commit_blocks,
    )
