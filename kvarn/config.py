"""Frozen configuration of the KVarN codec, with the named presets of docs/algorithm.md section 6.

Bytes per token per KV head follow the record layout of docs/algorithm.md section 4:
``[K codes][sK 2D][zK 2D][rK 2G][V codes][cV 2D][sV 2G][zV 2G]``, padded to 8 bytes, divided by G.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_TILES = (32, 64, 128, 256)
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 1024


def supported_head_dims() -> tuple[int, ...]:
    """Every power of two from 16 to 1024 (the Hadamard rotation needs a power of two)."""
    out, d = [], MIN_HEAD_DIM
    while d <= MAX_HEAD_DIM:
        out.append(d)
        d *= 2
    return tuple(out)


def _is_int(v) -> bool:
    """An integer that is not a bool (``True == 1`` would pass a membership test)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_head_dim(head_dim: int) -> None:
    if not isinstance(head_dim, int) or head_dim not in supported_head_dims():
        raise ValueError(
            f"head_dim={head_dim!r} is not supported: the Hadamard rotation needs a power of two "
            f"in {list(supported_head_dims())}"
        )


@dataclass(frozen=True)
class KVarNConfig:
    """KVarN settings. Use :meth:`from_name` for the presets of docs/algorithm.md section 6.

    key_bits / value_bits: 2, 4 or 8 bits per stored code.
    tile: G, tokens per tile (128 default, 64 allowed; 32 and 256 also accepted).
    sinkhorn_iters: T, iterations of the dual-axis normalization (8 default, 16 in the paper).
    sink_tokens: S, full-precision tokens at the start of every sequence (default: one tile).
        Must be a multiple of the tile so that quantized tiles stay aligned to G.
    key_quantile / value_quantile: the range each row of K / V is rounded over (docs/algorithm.md
        section 3): 0 is the spec's min/max, q > 0 the row's [q, 1-q] quantiles. None (default):
        the method's own range, min/max for every method except kvarn-auto, which uses the
        quantiles for 2-bit rows (:func:`kvarn.auto.auto_ranges`). :attr:`quantiles` resolves None to 0.
    rotation_dtype: "float32" (default, preferred on CPU) or "float16" (the reference implementation).
    quantize_sliding_window: quantize layers with sliding-window attention (off by default).
    """

    key_bits: int = 4
    value_bits: int = 2
    tile: int = 128
    sinkhorn_iters: int = 8
    sink_tokens: int | None = None
    key_quantile: float | None = None
    value_quantile: float | None = None
    rotation_dtype: str = "float32"
    quantize_sliding_window: bool = False

    def __post_init__(self) -> None:
        for field in ("key_bits", "value_bits"):
            v = getattr(self, field)
            if not _is_int(v) or v not in SUPPORTED_BITS:
                raise ValueError(f"{field}={v!r} is not supported; choose one of {list(SUPPORTED_BITS)}")
        if not _is_int(self.tile) or self.tile not in SUPPORTED_TILES:
            raise ValueError(f"tile={self.tile!r} is not supported; choose one of {list(SUPPORTED_TILES)}")
        if not _is_int(self.sinkhorn_iters) or self.sinkhorn_iters < 0:
            raise ValueError(f"sinkhorn_iters={self.sinkhorn_iters!r} must be an integer >= 0")
        if self.sink_tokens is None:
            object.__setattr__(self, "sink_tokens", self.tile)
        if not _is_int(self.sink_tokens) or self.sink_tokens < 0 or self.sink_tokens % self.tile:
            raise ValueError(
                f"sink_tokens={self.sink_tokens!r} must be a non-negative multiple of tile={self.tile}"
            )
        for field in ("key_bits", "value_bits", "tile", "sinkhorn_iters", "sink_tokens"):  # numpy ints as int (JSON)
            object.__setattr__(self, field, int(getattr(self, field)))
        for field in ("key_quantile", "value_quantile"):
            v = getattr(self, field)
            if v is not None and not (isinstance(v, (int, float)) and 0.0 <= v < 0.5):
                raise ValueError(f"{field}={v!r} must be None or a number in [0, 0.5)")
        if self.rotation_dtype not in ("float32", "float16"):
            raise ValueError(f"rotation_dtype={self.rotation_dtype!r}; choose 'float32' or 'float16'")
        if not isinstance(self.quantize_sliding_window, bool):
            raise ValueError(f"quantize_sliding_window={self.quantize_sliding_window!r} must be True or False")

    @classmethod
    def from_name(cls, name: str, **overrides) -> "KVarNConfig":
        """A preset of docs/algorithm.md section 6 by name (``k4v2_g128`` ...), with optional field overrides."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]

    @property
    def quantiles(self) -> tuple[float, float]:
        """(keys, values): the quantile each tensor's rows are rounded between, 0.0 for min/max."""
        return (float(self.key_quantile or 0.0), float(self.value_quantile or 0.0))

    @property
    def name(self) -> str:
        return f"k{self.key_bits}v{self.value_bits}_g{self.tile}"

    def key_code_bytes(self, head_dim: int) -> int:
        return head_dim * self.tile * self.key_bits // 8

    def value_code_bytes(self, head_dim: int) -> int:
        return self.tile * head_dim * self.value_bits // 8

    def record_bytes(self, head_dim: int) -> int:
        """Bytes of one (tile, KV head) record, docs/algorithm.md section 4, padded to a multiple of 8."""
        check_head_dim(head_dim)
        d, g = head_dim, self.tile
        raw = (
            self.key_code_bytes(d) + 2 * d + 2 * d + 2 * g
            + self.value_code_bytes(d) + 2 * d + 2 * g + 2 * g
        )
        return (raw + 7) // 8 * 8

    def bytes_per_token(self, head_dim: int) -> float:
        """Quantized K+V bytes per token per KV head (scales included)."""
        return self.record_bytes(head_dim) / self.tile

    def compression_ratio(self, head_dim: int) -> float:
        """fp16 K+V bytes (4 * head_dim per token) over quantized bytes."""
        return 4 * head_dim / self.bytes_per_token(head_dim)


PRESETS: dict[str, KVarNConfig] = {
    f"k{kb}v{vb}_g{g}": KVarNConfig(key_bits=kb, value_bits=vb, tile=g, sinkhorn_iters=8)
    for g in (128, 64)
    for kb, vb in ((2, 2), (4, 2), (4, 4))
}
