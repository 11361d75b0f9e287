"""The kvarn codec with the Triton flush (:func:`kvarn.kernels.encode_tiles`), for the fused paths.

Same fields as the torch codec (:class:`kvarn.methods.TileCodec`) for ``kvarn``; for ``kvarn-auto``
the per-(row, KV head) flavours are applied as :mod:`kvarn.flavour` does: the rotation per head in
torch before the kernel, the normalization per tile inside it.
"""

from __future__ import annotations

import contextlib

import torch

from ..codec import FP16_MAX, check_encoded, nonfinite_scales, rotate_kv
from ..flavour import Flavours, rotate_where
from ..methods import EncodedKV, TileCodec


class TritonTileCodec(TileCodec):
    """The kvarn method's codec with the Triton flush (same fields as the torch codec).

    The kernel has no range guard of its own, so the scales are checked after it
    (:func:`kvarn.codec.check_encoded`, ValueError naming the magnitude and the fp16 limit). That
    check reads the device; the host-free decode step (and a captured one) cannot, so there
    :meth:`deferred` only records on the device whether a scale is non-finite, and
    :meth:`raise_deferred` (at the next prefill, ``memory_report()`` or
    ``KVarNCache.check_numerics()``) raises for it. Tiles that underflow fp16 are not flagged as zero
    tiles on this path (their subnormal scales decode close to zero): docs/algorithm.md.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._defer = False
        self._bad = None  # device bool: a deferred check found a non-finite scale

    @contextlib.contextmanager
    def deferred(self):
        """Inside: encodes record non-finite scales on the device instead of reading them back."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False

    def raise_deferred(self) -> None:
        """ValueError if a deferred check recorded a non-finite scale (reads the device once)."""
        if self._bad is not None and bool(self._bad):
            self._bad = None
            raise ValueError("a tile frozen during a host-free decode step has non-finite fp16 scales: its values "
                             f"overflow the fp16 limit {FP16_MAX:g} of the stored scales")

    def encode(self, keys: torch.Tensor, values: torch.Tensor, flavours: Flavours | None = None) -> EncodedKV:
        from .. import kernels

        if self.method.name not in ("kvarn", "kvarn-auto"):
            return super().encode(keys, values, flavours)
        if flavours is not None and self.method.name != "kvarn-auto":
            raise ValueError(f"flavours are only meaningful for method 'kvarn-auto', not {self.method.name!r}")
        b, h, t, d = keys.shape
        c = self.config
        n = t // c.tile
        if flavours is None:  # the spec: every head rotated and normalized
            k, v, norm = rotate_kv(keys, c), rotate_kv(values, c), None
        else:
            k, v = rotate_where(keys, flavours.key_rotate), rotate_where(values, flavours.value_rotate)
            norm = tuple(x[:, :, None].expand(b, h, n) for x in (flavours.key_normalize, flavours.value_normalize))
        k = k.reshape(b, h, n, c.tile, d).transpose(-1, -2)
        v = v.reshape(b, h, n, c.tile, d)
        tiles = kernels.encode_tiles(k, v, c, normalize=norm)
        if self._defer or (k.is_cuda and torch.cuda.is_current_stream_capturing()):
            bad = nonfinite_scales(tiles)
            self._bad = bad if self._bad is None else self._bad | bad
        else:
            check_encoded(tiles, k, v)
        nbytes = int(round(self.bytes_per_token(d) * b * h * t))
        return EncodedKV(self.method, tuple(keys.shape), nbytes, tiles=tiles, flavours=flavours)
