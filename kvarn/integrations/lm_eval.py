"""lm-evaluation-harness (lm-eval 0.4.x) model type ``kvarn``: any kvarn cache method under the harness.

    python -m kvarn.integrations.lm_eval --model kvarn \\
        --model_args pretrained=FOLDER,method=kvarn,preset=k2v2_g128,device=cpu,dtype=float32 \\
        --tasks TASK --include_path DIR

``pretrained`` is a local Hugging Face folder or a bundled model name (``smollm2-135m``,
``gemma3-270m``); the other arguments are those of lm-eval's ``hf`` model (:class:`HFLM`), plus
``method`` (:data:`kvarn.methods.METHODS` or ``hf-quanto``/``hf-hqq``), ``preset``, ``sink_tokens``
and ``decoded_cache``. lm-eval finds models only in its own registry, so this module registers the
class when imported: run the harness through ``python -m kvarn.integrations.lm_eval`` (the
harness's own command line, after the registration) or import this module before
``lm_eval.simple_evaluate(model="kvarn", ...)``.

What the cache changes (docs/algorithm.md section 5):

- ``generate_until``: ``model.generate`` with a fresh :class:`kvarn.KVarNCache` per batch (left
  padding read from the batch's attention mask).
- ``loglikelihood`` / ``loglikelihood_rolling``: a single forward pass would be prefill, whose
  attention is exact, so the cache would change nothing. The scored sequence is instead fed in
  chunks of one tile through the quantized cache: teacher-forced decoding, where each chunk reads
  the quantized history of the chunks before it, as a generation would. Right padding (the
  harness's layout for these requests) only ever enters tiles after a row's real tokens, which no
  real token reads.
"""

from __future__ import annotations

import logging

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..cache import KVarNCache
from ..cache.hf_baselines import HF_METHODS
from ..methods import METHODS

logger = logging.getLogger(__name__)

NAME = "kvarn"


def _bool(x) -> bool:
    if isinstance(x, bool):
        return x
    if str(x).lower() in ("1", "true", "yes"):
        return True
    if str(x).lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"expected a boolean (true/false), got {x!r}")


@register_model(NAME)
class KVarNLM(HFLM):
    """lm-eval's HF causal LM with its KV cache replaced by a kvarn method."""

    def __init__(self, pretrained, method: str = "kvarn", preset: str = "k2v2_g128",
                 sink_tokens: int | None = None, decoded_cache: bool = True, **kwargs):
        from .. import models

        if method not in METHODS and method not in HF_METHODS:
            raise ValueError(f"unknown method {method!r}; valid: {sorted(METHODS) + sorted(HF_METHODS)}")
        if isinstance(pretrained, str) and pretrained in models.MODEL_NAMES:
            pretrained = str(models.model_folder(pretrained))
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained=pretrained, **kwargs)
        self.kv_method, self.kv_preset = method, preset
        self.kv_overrides = {} if sink_tokens in (None, "") else {"sink_tokens": int(sink_tokens)}
        self.kv_decoded_cache = _bool(decoded_cache)
        self.kv_chunk = self.new_cache().config.tile  # also validates method, preset, overrides
        logger.info("kvarn lm-eval model: method=%s preset=%s chunk=%d", method, preset, self.kv_chunk)

    def new_cache(self, attention_mask: torch.Tensor | None = None) -> KVarNCache:
        return KVarNCache(self.model, self.kv_method, self.kv_preset, attention_mask=attention_mask,
                          decoded_cache=self.kv_decoded_cache, **self.kv_overrides)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of ``inps [B, T]``, one tile-sized chunk at a time through the cache."""
        if attn_mask is not None or labels is not None:
            raise ValueError("the kvarn lm-eval model supports causal (decoder-only) models only")
        cache = self.new_cache(attention_mask=torch.ones_like(inps))
        out = []
        with torch.no_grad():
            for s in range(0, inps.shape[1], self.kv_chunk):
                out.append(self.model(inps[:, s:s + self.kv_chunk], past_key_values=cache, use_cache=True).logits)
        return torch.cat(out, dim=1)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        generation_kwargs["past_key_values"] = self.new_cache(generation_kwargs.get("attention_mask"))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main() -> None:
    """lm-eval's command line with the ``kvarn`` model type registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
