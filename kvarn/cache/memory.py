"""The entries of :meth:`kvarn.KVarNCache.memory_report` (its docstring defines each field): one per
layer, made by the layer kinds that know their storage, and their total over the layers."""

from __future__ import annotations

import torch

# The fields a total adds up over the layers (the ratios and the dtype's name are derived).
SUMMED = ("tokens", "quantized_tiles", "quantized_bytes", "full_precision_bytes", "fp16_equivalent_bytes",
          "reserved_bytes", "decoded_cache_bytes", "baseline_bytes")


def memory_entry(quantized_bytes, full_precision_bytes, tokens, fp16_equivalent_bytes, reserved_bytes,
                 quantized_tiles=0, decoded_cache_bytes=0, baseline_bytes=None, baseline_dtype=None) -> dict:
    """One memory entry. ``baseline_bytes``: what the model's own cache would hold for the same
    tokens, K and V in ``baseline_dtype`` (default: the fp16 figure); ``compression_ratio`` is
    against it, ``compression_vs_fp16`` against fp16."""
    total = quantized_bytes + full_precision_bytes
    if baseline_bytes is None:
        baseline_bytes, baseline_dtype = fp16_equivalent_bytes, baseline_dtype or "float16"
    return {
        "decoded_cache_bytes": decoded_cache_bytes,
        "tokens": tokens,
        "quantized_tiles": quantized_tiles,
        "quantized_bytes": quantized_bytes,
        "full_precision_bytes": full_precision_bytes,
        "total_bytes": total,
        "baseline_bytes": baseline_bytes,
        "baseline_dtype": baseline_dtype,
        "compression_ratio": baseline_bytes / total if total else 1.0,
        "fp16_equivalent_bytes": fp16_equivalent_bytes,
        "compression_vs_fp16": fp16_equivalent_bytes / total if total else 1.0,
        "reserved_bytes": reserved_bytes,
    }


def empty_entry() -> dict:
    """A layer that holds nothing yet."""
    return memory_entry(0, 0, 0, 0, 0)


def dense_entry(keys: torch.Tensor | None) -> dict:
    """A full-precision layer of transformers' own (a sliding-window layer left unquantized): its
    ``keys [B, H, L, D]`` and as many value elements, all in the model dtype."""
    n = 0 if keys is None or keys.dim() < 4 else keys.numel() * 2
    esize = 0 if keys is None else keys.element_size()
    tokens = 0 if not n else keys.shape[0] * keys.shape[2]
    return memory_entry(0, n * esize, tokens, n * 2, n * esize, baseline_bytes=n * esize,
                        baseline_dtype=None if keys is None else dtype_name(keys.dtype))


def total_entry(entries: list[dict]) -> dict:
    """The layers' entries added up; ``baseline_dtype`` names every dtype that holds tokens."""
    sums = {k: sum(entry[k] for entry in entries) for k in SUMMED}
    dtypes = sorted({e["baseline_dtype"] for e in entries if e["tokens"] and e["baseline_dtype"]})
    return memory_entry(sums["quantized_bytes"], sums["full_precision_bytes"], sums["tokens"],
                        sums["fp16_equivalent_bytes"], sums["reserved_bytes"], sums["quantized_tiles"],
                        sums["decoded_cache_bytes"], baseline_bytes=sums["baseline_bytes"],
                        baseline_dtype="+".join(dtypes) or None)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
