"""KV quantization methods under one interface, so every comparison is like for like.

Every method quantizes the same units: tiles of G tokens of one KV head, with the same sink and tail
policy (decided by the cache, not here). A method differs only in what it does inside a tile:

| method | rotation | normalization | K rows | V rows | format |
|---|---|---|---|---|---|
| fp16   | -        | -             | -       | -     | full precision |
| kvarn  | Hadamard | dual-axis     | channel | token | int RTN |
| kvarn-auto | per head | per head   | channel | token | int RTN |
| kivi   | -        | -             | channel | token | int RTN |
| rtn    | -        | -             | token   | token | int RTN |
| quarot | Hadamard | -             | token   | token | int RTN |
| hkivi  | Hadamard | -             | channel | token | int RTN |
| varn   | -        | dual-axis     | channel | token | int RTN |
| fp8    | -        | -             | token   | token | e4m3, fp16 per-token scale |

"K rows = channel" means the K tile is ``[D, G]`` and min/max run over the G tokens of a channel
(per-channel keys); "token" means ``[G, D]`` with min/max over the D channels of a token. Integer
methods share the codec's RTN (half-to-even, fp16 scale and zero per row); normalized methods add
an fp16 column scale. Stored bytes count codes plus exactly the scales each method needs.

``kvarn-auto`` stores the spec's KVarN records; which of rotation and normalization each (row, KV head)
uses is decided from the prompt (:mod:`kvarn.auto`) and passed to :meth:`TileCodec.encode` /
:meth:`TileCodec.decode` as :class:`kvarn.codec.flavour.Flavours`. Its rows of 2-bit codes are rounded
over their [q, 1 - q] quantiles (:func:`kvarn.auto.auto_ranges`, resolved into the codec's config
where the caller's config leaves the ranges open); without flavours it is KVarN with those ranges.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec.flavour import Flavours, decode_flavoured, encode_flavoured
from .codec.hadamard import rotate
from .codec.record import TileFields
from .codec.tiles import decode_tiles, encode_tile_fields, rotate_kv, validate_kv
from .config import KVarNConfig
from .cpu import CODEC_KERNELS, tile_passes

FP8_MAX = 448.0  # largest finite float8_e4m3fn
RECORD_METHODS = ("kvarn", "kvarn-auto")  # methods stored as the spec's padded records


@dataclass(frozen=True)
class Method:
    name: str
    rotate: bool
    normalize: bool
    key_per_channel: bool
    fmt: str  # "none" | "int" | "fp8"
    source: str


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fp16", False, False, False, "none",
           "no quantization: the model's own K/V, token for token identical to transformers' DynamicCache"),
    Method("kvarn", True, True, True, "int",
           "KVarN (Muller et al., arXiv 2606.03458): Hadamard, dual-axis variance normalization, RTN"),
    Method("kvarn-auto", True, True, True, "int",
           "kvarn's records with rotation and normalization chosen per (row, KV head) from the prompt "
           "(kvarn.auto); KVarN where the prompt is too short to decide"),
    Method("kivi", False, False, True, "int",
           "KIVI (Liu et al., ICML 2024, arXiv 2402.02750): per-channel keys, per-token values"),
    Method("rtn", False, False, False, "int",
           "plain asymmetric round-to-nearest, per token for keys and values"),
    Method("quarot", True, False, False, "int",
           "QuaRot-style (Ashkboos et al., NeurIPS 2024, arXiv 2404.00456): Hadamard + per-token RTN"),
    Method("hkivi", True, False, True, "int",
           "the KVarN paper's HK ablation: Hadamard rotation + KIVI"),
    Method("varn", False, True, True, "int",
           "the KVarN paper's VarN ablation: variance normalization without rotation"),
    Method("fp8", False, False, False, "fp8",
           "FP8 e4m3 with an fp16 per-token scale (vLLM's fp8 KV-cache format)"),
)}


def get_method(name: str | Method) -> Method:
    if isinstance(name, Method):
        return name
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown method {name!r}; valid methods: {sorted(METHODS)}")
    return METHODS[name]


@dataclass
class EncodedKV:
    """Stored form of ``T`` tokens (a multiple of G) of K and V, shape ``[B, H, T, D]``."""

    method: Method
    shape: tuple[int, int, int, int]
    nbytes: int
    tiles: TileFields | None = None      # integer methods
    keys: torch.Tensor | None = None     # fp16 (no quantization): [B, H, T, D], the input's dtype
    values: torch.Tensor | None = None
    k_fp8: torch.Tensor | None = None    # fp8: [B, H, T, D] float8_e4m3fn
    k_scale: torch.Tensor | None = None  # fp8: [B, H, T] fp16
    v_fp8: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    flavours: Flavours | None = None     # kvarn-auto: [B, Hk] flags the tiles were written with


class TileCodec:
    """Encode/decode full tiles of K/V with one method. Inputs are in the model's frame (K after RoPE).

    ``kernels``: who makes the passes over the tiles when encoding (:func:`kvarn.cpu.tile_passes`):
    ``"auto"`` (numba's loops on CPU where numba is installed, else torch), ``"numba"`` or
    ``"torch"``. The stored bits are the same either way.
    """

    def __init__(self, method: str | Method, config: KVarNConfig, kernels: str = "auto"):
        self.method = get_method(method)
        if not isinstance(config, KVarNConfig):
            raise TypeError(f"config must be a KVarNConfig, got {type(config).__name__}")
        if kernels not in CODEC_KERNELS:
            raise ValueError(f"kernels={kernels!r}; choose one of {list(CODEC_KERNELS)}")
        if kernels == "numba":
            from .cpu import encoder  # noqa: F401  (the ImportError naming numba now, not at the first encode)
        if self.method.name == "kvarn-auto":
            from .auto.rules import auto_ranges

            config = auto_ranges(config)
        self.config = config
        self.kernels = kernels

    def raise_deferred(self) -> None:
        """Raise for a numerics check an encode deferred (nothing here: this codec checks at once)."""

    # bytes -----------------------------------------------------------------------------------
    def bytes_per_token(self, head_dim: int) -> float:
        """Stored K+V bytes per token per KV head for a full tile."""
        m, c, d, g = self.method, self.config, head_dim, self.config.tile
        if m.fmt == "none":
            return 4.0 * d
        if m.fmt == "fp8":
            return 2 * (d + 2)
        if m.name in RECORD_METHODS:
            return c.record_bytes(d) / g
        codes = (c.key_bits + c.value_bits) * d * g / 8
        k_rows = d if m.key_per_channel else g
        scales = 4 * k_rows + 4 * g  # fp16 scale + zero per row, K and V
        if m.normalize:
            scales += 2 * (g if m.key_per_channel else d) + 2 * d  # fp16 column scales
        return (codes + scales) / g

    # encode / decode ---------------------------------------------------------------------------
    def encode(self, keys: torch.Tensor, values: torch.Tensor, flavours: Flavours | None = None) -> EncodedKV:
        """keys, values: ``[B, H, T, D]``, T a multiple of the tile; flavours ``[B, H]`` (kvarn-auto only)."""
        m, c = self.method, self.config
        validate_kv(keys, values, c.tile)
        b, h, t, d = keys.shape
        nbytes = int(round(self.bytes_per_token(d) * b * h * t))
        if flavours is not None:
            if m.name != "kvarn-auto":
                raise ValueError(f"flavours are only meaningful for method 'kvarn-auto', not {m.name!r}")
            tiles = encode_flavoured(keys, values, flavours, c, tile_passes(self.kernels, keys.device))
            return EncodedKV(m, tuple(keys.shape), nbytes, tiles=tiles, flavours=flavours)
        if m.fmt == "none":
            return EncodedKV(m, tuple(keys.shape), nbytes, keys=keys.clone(), values=values.clone())
        if m.fmt == "fp8":
            kq, ks = _fp8_encode(keys)
            vq, vs = _fp8_encode(values)
            return EncodedKV(m, tuple(keys.shape), nbytes, k_fp8=kq, k_scale=ks, v_fp8=vq, v_scale=vs)
        k = rotate_kv(keys, c) if m.rotate else keys.to(torch.float32)
        v = rotate_kv(values, c) if m.rotate else values.to(torch.float32)
        n = t // c.tile
        k = k.reshape(b, h, n, c.tile, d)
        v = v.reshape(b, h, n, c.tile, d)
        if m.key_per_channel:
            k = k.transpose(-1, -2)
        iters = c.sinkhorn_iters if m.normalize else 0
        passes = tile_passes(self.kernels, keys.device)
        kq, vq = c.quantiles
        kc, ks, kz, kr = encode_tile_fields(k, c.key_bits, iters, kq, passes=passes)
        vc, vs, vz, vcol = encode_tile_fields(v, c.value_bits, iters, vq, passes=passes)
        return EncodedKV(m, tuple(keys.shape), nbytes, tiles=TileFields(kc, ks, kz, kr, vc, vcol, vs, vz))

    def decode(self, enc: EncodedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (keys, values) float32 ``[B, H, T, D]`` in the model's frame."""
        m, c = enc.method, self.config
        b, h, t, d = enc.shape
        if m.fmt == "none":
            return enc.keys.to(torch.float32), enc.values.to(torch.float32)
        if m.fmt == "fp8":
            return _fp8_decode(enc.k_fp8, enc.k_scale), _fp8_decode(enc.v_fp8, enc.v_scale)
        if enc.flavours is not None:
            return decode_flavoured(enc.tiles, enc.flavours, c)
        k, v = decode_tiles(enc.tiles, c)
        if m.key_per_channel:
            k = k.transpose(-1, -2)
        k, v = k.reshape(b, h, t, d), v.reshape(b, h, t, d)
        if m.rotate:
            k, v = rotate(k), rotate(v)
        return k, v

    def roundtrip(self, keys: torch.Tensor, values: torch.Tensor,
                  flavours: Flavours | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize then dequantize; returns tensors of the input dtype."""
        k, v = self.decode(self.encode(keys, values, flavours))
        return k.to(keys.dtype), v.to(values.dtype)


def _fp8_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(torch.float32)
    scale = (x.abs().amax(-1) / FP8_MAX).clamp_min(1e-8).to(torch.float16)
    codes = (x / scale.to(torch.float32)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def _fp8_decode(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale.to(torch.float32)[..., None]
