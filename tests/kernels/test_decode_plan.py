"""The decode launch's plan: how many kernel variants Triton compiles as a cache grows.

Triton compiles a launch's ``tl.constexpr`` values in (a declared constexpr parameter, or a
``tl.constexpr`` object passed for a runtime one) and specializes runtime ints on being 1 and on
divisibility by 16, so every new combination is a new compile on the GPU (seconds each). A cache
decoded without ``max_length`` passes its used prefix, whose tile count and tail length change as
it grows: the launch must not turn those into new variants. The launch is recorded, not run (its
inputs on the kernels' device: CUDA, or CPU under the interpreter).
"""

import inspect

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from kvarn.config import KVarNConfig  # noqa: E402
from kvarn.kernels import decode, decode_plan  # noqa: E402
from kvarn.kernels.layout import empty_fields  # noqa: E402


class _Launched(Exception):
    pass


def _compiled_in(fn, args, kwargs) -> tuple:
    """The values Triton compiles into a launch: the keyword constexprs, declared ``tl.constexpr``
    parameters and ``tl.constexpr`` objects passed for runtime ones. (It also specializes each
    runtime int on being 1 and on divisibility by 16: two flags an int, a bounded set whatever
    the lengths, so not counted here.)"""
    params = inspect.signature(fn.fn).parameters.values()  # the kernel's own (GPU or interpreter)
    runtime = [p for p in params if p.name not in kwargs]
    fixed = [(p.name, getattr(a, "value", a)) for p, a in zip(runtime, args, strict=True)
             if "constexpr" in str(p.annotation) or isinstance(a, tl.constexpr)]
    return tuple(fixed) + tuple(sorted((k, getattr(v, "value", v)) for k, v in kwargs.items()))


@pytest.mark.parametrize("batch", [1, 16])
def test_a_growing_cache_compiles_few_variants(monkeypatch, batch, kdevice):
    fn = decode._decode_attention_kernel
    monkeypatch.setattr(decode_plan, "num_sms", lambda device: 132)  # the H200's plan

    def record(*args, **kwargs):
        raise _Launched(_compiled_in(fn, args, kwargs))

    class Recorder:
        def __getitem__(self, grid):
            return record

    monkeypatch.setattr(decode, "_decode_attention_kernel", Recorder())
    cfg = KVarNConfig.from_name("k4v2_g128")
    hq, hk, d, g, s = 32, 8, 64, cfg.tile, cfg.sink_tokens
    q = torch.zeros(batch, hq, 1, d, dtype=torch.float16, device=kdevice)
    sink = torch.zeros(batch, hk, s, d, dtype=torch.float16, device=kdevice)
    full = lambda v: torch.full((batch,), v, dtype=torch.int32, device=kdevice)  # noqa: E731

    def variant(length):
        """The launch of a step at ``length`` tokens, as FusedKVarNLayer.fused_inputs passes a cache
        without max_length: the used tiles and the tail up to its longest row."""
        n, r = divmod(length - s, g)
        r = max(r, 1)
        tail = torch.zeros(batch, hk, r, d, dtype=torch.float16, device=kdevice)
        tiles = empty_fields((batch, hk, n), cfg, d, kdevice) if n else None
        with pytest.raises(_Launched) as launched:
            decode.decode_attention(q, sink, sink, tiles, tail, tail, cfg, sink_lengths=full(s),
                                    tile_counts=full(n), tail_lengths=full(r), fp_frame="model")
        return launched.value.args[0]

    # A cache decoded 8K tokens past the sink compiles in a handful of value sets, all of them
    # within the first 4K (FP_SPLITS: the sink's and tail's 32-token blocks, up to 8). With the
    # split count compiled in, every few tiles were a new kernel (65 over these steps at batch 1).
    first = {variant(length) for length in range(s + 1, s + 4096, 7)}
    later = {variant(length) for length in range(s + 4096, s + 8192, 7)}
    assert later <= first, f"{len(later - first)} new compiled-in value sets after 4K tokens"
    assert len(first) <= 8, sorted(first)
