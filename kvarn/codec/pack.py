"""Bit packing of integer codes into uint8 (docs/algorithm.md section 4).

``P = 8 / bits`` codes per byte; the code at column ``c`` goes to byte ``c // P`` at bit offset
``(c % P) * bits``, low bits first (4-bit: even columns in the low nibble).
"""

from __future__ import annotations

import torch

from ..config import SUPPORTED_BITS


def _check(bits: int, cols: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; choose one of {list(SUPPORTED_BITS)}")
    per_byte = 8 // bits
    if cols % per_byte:
        raise ValueError(f"last axis of {cols} codes is not a multiple of {per_byte} ({bits}-bit packing)")
    return per_byte


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: uint8 ``[..., C]`` with values < 2^bits -> uint8 ``[..., C * bits / 8]``."""
    per_byte = _check(bits, codes.shape[-1])
    if per_byte == 1:
        return codes.to(torch.uint8).contiguous()
    # uint8 throughout: the shifted codes occupy disjoint bits, so their sum is their bitwise OR.
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
    return (c << shifts).sum(-1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """packed: uint8 ``[..., C * bits / 8]`` -> uint8 codes ``[..., C]``."""
    per_byte = _check(bits, 8 // bits)
    if per_byte == 1:
        return packed.to(torch.uint8).contiguous()
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    c = (packed.to(torch.uint8).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
