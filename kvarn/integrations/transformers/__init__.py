"""The fused GPU cache path for transformers (5.17 - 5.19): the KVarN cache's tiles encoded and read
by the Triton kernels inside the model's attention, and greedy decoding captured in CUDA graphs.

- :mod:`.attention`: the ``"kvarn"`` attention function and :func:`fused_cache`;
- :mod:`.fused_layer`: the cache layers whose tiles the kernels encode and read;
- :mod:`.triton_codec`: the codec of those layers (:func:`kvarn.kernels.encode_tiles`);
- :mod:`.graph`: :func:`decode_greedy`, the decode step captured in CUDA graphs;
- :mod:`.freeze_schedule`: where a captured decode's tile freeze runs (which step, which stream).

Importing this package needs torch alone; the kernels import triton on first use.
"""

from .attention import cache_for, fused_cache, register, use_fused
from .graph import decode_greedy

__all__ = ["cache_for", "decode_greedy", "fused_cache", "register", "use_fused"]
