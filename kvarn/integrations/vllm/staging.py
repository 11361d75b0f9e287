"""Full-precision staging of one attention layer, keyed by vLLM block id, and tile commits.

A vLLM block of ``G`` tokens (one tile) holds, per KV head, one KVarN record of docs/algorithm.md section 4 in the
paged cache. Tokens that are not in a committed record live here, in the model's frame and dtype:

- the sink: the first ``S`` tokens of every sequence (``S / G`` blocks), for the sequence's life;
- the unfinished tiles: blocks whose tokens are not all accepted yet (normally just the last one).

A block is *committed* (encoded once into its record, its staging slot released) when all its G
tokens are accepted: tokens before the request's ``num_computed_tokens`` always are, and without
speculative decoding every scheduled token is. A committed block is never re-encoded; new tokens
written into a block (the block was freed and reused) make it uncommitted again.

Slot lifetime. vLLM does not tell attention backends that a request finished, so a slot is
released when its block is committed, reused by the next writer of the block, or, once the pool
is full, when no step has touched it for ``stale_steps`` forward passes (a running request touches
its sink and tail slots at every step it is scheduled; finished and preempted requests never do
again). Reading a slot that is gone raises ``RuntimeError``; it is never silently zero.

Memory: ``2 * slots * Hk * G * D * itemsize`` bytes per layer, outside vLLM's KV cache budget
(the engine's reported capacity counts the paged records only). The pool starts small and doubles.
"""

from __future__ import annotations

import logging

import torch

from ...codec import check_encoded, encode_tiles, fields_to_records, kv_to_tiles, rotate_kv
from ...config import KVarNConfig

logger = logging.getLogger(__name__)


def encode_records(k: torch.Tensor, v: torch.Tensor, config: KVarNConfig, use_triton: bool) -> torch.Tensor:
    """Full tiles in the model frame ``[n, Hk, G, D]`` -> uint8 records ``[n, Hk, record_bytes]``."""
    n, hk, g, d = k.shape
    kt, vt = kv_to_tiles(rotate_kv(k, config), rotate_kv(v, config), g)  # [n, Hk, 1, D, G], [n, Hk, 1, G, D]
    kt, vt = kt[:, :, 0], vt[:, :, 0]
    if use_triton:
        from ...kernels import encode_tiles as triton_encode_tiles

        fields = triton_encode_tiles(kt, vt, config)
        check_encoded(fields, kt, vt)  # the kernel has no range guard of its own
    else:
        fields = encode_tiles(kt, vt, config)
    return fields_to_records(fields, config, d)


class LayerStaging:
    """Staging slots ``[slots, Hk, G, D]`` for K and V plus the committed-block set of one layer."""

    def __init__(self, config: KVarNConfig, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, stale_steps: int, initial_slots: int = 8):
        self.config, self.tile = config, config.tile
        self.shape = (num_kv_heads, config.tile, head_dim)
        self.k = torch.zeros(initial_slots, *self.shape, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.slot_of: dict[int, int] = {}
        self.block_of: list[int | None] = [None] * initial_slots
        self.last_used = [0] * initial_slots
        self.free = list(range(initial_slots - 1, -1, -1))
        self.committed: set[int] = set()
        self.stale_steps = stale_steps
        self.step = 0

    # slots --------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.step += 1

    def _release(self, slot: int) -> None:
        block = self.block_of[slot]
        if block is not None:
            del self.slot_of[block]
        self.block_of[slot] = None
        self.free.append(slot)

    def _allocate(self) -> int:
        if not self.free:
            for slot, block in enumerate(self.block_of):
                if block is not None and self.step - self.last_used[slot] >= self.stale_steps:
                    self._release(slot)
        if not self.free:
            old = self.k.shape[0]
            self.k = torch.cat([self.k, torch.zeros_like(self.k)])
            self.v = torch.cat([self.v, torch.zeros_like(self.v)])
            self.block_of += [None] * old
            self.last_used += [0] * old
            self.free = list(range(2 * old - 1, old - 1, -1))
            logger.info("kvarn staging grew to %d slots (%.1f MiB per layer)", 2 * old,
                        2 * self.k.numel() * self.k.element_size() / 2**20)
        return self.free.pop()

    def _slot(self, block: int, create: bool) -> int:
        slot = self.slot_of.get(block)
        if slot is None:
            if not create:
                raise RuntimeError(
                    f"kvarn: the full-precision tokens of KV block {block} are no longer staged "
                    "(a request was not scheduled for more than stale_steps steps); raise "
                    "additional_config['kvarn']['stale_steps']"
                )
            slot = self._allocate()
            self.slot_of[block] = slot
            self.block_of[slot] = block
        self.last_used[slot] = self.step
        return slot

    # tokens -------------------------------------------------------------------------------------
    def write(self, blocks: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stage tokens ``start .. start+n-1`` of a request. k, v: ``[n, Hk, D]``; blocks: its block row."""
        g, pos, n = self.tile, start, k.shape[0]
        while pos < start + n:
            b, off = blocks[pos // g], pos % g
            m = min(g - off, start + n - pos)
            slot = self._slot(b, create=True)
            self.committed.discard(b)
            i = pos - start
            self.k[slot, :, off:off + m] = k[i:i + m].transpose(0, 1)
            self.v[slot, :, off:off + m] = v[i:i + m].transpose(0, 1)
            pos += m

    def gather(self, blocks: list[int], start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Staged tokens ``start .. stop-1`` of a request -> K, V ``[Hk, stop-start, D]``."""
        g = self.tile
        if stop <= start:
            empty = self.k.new_zeros(self.shape[0], 0, self.shape[2])
            return empty, empty
        first, last = start // g, (stop - 1) // g
        slots = [self._slot(blocks[i], create=False) for i in range(first, last + 1)]
        idx = torch.tensor(slots, device=self.k.device)
        hk, _, d = self.shape
        k = self.k.index_select(0, idx).transpose(0, 1).reshape(hk, -1, d)
        v = self.v.index_select(0, idx).transpose(0, 1).reshape(hk, -1, d)
        lo = start - first * g
        return k[:, lo:lo + stop - start], v[:, lo:lo + stop - start]

    # commits ------------------------------------------------------------------------------------
    def commit(self, blocks: list[int], pages: torch.Tensor, use_triton: bool) -> None:
        """Encode the staged full tiles of ``blocks`` into ``pages[block]`` (uint8 ``[nb, Hk, R]``)."""
        todo = [b for b in dict.fromkeys(blocks) if b not in self.committed]
        if not todo:
            return
        slots = [self._slot(b, create=False) for b in todo]
        idx = torch.tensor(slots, device=self.k.device)
        records = encode_records(self.k.index_select(0, idx), self.v.index_select(0, idx), self.config, use_triton)
        pages[torch.tensor(todo, device=pages.device)] = records.to(pages.device)
        for b, slot in zip(todo, slots):
            self._release(slot)
            self.committed.add(b)
