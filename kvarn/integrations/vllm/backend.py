"""The KVarN attention backend for vLLM 0.32 (v1 engine): paged tile records, docs/algorithm.md section 5.

Paged layout. The KV block size is the tile G. ``customize_spec`` sets ``tokens_per_state = G`` and
``state_content_bytes = record_bytes(D)``, so a layer's cache is ``[num_blocks, Hk, 1, record]``
(viewed as uint8): one KVarN record per (block, KV head) (:mod:`kvarn.paged`), and the engine sizes
its block pool, hence its reported KV capacity in tokens, from the record size. The fp sink and
tail staging (:mod:`.staging`, one slot per running request) is reserved out of the same budget
(:mod:`.hooks`).

Per step, the metadata builder plans the work of every layer on the host, from host state only
(:mod:`.plan`), and hands the index arrays to the device: for a step of one-token decodes into
persistent buffers, so vLLM captures the layers' launches in full CUDA graphs
(``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``); other steps run eagerly (vLLM's piecewise
graphs around attention). The layers (:class:`~.impl.KVarNAttentionImpl`) then commit, stage and
attend.

Sliding-window layers keep a plain full-precision paged cache (``[nb, Hk, block, 2D]``, K then V).
Not supported (raise at construction): ALiBi, logit soft-capping, attention sinks, cross-layer KV
sharing, encoder attention, quantized sliding-window layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch
from torch.profiler import record_function

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ...config import PRESETS, KVarNConfig, supported_head_dims
from . import exact
from .commit import aligned_offsets, graph_sizes, launch_size, pack_aligned, pad_commits
from .hooks import install_hooks
from .impl import KVarNAttentionImpl
from .plan import PrefillRow, StepPlan, build_plan, padding_plan
from .settings import DEFAULT_PRESET, kv_cache_dtype_names, settings_from_vllm_config
from .staging import StagingPool

# A one-token decode step's index arrays, one entry per row, in the builder's persistent buffer.
_GRAPH_FIELDS = ("commit_src", "commit_dst", "dec_slot", "dec_sink", "dec_tail", "dec_tiles")


@dataclass
class WindowMetadata:
    """Per-step metadata of sliding-window layers (plain fp paged cache); host-side lists."""

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor  # [num_reqs, max_blocks] on the host
    slot_mapping: torch.Tensor


@dataclass
class KVarNMetadata:
    """One step's plan on the device (int32 unless noted; see :class:`~.plan.StepPlan`)."""

    num_tokens: int
    uniform: bool
    commit_src: torch.Tensor | None
    commit_dst: torch.Tensor | None
    move_src: torch.Tensor | None  # int64
    move_dst: torch.Tensor | None
    write_rows: torch.Tensor  # int64
    write_tok: torch.Tensor | None  # int64; None when the rows are the step's tokens in order
    dec_rows: int
    dec_tok: torch.Tensor | None  # int64; None when the rows are the step's tokens in order
    dec_req: torch.Tensor | None  # int64
    dec_slot: torch.Tensor
    dec_sink: torch.Tensor
    dec_tail: torch.Tensor
    dec_tiles: torch.Tensor
    block_table: torch.Tensor  # vLLM's [rows, W]
    prefill: list[PrefillRow]
    dec_plan_rows: int | None = None  # eager steps (CUDA): the graph size the decode launch is planned as
    fresh: "exact.FreshRows | None" = None
    continued: "exact.ContinuedRows | None" = None
    post_src: torch.Tensor | None = None
    post_dst: torch.Tensor | None = None
    post_step_src: torch.Tensor | None = None
    post_step_dst: torch.Tensor | None = None
    late_tok: torch.Tensor | None = None  # int64
    late_rows: torch.Tensor | None = None  # int64
    dec_tile_list: torch.Tensor | None = None  # CPU decode: the pages the rows read, ragged (int64)
    dec_tile_row: torch.Tensor | None = None  # and the decode row of each (int64)
    scratch: dict = field(default_factory=dict)  # buffers the layers of the step share (CPU decode)


def _is_windowed(spec: AttentionSpec) -> bool:
    return getattr(spec, "sliding_window", None) is not None


class KVarNMetadataBuilder(AttentionMetadataBuilder[KVarNMetadata | WindowMetadata]):
    """Plans each step for all KVarN layers of a KV-cache group and owns the group's
    :class:`~.staging.StagingPool`; the model runner hook of :mod:`.hooks` tells it each step's rows
    (:meth:`kvarn_set_rows`) and the requests that left (:meth:`kvarn_release`)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        # Sliding-window layers read host block tables: attention stays outside the graphs.
        return AttentionCGSupport.NEVER if _is_windowed(kv_cache_spec) else cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.windowed = _is_windowed(kv_cache_spec)
        settings = settings_from_vllm_config(vllm_config)
        self.config = settings.config
        self.spec_tokens = settings.spec_tokens(vllm_config)
        sched = vllm_config.scheduler_config
        slots = settings.slots(vllm_config)
        if slots < sched.max_num_seqs:
            raise ValueError(f"kvarn: {slots} staging slots for max_num_seqs={sched.max_num_seqs}; every running "
                             "request needs one")
        self._init_reorder_batch_threshold(1 + self.spec_tokens)  # decode rows first, as FlashAttention's builder
        self.pool = None if self.windowed else StagingPool(slots, self.config)
        self._rows: tuple[list[str], np.ndarray] | None = None
        max_rows, max_tokens = sched.max_num_seqs, max(sched.max_num_batched_tokens, sched.max_num_seqs)
        # Persistent device buffers of the one-token decode steps (the graphs read them in place).
        self._meta = torch.zeros(len(_GRAPH_FIELDS) * aligned_offsets([max_rows], 4)[1], dtype=torch.int32,
                                 device=device)
        self._write = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # Eager launches are sized like the captured ones (:func:`.commit.launch_size`): no Triton
        # compile of a new variant inside a step.
        self.launch_sizes = graph_sizes(vllm_config)
        install_hooks(vllm_config)

    def kvarn_release(self, req_ids) -> None:
        if self.pool is not None:
            self.pool.release(req_ids)

    def kvarn_set_rows(self, req_ids: list[str], block_table: np.ndarray) -> None:
        """This step's requests in row order and the host block table (read by the next :meth:`build`)."""
        self._rows = (req_ids, block_table)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVarNMetadata | WindowMetadata:
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
        rows, self._rows = self._rows, None  # one plan per step: a later build (warm-up) plans padding
        g = self.config.tile
        with record_function("kvarn.plan"):
            if rows is None:
                plan, bt = padding_plan(self.pool, g, self.spec_tokens, cam.num_actual_tokens, r), None
            else:
                req_ids, bt = rows
                lens = cam.seq_lens_cpu_upper_bound
                lens = (lens if lens is not None else cam.seq_lens.cpu()).numpy()
                plan = build_plan(self.pool, req_ids, cam.query_start_loc_cpu.numpy(), lens, bt, g,
                                  self.spec_tokens, cam.num_actual_tokens, r)
            return self._to_device(plan, cam, bt)

    def _host(self, x: np.ndarray) -> torch.Tensor:
        # Pinned by torch's caching host allocator, which keeps the block until the copy has run.
        t = torch.from_numpy(np.ascontiguousarray(x))
        return t if self.device.type == "cpu" else t.pin_memory()

    def _upload(self, arrays: dict[str, np.ndarray | None], dtype) -> dict[str, torch.Tensor | None]:
        """The arrays on the device, in one host-to-device copy (views of one buffer, each 16-byte
        aligned: :func:`.commit.aligned_offsets`); None or empty ones stay None."""
        live = {k: a for k, a in arrays.items() if a is not None and np.size(a)}
        out: dict[str, torch.Tensor | None] = {k: None for k in arrays}
        if not live:
            return out
        packed, where = pack_aligned(live, dtype)
        flat = self._host(packed).to(self.device, non_blocking=True)
        out.update({k: flat[part] for k, part in where.items()})
        return out

    def _to_device(self, plan: StepPlan, cam: CommonAttentionMetadata, bt: np.ndarray | None) -> KVarNMetadata:
        n = plan.dec_slot.shape[0]
        if plan.uniform and self.device.type != "cpu":  # into the persistent buffers, at offsets fixed by the row count
            # Each field 16-byte aligned, as in eager steps; offsets fixed by the row count.
            packed, where = pack_aligned({k: getattr(plan, k) for k in _GRAPH_FIELDS}, np.int32)
            meta = self._meta[: packed.size]
            meta.copy_(self._host(packed), non_blocking=True)
            write = self._write[: plan.num_tokens]
            write.copy_(self._host(plan.write_rows), non_blocking=True)
            return KVarNMetadata(
                num_tokens=plan.num_tokens, uniform=True, move_src=None, move_dst=None, write_rows=write,
                write_tok=None, dec_rows=n, dec_tok=None, dec_req=None, block_table=cam.block_table_tensor,
                prefill=[], **{k: meta[part] for k, part in where.items()})
        # Eager steps: every index array of the step in two copies (int32 for the kernels and
        # FlashAttention's boundaries, int64 for torch's index ops).
        fr, co = plan.fresh, plan.continued
        commits = {"commit": (plan.commit_src, plan.commit_dst), "post": (plan.post_src, plan.post_dst),
                   "post_step": (plan.post_step_src, plan.post_step_dst)}
        if self.device.type != "cpu":
            commits = {k: pad_commits(*pair, self.launch_sizes) for k, pair in commits.items()}
        i32 = self._upload({
            **{f"{k}_{end}": a for k, pair in commits.items() for end, a in zip(("src", "dst"), pair)},
            "dec_slot": plan.dec_slot, "dec_sink": plan.dec_sink, "dec_tail": plan.dec_tail,
            "dec_tiles": plan.dec_tiles, "fresh_cu": fr.cu if fr else None,
            "cu_q": co.cu_q if co else None, "cu_k": co.cu_k if co else None}, np.int32)
        i64 = self._upload({
            "move_src": plan.move_src, "move_dst": plan.move_dst, "write_rows": plan.write_rows,
            "write_tok": plan.write_tok, "dec_tok": plan.dec_tok, "dec_req": plan.dec_req,
            "late_tok": plan.late_tok, "late_rows": plan.late_rows,
            "fresh_tok": fr.tok if fr and not fr.contiguous else None,
            **({f"co_{k}": getattr(co, k) for k in ("q_tok", "stage_src", "stage_dst", "rec_pages", "rec_dst",
                                                     "chunk_dst")} if co else {})}, np.int64)
        md = KVarNMetadata(
            num_tokens=plan.num_tokens, uniform=False, commit_src=i32["commit_src"], commit_dst=i32["commit_dst"],
            move_src=i64["move_src"], move_dst=i64["move_dst"], write_rows=i64["write_rows"],
            write_tok=i64["write_tok"], dec_rows=n, dec_tok=i64["dec_tok"], dec_req=i64["dec_req"],
            dec_slot=i32["dec_slot"], dec_sink=i32["dec_sink"], dec_tail=i32["dec_tail"], dec_tiles=i32["dec_tiles"],
            block_table=cam.block_table_tensor, prefill=plan.prefill, post_src=i32["post_src"],
            post_dst=i32["post_dst"], post_step_src=i32["post_step_src"], post_step_dst=i32["post_step_dst"],
            late_tok=i64["late_tok"], late_rows=i64["late_rows"],
            dec_plan_rows=launch_size(n, self.launch_sizes) if n and self.device.type != "cpu" else None)
        if fr is not None:
            tok = slice(int(fr.tok[0]), int(fr.tok[-1]) + 1) if fr.contiguous else i64["fresh_tok"]
            md.fresh = exact.FreshRows(tok=tok, cu=i32["fresh_cu"], longest=fr.longest, bounds=fr.cu.tolist())
        if co is not None:
            md.continued = exact.ContinuedRows(
                q_tok=i64["co_q_tok"], cu_q=i32["cu_q"], cu_k=i32["cu_k"], max_q=co.max_q, max_k=co.max_k,
                stage_src=i64["co_stage_src"], stage_dst=i64["co_stage_dst"], rec_pages=i64["co_rec_pages"],
                rec_dst=i64["co_rec_dst"], chunk_dst=i64["co_chunk_dst"], bounds_q=co.cu_q.tolist(),
                bounds_k=co.cu_k.tolist())
        if self.device.type == "cpu" and n and bt is not None:
            md.dec_tile_list, md.dec_tile_row = _ragged_tiles(plan, bt, self.config)
        elif self.device.type == "cpu":
            md.dec_tile_list, md.dec_tile_row = torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
        return md


def _ragged_tiles(plan: StepPlan, bt: np.ndarray, cfg: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages every decode row reads, concatenated, and the row of each (the CPU decode's input)."""
    counts = plan.dec_tiles.astype(np.int64)
    row = np.repeat(np.arange(counts.size), counts)
    col = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts) + cfg.sink_tokens // cfg.tile
    pages = bt[plan.dec_req[row], col].astype(np.int64)
    return torch.from_numpy(pages), torch.from_numpy(row)


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


__all__ = ["KVarNAttentionBackend", "KVarNMetadata", "KVarNMetadataBuilder", "backend_class_path"]
