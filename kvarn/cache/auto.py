"""kvarn-auto in :class:`kvarn.KVarNCache`: layers whose flavours are decided from the prompt.

The decision (:mod:`kvarn.auto`) needs the prompt's queries, which a transformers cache never sees:
``update`` receives only K and V. So, for the prefill forward only (the first forward with the cache),
the cache switches the model to a registered attention function that hands each layer's query, key
and value to its :class:`KVarNAutoLayer` and then calls the model's own attention function, output
unchanged; the forward hook switches the model back. Decode steps run untouched.

Order of events per layer: the prefill ``update`` stores the prompt (nothing is encoded yet), the
attention call delivers the query and the layer decides, and the first decode step's ``freeze``
encodes the prompt's tiles with the decided flavours; every later tile of the row uses the same
flavours. A layer that never saw its queries (for example a prefill run outside the model the cache
was built with) falls back to KVarN, with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import weakref

import torch

from ..auto import AutoSettings, LayerDecision, decide, fallback
from ..methods import TileCodec
from .layer import KVarNLayer

logger = logging.getLogger(__name__)

CAPTURE_PREFIX = "kvarn_auto_capture__"
_CALLBACK_ATTR = "_kvarn_auto_callback"


class KVarNAutoLayer(KVarNLayer):
    """A :class:`KVarNLayer` whose tiles use per-(row, KV head) flavours chosen from the prompt."""

    def __init__(self, codec: TileCodec, padding=None, is_sliding: bool = False, decoded_cache: bool = False,
                 settings: AutoSettings = AutoSettings()):
        super().__init__(codec, padding, is_sliding, decoded_cache)
        self.settings = settings
        self.decision: LayerDecision | None = None
        self.expects_queries = False  # set by KVarNCache when it captures the prefill's queries

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.decision = None

    def reset(self) -> None:
        super().reset()
        self.decision = None

    def observe_prompt(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       scaling: float | None = None) -> None:
        """Decide from the prefill: query ``[B, Hq, L, D]``, keys/values ``[B, Hk, L, D]`` (pads included)."""
        if self.decision is not None or not self.is_initialized or any(self.store.counts):
            return
        self._set(decide(query, keys, values, self.codec.config, self.pads, self.settings, scaling))

    def _set(self, decision: LayerDecision) -> None:
        self.decision = decision
        self.store.flavours = decision.flavours.map(lambda x: x.to(self.device))

    def freeze(self) -> None:
        if self.decision is None and self.is_initialized:
            if self.expects_queries:
                logger.warning("kvarn-auto: no prompt queries reached this layer before its first tile; "
                               "it uses KVarN on every head")
            self._set(LayerDecision([fallback(self.heads, 0) for _ in range(self.batch)]))
        super().freeze()

    def _select(self, index: torch.Tensor) -> None:
        super()._select(index)
        if self.decision is not None:
            self.decision = self.decision.select(index.tolist())

    def view(self):
        """:meth:`KVarNLayer.view` plus the rotation flags of each (row, KV head)."""
        v = super().view()
        fl = self.store.flavours
        if fl is None:
            return v
        return dataclasses.replace(v, key_rotated=fl.key_rotate, value_rotated=fl.value_rotate)

    def flavours(self) -> list[dict] | None:
        """Per row: ``decided`` and the flavour name per KV head (None before the decision)."""
        if self.decision is None:
            return None
        names = self.decision.flavours.names()
        return [{"decided": r.decided, "prompt_tokens": r.prompt_tokens, "heads": n}
                for r, n in zip(self.decision.rows, names)]


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    callback = getattr(module, _CALLBACK_ATTR, None)
    if callback is not None:
        callback(module, query, key, value, kwargs)
    inner = getattr(module, "_kvarn_auto_inner", None)
    return inner(module, query, key, value, attention_mask, **kwargs)


def _inner_function(module, name: str):
    """The attention function the model itself would call for implementation ``name``."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _register(previous: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    name = CAPTURE_PREFIX + previous
    AttentionInterface.register(name, _capture_attention)
    mask = ALL_MASK_ATTENTION_FUNCTIONS[previous] if previous in ALL_MASK_ATTENTION_FUNCTIONS else sdpa_mask
    AttentionMaskInterface.register(name, mask)
    return name


def install_prompt_capture(model: torch.nn.Module, cache) -> list:
    """Hooks on ``model`` that deliver the prefill's queries to ``cache``'s auto layers.

    Returns the hook handles. The hooks hold the cache weakly and remove themselves once it is gone.
    """
    from ..analysis.capture import attention_modules

    cache_ref = weakref.ref(cache)
    state = {"previous": None}

    def callback(module, query, key, value, kwargs):
        c = cache_ref()
        layer = None if c is None else c.layers[module.layer_idx]
        if isinstance(layer, KVarNAutoLayer):
            layer.observe_prompt(query, key, value, kwargs.get("scaling", getattr(module, "scaling", None)))

    def restore():
        if state["previous"] is None:
            return
        for m in attention_modules(model):
            for attr in (_CALLBACK_ATTR, "_kvarn_auto_inner"):
                m.__dict__.pop(attr, None)
        model.set_attn_implementation(state["previous"])
        state["previous"] = None

    def pre_hook(module, args, kwargs):
        c = cache_ref()
        if c is None:
            for h in handles:
                h.remove()
            return None
        restore()  # a previous forward that raised
        if kwargs.get("past_key_values") is not c or c.get_seq_length() > 0:
            return None
        previous = model.config._attn_implementation or "eager"
        name = _register(previous)
        for m in attention_modules(model):
            setattr(m, _CALLBACK_ATTR, callback)
            setattr(m, "_kvarn_auto_inner", _inner_function(m, previous))
        model.set_attn_implementation(name)
        state["previous"] = previous
        return None

    def post_hook(module, args, kwargs, output):
        restore()
        return None

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True),
        model.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
    ]
    return handles
