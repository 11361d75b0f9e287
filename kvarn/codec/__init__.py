"""The KVarN tile codec (docs/algorithm.md sections 1-4), one module per piece:

- :mod:`.hadamard`: the rotation ``x @ H``;
- :mod:`.normalize`: the dual-axis variance normalization (row and column scales);
- :mod:`.quantize`: round-to-nearest of each row over its range;
- :mod:`.pack`: codes packed into bytes;
- :mod:`.record`: the stored fields of a tile and their byte record;
- :mod:`.tiles`: the codec itself, encode and decode of tiles, and the ``[B, H, T, D]`` API;
- :mod:`.flavour`: rotation and normalization switched per (row, KV head), for kvarn-auto.

Pure torch: the numba twins of the encoder's passes are in :mod:`kvarn.cpu`, the Triton kernels in
:mod:`kvarn.kernels`.
"""

from .hadamard import hadamard_matrix, rotate
from .record import FIELD_ORDER, TileFields, fields_to_records, records_to_fields
from .tiles import (FP16_MAX, FP16_TINY, QuantizedKV, check_encoded, decode_tiles, dequantize_kv, encode_tile_fields,
                    encode_tiles, kv_to_tiles, quantize_kv, rotate_kv, tiles_to_kv, validate_kv)

__all__ = [
    "FIELD_ORDER", "FP16_MAX", "FP16_TINY", "QuantizedKV", "TileFields", "check_encoded", "decode_tiles", "dequantize_kv",
    "encode_tile_fields", "encode_tiles", "fields_to_records", "hadamard_matrix", "kv_to_tiles", "quantize_kv",
    "records_to_fields", "rotate", "rotate_kv", "tiles_to_kv", "validate_kv",
]
