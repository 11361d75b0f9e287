"""Greedy decoding with the decode step captured in CUDA graphs (transformers 5.17 - 5.19).

    cache = hf_attention.fused_cache(model, "k4v2_g128", max_length=prompt_len + new)
    tokens = decode_greedy(model, cache, input_ids, new)          # [B, new]

The step is one token per row through ``model(...)`` with static inputs: token ids ``[B, 1]`` and
position ``[1, 1]`` buffers; the argmax is written back into the id buffer and the position is
incremented, both on the device, so replaying the recorded step *is* the next step. No attention
mask is passed (rows in lockstep need none), so transformers builds none.

Caches that can be captured: :func:`~kvarn.integrations.hf_attention.fused_cache` with
``max_length`` (every row at the same length, i.e. no left padding; see
:class:`~kvarn.integrations.hf_attention.FusedKVarNLayer`) and transformers' ``StaticCache``.
A fused step that completes a tile also encodes it, so kvarn has two graphs, ``plain`` and
``flush``; the host knows which step is which from its own lengths. Replaying runs none of the
step's Python, so after each replay the runner advances the host lengths of every fused layer.
A flush step starts every layer's encode at its beginning, on a side CUDA stream
(:meth:`~kvarn.integrations.hf_attention.FusedKVarNLayer.flush_ahead`); each layer's update waits
for its own encode only, so the encodes of later layers overlap the forward of earlier ones (the
same tiles, bit for bit: only when and on which stream they are encoded changes).

Steps run eagerly until the cache is steady (the first decode step freezes the prompt's tiles on
the host plan) and each graph has been warmed up by one eager step of its kind (kernel compilation
and library workspaces must not happen during capture); a ``flush`` graph is captured at the first
flush once the encoder has run (any tile frozen before). Greedy decoding only: every row produces
``max_new_tokens`` tokens (no stop on EOS, which would need a host read per step).

``capture``: ``"cuda"`` (CUDA graphs), ``"none"`` (the same step, eagerly) or ``"simulate"``
(no GPU needed: each "replay" runs the step eagerly with the host lengths put back to their values
at capture time, then advanced as after a real replay; a step that took a position from the host
instead of the device would write at the wrong place, so tests can check capture safety on CPU).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .hf_attention import FusedKVarNLayer

logger = logging.getLogger(__name__)

CAPTURE_MODES = ("cuda", "none", "simulate")

__all__ = ["decode_greedy", "CAPTURE_MODES"]


def _fused_layers(cache) -> list[FusedKVarNLayer]:
    return [layer for layer in getattr(cache, "layers", []) if isinstance(layer, FusedKVarNLayer)]


def _check_cache(cache) -> str:
    """"kvarn" or "static"; ValueError for caches whose step cannot be captured."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(cache, "layers", None)
    if not layers:
        raise ValueError("decode_greedy needs a transformers Cache with layers")
    if all(isinstance(layer, FusedKVarNLayer) for layer in layers):
        missing = [i for i, layer in enumerate(layers) if layer.max_length is None]
        if missing:
            raise ValueError(f"fused layers {missing} have no max_length; build the cache with "
                             "fused_cache(model, preset, max_length=...)")
        return "kvarn"
    if all(isinstance(layer, StaticLayer) for layer in layers):
        return "static"
    kinds = sorted({type(layer).__name__ for layer in layers})
    raise ValueError(f"decode_greedy captures FusedKVarNLayer (fused_cache with max_length) or StaticLayer "
                     f"(StaticCache) caches, got layers {kinds}")


def _seq_length(cache) -> int:
    n = cache.get_seq_length()
    return int(n)  # StaticCache keeps it on the device: one read before decoding starts


class _Graphs:
    """The captured steps by kind, and the host-state bookkeeping around capture and replay."""

    def __init__(self, cache, step: Callable[[], None], mode: str, warmup: int):
        self.cache, self.step, self.mode, self.warmup = cache, step, mode, warmup
        self.fused = _fused_layers(cache)
        self.graphs: dict[str, object] = {}
        self.eager_runs: dict[str, int] = {"plain": 0, "flush": 0}
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stream = torch.cuda.Stream() if mode == "cuda" else None

    def kind(self) -> str:
        return "flush" if any(layer.tiles_due() for layer in self.fused) else "plain"

    def steady(self) -> bool:
        return all(layer.steady for layer in self.fused)

    def _host_state(self):
        return [layer.host_state() for layer in self.fused]

    def _set_host_state(self, states) -> None:
        for layer, s in zip(self.fused, states):
            layer.set_host_state(s)

    def _advance(self) -> None:
        for layer in self.fused:
            layer.advance(1)

    def _ready(self, kind: str) -> bool:
        if self.mode == "none" or not self.steady():
            return False
        if kind == "plain":
            return self.eager_runs["plain"] >= self.warmup
        # The flush runs the encoder: capture once it has run eagerly (the prompt's freeze counts).
        return any(layer.store.counts[0] > 0 for layer in self.fused) or self.eager_runs["flush"] > 0

    def _capture(self, kind: str):
        before = self._host_state()
        if self.mode == "cuda":
            graph = torch.cuda.CUDAGraph()
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self.step()
            torch.cuda.current_stream().wait_stream(self.stream)
        else:
            graph = before  # simulate: the host state the step saw when it was "recorded"
        self._set_host_state(before)  # capture ran the Python, not the step: undo its host side
        logger.info("captured the %s decode step", kind)
        return graph

    def _replay(self, kind: str) -> None:
        graph = self.graphs[kind]
        if self.mode == "cuda":
            graph.replay()
        else:
            now = self._host_state()
            self._set_host_state(graph)
            self.step()
            self._set_host_state(now)
        self._advance()

    def run(self) -> None:
        """One decode step: replayed when its graph exists (capturing it first when ready), else eager."""
        kind = self.kind()
        if kind not in self.graphs and self._ready(kind):
            self.graphs[kind] = self._capture(kind)
        if kind in self.graphs:
            self._replay(kind)
            return
        if self.stream is not None:  # warm-up on the capture stream: per-stream workspaces exist before capture
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.step()
            torch.cuda.current_stream().wait_stream(self.stream)
        else:
            self.step()
        if self.steady():
            self.eager_runs[kind] += 1


@torch.no_grad()
def decode_greedy(model, cache, input_ids: torch.Tensor, max_new_tokens: int, *, capture: str = "cuda",
                  warmup: int = 1, on_step: Callable[[int], None] | None = None,
                  flush_ahead: bool = True) -> torch.Tensor:
    """Greedy tokens ``[B, max_new_tokens]`` after ``input_ids`` ``[B, T]`` (tokens not yet in ``cache``).

    The first forward processes ``input_ids`` eagerly (the prefill, or the last prompt token of a
    history already written into the cache); each further token is one decode step, captured
    according to ``capture`` (see the module docstring). ``warmup``: eager steady steps before the
    plain step is captured. ``on_step(i)`` is called on the host after token ``i`` has been queued
    (for example to record a CUDA event); it must not read device values if speed matters.
    ``flush_ahead``: start a flush step's encodes on a side stream (module docstring); False
    encodes each layer's tiles inside its update, on the step's stream (same tokens and tiles).
    """
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture={capture!r}; choose one of {CAPTURE_MODES}")
    if capture == "cuda" and input_ids.device.type != "cuda":
        raise ValueError(f"capture='cuda' needs the model on a CUDA device, input_ids are on {input_ids.device}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [B, T] with T >= 1, got {tuple(input_ids.shape)}")
    _check_cache(cache)
    b, t = input_ids.shape
    dev = input_ids.device
    start = _seq_length(cache)
    positions = torch.arange(start, start + t, device=dev)[None]
    logits = model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True,
                   logits_to_keep=1).logits
    ids = logits[:, -1:].argmax(-1)  # [B, 1]: the static input of every step
    pos = torch.full((1, 1), start + t, dtype=torch.long, device=dev)
    out = torch.empty(b, max_new_tokens, dtype=torch.long, device=dev)
    out[:, 0] = ids[:, 0]
    if on_step is not None:
        on_step(0)
    ahead = _fused_layers(cache) if flush_ahead else []
    flush_stream = torch.cuda.Stream(dev) if dev.type == "cuda" and ahead else None

    def step() -> None:
        for layer in ahead:  # a flush step: every layer's encode starts now (module docstring)
            layer.flush_ahead(flush_stream)
        step_logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits
        ids.copy_(step_logits[:, -1:].argmax(-1))
        pos.add_(1)

    graphs = _Graphs(cache, step, capture, warmup)
    for i in range(1, max_new_tokens):
        graphs.run()
        out[:, i] = ids[:, 0]
        if on_step is not None:
            on_step(i)
    return out
