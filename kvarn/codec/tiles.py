"""The KVarN tile codec: rotation, normalization, RTN and packing (docs/algorithm.md sections 1-3).

A tile of rotated values ``x [..., R, C]`` (``k' = k @ H``; K: ``[D, G]``, rows = channels; V:
``[G, D]``, rows = tokens) is normalized, ``Y = x / (row_scale[:, None] * col_scale[None, :])`` with
the dual-axis scales of :mod:`kvarn.codec.normalize`; each row of ``Y`` is rounded to ``bits`` over its
range (:func:`kvarn.codec.quantize.rtn_rows`: ``Y ~= q * step + lo``) and the codes are packed
(:mod:`kvarn.codec.pack`). Stored, in fp16: ``scale = row_scale * step`` and ``zero = row_scale * lo`` per
row, ``col_scale`` per column, so ``x ~= (q * scale + zero) * col_scale`` (:func:`decode_tiles`).
The fields and their byte record: :mod:`kvarn.codec.record`.

On top, the ``[B, H, T, D]`` API: :func:`quantize_kv` (rotate, cut into tiles of G tokens, encode),
:func:`dequantize_kv`, and :class:`QuantizedKV` holding the tiles.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import KVarNConfig, check_head_dim
from .hadamard import rotate
from .normalize import Workspace, apply_scales, best_iterate, normalize_iterates
from .pack import pack_codes, unpack_codes
from .quantize import dequantize_rows, rtn_rows
from .record import FIELD_ORDER, TileFields, check_finite_scales, fields_to_records, records_to_fields

logger = logging.getLogger(__name__)

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
FP16_TINY = float(torch.finfo(torch.float16).tiny)  # 2^-14, the smallest normal fp16


def _round_and_pack(y: torch.Tensor, bits: int, quantile: float):
    """Rows of ``y [..., R, C]`` rounded and packed: (codes ``uint8 [..., C / P, R]`` in the stored
    order (:mod:`kvarn.codec.record`), step ``[..., R]``, lo ``[..., R]``)."""
    codes, step, lo = rtn_rows(y, bits, quantile)
    return pack_codes(codes, bits).transpose(-1, -2).contiguous(), step, lo


def quantize_scaled(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int, quantile: float):
    """The rows of ``Y = x / (exp(b) ⊗ exp(a))`` (:func:`kvarn.codec.normalize.apply_scales`) rounded
    and packed: (codes ``uint8 [..., C / P, R]`` in the stored order, step ``[..., R]``, lo ``[..., R]``).
    The torch twin of a ``passes`` object's ``quantize``."""
    return _round_and_pack(apply_scales(x, a, b), bits, quantile)


def encode_tile_fields(x: torch.Tensor, bits: int, iters: int, quantile: float, normalized=None, passes=None):
    """One tensor's tiles (K's or V's), x: ``[..., R, C]`` float32 -> its stored fields (packed codes,
    row scale, row zero, col scale), fp16 scales. ``iters``: Sinkhorn iterations (0: no normalization,
    the column scales are 1).

    ``normalized``: ``(y, col_scale, row_scale)`` of x at a given iterate instead of the best one
    (the kernels' tests: an iterate the Triton encoder kept on a tie up to fp32 rounding).
    ``passes``: a class like :class:`kvarn.codec.normalize.Workspace` whose instance for ``x`` makes the
    passes over the tiles, including ``quantize`` (:class:`kvarn.cpu.encoder.TilePasses`); None:
    torch operations.

    Guard rails on the fp16 scales (docs/algorithm.md, "Numerical range"): a tile whose scales
    would overflow fp16 raises ValueError; a tile whose every row scale and zero is below fp16's
    smallest normal number is stored as a zero tile (all fields 0, column scales 0 as its flag).
    Other tiles are encoded exactly as docs/algorithm.md sections 2-3 say.
    """
    if normalized is None:
        ws = passes(x) if passes is not None else Workspace(x) if iters else None
        if iters == 0:  # the identity is the only iterate: no imbalance to score (nor torch buffers)
            a, b = x.new_zeros(*x.shape[:-2], x.shape[-1]), x.new_zeros(*x.shape[:-1])
        else:
            a, b = best_iterate(*normalize_iterates(x, iters, ws))
        quantize = quantize_scaled if passes is None else ws.quantize
        packed, step, lo = quantize(x, a, b, bits, quantile)
        col_scale, row_scale = torch.exp(a), torch.exp(b)
    else:
        y, col_scale, row_scale = normalized
        packed, step, lo = _round_and_pack(y, bits, quantile)
    scale32, zero32 = row_scale * step, row_scale * lo
    scale, zero, col = scale32.to(torch.float16), zero32.to(torch.float16), col_scale.to(torch.float16)
    finite = torch.isfinite(scale).all(-1) & torch.isfinite(zero).all(-1) & torch.isfinite(col).all(-1)
    if not bool(finite.all()):
        worst = float(x.abs().amax(dim=(-2, -1))[~finite].max())
        needed = float(torch.maximum(scale32.abs().amax(-1), zero32.abs().amax(-1))[~finite].max())
        raise ValueError(
            f"{int((~finite).sum())} tile(s) cannot be stored: values of magnitude up to {worst:.3g} need "
            f"a row scale or zero of {needed:.3g}, above the fp16 limit {FP16_MAX:g} of the stored scales"
        )
    # One max per tile: the largest stored row value. Below 2^-14 every scale and zero would be an
    # fp16 subnormal (or 0) and the tile would decode to noise or to zeros without a word.
    tiny = torch.maximum(scale32.abs().amax(-1), zero32.abs().amax(-1)) < FP16_TINY
    if bool(tiny.any()):
        logger.warning(
            "%d tile(s) of magnitude at most %.3g stored as zero tiles: their fp16 scales would be "
            "below the smallest normal fp16 %.3g", int(tiny.sum()), float(x.abs().amax(dim=(-2, -1))[tiny].max()),
            FP16_TINY,
        )
        keep = ~tiny
        packed = packed * keep[..., None, None].to(packed.dtype)
        scale, zero, col = (f * keep[..., None].to(f.dtype) for f in (scale, zero, col))
    return packed, scale, zero, col


def encode_tiles(k_tiles: torch.Tensor, v_tiles: torch.Tensor, config: KVarNConfig, passes=None) -> TileFields:
    """Quantize rotated tiles. k_tiles: ``[..., D, G]``, v_tiles: ``[..., G, D]``, float32.
    ``passes``: see ``encode_tile_fields`` (:func:`kvarn.cpu.encoder.encode_tiles` sets it)."""
    k_tiles = k_tiles.to(torch.float32)
    v_tiles = v_tiles.to(torch.float32)
    kq, vq = config.quantiles
    kc, ks, kz, kr = encode_tile_fields(k_tiles, config.key_bits, config.sinkhorn_iters, kq, passes=passes)
    vc, vs, vz, vcol = encode_tile_fields(v_tiles, config.value_bits, config.sinkhorn_iters, vq, passes=passes)
    return TileFields(kc, ks, kz, kr, vc, vcol, vs, vz)


def decode_tiles(t: TileFields, config: KVarNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize to float32 rotated tiles: ``(k [..., D, G], v [..., G, D])``."""
    kq = unpack_codes(t.k_codes.transpose(-1, -2), config.key_bits)
    k = dequantize_rows(kq, t.k_row_scale, t.k_row_zero) * t.k_col_scale.to(torch.float32)[..., None, :]
    vq = unpack_codes(t.v_codes.transpose(-1, -2), config.value_bits)
    v = dequantize_rows(vq, t.v_row_scale, t.v_row_zero) * t.v_col_scale.to(torch.float32)[..., None, :]
    return k, v


def validate_kv(keys: torch.Tensor, values: torch.Tensor, tile: int | None = None) -> None:
    """Raise TypeError/ValueError for anything the codec cannot store faithfully."""
    for name, x in (("keys", keys), ("values", values)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [B, H, T, D], got shape {tuple(x.shape)}")
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have the same shape")
    check_head_dim(keys.shape[-1])
    if tile is not None and keys.shape[2] % tile:
        raise ValueError(f"T={keys.shape[2]} tokens is not a multiple of the tile G={tile}")
    for name, x in (("keys", keys), ("values", values)):
        if x.numel() and not torch.isfinite(x).all():
            raise ValueError(f"{name} contain NaN or Inf; the KV cache cannot quantize non-finite values")


@dataclass
class QuantizedKV:
    """Packed KVarN tiles for keys/values of shape ``[B, H, T, D]``; fields have leading ``[B, H, T/G]``."""

    tiles: TileFields
    config: KVarNConfig
    shape: tuple[int, int, int, int]
    dtype: torch.dtype

    @property
    def head_dim(self) -> int:
        return self.shape[-1]

    @property
    def num_tiles(self) -> int:
        b, h, t, _ = self.shape
        return b * h * (t // self.config.tile)

    @property
    def nbytes(self) -> int:
        """Stored bytes, as padded records (docs/algorithm.md section 4)."""
        return self.num_tiles * self.config.record_bytes(self.head_dim)

    def __getattr__(self, name):  # expose k_codes, v_row_scale, ... directly
        if name in FIELD_ORDER:
            return getattr(self.tiles, name)
        raise AttributeError(name)

    def to_records(self) -> torch.Tensor:
        """uint8 ``[B, H, T/G, record_bytes]`` in the byte layout of docs/algorithm.md section 4."""
        return fields_to_records(self.tiles, self.config, self.head_dim)

    @property
    def zero_tiles(self) -> tuple[torch.Tensor, torch.Tensor]:
        """bool ``[B, H, T/G]`` for K and for V: tiles stored as zero tiles (column scales all 0).

        The encoder stores a tile whose scales would underflow fp16 this way; a normal tile's column
        scales are at least ``e^-0.3``.
        """
        return (self.tiles.k_col_scale == 0).all(-1), (self.tiles.v_col_scale == 0).all(-1)

    @classmethod
    def from_records(
        cls, records: torch.Tensor, config: KVarNConfig, head_dim: int, dtype: torch.dtype = torch.float16,
        validate: bool = True,
    ) -> "QuantizedKV":
        """Rebuild from uint8 records ``[B, H, T/G, record_bytes]``.

        validate: reject records whose fp16 scales or zeros are NaN or Inf (ValueError naming the
        first such record and field); one pass over the scale bytes, not the codes.
        """
        if not isinstance(config, KVarNConfig):
            raise TypeError(f"config must be a KVarNConfig, got {type(config).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype={dtype!r} must be a floating-point torch.dtype (the dtype K/V decode to)")
        if not isinstance(records, torch.Tensor):
            raise TypeError(f"records must be a torch.Tensor, got {type(records).__name__}")
        if records.dim() != 4:
            raise ValueError(f"records must be [B, H, T/G, bytes], got shape {tuple(records.shape)}")
        b, h, n, _ = records.shape
        tiles = records_to_fields(records, config, head_dim)
        if validate:
            check_finite_scales(tiles)
        return cls(tiles, config, (b, h, n * config.tile, head_dim), dtype)


def check_encoded(tiles: TileFields, k_tiles: torch.Tensor, v_tiles: torch.Tensor) -> None:
    """For encoders without the torch codec's guard (the Triton flush): ValueError when a scale
    overflowed fp16, naming the input magnitude and the limit. Reads the scales only."""
    try:
        check_finite_scales(tiles)
    except ValueError as e:
        worst = max(float(k_tiles.abs().amax()), float(v_tiles.abs().amax()))
        raise ValueError(
            f"tiles of magnitude up to {worst:.3g} overflow their fp16 scales (fp16 limit {FP16_MAX:g}): {e}"
        ) from None


def rotate_kv(x: torch.Tensor, config: KVarNConfig) -> torch.Tensor:
    """``x @ H`` in the configured rotation dtype, returned as float32. x: ``[..., D]``."""
    dt = torch.float16 if config.rotation_dtype == "float16" else torch.float32
    return rotate(x, dt).to(torch.float32)


def kv_to_tiles(k_rot: torch.Tensor, v_rot: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, T, D]`` rotated K/V -> K tiles ``[B, H, T/G, D, G]`` and V tiles ``[B, H, T/G, G, D]``."""
    b, h, t, d = k_rot.shape
    kt = k_rot.reshape(b, h, t // tile, tile, d).transpose(-1, -2)
    vt = v_rot.reshape(b, h, t // tile, tile, d)
    return kt, vt


def tiles_to_kv(k_tiles: torch.Tensor, v_tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`kv_to_tiles`."""
    b, h, n, d, g = k_tiles.shape
    return k_tiles.transpose(-1, -2).reshape(b, h, n * g, d), v_tiles.reshape(b, h, n * g, d)


def quantize_kv(keys: torch.Tensor, values: torch.Tensor, config: KVarNConfig) -> QuantizedKV:
    """Quantize full tiles of K (after RoPE) and V. keys, values: ``[B, H, T, D]``, T a multiple of G."""
    if not isinstance(config, KVarNConfig):
        raise TypeError(f"config must be a KVarNConfig, got {type(config).__name__}")
    validate_kv(keys, values, config.tile)
    kt, vt = kv_to_tiles(rotate_kv(keys, config), rotate_kv(values, config), config.tile)
    return QuantizedKV(encode_tiles(kt, vt, config), config, tuple(keys.shape), keys.dtype)


def dequantize_kv(qkv: QuantizedKV, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize to ``[B, H, T, D]`` in the original dtype; un-rotated unless ``rotated=True``."""
    if not isinstance(qkv, QuantizedKV):
        raise TypeError(f"qkv must be a QuantizedKV (from quantize_kv or QuantizedKV.from_records), "
                        f"got {type(qkv).__name__}")
    k, v = tiles_to_kv(*decode_tiles(qkv.tiles, qkv.config))
    if not rotated:
        k, v = rotate(k), rotate(v)
    k, v = k.to(qkv.dtype), v.to(qkv.dtype)
    for name, x in (("keys", k), ("values", v)):
        # Finite scales can still decode past the output dtype's range (records not made by the
        # encoder): say so instead of returning Inf, or NaN after the rotation.
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            b, h, t, _ = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{name} of record {(b, h, t // qkv.config.tile)} decode to non-finite values in "
                f"{qkv.dtype} (its largest finite value is {torch.finfo(qkv.dtype).max:.4g})"
            )
    return k, v
