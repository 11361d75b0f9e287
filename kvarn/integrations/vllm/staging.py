"""Full-precision staging of sink and unfinished tiles, sized and reserved at start-up.

A vLLM block of ``G`` tokens (one tile) holds, per KV head, one KVarN record of docs/algorithm.md
section 4 in the paged cache. Tokens that are not in a committed record live in a staging *slot*, in
the rotated frame (``k' = k @ H``, computed in fp32) and the model's dtype:

- the sink: the first ``S`` tokens of every sequence (``S / G`` blocks), for the sequence's life;
- the unfinished tile of every sequence (its last block);
- the whole prompt of a request that is still prefilling, so that the prompt's own attention is
  exact across chunks (its full tiles are committed at its first step after the prompt).

The slot table (:class:`StagingIndex`) is shared by every layer of a KV-cache group: all of them
see the same block ids, so the table is updated once per step by the metadata builder. Each layer
owns two tensors ``[slots + 1, G, Hk, D]`` (K and V); the last slot stays zero and stands in for
absent blocks, so gathers never need a Python branch per request.

Lifetime follows vLLM's request lifecycle: the slots of a request's blocks are released when vLLM
reports it finished or preempted (the model runner's ``finished_req_ids`` / ``preempted_req_ids``,
see :mod:`.hooks`), and a block's slot is released when the block is committed into its record.

Budget: the pool has a fixed size, :func:`staging_slots`, reserved out of vLLM's KV-cache memory
at start-up (:mod:`.hooks` subtracts :func:`staging_bytes` of every KVarN layer from the memory the
worker reports), so the capacity vLLM logs is what is really left for records. Running out of
slots raises ``RuntimeError`` naming the ``staging_slots`` override; it never overwrites data.
"""

from __future__ import annotations

import torch

from ...codec import check_encoded, encode_tiles
from ...config import KVarNConfig
from ...record import store_records


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def staging_slots(config: KVarNConfig, max_num_seqs: int, max_num_batched_tokens: int,
                  max_model_len: int) -> int:
    """Slots one layer needs so that any schedule vLLM can form fits.

    Every running sequence holds its sink blocks and one unfinished tile (``S/G + 1``); the prompts
    prefilled in one step add at most ``max_num_batched_tokens / G`` full tiles beyond those, and a
    prompt prefilled in chunks across steps (the scheduler carries at most one) holds up to
    ``max_model_len / G`` tiles until it completes.
    """
    g = config.tile
    return (max_num_seqs * (config.sink_tokens // g + 1) + _cdiv(max_num_batched_tokens, g)
            + _cdiv(max_model_len, g))


def staging_bytes(slots: int, config: KVarNConfig, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
    """Bytes of one layer's K and V staging: ``2 * (slots + 1) * G * Hk * D * itemsize``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * (slots + 1) * config.tile * num_kv_heads * head_dim * itemsize


def encode_records(k: torch.Tensor, v: torch.Tensor, config: KVarNConfig, kernels: str = "torch") -> torch.Tensor:
    """Full rotated tiles ``[n, G, Hk, D]`` (staging layout) -> uint8 records ``[n, Hk, record_bytes]``
    in the tile store's order (the backend reads pages with :func:`kvarn.record.record_field_views`).
    ``kernels``: ``"torch"`` (the codec), ``"numba"`` (:mod:`kvarn.cpu_kernels`, the same bits) or
    ``"triton"``."""
    d = k.shape[-1]
    # Contiguous tiles: every pass of the normalization then runs over plain memory.
    kt = k.permute(0, 2, 3, 1).to(torch.float32, memory_format=torch.contiguous_format)  # [n, Hk, D, G]
    vt = v.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)  # [n, Hk, G, D]
    if kernels == "triton":
        from ...kernels import encode_tiles as triton_encode_tiles

        fields = triton_encode_tiles(kt, vt, config)
        check_encoded(fields, kt, vt)  # the kernel has no range guard of its own
    elif kernels == "numba":
        from ...cpu_kernels import encode_tiles as numba_encode_tiles

        fields = numba_encode_tiles(kt, vt, config, parallel=True)
    elif kernels == "torch":
        fields = encode_tiles(kt, vt, config)
    else:
        raise ValueError(f"kernels={kernels!r}; choose one of ['torch', 'numba', 'triton']")
    return store_records(fields, config, d)


class StagingIndex:
    """Slot table of one KV-cache group: block id -> staging slot, and which blocks are committed.

    Host-side tensors, indexed by block id (grown on demand). ``slots`` usable slots; slot
    ``slots`` is the zero slot.
    """

    def __init__(self, slots: int, num_blocks: int = 0):
        self.slots = slots
        self.zero_slot = slots
        self.block_to_slot = torch.full((max(num_blocks, 1),), -1, dtype=torch.int64)
        self.committed = torch.zeros(max(num_blocks, 1), dtype=torch.bool)
        self.free = list(range(slots - 1, -1, -1))
        self.layers: dict[int, object] = {}  # id -> the attention impl of every KVarN layer, in order

    @property
    def used(self) -> int:
        return self.slots - len(self.free)

    def reserve_blocks(self, max_block: int) -> None:
        """Grow the per-block tables to cover block ids ``<= max_block``."""
        n = self.block_to_slot.shape[0]
        if max_block < n:
            return
        grow = max(max_block + 1, 2 * n) - n
        self.block_to_slot = torch.cat([self.block_to_slot, torch.full((grow,), -1, dtype=torch.int64)])
        self.committed = torch.cat([self.committed, torch.zeros(grow, dtype=torch.bool)])

    def release(self, blocks: torch.Tensor) -> None:
        """The blocks left their request (finished, preempted) or were committed: free their slots.

        A released block is no longer committed: its next owner writes it from the start.
        """
        blocks = torch.as_tensor(blocks, dtype=torch.int64).reshape(-1)
        if not blocks.numel():
            return
        self.reserve_blocks(int(blocks.max()))
        slots = self.block_to_slot[blocks]
        held = slots >= 0
        self.free.extend(torch.unique(slots[held]).tolist())
        self.block_to_slot[blocks] = -1
        self.committed[blocks] = False

    def release_slots_of(self, blocks: torch.Tensor) -> None:
        """Free the slots of committed blocks (their records hold the tokens now)."""
        slots = self.block_to_slot[blocks]
        self.free.extend(slots[slots >= 0].tolist())
        self.block_to_slot[blocks] = -1

    def allocate(self, blocks: torch.Tensor) -> None:
        """Give every block of ``blocks`` (unique ids) that has no slot one."""
        self.reserve_blocks(int(blocks.max()) if blocks.numel() else 0)
        need = blocks[self.block_to_slot[blocks] < 0]
        if need.numel() > len(self.free):
            raise RuntimeError(
                f"kvarn: the full-precision staging pool is exhausted ({self.slots} slots per layer, "
                f"{need.numel()} more needed); it is sized from max_num_seqs, max_num_batched_tokens "
                "and max_model_len at start-up. Raise additional_config['kvarn']['staging_slots']"
            )
        if need.numel():
            taken = [self.free.pop() for _ in range(need.numel())]
            self.block_to_slot[need] = torch.tensor(taken, dtype=torch.int64)
            self.committed[need] = False

    def slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """Slot of each block id (any shape); blocks without one map to the zero slot."""
        s = self.block_to_slot[blocks]
        return torch.where(s >= 0, s, torch.full_like(s, self.zero_slot))
