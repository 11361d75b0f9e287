"""The kvarn codec with the Triton flush (:func:`kvarn.kernels.encode_tiles`), for the fused paths.

Same fields as the torch codec (:class:`kvarn.methods.TileCodec`) for ``kvarn``; for ``kvarn-auto``
the per-(row, KV head) flavours are applied as :mod:`kvarn.codec.flavour` does, per tile inside the
kernel: the rotation of the head's tokens and the normalization.
"""

from __future__ import annotations

import contextlib

import torch

from ...codec.flavour import Flavours
from ...codec.record import TileFields
from ...codec.tiles import FP16_MAX, check_encoded
from ...methods import EncodedKV, TileCodec


class TritonTileCodec(TileCodec):
    """The kvarn method's codec with the Triton flush (same fields as the torch codec).

    One launch per call: the encoder rotates the model-frame tiles itself (per head for kvarn-auto),
    normalizes, rounds, packs and writes the fields; :meth:`encode_into` writes them straight into
    a store's reserved slots. The kernel has no range guard of its own, so the scales are checked
    after it (:func:`kvarn.codec.check_encoded`, ValueError naming the magnitude and the fp16
    limit). That check reads the device; the host-free decode step (and a captured one) cannot, so
    there :meth:`deferred` lets the kernel raise a device flag when it stores a non-finite scale,
    and :meth:`raise_deferred` (at the next prefill, ``memory_report()`` or
    ``KVarNCache.check_numerics()``) raises for it. Tiles that underflow fp16 are not flagged as zero
    tiles on this path (their subnormal scales decode close to zero): docs/algorithm.md.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._defer = False
        self._bad = None  # int32 [1] on the device, set by a deferred encode that stored a non-finite scale
        self._programs = None  # the encoder's grid cap inside beside()

    @contextlib.contextmanager
    def deferred(self):
        """Inside: encodes record non-finite scales on the device instead of reading them back."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False

    @contextlib.contextmanager
    def beside(self, programs: int):
        """Inside: each launch has at most ``programs`` programs for K and for V (each encodes every
        ``programs``-th tile; the same bits). For encodes that run on a side stream beside the decode
        step: a launch with a program per tile takes every SM until it is done, one with fewer
        shares the SMs with the step's kernels (BENCHMARKS.md, the freeze step)."""
        self._programs = programs
        try:
            yield
        finally:
            self._programs = None

    def raise_deferred(self) -> None:
        """ValueError if a deferred check recorded a non-finite scale (reads the device once)."""
        if self._bad is not None and bool(self._bad[0]):
            self._bad.zero_()  # the same flag: captured graphs keep its address
            raise ValueError("a tile frozen during a host-free decode step has non-finite fp16 scales: its values "
                             f"overflow the fp16 limit {FP16_MAX:g} of the stored scales")

    def _launch(self, keys, values, flavours, out=None, slot=None):
        from ... import kernels

        b, h, t, d = keys.shape
        c = self.config
        n = t // c.tile
        k = keys.reshape(b, h, n, c.tile, d).transpose(-1, -2)  # views: the encoder reads the strides
        v = values.reshape(b, h, n, c.tile, d)
        if flavours is None:  # the spec: every head rotated and normalized
            rotate, norm = True, None
        else:
            per_tile = [x[:, :, None].expand(b, h, n) for x in (flavours.key_rotate, flavours.value_rotate,
                                                                 flavours.key_normalize, flavours.value_normalize)]
            rotate, norm = tuple(per_tile[:2]), tuple(per_tile[2:])
        deferred = self._defer or (k.is_cuda and torch.cuda.is_current_stream_capturing())
        if deferred and self._bad is None:
            self._bad = torch.zeros(1, dtype=torch.int32, device=keys.device)
        tiles = kernels.encode_tiles(k, v, c, out, normalize=norm, rotate=rotate, slot=slot,
                                     bad=self._bad if deferred else None, programs=self._programs)
        if not deferred:
            check_encoded(tiles, keys, values)
        return tiles

    def _check_method(self, flavours) -> bool:
        """True when this codec's kernel encodes the method (kvarn, kvarn-auto)."""
        if self.method.name not in ("kvarn", "kvarn-auto"):
            return False
        if flavours is not None and self.method.name != "kvarn-auto":
            raise ValueError(f"flavours are only meaningful for method 'kvarn-auto', not {self.method.name!r}")
        return True

    def encode(self, keys: torch.Tensor, values: torch.Tensor, flavours: Flavours | None = None) -> EncodedKV:
        if not self._check_method(flavours):
            return super().encode(keys, values, flavours)
        tiles = self._launch(keys, values, flavours)
        b, h, t, d = keys.shape
        nbytes = int(round(self.bytes_per_token(d) * b * h * t))
        return EncodedKV(self.method, tuple(keys.shape), nbytes, tiles=tiles, flavours=flavours)

    def encode_into(self, keys: torch.Tensor, values: torch.Tensor, flavours: Flavours | None, fields: TileFields,
                    slot: torch.Tensor) -> bool:
        """Encode ``[B, Hk, n*G, D]`` model-frame K/V straight into ``fields`` (``[B, Hk, capacity,
        ...]``) at slots ``slot .. slot + n - 1`` (``slot``: int32 or long ``[1]`` on the device). False when
        this codec's kernel does not encode the method (the caller encodes and copies instead)."""
        if not self._check_method(flavours):
            return False
        self._launch(keys, values, flavours, out=fields, slot=slot)
        return True
