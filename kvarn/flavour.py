"""Per-(row, KV head) flavours of the KVarN tile codec: rotation and normalization switched on or off.

A flavour is four flags per (row, KV head): ``key_rotate``, ``key_normalize``, ``value_rotate``,
``value_normalize``. All four on is the spec's KVarN; ``key_rotate = value_rotate = False`` with
normalization on is the paper's VarN ablation; all off is KIVI (per-channel K, per-token V).

The stored tile format is the spec's (section 4) for every flavour, byte for byte:

- no normalization = the identity scaling (T = 0 Sinkhorn iterations), so the column scales
  ``rK``/``cV`` are exactly 1 and the row scales absorb only the RTN step;
- no rotation = the tile is stored in the model frame (``k`` instead of ``k @ H``).

So a reader needs only the two rotation flags: it rotates the query where ``key_rotate`` and
un-rotates the attention output where ``value_rotate`` (see :func:`kvarn.attention.decode_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .codec import FIELD_ORDER, TileFields, _encode_one, decode_tiles, rotate_kv, tile_passes
from .config import KVarNConfig
from .hadamard import rotate

FLAG_NAMES = ("key_rotate", "key_normalize", "value_rotate", "value_normalize")

#: Named flavours as (key_rotate, key_normalize, value_rotate, value_normalize).
NAMED = {
    "kvarn": (True, True, True, True),
    "varn": (False, True, False, True),
    "hkivi": (True, False, True, False),
    "kivi": (False, False, False, False),
}

#: The four (rotate, normalize) options of one tensor, in the order candidates are scored.
OPTIONS = ((True, True), (False, True), (True, False), (False, False))


@dataclass
class Flavours:
    """Flags of shape ``[B, Hk]`` (bool), one set per row and KV head."""

    key_rotate: torch.Tensor
    key_normalize: torch.Tensor
    value_rotate: torch.Tensor
    value_normalize: torch.Tensor

    def __post_init__(self) -> None:
        shape = self.key_rotate.shape
        for name in FLAG_NAMES:
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bool or x.shape != shape or x.dim() != 2:
                raise ValueError(f"Flavours.{name} must be a bool tensor [B, Hk] like key_rotate {tuple(shape)}")

    @classmethod
    def named(cls, name: str, batch: int, heads: int, device=None) -> "Flavours":
        """Every (row, head) with the named flavour (``kvarn``, ``varn``, ``hkivi``, ``kivi``)."""
        if name not in NAMED:
            raise ValueError(f"unknown flavour {name!r}; valid flavours: {sorted(NAMED)}")
        return cls(*(torch.full((batch, heads), f, dtype=torch.bool, device=device) for f in NAMED[name]))

    def map(self, fn) -> "Flavours":
        return Flavours(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def select(self, index: torch.Tensor) -> "Flavours":
        """Rows ``index`` (long ``[B']``), for beam reordering or tile batches."""
        return self.map(lambda x: x.index_select(0, index.to(x.device)))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.key_rotate.shape)

    def names(self) -> list[list[str]]:
        """``[B][Hk]`` flavour names: a named flavour where one matches, else ``K<r><n>/V<r><n>``."""
        flags = torch.stack([getattr(self, n) for n in FLAG_NAMES], dim=-1).tolist()
        inverse = {v: k for k, v in NAMED.items()}

        def name(f):
            if tuple(f) in inverse:
                return inverse[tuple(f)]
            bit = lambda r, n: ("R" if r else "-") + ("N" if n else "-")  # noqa: E731
            return f"K{bit(f[0], f[1])}/V{bit(f[2], f[3])}"

        return [[name(f) for f in row] for row in flags]


def _select_rotate(x: torch.Tensor, flag: torch.Tensor, config: KVarNConfig) -> torch.Tensor:
    """x ``[M, Hk, T, D]`` -> float32, rotated where ``flag [M, Hk]``."""
    x = x.to(torch.float32)
    if not bool(flag.any()):
        return x
    rot = rotate_kv(x, config)
    return torch.where(flag[:, :, None, None], rot, x) if not bool(flag.all()) else rot


def _encode_mixed(x: torch.Tensor, normalize: torch.Tensor, bits: int, quantile: float, config: KVarNConfig,
                  passes=None):
    """Tiles ``x [M, Hk, N, R, C]``; Sinkhorn where ``normalize [M, Hk]``, the identity elsewhere;
    rows rounded over their ``[quantile, 1 - quantile]`` range. ``passes``: see :func:`kvarn.codec.tile_passes`."""
    iters = config.sinkhorn_iters
    if bool(normalize.all()) or iters == 0:
        return _encode_one(x, bits, iters, quantile, passes=passes)
    if not bool(normalize.any()):
        return _encode_one(x, bits, 0, quantile, passes=passes)
    m, h = normalize.shape
    flat = x.reshape(m * h, *x.shape[2:])
    sel = normalize.reshape(-1)
    on = _encode_one(flat[sel], bits, iters, quantile, passes=passes)
    off = _encode_one(flat[~sel], bits, 0, quantile, passes=passes)
    out = []
    for a, b in zip(on, off):
        y = a.new_empty(m * h, *a.shape[1:])
        y[sel], y[~sel] = a, b
        out.append(y.reshape(m, h, *a.shape[1:]))
    return tuple(out)


def encode_flavoured(keys: torch.Tensor, values: torch.Tensor, flavours: Flavours, config: KVarNConfig,
                     kernels: str = "auto") -> TileFields:
    """Quantize full tiles with a flavour per (row, head).

    keys, values: ``[M, Hk, N*G, D]`` in the model frame (K after RoPE); flavours: ``[M, Hk]``.
    Returns TileFields with leading dims ``[M, Hk, N]`` in the spec's layout (K tile ``[D, G]``).
    kernels: who makes the codec's passes (:func:`kvarn.codec.tile_passes`; the same bits).
    """
    m, h, t, d = keys.shape
    if flavours.shape != (m, h):
        raise ValueError(f"flavours are {flavours.shape} but the tiles have [M, Hk] = {(m, h)}")
    g = config.tile
    k = _select_rotate(keys, flavours.key_rotate, config).reshape(m, h, t // g, g, d).transpose(-1, -2)
    v = _select_rotate(values, flavours.value_rotate, config).reshape(m, h, t // g, g, d)
    passes = tile_passes(kernels, keys.device)
    kq, vq = config.quantiles
    kc, ks, kz, kr = _encode_mixed(k, flavours.key_normalize, config.key_bits, kq, config, passes)
    vc, vs, vz, vcol = _encode_mixed(v, flavours.value_normalize, config.value_bits, vq, config, passes)
    return TileFields(kc, ks, kz, kr, vc, vcol, vs, vz)


def decode_flavoured(tiles: TileFields, flavours: Flavours, config: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`encode_flavoured`: float32 ``(keys, values)`` ``[M, Hk, N*G, D]``, model frame."""
    k, v = decode_tiles(tiles, config)  # [M, Hk, N, D, G], [M, Hk, N, G, D]
    m, h, n, d, g = k.shape
    k = k.transpose(-1, -2).reshape(m, h, n * g, d)
    v = v.reshape(m, h, n * g, d)
    return _select_rotate(k, flavours.key_rotate, config), _select_rotate(v, flavours.value_rotate, config)


def roundtrip_flavoured(keys: torch.Tensor, values: torch.Tensor, flavours: Flavours, config: KVarNConfig):
    """Quantize then dequantize (float32, model frame). keys, values: ``[M, Hk, N*G, D]``."""
    return decode_flavoured(encode_flavoured(keys, values, flavours, config), flavours, config)


def roundtrip_options(keys: torch.Tensor, values: torch.Tensor, config: KVarNConfig, kernels: str = "auto"):
    """Each of the four :data:`OPTIONS`, applied to K and V alike: the encodings and round trips.

    keys, values: ``[Hk, N*G, D]`` in the model frame; kernels: as :func:`encode_flavoured`. Returns
    the fields ``[4, Hk, N, ...]`` (row c: option c) and their round trips ``(keys, values)``
    ``[4, Hk, N*G, D]``, float32, model frame: what :func:`encode_flavoured` and
    :func:`decode_flavoured` give for each option, bit for bit (the codec's encode is per tile, and
    every rotation here has the shape it has there).

    The rotation is taken once per tensor, and the two normalized options are one encode (as are
    the two without normalization): four codec calls instead of eight, whose fixed cost per call
    (a few dozen small tensor operations per normalization iteration) is most of a trial on CPU.
    """
    h, t, d = keys.shape
    g = config.tile
    passes = tile_passes(kernels, keys.device)
    plain_k, plain_v = keys.to(torch.float32)[None], values.to(torch.float32)[None]
    rot_k, rot_v = rotate_kv(plain_k, config), rotate_kv(plain_v, config)
    # Rows in OPTIONS order within each call: (rotated, model frame).
    k = torch.cat([rot_k, plain_k]).reshape(2, h, t // g, g, d).transpose(-1, -2)
    v = torch.cat([rot_v, plain_v]).reshape(2, h, t // g, g, d)
    kq, vq = config.quantiles
    norm_k = _encode_one(k, config.key_bits, config.sinkhorn_iters, kq, passes=passes)
    bare_k = _encode_one(k, config.key_bits, 0, kq, passes=passes)
    norm_v = _encode_one(v, config.value_bits, config.sinkhorn_iters, vq, passes=passes)
    bare_v = _encode_one(v, config.value_bits, 0, vq, passes=passes)
    kc, ks, kz, kr = (torch.cat(pair) for pair in zip(norm_k, bare_k))
    vc, vs, vz, vcol = (torch.cat(pair) for pair in zip(norm_v, bare_v))
    stacked = TileFields(kc, ks, kz, kr, vc, vcol, vs, vz)
    dk, dv = decode_tiles(stacked, config)  # [4, Hk, N, D, G], [4, Hk, N, G, D]
    dk = dk.transpose(-1, -2).reshape(4, h, t, d)
    dv = dv.reshape(4, h, t, d)
    for c, (rot, _) in enumerate(OPTIONS):
        if rot:  # back to the model frame, one option at a time (decode_flavoured's shapes)
            dk[c:c + 1] = rotate_kv(dk[c:c + 1], config)
            dv[c:c + 1] = rotate_kv(dv[c:c + 1], config)
    return stacked, dk, dv


def option_index(rotate: torch.Tensor, normalize: torch.Tensor) -> torch.Tensor:
    """The row of :data:`OPTIONS` of each ``(rotate, normalize)`` flag pair (long, same shape)."""
    return (~rotate).long() + 2 * (~normalize).long()


def select_options(tiles: TileFields, key_option: torch.Tensor, value_option: torch.Tensor) -> TileFields:
    """Per head, the K fields of option ``key_option[h]`` and the V fields of ``value_option[h]``.

    tiles: fields ``[4, Hk, N, ...]`` as :func:`roundtrip_options` returns them (K and V are encoded
    independently, so any pair of options is a valid flavour); options: long ``[..., Hk]``. Returns
    fields ``[..., Hk, N, ...]``: what :func:`encode_flavoured` gives for those flavours (its encode
    is per tile).
    """
    heads = torch.arange(key_option.shape[-1], device=key_option.device)
    return TileFields(**{
        name: getattr(tiles, name)[(key_option if name.startswith("k_") else value_option), heads]
        for name in FIELD_ORDER
    })


def rotate_where(x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """``x @ H`` where ``flag`` (broadcast over the last two axes), ``x`` elsewhere; float32.

    x: ``[B, H, T, D]``, flag: bool ``[B, H]``.
    """
    x = x.to(torch.float32)
    # No shortcut on flag.all(): that would read the device (the decode step must not).
    return torch.where(flag[:, :, None, None], rotate(x, torch.float32), x)
