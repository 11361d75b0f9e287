"""The stored form of a KVarN tile: its fields and their byte record (docs/algorithm.md section 4).

Every stored value is in the rotated frame (``k' = k @ H``). A K tile is ``[D, G]`` (rows =
channels, quantized per channel over G tokens); a V tile is ``[G, D]`` (rows = tokens, quantized per
token over D channels). Stored fields per (tile, KV head), all scales fp16:

    k_codes     uint8 [G*kb/8, D]   K codes packed along tokens (byte c of channel d holds tokens P c + i)
    k_row_scale fp16  [D]           sK = row_scale * step
    k_row_zero  fp16  [D]           zK = row_scale * lo
    k_col_scale fp16  [G]           rK = col_scale       K'[d,g] = (q*sK[d] + zK[d]) * rK[g]
    v_codes     uint8 [D*vb/8, G]   V codes packed along channels (byte c of token g holds channels P c + j)
    v_col_scale fp16  [D]           cV = col_scale
    v_row_scale fp16  [G]           sV = row_scale * step
    v_row_zero  fp16  [G]           zV = row_scale * lo  V'[g,d] = (q*sV[g] + zV[g]) * cV[d]

The byte record concatenates them in exactly that order (fp16 little-endian), zero-padded to a
multiple of 8 bytes: D=G=128, k4v2 -> 8192 + 768 + 4096 + 768 = 13824 bytes.

Code byte order. A packed code matrix is ``[rows, cols / P]`` in the record (docs/algorithm.md section 4: the K
codes channel-major ``[D, G/P]``, the V codes token-major ``[G, D/P]``). Stored fields and tile
stores keep both code matrices transposed (``[G/P, D]`` and ``[D/P, G]``): the same bytes, each
unchanged, in the order the decode kernel's matrix products consume them (a row of bytes runs along
the product's reduction axis: channels for K, tokens for V; see :mod:`kvarn.kernels.decode`).
:func:`fields_to_records` and :func:`records_to_fields` convert to and from the record's order;
:func:`record_field_views` views a tile store's buffer, which holds records with the code matrices
transposed (:func:`record_layout`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from ..config import KVarNConfig

FIELD_ORDER = (
    "k_codes", "k_row_scale", "k_row_zero", "k_col_scale",
    "v_codes", "v_col_scale", "v_row_scale", "v_row_zero",
)


@dataclass
class TileFields:
    """Stored fields of a batch of tiles; every tensor has the same leading dims ``[...]``."""

    k_codes: torch.Tensor
    k_row_scale: torch.Tensor
    k_row_zero: torch.Tensor
    k_col_scale: torch.Tensor
    v_codes: torch.Tensor
    v_col_scale: torch.Tensor
    v_row_scale: torch.Tensor
    v_row_zero: torch.Tensor

    def map(self, fn) -> "TileFields":
        return TileFields(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in FIELD_ORDER)


def fields_to_records(t: TileFields, config: KVarNConfig, head_dim: int) -> torch.Tensor:
    """TileFields with leading dims ``[...]`` -> uint8 records ``[..., record_bytes]`` (spec order)."""
    lead = t.k_codes.shape[:-2]
    parts = [_to_record_order(n, getattr(t, n)).contiguous().view(torch.uint8).reshape(*lead, -1)
             for n in FIELD_ORDER]
    raw = torch.cat(parts, dim=-1)
    pad = config.record_bytes(head_dim) - raw.shape[-1]
    return torch.nn.functional.pad(raw, (0, pad)) if pad else raw


_CODES = ("k_codes", "v_codes")


def _to_record_order(name: str, x: torch.Tensor) -> torch.Tensor:
    """A stored field in the record's order: code matrices transposed back (module docstring)."""
    return x.transpose(-1, -2) if name in _CODES else x


def record_layout(config: KVarNConfig, head_dim: int) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(field, per-tile shape, dtype)`` of a tile store's records, in record order
    (docs/algorithm.md section 4).

    The code matrices have the stored (transposed) shape; their byte ranges are the record's.
    """
    d, g = head_dim, config.tile
    return [
        ("k_codes", (g * config.key_bits // 8, d), torch.uint8),
        ("k_row_scale", (d,), torch.float16), ("k_row_zero", (d,), torch.float16),
        ("k_col_scale", (g,), torch.float16),
        ("v_codes", (d * config.value_bits // 8, g), torch.uint8),
        ("v_col_scale", (d,), torch.float16), ("v_row_scale", (g,), torch.float16),
        ("v_row_zero", (g,), torch.float16),
    ]


def record_field_views(records: torch.Tensor, config: KVarNConfig, head_dim: int) -> TileFields:
    """A tile store's uint8 ``[..., record_bytes]`` (byte axis contiguous) -> TileFields of views, no copy.

    Every field is a byte range of the record; fp16 fields reinterpret their (even-aligned) bytes.
    The store's records hold the code matrices transposed (module docstring); for records in the
    spec's order use :func:`records_to_fields`.
    """
    expected = config.record_bytes(head_dim)
    if records.dtype != torch.uint8 or records.shape[-1] != expected:
        raise ValueError(
            f"records must be uint8 [..., {expected}] for {config.name} at head_dim={head_dim}, "
            f"got {records.dtype} {tuple(records.shape)}"
        )
    if records.stride(-1) != 1:
        raise ValueError("records must be contiguous along the byte axis")
    out, offset = {}, 0
    for name, shape, dtype in record_layout(config, head_dim):
        nbytes = math.prod(shape) * (2 if dtype == torch.float16 else 1)
        chunk = records[..., offset:offset + nbytes]
        if dtype == torch.float16:
            chunk = chunk.view(torch.float16)
        out[name] = chunk.unflatten(-1, shape) if len(shape) > 1 else chunk
        offset += nbytes
    return TileFields(**out)


def store_records(t: TileFields, config: KVarNConfig, head_dim: int) -> torch.Tensor:
    """TileFields ``[...]`` -> uint8 ``[..., record_bytes]`` in a tile store's order (code matrices
    transposed, module docstring): the inverse of :func:`record_field_views`. For the spec's byte
    order use :func:`fields_to_records`."""
    lead = t.k_codes.shape[:-2]
    out = torch.zeros(*lead, config.record_bytes(head_dim), dtype=torch.uint8, device=t.k_codes.device)
    views = record_field_views(out, config, head_dim)
    for name in FIELD_ORDER:
        getattr(views, name).copy_(getattr(t, name))
    return out


def records_to_fields(records: torch.Tensor, config: KVarNConfig, head_dim: int) -> TileFields:
    """Inverse of :func:`fields_to_records`: contiguous copies of every field.

    records: uint8 ``[..., record_bytes]`` in the spec's byte order.
    """
    if isinstance(records, torch.Tensor) and records.dim() and records.stride(-1) != 1:
        records = records.contiguous()
    views = record_field_views(records, config, head_dim)
    out = {}
    for name in FIELD_ORDER:
        x = getattr(views, name)
        if name in _CODES:  # the record's bytes, [rows, cols / P], into the stored order
            x = x.flatten(-2).unflatten(-1, x.shape[-2:][::-1]).transpose(-1, -2)
        out[name] = x.contiguous()
    return TileFields(**out)


def check_finite_scales(tiles: TileFields) -> None:
    """ValueError naming the first record (index into the leading dims) with a NaN/Inf fp16 field."""
    for name in FIELD_ORDER:
        x = getattr(tiles, name)
        if x.dtype != torch.float16:
            continue
        bad = ~torch.isfinite(x).all(-1)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"record {where} (of {tuple(bad.shape)} records) has a non-finite {name} "
                f"({int(bad.sum())} record(s) in all); a valid record holds finite fp16 scales"
            )


__all__ = [
    "FIELD_ORDER", "TileFields", "check_finite_scales", "fields_to_records", "record_field_views", "record_layout",
    "records_to_fields", "store_records",
]
