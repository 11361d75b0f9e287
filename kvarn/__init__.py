"""kvarn: variance-normalized 2-4 bit KV-cache quantization (KVarN, arXiv 2606.03458).

``import kvarn`` needs only torch; transformers, triton and vLLM are imported lazily.
"""

from .codec.tiles import QuantizedKV, dequantize_kv, quantize_kv
from .config import PRESETS, KVarNConfig

__all__ = ["KVarNConfig", "PRESETS", "QuantizedKV", "quantize_kv", "dequantize_kv", "KVarNCache", "models"]

__version__ = "0.1.0"


def __getattr__(name):
    # Heavy integrations load on first use, so the core needs torch alone.
    if name == "KVarNCache":
        from .cache import KVarNCache

        return KVarNCache
    if name in ("models", "analysis", "eval", "kernels", "methods"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kvarn' has no attribute {name!r}")
