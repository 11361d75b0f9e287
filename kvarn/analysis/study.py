"""One drift study end to end: pseudo-decode, optional free run, then drift.json, plots and summary.md."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from .drift import pseudo_decode
from .freerun import free_run
from .plots import write_plots
from .report import build_report, summary_markdown, write_json
from .specs import MethodSpec

log = logging.getLogger(__name__)


def run_drift(
    model,
    input_ids: torch.Tensor,
    specs: list[MethodSpec],
    out_dir: str | Path,
    *,
    model_name: str,
    chunk: int | None = None,
    sink_tokens: int | None = None,
    quantize_sliding_window: bool = False,
    prompt_tokens: int = 0,
    new_tokens: int = 0,
    tokenizer=None,
    extra: dict | None = None,
    progress: bool = True,
    plots: bool = True,
    prefill: int | None = None,
) -> dict:
    """Run the study on ``input_ids [1, T]`` and write ``drift.json``, ``summary.md`` and the PNGs to ``out_dir``.

    The free run (greedy generation) runs when ``prompt_tokens`` and ``new_tokens`` are both > 0, on the
    first ``prompt_tokens`` tokens of ``input_ids``. Returns the ``drift.json`` document.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    run = pseudo_decode(
        model, input_ids, specs, chunk, sink_tokens=sink_tokens,
        quantize_sliding_window=quantize_sliding_window, progress=progress, prefill=prefill,
    )
    log.info("pseudo-decode of %d tokens x %d methods: %.1f s", run.tokens, len(specs), time.perf_counter() - start)
    free, settings = None, None
    if prompt_tokens > 0 and new_tokens > 0:
        if prompt_tokens > input_ids.shape[1]:
            raise ValueError(f"prompt_tokens={prompt_tokens} exceeds the {input_ids.shape[1]} input tokens")
        t0 = time.perf_counter()
        free = free_run(
            model, input_ids[:, :prompt_tokens], specs, new_tokens, sink_tokens=sink_tokens,
            quantize_sliding_window=quantize_sliding_window, progress=progress,
        )
        settings = {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens}
        if tokenizer is not None:
            settings["fp16_text"] = tokenizer.decode(free[0])
        log.info("free run: %.1f s", time.perf_counter() - t0)
    doc = build_report(model_name, run, free, settings, {**(extra or {}), "seconds": time.perf_counter() - start})
    write_json(doc, out / "drift.json")
    (out / "summary.md").write_text(summary_markdown(doc), encoding="utf-8")
    if plots:
        write_plots(doc, out)
    log.info("wrote %s", out)
    return doc
