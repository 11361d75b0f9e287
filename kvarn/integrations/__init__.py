"""Thin adapters to other libraries and engines; each imports its library lazily (``import kvarn``
needs only torch). :mod:`kvarn.integrations.vllm.plugin` is vLLM's plugin entry point and
:mod:`kvarn.integrations.vllm` the KVarN attention backend for vLLM (see ``docs/vllm.md``).
"""
