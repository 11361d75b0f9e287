"""Error-accumulation analysis of KV-cache quantization (docs/algorithm.md section 7).

- :func:`pseudo_decode`: static vs accumulated attention-output error, K/V error and its
  magnitude/direction decomposition, next-token KL, top-1 agreement and perplexity, per chunk.
- :func:`free_run`: greedy generation with each method against fp16.
- :func:`run_drift`: both, written as ``drift.json`` + plots + ``summary.md`` (``kvarn drift``).

Needs transformers (imported when a model runs); matplotlib only for the plots.
"""

from .drift import pseudo_decode
from .errors import decompose_error
from .freerun import FreeRun, free_run
from .inputs import load_text, tokenize
from .results import DriftRun, MethodDrift
from .specs import MethodSpec, parse_specs
from .study import run_drift

__all__ = [
    "DriftRun", "FreeRun", "MethodDrift", "MethodSpec", "decompose_error", "free_run", "load_text",
    "parse_specs", "pseudo_decode", "run_drift", "tokenize",
]
