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

from ..config import KVarNConfig
from .hadamard import rotate
from .record import FIELD_ORDER, TileFields
from .tiles import decode_tiles, encode_tile_fields, rotate_kv

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
    rows rounded over their ``[quantile, 1 - quantile]`` range. ``passes``: see :func:`kvarn.codec.encode_tile_fields`."""
    iters = config.sinkhorn_iters
    if bool(normalize.all()) or iters == 0:
        return encode_tile_fields(x, bits, iters, quantile, passes=passes)
    if not bool(normalize.any()):
        return encode_tile_fields(x, bits, 0, quantile, passes=passes)
    m, h = normalize.shape
    flat = x.reshape(m * h, *x.shape[2:])
    sel = normalize.reshape(-1)
    on = encode_tile_fields(flat[sel], bits, iters, quantile, passes=passes)
    off = encode_tile_fields(flat[~sel], bits, 0, quantile, passes=passes)
    out = []
    for a, b in zip(on, off):
        y = a.new_empty(m * h, *a.shape[1:])
        y[sel], y[~sel] = a, b
        out.append(y.reshape(m, h, *a.shape[1:]))
    return tuple(out)


def encode_flavoured(keys: torch.Tensor, values: torch.Tensor, flavours: Flavours, config: KVarNConfig,
                     passes=None) -> TileFields:
    """Quantize full tiles with a flavour per (row, head).

    keys, values: ``[M, Hk, N*G, D]`` in the model frame (K after RoPE); flavours: ``[M, Hk]``.
    Returns TileFields with leading dims ``[M, Hk, N]`` in the spec's layout (K tile ``[D, G]``).
    passes: who makes the codec's passes (:func:`kvarn.cpu.tile_passes`; None: torch; the same bits).
    """
    m, h, t, d = keys.shape
    if flavours.shape != (m, h):
        raise ValueError(f"flavours are {flavours.shape} but the tiles have [M, Hk] = {(m, h)}")
    g = config.tile
    k = _select_rotate(keys, flavours.key_rotate, config).reshape(m, h, t // g, g, d).transpose(-1, -2)
    v = _select_rotate(values, flavours.value_rotate, config).reshape(m, h, t // g, g, d)
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


def roundtrip_options(keys: torch.Tensor, values: torch.Tensor, config: KVarNConfig, passes=None,
                      key_options: int = 4, value_options: int = 4):
    """The first ``key_options`` of :data:`OPTIONS` applied to K and the first ``value_options`` to V
    (2: the normalized ones, RN and -N; 4: all): the encodings and round trips.

    keys, values: ``[Hk, N*G, D]`` in the model frame; passes: as :func:`encode_flavoured`. Returns
    the fields, K's ``[key_options, Hk, N, ...]`` and V's ``[value_options, Hk, N, ...]`` (row c:
    option c; so K's and V's leading dims differ when the counts do), and their round trips
    ``(keys [key_options, Hk, N*G, D], values [value_options, Hk, N*G, D])``, float32, model frame:
    what :func:`encode_flavoured` and :func:`decode_flavoured` give for each option, bit for bit
    (the codec's encode is per tile, and every rotation here has the shape it has there). A rule
    that never picks an option need not pay for it (rule a2's keys: two).

    The rotation is taken once per tensor, and the two normalized options are one encode (as are
    the two without normalization): at most four codec calls instead of eight, whose fixed cost per
    call (a few dozen small tensor operations per normalization iteration) is most of a trial on CPU.
    """
    for name, n in (("key_options", key_options), ("value_options", value_options)):
        if n not in (2, 4):
            raise ValueError(f"{name}={n!r}: choose 2 (the normalized options) or 4 (all of OPTIONS)")
    h, t, d = keys.shape
    g = config.tile
    kq, vq = config.quantiles

    def trial(x, bits, quantile, options, as_tiles):
        plain = x.to(torch.float32)[None]
        both = as_tiles(torch.cat([rotate_kv(plain, config), plain]))  # OPTIONS order: rotated, model frame
        parts = [encode_tile_fields(both, bits, config.sinkhorn_iters, quantile, passes=passes)]
        if options == 4:
            parts.append(encode_tile_fields(both, bits, 0, quantile, passes=passes))
        return [torch.cat(f) for f in zip(*parts)]

    kc, ks, kz, kr = trial(keys, config.key_bits, kq, key_options,
                           lambda x: x.reshape(2, h, t // g, g, d).transpose(-1, -2))
    vc, vs, vz, vcol = trial(values, config.value_bits, vq, value_options, lambda x: x.reshape(2, h, t // g, g, d))
    stacked = TileFields(kc, ks, kz, kr, vc, vcol, vs, vz)
    dk, dv = decode_tiles(stacked, config)  # [Ok, Hk, N, D, G], [Ov, Hk, N, G, D]
    dk = dk.transpose(-1, -2).reshape(key_options, h, t, d)
    dv = dv.reshape(value_options, h, t, d)
    for x in (dk, dv):
        for c in range(0, x.shape[0], 2):  # OPTIONS 0 and 2 are rotated: back to the model frame,
            x[c:c + 1] = rotate_kv(x[c:c + 1], config)  # one option at a time (decode_flavoured's shapes)
    return stacked, dk, dv


def option_index(rotate: torch.Tensor, normalize: torch.Tensor) -> torch.Tensor:
    """The row of :data:`OPTIONS` of each ``(rotate, normalize)`` flag pair (long, same shape)."""
    return (~rotate).long() + 2 * (~normalize).long()


def select_options(tiles: TileFields, key_option: torch.Tensor, value_option: torch.Tensor) -> TileFields:
    """Per head, the K fields of option ``key_option[h]`` and the V fields of ``value_option[h]``.

    tiles: fields ``[Ok, Hk, N, ...]`` (K) and ``[Ov, Hk, N, ...]`` (V) as :func:`roundtrip_options`
    returns them (K and V are encoded independently, so any pair of options is a valid flavour);
    options: long ``[..., Hk]``, each below its tensor's count of options. Returns
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
