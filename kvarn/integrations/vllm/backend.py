"""The KVarN attention backend for vLLM 0.32 (v1 engine): paged tile records, docs/algorithm.md section 5.

Paged layout. The KV block size is the tile G. ``customize_spec`` sets ``tokens_per_state = G`` and
``state_content_bytes = record_bytes(D)``, so a layer's cache is ``[num_blocks, Hk, 1, record]``
(viewed as uint8): one KVarN record of docs/algorithm.md section 4 per (block, KV head), and the engine sizes
its block pool, hence its reported KV capacity in tokens, from the record size.

Per request and step (``ctx`` cached tokens, ``n`` new ones, ``L = ctx + n``):
1. commit the staged full tiles before ``ctx`` (accepted) that are not committed yet, unless the
   request is still prefilling (chunked prefill: its prompt stays in fp until the prompt is done);
2. stage the new K/V in full precision (:mod:`.staging`);
3. attention: if every query token lies in the fp tail, the packed decode path
   (``kvarn.attention.decode_attention``, or ``kvarn.kernels.decode_attention`` on CUDA) over
   [sink fp | packed tiles | tail fp]; otherwise (prefill, chunked prefill) an explicit causal
   attention over [sink fp | dequantized tiles | fp tokens], exact for the prompt itself;
4. without speculative decoding every scheduled token is accepted: commit the full tiles now
   (after the prompt: prefill tiles are committed at the first decode step, before it reads them).

Sliding-window layers keep a plain full-precision paged cache (``[nb, Hk, block, 2D]``, K then V).
Not supported (raise at construction): ALiBi, logit soft-capping, attention sinks, cross-layer KV
sharing, encoder attention, quantized sliding-window layers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ...attention import decode_attention
from ...codec import decode_tiles, records_to_fields
from ...config import PRESETS, KVarNConfig, supported_head_dims
from ...hadamard import rotate
from .settings import DEFAULT_PRESET, kv_cache_dtype_names, settings_from_vllm_config
from .staging import LayerStaging

logger = logging.getLogger(__name__)


@dataclass
class KVarNMetadata:
    """Per-step metadata; host-side lists because the backend walks requests on the host."""

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] on the host
    slot_mapping: torch.Tensor
    prefilling: list[bool]  # the request's prompt is not fully computed after this step's chunk


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata:
        cam = common_attn_metadata
        r = cam.num_reqs
        prefilling = cam.is_prefilling[:r].tolist() if cam.is_prefilling is not None else [False] * r
        return KVarNMetadata(
            num_actual_tokens=cam.num_actual_tokens,
            query_start_loc=cam.query_start_loc_cpu[: r + 1].tolist(),
            seq_lens=cam.seq_lens[:r].tolist(),
            block_table=cam.block_table_tensor[:r].cpu(),
            slot_mapping=cam.slot_mapping,
            prefilling=prefilling,
        )


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


class KVarNAttentionImpl(AttentionImpl[KVarNMetadata]):
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
        self.speculative = vllm_config.speculative_config is not None
        self.staging: LayerStaging | None = None
        self._cache_ptr: int | None = None
        self._triton_logged = False

    # dispatch ----------------------------------------------------------------------------------
    def _use_triton(self, x: torch.Tensor) -> bool:
        mode = self.settings.kernels
        use = mode == "triton" or (mode == "auto" and x.is_cuda and self.head_size >= 64 and self.config.tile >= 64)
        if not self._triton_logged:
            logger.info("kvarn vLLM backend: %s kernels (kernels=%s, device=%s)",
                        "Triton" if use else "torch reference", mode, x.device)
            self._triton_logged = True
        return use

    # forward -----------------------------------------------------------------------------------
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the KVarN backend")
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata is None:  # profiling / warm-up
            return output
        md = attn_metadata
        out = output.view(-1, self.num_heads, self.head_size)
        q = query.view(-1, self.num_heads, self.head_size)
        k = key.view(-1, self.num_kv_heads, self.head_size)
        v = value.view(-1, self.num_kv_heads, self.head_size)
        if self.sliding_window is not None:
            self._forward_fp(q, k, v, kv_cache, md, out)
        else:
            self._forward_kvarn(q, k, v, kv_cache, md, out)
        return output

    def _forward_kvarn(self, q, k, v, kv_cache, md, out) -> None:
        cfg, g = self.config, self.config.tile
        pages = kv_cache.view(torch.uint8)[:, :, 0]  # [num_blocks, Hk, record_bytes]
        if self.staging is None or self._cache_ptr != kv_cache.data_ptr():
            # A new cache tensor (the engine allocates it after its dummy runs): nothing staged is valid.
            self._cache_ptr = kv_cache.data_ptr()
            self.staging = LayerStaging(cfg, self.num_kv_heads, self.head_size, k.dtype, k.device,
                                        self.settings.stale_steps)
        st = self.staging
        st.begin_step()
        use_triton = self._use_triton(q)
        sink_blocks = cfg.sink_tokens // g
        for r in range(len(md.seq_lens)):
            q0, q1 = md.query_start_loc[r], md.query_start_loc[r + 1]
            n, length = q1 - q0, md.seq_lens[r]
            if n == 0:
                continue
            ctx = length - n
            blocks = md.block_table[r, : -(-length // g)].tolist()
            if md.prefilling[r]:  # chunked prefill: the prompt's own attention stays exact
                st.write(blocks, ctx, k[q0:q1], v[q0:q1])
                out[q0:q1] = self._attend(q[q0:q1], blocks, length, st, pages, use_triton).to(out.dtype)
                continue
            st.commit(blocks[sink_blocks: ctx // g], pages, use_triton)
            st.write(blocks, ctx, k[q0:q1], v[q0:q1])
            out[q0:q1] = self._attend(q[q0:q1], blocks, length, st, pages, use_triton).to(out.dtype)
            if not self.speculative:
                st.commit(blocks[sink_blocks: length // g], pages, use_triton)

    def _attend(self, q, blocks, length, st, pages, use_triton) -> torch.Tensor:
        """q: ``[n, Hq, D]`` for the last n tokens of a sequence of ``length`` -> ``[n, Hq, D]``."""
        cfg, g, d = self.config, self.config.tile, self.head_size
        n, ctx = q.shape[0], length - q.shape[0]
        s = min(cfg.sink_tokens, length)
        sink_blocks = cfg.sink_tokens // g
        nt = 0
        while sink_blocks + nt < length // g and blocks[sink_blocks + nt] in st.committed:
            nt += 1
        tail0 = s + nt * g
        sink_k, sink_v = st.gather(blocks, 0, s)
        tail_k, tail_v = st.gather(blocks, tail0, length)
        tiles = None
        if nt:
            idx = torch.tensor(blocks[sink_blocks: sink_blocks + nt], device=pages.device)
            records = pages.index_select(0, idx).transpose(0, 1)[None].contiguous()  # [1, Hk, nt, R]
            tiles = records_to_fields(records, cfg, d)
        if ctx >= tail0:  # every query token is in the fp tail: packed decode path
            fn = decode_attention
            if use_triton:
                from ...kernels import decode_attention as fn
            o = fn(q.transpose(0, 1)[None], sink_k[None] if s else None, sink_v[None] if s else None,
                   tiles, tail_k[None], tail_v[None], cfg, self.scale, causal=True, fp_frame="model")
            return o[0].transpose(0, 1)
        keys, values = [sink_k.float()], [sink_v.float()]
        if tiles is not None:
            kt, vt = decode_tiles(tiles, cfg)  # rotated: [1, Hk, nt, D, G], [1, Hk, nt, G, D]
            keys.append(rotate(kt[0].transpose(-1, -2).reshape(self.num_kv_heads, nt * g, d)))
            values.append(rotate(vt[0].reshape(self.num_kv_heads, nt * g, d)))
        keys.append(tail_k.float())
        values.append(tail_v.float())
        return self._causal(q, torch.cat(keys, 1), torch.cat(values, 1), ctx, None)

    def _causal(self, q, keys, values, ctx, window) -> torch.Tensor:
        """Exact attention of ``q [n, Hq, D]`` at positions ``ctx..`` over ``keys [Hk, L, D]``."""
        n, length = q.shape[0], keys.shape[1]
        qpos = torch.arange(ctx, ctx + n, device=q.device)[:, None]
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        group = self.num_heads // self.num_kv_heads
        kk = keys.float().repeat_interleave(group, 0)
        vv = values.float().repeat_interleave(group, 0)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1).float(), kk, vv, attn_mask=mask, scale=self.scale)
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
