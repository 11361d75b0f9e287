"""kvarn-auto: rotation and normalization chosen per (row, KV head) from the prompt, or, for a
prompt shorter than the sink plus a tile, at the row's first tile past the sink.

- :mod:`.rules`: the rules (a2, the default, a3, n2: per-head scores of the prompt's own error;
  r3: the self-test's candidates), :class:`AutoSettings`, :func:`decide`, the 2-bit ranges;
- :mod:`.decision`: what a rule decided, per row and per layer;
- :mod:`.self_test_rule`: rule r3, a short self-test of the model on its prompt;
- :mod:`.layer`: the cache layer that decides (:class:`~kvarn.auto.layer.KVarNAutoLayer`);
- :mod:`.prompt_capture`: the hooks that hand the forwards' queries to those layers.

This package exports the rules; the cache layer and the hooks are used through
:class:`kvarn.KVarNCache` (``method="kvarn-auto"``).
"""

from .decision import LayerDecision, RowDecision
from .rules import (LOW_BIT_QUANTILE, POLICIES, RULES, TRIAL_TILES, AutoSettings, auto_ranges, decide,
                    decide_first_tile, decide_row, first_tile_tokens)

__all__ = ["AutoSettings", "LOW_BIT_QUANTILE", "LayerDecision", "POLICIES", "RULES", "RowDecision", "TRIAL_TILES",
           "auto_ranges", "decide", "decide_first_tile", "decide_row", "first_tile_tokens"]
