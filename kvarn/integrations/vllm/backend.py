"""The KVarN attention backend for vLLM 0.32 (v1 engine): paged tile records, docs/algorithm.md section 5.

Paged layout. The KV block size is the tile G. ``customize_spec`` sets ``tokens_per_state = G`` and
``state_content_bytes = record_bytes(D)``, so a layer's cache is ``[num_blocks, Hk, 1, record]``
(viewed as uint8): one KVarN record of docs/algorithm.md section 4 per (block, KV head), and the engine sizes
its block pool, hence its reported KV capacity in tokens, from the record size.

Per step, the metadata builder turns vLLM's block table, ``seq_lens`` and slot mapping into one
:class:`~.plan.StepPlan` of index tensors for every layer (:mod:`.plan`). The layers
(:class:`~.impl.KVarNAttentionImpl`) then stage their new tokens with one ``index_copy_``; the step's
first layer encodes the tiles to commit of every layer at once (``encode_records``, in chunks of
bounded size); each layer runs one batched decode attention for all decoding requests and one
batched exact attention for all prefilling ones (:mod:`.exact`). The fp sink and tail staging is a
fixed pool reserved out of vLLM's KV budget (:mod:`.staging`, :mod:`.hooks`).

Sliding-window layers keep a plain full-precision paged cache (``[nb, Hk, block, 2D]``, K then V).
Not supported (raise at construction): ALiBi, logit soft-capping, attention sinks, cross-layer KV
sharing, encoder attention, quantized sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch.profiler import record_function

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ...config import PRESETS, KVarNConfig, supported_head_dims
from .hooks import install_hooks
from .impl import KVarNAttentionImpl
from .plan import StepPlan, build_plan
from .settings import DEFAULT_PRESET, kv_cache_dtype_names, settings_from_vllm_config
from .staging import StagingIndex


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


__all__ = ["KVarNAttentionBackend", "KVarNMetadataBuilder", "backend_class_path"]
