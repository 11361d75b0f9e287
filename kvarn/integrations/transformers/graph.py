"""Greedy decoding with the decode step captured in CUDA graphs (transformers 5.17 - 5.19).

    cache = fused_cache(model, "k4v2_g128", max_length=prompt_len + new)
    tokens = decode_greedy(model, cache, input_ids, new)          # [B, new]

The step is one token per row through ``model(...)`` with static inputs: token ids ``[B, 1]`` and
position ``[1, 1]`` buffers; the argmax is written back into the id buffer and the position is
incremented, both on the device, so replaying the recorded step *is* the next step. No attention
mask is passed (rows in lockstep need none), so transformers builds none.

Caches that can be captured: :func:`~kvarn.integrations.transformers.attention.fused_cache` with
``max_length`` (every row at the same length, i.e. no left padding; see
:class:`~kvarn.integrations.transformers.fused_layer.FusedKVarNLayer`) and transformers' ``StaticCache``.
A tile is encoded by the fused step after the one whose token completes it (the tile stays in
full precision while it is the unfinished last one, as the spec says), so steps come in kinds,
each its own graph: ``plain``; ``fill``, whose token completes a tile; ``flush``, which freezes it.
The host knows which step is which from its own lengths. Replaying runs none of the step's Python,
so after each replay the runner advances the host lengths of every fused layer.
With ``flush_ahead`` (the default) the freeze is shared by the ``fill`` and the ``flush`` step, on
a side CUDA stream (:mod:`~kvarn.integrations.transformers.freeze_schedule` says which layers start where, and
on how many SMs): the early layers start their encodes in the fill step, each as soon as its
attention has read the token that completes its tile
(:meth:`~kvarn.integrations.transformers.fused_layer.FusedKVarNLayer.read_done`), overlapping the rest of that
step, joined at its end; the others start theirs in the flush step, each after the read of a layer
that many layers earlier, and each of their updates waits for its own. The launches are given part
of the SMs (the encoder's grid capped, the same bits), so they share the GPU with the step's
kernels. The stored tiles are the same bits, written into the same slots; the decode reads a tile
only from the step that freezes it, as without the side stream. (A freeze not prepared by a fill
step, e.g. after the host plan, is ``flush_inline``: its encodes start at the step's beginning on
the side stream and each layer's update waits for its own.)

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

from . import freeze_schedule
from .fused_layer import FusedKVarNLayer

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

    def __init__(self, cache, step: Callable[[str], None], mode: str, warmup: int, ahead: bool):
        self.cache, self.step, self.mode, self.warmup = cache, step, mode, warmup
        self.ahead = ahead  # fill steps start their tiles' encodes (decode_greedy's flush_ahead)
        self.fused = _fused_layers(cache)
        self.graphs: dict[str, object] = {}
        self.eager_runs: dict[str, int] = {}
        self.last = None  # the kind of the previous step, when it was steady
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.stream = torch.cuda.Stream() if mode == "cuda" else None

    def kind(self) -> str:
        if any(layer.tiles_due() for layer in self.fused):
            return "flush" if self.ahead and self.last == "fill" else "flush_inline"
        if self.ahead and any(layer.fills() for layer in self.fused):
            return "fill"
        return "plain"

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
            return self.eager_runs.get("plain", 0) >= self.warmup
        # The other kinds run the encoder: capture once it has run eagerly (the prompt's freeze counts).
        return any(layer.store.counts[0] > 0 for layer in self.fused) or any(
            self.eager_runs.get(k, 0) for k in ("fill", "flush_inline"))

    def _run_step(self, kind: str) -> None:
        """The step's Python (eagerly, or recorded), told what the host knows of its kind."""
        if kind == "flush":  # the fill step before encoded these layers' tiles and joined its side stream
            for layer in self.fused:
                if layer.ahead_in_fill:
                    layer.encoded_ahead()
        self.step(kind)

    def _capture(self, kind: str):
        before = self._host_state()
        if self.mode == "cuda":
            graph = torch.cuda.CUDAGraph()
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self._run_step(kind)
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
            self._run_step(kind)
            self._set_host_state(now)
        self._advance()

    def run(self) -> None:
        """One decode step: replayed when its graph exists (capturing it first when ready), else eager."""
        kind = self.kind()
        self.last = kind if self.steady() else None
        if kind not in self.graphs and self._ready(kind):
            self.graphs[kind] = self._capture(kind)
        if kind in self.graphs:
            self._replay(kind)
            return
        if self.stream is not None:  # warm-up on the capture stream: per-stream workspaces exist before capture
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self._run_step(kind)
            torch.cuda.current_stream().wait_stream(self.stream)
        else:
            self._run_step(kind)
        if self.steady():
            self.eager_runs[kind] = self.eager_runs.get(kind, 0) + 1


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
    ``flush_ahead``: start each tile's encode in the step that completes it, on a side stream
    (module docstring); False encodes each layer's tiles inside the update that freezes them, on
    the step's stream (same tokens and tiles).
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
    flush_stream = freeze_schedule.side_stream(dev) if dev.type == "cuda" and ahead else None

    def step(kind: str) -> None:
        if kind != "flush":  # a freeze no fill step prepared: every layer's encode starts now
            for layer in ahead:
                layer.flush_ahead(flush_stream)
        step_logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits
        ids.copy_(step_logits[:, -1:].argmax(-1))
        pos.add_(1)
        # A captured step must join every stream it forked, and only those (waiting on the side
        # stream when this step queued nothing there would depend on work outside the capture).
        if flush_stream is not None and any(layer.ahead_pending() for layer in ahead):
            torch.cuda.current_stream(dev).wait_stream(flush_stream)
        for layer in ahead:
            layer.joined()

    graphs = _Graphs(cache, step, capture, warmup, ahead=bool(ahead))
    # The freeze is shared by the fill and the flush step (module docstring, freeze_schedule).
    # No fused layers (or flush_ahead off): none early.
    early = min(freeze_schedule.early_layers(ahead), len(ahead))
    programs = freeze_schedule.beside_programs(dev)  # read only by encodes on the side stream
    for i, layer in enumerate(ahead):
        layer.ahead_stream = flush_stream
        layer.ahead_in_fill = i < early
        layer.ahead_starts = ()
        layer.ahead_programs = programs
    for starter, j in freeze_schedule.starts(len(ahead), early):
        ahead[starter].ahead_starts += (ahead[j],)
    try:
        for i in range(1, max_new_tokens):
            graphs.run()
            out[:, i] = ids[:, 0]
            if on_step is not None:
                on_step(i)
    finally:
        for layer in ahead:
            layer.ahead_stream, layer.ahead_in_fill, layer.ahead_starts, layer.ahead_programs = False, True, (), None
    return out
