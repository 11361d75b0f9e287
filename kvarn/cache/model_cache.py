"""``KVarNCache``: a transformers ``Cache`` that stores K/V with a kvarn method (docs/algorithm.md section 5).

One layer object per decoder layer: a :class:`~kvarn.cache.layer.KVarNLayer` for full attention
(and for sliding-window attention when ``quantize_sliding_window=True``), transformers' own
``DynamicSlidingWindowLayer`` (full precision) for sliding-window or chunked attention otherwise.
Any other layer type (linear attention, mamba, conv, ...) raises ``ValueError``
(:mod:`kvarn.cache.layer_types`).

Left padding. Each row's sink and tiles start at its first real token, so pads never enter a tile or
a scale. The cache learns the padding from the prefill's ``attention_mask``: pass it explicitly
(``attention_mask=`` or :meth:`KVarNCache.set_padding`), or, when built from a model, let a forward
pre-hook read it from the model's first call with this cache (the hook then removes itself).
Only left padding is accepted (``0...0 1...1`` per row).

Methods (``method=``; every one uses the same tiles, sink and tail, see :mod:`kvarn.methods`):

- ``fp16``: no quantization; token for token identical to transformers' ``DynamicCache``.
- ``kvarn``: KVarN (Muller et al., arXiv 2606.03458): Hadamard rotation, dual-axis variance
  normalization, per-channel K / per-token V round-to-nearest.
- ``kivi``: KIVI (Liu et al., ICML 2024, arXiv 2402.02750): per-channel keys, per-token values.
- ``rtn``: plain asymmetric round-to-nearest per token for keys and values.
- ``quarot``: QuaRot-style (Ashkboos et al., NeurIPS 2024, arXiv 2404.00456): Hadamard + per-token RTN.
- ``hkivi``: the KVarN paper's "HK" ablation: Hadamard rotation + KIVI.
- ``varn``: the KVarN paper's "VarN" ablation: variance normalization without rotation.
- ``fp8``: FP8 e4m3 with an fp16 per-token scale (vLLM's fp8 KV-cache format).
- ``kvarn-auto``: kvarn's records, with rotation and normalization chosen per (row, layer, KV head)
  from the prompt (:mod:`kvarn.auto`, :mod:`kvarn.auto.layer`); it reads the prefill's queries
  (:mod:`kvarn.auto.prompt_capture`), so it needs the model itself (built from a config or None,
  every layer is KVarN, with a warning); a row whose prompt is shorter than ``sink_tokens + tile``
  decides when its first tile past the sink completes, from the queries the decode steps bring.
  :meth:`KVarNCache.flavours` and ``memory_report()["flavours"]`` report the choices, when each was
  made and from how many queries.

Two more baselines are transformers' own quantized cache layers, not kvarn codecs: ``hf-quanto``
and ``hf-hqq`` (:mod:`kvarn.cache.hf_baselines`); ``decoded_cache`` is ignored for them.

Memory. :meth:`KVarNCache.memory_report` counts what is stored: encoded tiles at their format's
bytes (kvarn records padded to 8 bytes, docs/algorithm.md; methods without normalization store no
column scales), sink and tail at the model dtype's size (so an fp32 model's full-precision parts
count 4 bytes per element), and sliding-window layers as transformers holds them. Its baseline is
the model's own cache in the model dtype (``baseline_bytes``, ``baseline_dtype``); the fp16 figure
is a separate field.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import replace, fields as dc_fields

import torch
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer, QuantizedLayer

from ..auto.rules import AutoSettings
from ..config import KVarNConfig, check_head_dim
from ..methods import METHODS, Method, TileCodec, get_method
from .hf_baselines import HF_GROUP, HF_METHODS, hf_layer_factory, hf_memory
from .layer import KVarNLayer
from .layer_types import SLIDING_TYPES, layer_types_of, text_config
from .memory import dense_entry, total_entry

logger = logging.getLogger(__name__)


class _Padding:
    pads: list[int] | None = None


def _get_any_method(name) -> Method:
    if isinstance(name, Method):
        return name
    if isinstance(name, str) and name in HF_METHODS:
        return HF_METHODS[name]
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid kvarn methods: {sorted(METHODS)}; "
                         f"transformers baselines: {sorted(HF_METHODS)}")
    return get_method(name)


def pads_from_mask(attention_mask: torch.Tensor) -> list[int]:
    """Left-padding lengths from a ``[B, L]`` 0/1 mask; ValueError unless every row is ``0..0 1..1``."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError("attention_mask must be a 2-D tensor [batch, length] of 0/1")
    m = attention_mask.to(torch.bool).cpu()
    pads = (~m).long().cumprod(dim=1).sum(dim=1)
    ok = m.sum(dim=1) == m.shape[1] - pads
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0])
        raise ValueError(
            f"attention_mask row {row} is not left-padded (0...0 1...1); KVarNCache supports left padding only"
        )
    return pads.tolist()


class KVarNCache(Cache):
    """A transformers ``Cache`` quantizing K/V with a kvarn method, for ``model.generate``.

    model_or_config: a transformers model or its config (layer types, sliding windows), or None
        (layers created lazily, all full attention).
    method: one of :data:`kvarn.methods.METHODS` (``fp16``, ``kvarn``, ``kivi``, ``rtn``, ``quarot``,
        ``hkivi``, ``varn``, ``fp8``) or of :data:`~kvarn.cache.hf_baselines.HF_METHODS` (``hf-quanto``,
        ``hf-hqq``: transformers' quantized layers; one bit width for K and V, no sink, ``decoded_cache``
        ignored).
    preset: a preset name of :data:`kvarn.PRESETS` or a :class:`KVarNConfig`.
    attention_mask: the prefill's ``[B, L]`` mask, for left padding (else read from the model's call).
    decoded_cache: keep each frozen tile's dequantized float32 K/V (a working copy of the reference
        read path, decoded once when the tile freezes) instead of re-decoding the history every
        step. Faster on CPU; reported as ``decoded_cache_bytes``, apart from the stored bytes.
    overrides: KVarNConfig fields (``tile``, ``sink_tokens``, ``sinkhorn_iters``,
        ``quantize_sliding_window``, ...).
    auto: :class:`kvarn.auto.AutoSettings` of ``kvarn-auto`` (decision rule, sampled queries).
    kernels: who makes the codec's passes over the tiles (:class:`kvarn.methods.TileCodec`):
        ``"auto"`` (numba's loops on CPU where numba is installed: the same bits, the encode 2-3x
        faster), ``"numba"`` or ``"torch"``.
    """

    def __init__(self, model_or_config=None, method: str = "kvarn", preset: str | KVarNConfig = "k2v2_g128",
                 *, attention_mask: torch.Tensor | None = None, decoded_cache: bool = False,
                 auto: AutoSettings | None = None, kernels: str = "auto", **overrides):
        self.method = _get_any_method(method)
        self._padding = _Padding()
        self._hook = None
        self._model_ref = None
        self._auto_hooks = []
        if auto is not None and self.method.name != "kvarn-auto":
            raise ValueError(f"auto= is only meaningful for method 'kvarn-auto', not {self.method.name!r}")
        if self.method.name == "kvarn-auto" and not isinstance(model_or_config, torch.nn.Module):
            logger.warning("kvarn-auto without the model (a config or None) cannot see the prefill's queries: "
                           "every layer uses KVarN unless its observe() is called")
        if self.method.name in HF_METHODS:
            if kernels != "auto":
                raise ValueError(f"kernels={kernels!r} chooses kvarn's codec passes; method {self.method.name!r} "
                                 "is transformers' own quantized cache (leave kernels='auto')")
            self._init_hf(model_or_config, preset, overrides, attention_mask)
            return
        self.codec = TileCodec(self.method, _make_config(preset, overrides), kernels)
        self.config = self.codec.config  # the method's ranges resolved (kvarn-auto's, kvarn.auto.auto_ranges)
        layer_cls = KVarNLayer
        if self.method.name == "kvarn-auto":
            # kvarn-auto's layer and hooks are built on this package's layers: imported where used
            from ..auto.layer import KVarNAutoLayer

            layer_cls = functools.partial(KVarNAutoLayer, settings=auto or AutoSettings())
        if attention_mask is not None:
            self._padding.pads = pads_from_mask(attention_mask)
        if model_or_config is None:
            super().__init__(layer_class_to_replicate=lambda: layer_cls(self.codec, self._padding,
                                                                         decoded_cache=decoded_cache))
            return
        text = text_config(model_or_config)
        layers = []
        for kind, window in layer_types_of(text):
            if kind in SLIDING_TYPES and not self.config.quantize_sliding_window:
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
            else:
                layers.append(layer_cls(self.codec, self._padding, is_sliding=kind in SLIDING_TYPES,
                                         decoded_cache=decoded_cache))
        head_dim = getattr(text, "head_dim", None)
        if head_dim is None and getattr(text, "num_attention_heads", None):
            head_dim = text.hidden_size // text.num_attention_heads
        if head_dim is not None and any(isinstance(layer, KVarNLayer) for layer in layers):
            check_head_dim(int(head_dim))
        super().__init__(layers=layers)
        if isinstance(model_or_config, torch.nn.Module):
            self._model_ref = weakref.ref(model_or_config)
            if attention_mask is None:
                self._install_hook()
            if self.method.name == "kvarn-auto":
                from ..auto.prompt_capture import install_prompt_capture

                self._auto_hooks = install_prompt_capture(model_or_config, self)
                for layer in self.layers:
                    if isinstance(layer, KVarNAutoLayer):
                        layer.expects_queries = True

    def _init_hf(self, model_or_config, preset, overrides, attention_mask) -> None:
        """Layers of transformers' quantized cache (``hf-quanto`` / ``hf-hqq``): no sink, no tiles."""
        if overrides.get("sink_tokens"):
            raise ValueError(f"method {self.method.name!r} has no full-precision sink; "
                             f"got sink_tokens={overrides['sink_tokens']}")
        self.config = _make_config(preset, {**overrides, "sink_tokens": 0})
        self.codec = None
        if attention_mask is not None:  # validated; pads are quantized like tokens, as in transformers
            self._padding.pads = pads_from_mask(attention_mask)
        make = hf_layer_factory(self.method, self.config)
        if model_or_config is None:
            super().__init__(layer_class_to_replicate=make)
            return
        text = text_config(model_or_config)
        layers = [DynamicSlidingWindowLayer(sliding_window=window) if kind in SLIDING_TYPES else make()
                  for kind, window in layer_types_of(text)]
        head_dim = getattr(text, "head_dim", None)
        if head_dim is None and getattr(text, "num_attention_heads", None):
            head_dim = text.hidden_size // text.num_attention_heads
        if head_dim is not None and int(head_dim) % HF_GROUP:
            raise ValueError(f"method {self.method.name!r} quantizes groups of {HF_GROUP} channels; "
                             f"head_dim={head_dim} is not a multiple of {HF_GROUP}")
        super().__init__(layers=layers)

    # padding ------------------------------------------------------------------------------------
    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Declare the prefill's left padding (``[B, L]`` 0/1 mask, or None for none)."""
        if any(getattr(layer, "is_initialized", False) for layer in self.layers):
            raise ValueError("set_padding must be called before the first forward with this cache")
        self._padding.pads = None if attention_mask is None else pads_from_mask(attention_mask)

    def _install_hook(self) -> None:
        model = self._model_ref() if self._model_ref is not None else None
        if model is None or self._hook is not None:
            return
        cache_ref = weakref.ref(self)

        def hook(module, args, kwargs):
            cache = cache_ref()
            if cache is None:
                handle.remove()
                return None
            if kwargs.get("past_key_values") is not cache or cache.get_seq_length() > 0:
                return None
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                cache.set_padding(mask)
            handle.remove()
            cache._hook = None
            return None

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        self._hook = handle

    def reset(self):
        super().reset()
        self._padding.pads = None
        self._install_hook()

    # state --------------------------------------------------------------------------------------
    def freeze(self) -> None:
        """Declare every cached token accepted and encode all complete tiles now."""
        for layer in self.layers:
            if isinstance(layer, KVarNLayer) and layer.is_initialized:
                layer.freeze()

    def flavours(self) -> dict[int, list[dict] | None]:
        """kvarn-auto: per quantized layer, per row, ``decided``, when (``decided_at``: ``"prefill"`` or
        ``"first_tile"``) and from how many tokens and queries, ``pending`` and each KV head's
        flavour name (:meth:`kvarn.codec.flavour.Flavours.names`; :meth:`kvarn.auto.layer.KVarNAutoLayer.flavours`);
        None for a layer that has seen no query yet. {} otherwise."""
        if self.method.name != "kvarn-auto":
            return {}
        from ..auto.layer import KVarNAutoLayer

        return {i: layer.flavours() for i, layer in enumerate(self.layers) if isinstance(layer, KVarNAutoLayer)}

    def check_numerics(self) -> None:
        """ValueError if a tile frozen without a host read (the fused decode step) had a non-finite
        fp16 scale; other encodes check at once. ``memory_report()`` calls it too."""
        for layer in self.layers:
            if isinstance(layer, KVarNLayer):
                layer.codec.raise_deferred()

    def memory_report(self) -> dict:
        """Bytes actually stored, per layer and in total, against what the model's own cache holds.

        Per layer and in ``total``: ``tokens`` (real tokens held, summed over rows),
        ``quantized_tiles`` (tile x KV-head records), ``quantized_bytes`` (encoded tiles: codes and
        scales, kvarn records padded as in docs/algorithm.md), ``full_precision_bytes`` (sink, tail,
        sliding-window layers and unquantized tiles, in the model dtype), ``total_bytes``;
        ``baseline_bytes``: the same tokens' K and V as the model's own cache holds them, in the
        model dtype named by ``baseline_dtype`` (``"float32"`` for an fp32 model), and
        ``compression_ratio`` = baseline over total; ``fp16_equivalent_bytes`` and
        ``compression_vs_fp16``: the same against fp16 K and V, whatever the model dtype;
        ``reserved_bytes`` (allocated buffer capacity: buffers grow by 10% at a time, so it stays
        within 10% of the stored bytes plus one full-precision tile per row and layer, for rows of
        equal length) and ``decoded_cache_bytes`` (the optional dequantized working copy; not part
        of ``total_bytes``).
        """
        self.check_numerics()
        layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, KVarNLayer):
                entry = layer.memory()
                kind = "quantized"
            elif isinstance(layer, QuantizedLayer):
                entry = hf_memory(layer)
                kind = "quantized_hf"
            else:
                entry = dense_entry(getattr(layer, "keys", None))
                kind = "full_precision_sliding"
            layers.append({"layer": i, "kind": kind, **entry})
        total = total_entry(layers)
        auto = {"flavours": self.flavours()} if self.method.name == "kvarn-auto" else {}
        return {"method": self.method.name, "preset": self.config.name,
                "sink_tokens": self.config.sink_tokens, "total": total, "layers": layers, **auto}

    def __repr__(self):
        return f"KVarNCache(method={self.method.name!r}, config={self.config!r}, layers={len(self.layers)})"


def _make_config(preset, overrides) -> KVarNConfig:
    valid = {f.name for f in dc_fields(KVarNConfig)}
    bad = sorted(set(overrides) - valid)
    if bad:
        raise ValueError(f"unknown KVarNCache option(s) {bad}; valid config fields: {sorted(valid)}")
    if isinstance(preset, KVarNConfig):
        return replace(preset, **overrides) if overrides else preset
    if not isinstance(preset, str):
        raise TypeError(f"preset must be a preset name or a KVarNConfig, got {type(preset).__name__}")
    return KVarNConfig.from_name(preset, **overrides)


__all__ = ["KVarNCache", "pads_from_mask"]
