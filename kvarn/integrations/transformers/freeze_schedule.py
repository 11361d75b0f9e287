"""Where a captured decode's tile freeze runs: which layers' encodes start in which step, at whose
read, and on how much of the GPU (:func:`kvarn.integrations.transformers.graph.decode_greedy`, ``flush_ahead``).

The freeze of a batch-16 step (a program for every SM in each layer's encode) would cost that step
16% in one piece, so it is shared by the ``fill`` step (whose token completes the tiles) and the
``flush`` step (which freezes them), on a side CUDA stream. Each figure here is measured on the H200
(BENCHMARKS.md: the freeze step), except lead_in's (an H100).

Each layer's encode is its own fork of the side stream and its own wait: forking several layers'
encodes together costs the batch-16 freeze steps more (on an H100: +3.1-5.5% against +1.7-3.0%),
though the forks and waits alone cost less.
"""

from __future__ import annotations

import torch

BESIDE = 4  # a fraction of the SMs per K and per V (BENCHMARKS.md: the freeze step)


def beside_programs(device: torch.device) -> int:
    """The encoder's programs for K and for V when its launches run beside the decode step: a
    program on half the SMs, the other half left to the step's kernels (at batch 16 on the H200, 33
    of 128 tiles a layer; smaller launches are not capped)."""
    from ...kernels.layout import num_sms

    return max(1, num_sms(device) // BESIDE)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side CUDA stream the encodes run on, beside the step's own: a plain stream (its
    launches may use any SM; :func:`beside_programs` caps how many they take). A green context's
    stream of 64 SMs, with two 4-warp encode programs sharing each, takes a third less SM-time a
    layer and costs the B 16 freeze steps the same; fewer SMs cost more (an H100)."""
    return torch.cuda.Stream(device)


def lead_in(device: torch.device) -> None:
    """The side stream's first launch after a fork, before the encodes: one empty program.

    A fork at a layer's read makes the encodes and the step's next kernel (the output projection,
    a GEMM of one block an SM) ready at the same moment, the read's end. Started first, the encodes
    take SMs that GEMM then waits for; one empty launch ahead of them lets the GEMM place its blocks
    first (profiled on an H100 at 8K x 16: the step's GEMMs stretch 146-159 µs in a freeze step
    with it, 249-262 µs without).

    Measured (BENCHMARKS.md: the freeze step; an H100, k4v2 and k2v2): the B 16 freeze
    steps +1.5-2.1% at 8K and +1.0-1.6% at 32K against +2.4-2.8% and +1.6-2.3% without it, at B 1
    +0.3-0.8% against +0.6-1.8%. A wait of 3-6 µs in its place reads the same, 12-24 µs costs more,
    48 µs gives all of the gain back, and a launch after the encodes gains nothing."""
    from ...kernels.layout import launch_empty

    with torch.cuda.device(device):
        launch_empty()


def encodes_fill_the_gpu(layers: list) -> bool:
    """Whether one layer's encode launch (a K and a V program per row and KV head) has a program
    for every SM (batch 16 and up on an H200)."""
    if not layers or layers[0].device.type != "cuda":
        return False
    from ...kernels.layout import num_sms

    rows, heads = layers[0].tail_k.shape[:2]
    return 2 * rows * heads >= num_sms(layers[0].device)


def early_layers(layers: list) -> int:
    """How many of the layers start their encodes in the fill step, the share that evens the two
    steps' excess on the H200 (BENCHMARKS.md: the freeze step); at least one. Half (16 of 32) where
    the encodes fill the GPU: with the decode attention flat over the tail, each layer's encode
    costs either step about the same (32K and 8K x 16: 16 layers give the smallest larger step over
    both contexts, against 5, 10, 12 and 14); 5/8 (20 of 32) below that, where the fill step's
    encodes cost less per layer than the flush step's."""
    n = len(layers)
    if encodes_fill_the_gpu(layers):
        return max(1, n // 2)
    return max(1, (5 * n + 4) // 8)


def starts(n: int, early: int) -> list[tuple[int, int]]:
    """Which layer's read starts which layer's encode: ``(starter, layer)`` for each of ``n`` layers,
    of which the first ``early`` start in the fill step.

    An early layer's encode starts at its own read, in the fill step (joined at that step's end); a
    later layer's, in the flush step, at the read of the layer ``early`` before it: layer early + i's
    encode starts after layer i's read, and the layer's update waits for it."""
    if not (0 == early == n or 1 <= early <= n):  # a later layer's start needs an early read
        raise ValueError(f"need 1 <= early <= n (or no layers), got n={n}, early={early}")
    return [(i, i) for i in range(early)] + [(i - early, i) for i in range(early, n)]


class Started:
    """Encodes started together on a side stream (one fork, :func:`start_encodes`): the event
    recorded after the last of them, and whether the step's stream has waited for it yet (one
    wait covers them all)."""

    __slots__ = ("event", "waited")

    def __init__(self, event: torch.cuda.Event):
        self.event, self.waited = event, False


def start_encodes(layers: tuple, stream: torch.cuda.Stream | None) -> None:
    """Start the due encodes of fused ``layers`` (``FusedKVarNLayer.due_ahead``; the others are
    left alone, and with none due nothing happens): at once when ``stream`` is None, else on that
    side stream after one wait for the current stream (the tails' last tokens were written there,
    and from a read, the read was queued after them), :func:`lead_in` first, with one event after
    the last encode. Each layer's next update waits for that event before it overwrites and reads
    its tail, unless another layer's has (``FusedKVarNLayer._flush_device``); a step that ends
    first joins the side stream (decode_greedy)."""
    due = [(x, n) for x in layers if (n := x.due_ahead())]
    if not due:
        return
    if stream is None:
        for x, n in due:
            x.encode_due(n)
            x.encoded_ahead()
        return
    device = due[0][0].device
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        lead_in(device)  # the step's next kernel places its blocks first
        for x, n in due:
            x.encode_due(n, x.ahead_programs)
        event = torch.cuda.Event()
        event.record(stream)
    started = Started(event)
    for x, _ in due:
        x.encoded_ahead(started)
