"""``kvarn eval TASK[,TASK...] --model M --method X[,Y] --preset P[,Q] ... --out DIR``.

Runs every (task, method, preset) combination, one JSONL file each, then writes ``summary.json``
and ``summary.md`` for everything in DIR. Rerunning resumes. ``fp16`` ignores the preset.

``--device cuda`` generates on a GPU; there the ``kvarn`` and ``kvarn-auto`` methods decode through the
fused attention (:mod:`kvarn.integrations.transformers.attention`), the other methods through the cache's own
read path.
``--regrade`` generates nothing: it grades the stored outputs of DIR again (for example HumanEval
programs generated on a machine whose sandbox could not run) and rewrites the JSONL files and the
summary.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger(__name__)


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(t) for t in _csv(text)]


def _methods(text: str) -> list[str]:
    """``--method``: checked before the model loads and before a run's JSONL file is created (every
    run builds a KVarNCache, so transformers' own quantized caches, generate's hf-*, are not among them)."""
    from kvarn.methods import get_method

    names = _csv(text)
    try:
        for name in names:
            get_method(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _presets(text: str) -> list[str]:
    from kvarn.cli import preset_name

    return [preset_name(t) for t in _csv(text)]


def add_parser(subparsers) -> None:
    from kvarn.cli import positive_int

    p = subparsers.add_parser("eval", help="evaluate a model with a KV-cache method on tasks",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task", type=_csv, help="math500, aime24, aime25, gsm8k, humaneval, line_retrieval (comma list)")
    p.add_argument("--model", default="smollm2-135m", help="bundled model name or local HF folder")
    p.add_argument("--method", type=_methods, default=["fp16"], help="comma list of cache methods")
    p.add_argument("--preset", type=_presets, default=["k4v2_g128"], help="comma list of presets")
    p.add_argument("--limit", type=positive_int, default=None, help="first N problems (line_retrieval: per length)")
    p.add_argument("--samples", type=positive_int, default=1, help="samples per problem and seed")
    p.add_argument("--seed", type=_ints, default=[0], help="comma list of seeds")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy (default 0.6, DeepSeek-R1)")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--max-new-tokens", type=positive_int, default=32768)
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--fewshot", type=int, default=None, help="shots for base models (default 4; 0 with a chat template)")
    p.add_argument("--lines", type=_ints, default=[20, 60], help="line_retrieval lengths in lines")
    p.add_argument("--exec-timeout", type=float, default=10.0, help="HumanEval seconds per program")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1, ...")
    p.add_argument("--regrade", action="store_true", help="grade the stored outputs in --out again; no generation")
    p.add_argument("--out", required=True, help="output folder (JSONL per run, summary.json, summary.md)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_main)


def _task_records(task: str, args) -> tuple[list[dict], list[dict]]:
    """(the records to evaluate, the whole task: few-shot pool and id lookup; empty for line_retrieval)."""
    from kvarn.eval import load_task

    if task == "line_retrieval":
        return load_task(task, n_lines=args.lines, n_samples=args.limit or 20), []
    pool = load_task(task)
    return (pool[: args.limit] if args.limit else pool), pool


def _main(args) -> int:
    import torch

    from kvarn import models
    from kvarn.eval import TASKS, RunSpec, SamplingConfig, expand_runs, regrade, run_eval, write_summary

    bad = [t for t in args.task if t not in TASKS]
    if bad:
        raise SystemExit(f"unknown task(s) {bad}; valid: {list(TASKS)}")
    if args.regrade:
        for task in args.task:
            records, pool = _task_records(task, args)
            done = regrade(args.out, task, pool or records, exec_timeout_s=args.exec_timeout)
            if not done:
                raise SystemExit(f"--regrade: no {task} runs ({task}__*.jsonl) in {args.out}")
            for path, changed in done:
                log.info("regraded %s: %d grade(s) changed", path, changed)
        write_summary(args.out)
        return 0
    from kvarn.cli import torch_device

    device = torch_device(args.device)
    cfg = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         max_new_tokens=args.max_new_tokens, samples=args.samples,
                         seeds=tuple(args.seed), batch_size=args.batch_size, fewshot=args.fewshot)
    model, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype), padding_side="left")
    model.to(device)
    cache_factory = None
    if device.type == "cuda":
        from kvarn.integrations.transformers import attention as hf_attention

        hf_attention.use_fused(model)
        cache_factory = hf_attention.cache_for
    model_name = args.model.rstrip("/").split("/")[-1]
    for task in args.task:
        records, pool = _task_records(task, args)
        for method, preset in expand_runs(args.method, args.preset):
            spec = RunSpec(task, model_name, method, preset, records, fewshot_pool=pool)
            path = run_eval(spec, model, tokenizer, cfg, args.out, progress=not args.no_progress,
                            exec_timeout_s=args.exec_timeout, cache_factory=cache_factory)
            log.info("wrote %s", path)
    jpath, mpath = write_summary(args.out)
    log.info("summary: %s, %s", jpath, mpath)
    return 0
