"""Triton kernels, each the twin of a pure-torch function with the same signature.

| kernel | torch twin |
|---|---|
| :func:`encode_tiles` (``_encode_tiles_kernel``) | :func:`kvarn.codec.encode_tiles` |
| :func:`decode_attention` (``_decode_attention_kernel``) | :func:`kvarn.attention.decode_attention` |
| :func:`kvarn.kernels.tail.append_tail` (``_append_tail_kernel``) | the indexed write of a decode step's K/V at each row's tail length (``tests/kernels/test_tail.py``) |

Importing this package needs triton. The kernels run on CUDA tensors, or on CPU tensors under
triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported); anything else raises.
"""

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("kvarn.kernels needs triton (pip install 'kvarn[triton]')") from exc

from .decode import decode_attention
from .encode import encode_tiles
from .layout import record_fields_view

__all__ = ["encode_tiles", "decode_attention", "record_fields_view"]
