"""Which methods a drift study runs: ``"<method>:<preset>"`` specs and the config each runs with.

A :class:`MethodSpec` is one method of :data:`kvarn.methods.METHODS` at one preset of
:data:`kvarn.PRESETS`, optionally with kvarn-auto's decision rule and with rounding ranges other than
the method's own (:data:`RANGES`). :func:`method_config` turns it into the :class:`KVarNConfig` it
runs with; specs whose runs would be identical share one (:func:`dedup_key`: fp16 and fp8 ignore
the bit widths).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..auto.rules import AutoSettings, auto_ranges
from ..config import KVarNConfig
from ..methods import METHODS, get_method


@dataclass(frozen=True)
class MethodSpec:
    """One method at one preset; ``key`` is ``"<method>:<preset>"``.

    rule: kvarn-auto's decision rule, ``"<rule>"`` or ``"<rule>@<margin>"`` (:meth:`kvarn.auto.AutoSettings.parse`);
    the default rule's key has no suffix, another rule's key is ``"kvarn-auto-<rule>:<preset>"``.
    ranges: the rows' rounding ranges, one of :data:`RANGES`: None, the method's own (min/max, but
    kvarn-auto's quantiles for 2-bit rows); ``"auto"``, kvarn-auto's (:func:`kvarn.auto.auto_ranges`)
    for any method (key suffix ``+q``); ``"minmax"``, the spec's min/max for any method (``+minmax``).
    """

    method: str
    preset: str
    rule: str | None = None
    ranges: str | None = None

    def __post_init__(self) -> None:
        get_method(self.method)
        KVarNConfig.from_name(self.preset)
        if self.rule is not None:
            if self.method != "kvarn-auto":
                raise ValueError(f"rule={self.rule!r} is only meaningful for method 'kvarn-auto', not {self.method!r}")
            AutoSettings.parse(self.rule)
        if self.ranges is not None and self.ranges not in RANGES:
            raise ValueError(f"ranges={self.ranges!r}; choose None (the method's own) or one of {list(RANGES)}")

    @property
    def auto(self) -> AutoSettings | None:
        if self.method != "kvarn-auto":
            return None
        return AutoSettings() if self.rule is None else AutoSettings.parse(self.rule)

    @property
    def key(self) -> str:
        name = self.method
        if self.rule is not None and self.auto != AutoSettings():
            name += f"-{self.auto.name}"
        if self.ranges is not None:
            name += "+q" if self.ranges == "auto" else f"+{self.ranges}"
        return f"{name}:{self.preset}"


#: :attr:`MethodSpec.ranges` other than the method's own.
RANGES = ("auto", "minmax")


def parse_specs(methods: list[str] | None = None, presets: list[str] | None = None,
                auto_rules: list[str] | None = None, ranges: list[str | None] | None = None) -> list[MethodSpec]:
    """Every method x preset (defaults: all methods, presets k2v2_g128 and k4v2_g128); kvarn-auto once
    per rule of ``auto_rules`` (default: its default rule); each once per entry of ``ranges``
    (:attr:`MethodSpec.ranges`; default: the method's own only)."""
    methods = list(METHODS) if not methods else methods
    presets = ["k2v2_g128", "k4v2_g128"] if not presets else presets
    out = []
    for p in presets:
        for m in methods:
            rules = (auto_rules or [None]) if m == "kvarn-auto" else [None]
            out += [MethodSpec(m, p, r, q) for r in rules for q in (ranges or [None])]
    return out


def method_config(spec: MethodSpec, sink_tokens: int | None = None, quantize_sliding_window: bool = False):
    config = KVarNConfig.from_name(spec.preset, sink_tokens=sink_tokens, quantize_sliding_window=quantize_sliding_window)
    if spec.ranges == "auto" or (spec.ranges is None and spec.method == "kvarn-auto"):
        return auto_ranges(config)  # kvarn-auto's own (TileCodec resolves them too): one run for both keys
    if spec.ranges == "minmax":
        return replace(config, key_quantile=0.0, value_quantile=0.0)
    return config


def dedup_key(spec: MethodSpec, config: KVarNConfig) -> tuple:
    # fp16 and fp8 ignore the bit widths: run them once per tile/sink layout.
    if get_method(spec.method).fmt in ("none", "fp8"):
        return (spec.method, config.tile, config.sink_tokens, config.quantize_sliding_window)
    return (spec.method, config, spec.auto)


__all__ = ["RANGES", "MethodSpec", "dedup_key", "method_config", "parse_specs"]
