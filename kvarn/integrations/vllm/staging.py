"""Full-precision staging: one slot per running request, sized from the scheduler and reserved
out of vLLM's KV budget.

A vLLM block of G tokens (one tile) holds, per KV head, one KVarN record (:mod:`kvarn.paged`).
Tokens that are not in a record live in their request's staging *slot* of ``L = S + G + E`` token
rows (rotated frame ``k' = k @ H`` computed in fp32, stored in the model's dtype), K and V side by
side (``[slots + 1, L, 2, Hk, D]`` per layer):

- rows ``0 .. S - 1``: the sink (the first ``S`` tokens), for the request's life;
- rows ``S .. S + G - 1``: the unfinished tile, from its first token (the *tail base*);
- rows ``S + G .. L - 1``: ``E`` rows for the draft tokens of speculative decoding that run past
  the tile (``E = num_speculative_tokens``, 0 without it); once accepted they move to the front.

vLLM never runs more than ``max_num_seqs`` requests, and every running request holds exactly one
slot, so the pool (``max_num_seqs`` slots) cannot run out: no schedule vLLM forms needs more, and
no step waits or fails for staging. The last slot (``slots``) takes the writes of padded tokens
and is never read as a request's.

The host side (:class:`StagingPool`) maps request ids to slots and keeps, per request, how far its
tiles are committed and where its tail starts; the model runner's hook (:mod:`.hooks`) releases
the slots of finished and preempted requests.
"""

from __future__ import annotations

import numpy as np
import torch

from ...config import KVarNConfig


def slot_tokens(config: KVarNConfig, spec_tokens: int) -> int:
    """Token rows of one request's slot: sink, one tile and room for ``spec_tokens`` draft tokens."""
    return config.sink_tokens + config.tile + spec_tokens


def staging_bytes(slots: int, config: KVarNConfig, spec_tokens: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Bytes of one layer's staging, K and V: ``(slots + 1) * L * 2 * Hk * D * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (slots + 1) * slot_tokens(config, spec_tokens) * 2 * num_kv_heads * head_dim * itemsize


class StagingPool:
    """Slots of one KV-cache group, shared by its layers: request id -> slot, and per slot (host
    arrays, so a decode step is planned with a few vector operations) how many tiles are committed
    (tiles below that index are records, or the sink) and the position of the tail's first token."""

    def __init__(self, slots: int, config: KVarNConfig):
        self.slots = slots
        self.trash = slots  # the padded tokens' slot
        self.sink_tiles = config.sink_tokens // config.tile
        self.sink_tokens = config.sink_tokens
        self.slot_of: dict[str, int] = {}
        self.committed = np.full(slots + 1, self.sink_tiles, dtype=np.int64)
        self.tail_base = np.full(slots + 1, self.sink_tokens, dtype=np.int64)
        self._free = list(range(slots - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.slots - len(self._free)

    def slots_for(self, req_ids: list[str]) -> np.ndarray:
        """The requests' slots; a request seen for the first time gets a free one, its state reset."""
        out = np.empty(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            slot = self.slot_of.get(req_id)
            if slot is None:
                if not self._free:  # more running requests than max_num_seqs: vLLM never schedules that
                    raise RuntimeError(f"kvarn: {self.slots} staging slots for more running requests "
                                       f"({len(self.slot_of) + 1}); the pool is sized from max_num_seqs")
                slot = self.slot_of[req_id] = self._free.pop()
                self.committed[slot], self.tail_base[slot] = self.sink_tiles, self.sink_tokens
            out[i] = slot
        return out

    def release(self, req_ids) -> None:
        """The requests finished or were preempted: their slots are free (a resumed request starts over)."""
        for req_id in req_ids:
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self._free.append(slot)


__all__ = ["StagingPool", "slot_tokens", "staging_bytes"]
