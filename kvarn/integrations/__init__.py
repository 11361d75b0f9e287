"""Adapters to other libraries and engines; each imports its library lazily (``import kvarn``
needs only torch). :mod:`kvarn.integrations.transformers` is the fused GPU cache path for
transformers, :mod:`kvarn.integrations.lm_eval` the ``kvarn`` model type of lm-evaluation-harness,
:mod:`kvarn.integrations.vllm.plugin` vLLM's plugin entry point and :mod:`kvarn.integrations.vllm`
the KVarN attention backend for vLLM (see ``docs/vllm.md``).
"""
