"""Where the kernels may run, and strided views of tile fields.

A record buffer ``uint8 [..., record_bytes]`` (spec section 4) can be seen as a :class:`TileFields`
of strided views without copying (:func:`kvarn.codec.record.record_field_views`, re-exported here as
``record_fields_view``). Kernels read and write such views in place, so a cache can keep one
preallocated record buffer and flush into it directly.
"""

from __future__ import annotations

import os

import torch
import triton

from ..codec.record import FIELD_ORDER, TileFields
from ..codec.record import record_field_views as record_fields_view
from ..codec.record import record_layout
from ..config import KVarNConfig


def interpreting() -> bool:
    """True under triton's CPU interpreter (a property of the process, read, never set here)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter; never a silent fallback."""
    for t in tensors:
        if t is None:
            continue
        if t.is_cuda:
            continue
        if t.device.type == "cpu" and interpreting():
            continue
        raise ValueError(
            f"kvarn.kernels needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got a tensor on {t.device}; "
            "use the torch twin for CPU"
        )


def empty_fields(lead: tuple[int, ...], config: KVarNConfig, head_dim: int, device) -> TileFields:
    """Uninitialized contiguous TileFields with leading dims ``lead``."""
    return TileFields(**{
        name: torch.empty(*lead, *shape, dtype=dtype, device=device)
        for name, shape, dtype in record_layout(config, head_dim)
    })


def lead_strides(t: torch.Tensor, n_lead: int, inner: int) -> tuple[int, ...]:
    """Strides of the ``n_lead`` leading dims; the ``inner`` trailing dims must be contiguous."""
    expect = 1
    for dim in range(t.dim() - 1, t.dim() - 1 - inner, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expect:
            raise ValueError(f"tile field of shape {tuple(t.shape)} must be contiguous within a tile")
        expect *= t.shape[dim]
    return tuple(t.stride(i) for i in range(n_lead))


def check_fields(t: TileFields, lead: tuple[int, ...], config: KVarNConfig, head_dim: int) -> None:
    for name, shape, dtype in record_layout(config, head_dim):
        x = getattr(t, name)
        if tuple(x.shape) != (*lead, *shape) or x.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} {(*lead, *shape)}, got {x.dtype} {tuple(x.shape)}")


__all__ = ["record_fields_view", "empty_fields", "check_device", "lead_strides", "interpreting", "FIELD_ORDER"]


def check_launch_knobs(num_warps: int | None, max_registers: int | None) -> None:
    """The kernels' tuning knobs, refused by name before any launch: warps a power of two from 1 to
    32 (Triton's), a register cap from 16 to 255 per thread (ptxas's range)."""
    if num_warps is not None and (type(num_warps) is not int or num_warps not in (1, 2, 4, 8, 16, 32)):
        raise ValueError(f"num_warps={num_warps!r}; use None (the default) or 1, 2, 4, 8, 16 or 32")
    if max_registers is not None and (type(max_registers) is not int or not 16 <= max_registers <= 255):
        raise ValueError(f"max_registers={max_registers!r}; use None (no cap) or an int from 16 to 255")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (launch planning); 4 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@triton.jit
def _empty_kernel():
    pass


def launch_empty() -> None:
    """One empty one-warp program on the current stream: a launch that does nothing but take its
    place in the stream's order (:func:`kvarn.integrations.transformers.freeze_schedule.lead_in`)."""
    _empty_kernel[(1,)](num_warps=1)
