"""Generate, grade and record: one JSONL line per (problem, seed, sample), resumable.

Every sample is generated with a fresh :class:`kvarn.KVarNCache` (``method``, ``preset``), in
batches of left-padded prompts, and graded at once. The JSONL file of a run is
``<out>/<task>__<model>__<method>__<preset>.jsonl``; rerunning the same command skips the samples
already there (a half-written last line from an interruption is dropped), so an interrupted run
resumes. With sampling, a resumed run draws different (equally valid) samples from the ones an
uninterrupted run would have: each batch is seeded from its seed and first problem.

Defaults follow the DeepSeek-R1 evaluation protocol: temperature 0.6, top_p 0.95, no top-k, a
32768-token budget, one sample per problem and seed (R1 reports pass@1 averaged over 64 samples:
use ``samples`` and several seeds for that). ``temperature=0`` is greedy decoding.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .grading import grade
from .prompts import build_prompt, fewshot_prefix, has_chat_template, stop_strings, trim_at_stop

log = logging.getLogger(__name__)

PRESET_FREE = ("fp16",)  # methods whose cache ignores the preset
BITS_FREE = ("fp8",)  # methods that use only the preset's tile (sink and tail), not its bits


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings of an evaluation run (defaults: the DeepSeek-R1 protocol)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32768
    samples: int = 1
    seeds: tuple[int, ...] = (0,)
    batch_size: int = 8
    fewshot: int | None = None  # None: 0 under a chat template, 4 for base models

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        for name in ("max_new_tokens", "samples", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")
        if self.top_k < 0 or (self.fewshot is not None and self.fewshot < 0):
            raise ValueError(f"top_k={self.top_k!r} and fewshot={self.fewshot!r} must be >= 0")
        if not self.seeds:
            raise ValueError("seeds must not be empty")
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))


@dataclass
class RunSpec:
    task: str
    model_name: str
    method: str
    preset: str | None
    records: list[dict]
    fewshot_pool: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.task}__{self.model_name.replace('/', '_')}__{self.method}__{self.preset or 'none'}"


def _read_done(path: Path) -> list[dict]:
    """Complete lines of a previous run; the file is rewritten without a broken last line."""
    if not path.exists():
        return []
    done, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            done.append(json.loads(line))
        except json.JSONDecodeError:
            dropped += 1
    if dropped:
        log.warning("%s: dropped %d incomplete line(s)", path, dropped)
        path.write_text("".join(json.dumps(r) + "\n" for r in done), encoding="utf-8")
    return done


def default_cache_factory(model, method: str, preset: str | None):
    from kvarn import KVarNCache

    # Frozen tiles are dequantized once (same tokens as re-decoding every step, much faster on CPU).
    return KVarNCache(model, method=method, preset=preset or "k4v2_g128", decoded_cache=True)


def _eos_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids]) if ids is not None else set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def _generate(model, tokenizer, prompts: list[str], cache, cfg: SamplingConfig, seed: int,
              stops: list[str]) -> list[tuple[str, int, str]]:
    """(text, generated tokens, finish reason "stop" | "length") for each prompt."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=not has_chat_template(tokenizer)).to(model.device)
    if hasattr(cache, "set_padding"):
        cache.set_padding(enc["attention_mask"])  # explicit, rather than the cache's first-call hook
    kwargs = dict(max_new_tokens=cfg.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                  past_key_values=cache)
    if cfg.temperature > 0:
        kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if stops:
        kwargs.update(stop_strings=stops, tokenizer=tokenizer)
    torch.manual_seed(seed)
    out = model.generate(**enc, **kwargs)
    gen = out[:, enc["input_ids"].shape[1]:].tolist()
    ends = _eos_ids(model, tokenizer) | {tokenizer.pad_token_id}
    results = []
    for row in gen:
        n = next((i + 1 for i, t in enumerate(row) if t in ends), None)
        text = tokenizer.decode(row[:n] if n else row, skip_special_tokens=True)
        text, stopped = trim_at_stop(text, stops)
        if n is None and not stopped and len(row) >= cfg.max_new_tokens:
            results.append((text, len(row), "length"))
        else:
            results.append((text, n or len(row), "stop"))
    return results


def run_eval(spec: RunSpec, model, tokenizer, cfg: SamplingConfig, out_dir, *, cache_factory=None,
             progress: bool = True, exec_timeout_s: float = 10.0) -> Path:
    """Generate and grade every missing sample of ``spec``; returns the JSONL path."""
    from tqdm.auto import tqdm

    cache_factory = cache_factory or default_cache_factory
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{spec.label}.jsonl"
    done = {(r["id"], r["seed"], r["sample"]) for r in _read_done(path)}
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # left padding needs one; masked out anyway
    n_shots = cfg.fewshot if cfg.fewshot is not None else (0 if has_chat_template(tokenizer) else 4)
    prefix = fewshot_prefix(spec.task, spec.fewshot_pool, n_shots)
    stops = stop_strings(spec.task, tokenizer)
    prompts = {r["id"]: build_prompt(spec.task, r, tokenizer, fewshot=prefix) for r in spec.records}
    todo = [(r, s, k) for s in cfg.seeds for r in spec.records for k in range(cfg.samples)
            if (r["id"], s, k) not in done]
    # Similar lengths together waste less padding; the order is deterministic.
    todo.sort(key=lambda item: (item[1], len(prompts[item[0]["id"]]), item[0]["id"], item[2]))
    bar = tqdm(total=len(todo), desc=spec.label, disable=not progress, unit="sample")
    with path.open("a", encoding="utf-8") as f:
        for start in range(0, len(todo), cfg.batch_size):
            batch = todo[start:start + cfg.batch_size]
            first, seed, k = batch[0]
            batch_seed = zlib.crc32(f"{seed}/{first['id']}/{k}".encode())
            cache = cache_factory(model, spec.method, spec.preset)
            outs = _generate(model, tokenizer, [prompts[r["id"]] for r, _, _ in batch], cache, cfg,
                             batch_seed, stops)
            for (rec, s, k), (text, n_tokens, finish) in zip(batch, outs):
                g = grade(spec.task, rec, text, finish_reason=finish, exec_timeout_s=exec_timeout_s)
                row = {
                    "task": spec.task, "model": spec.model_name, "method": spec.method,
                    "preset": spec.preset, "id": rec["id"], "group": rec.get("group"), "seed": s,
                    "sample": k, "prompt": prompts[rec["id"]], "output": text,
                    "generated_tokens": n_tokens, "finish_reason": finish, "correct": g.correct,
                    "reason": g.reason, "extracted": g.extracted, "answer": rec.get("answer"),
                    "sampling": asdict(cfg),
                }
                f.write(json.dumps(row) + "\n")
            f.flush()
            bar.update(len(batch))
    bar.close()
    return path


def regrade(out_dir, task: str, records: list[dict], *, exec_timeout_s: float = 10.0) -> list[tuple[Path, int]]:
    """Grade the stored outputs of every ``task`` run in ``out_dir`` again and rewrite the files.

    Generation and grading can then happen on different machines (HumanEval programs generated on
    a GPU box without user namespaces, executed here). Returns (path, grades changed) per file.
    Every row must belong to ``records``: an unknown id raises before any file is rewritten.
    """
    by_id = {r["id"]: r for r in records}
    done = []
    for path in sorted(Path(out_dir).glob(f"{task}__*.jsonl")):
        rows = _read_done(path)
        missing = sorted({r["id"] for r in rows} - by_id.keys())
        if missing:
            raise ValueError(f"{path}: ids {missing[:5]} are not records of {task!r} as loaded here")
        changed = 0
        for row in rows:
            g = grade(task, by_id[row["id"]], row["output"], finish_reason=row["finish_reason"],
                      exec_timeout_s=exec_timeout_s)
            changed += (g.correct, g.reason) != (row["correct"], row["reason"])
            row.update(correct=g.correct, reason=g.reason, extracted=g.extracted)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(path)  # atomic: an interruption leaves the old file whole
        done.append((path, changed))
    return done


def expand_runs(methods: list[str], presets: list[str]) -> list[tuple[str, str | None]]:
    """Every (method, preset) pair, without duplicates: a preset-free method appears once with
    preset None, a bits-free one once per tile size (with the first preset of that tile)."""
    from kvarn.config import PRESETS

    pairs = []
    for m in methods:
        tiles = set()
        for p in ([None] if m in PRESET_FREE else presets):
            if m in BITS_FREE and p in PRESETS:
                if PRESETS[p].tile in tiles:
                    continue
                tiles.add(PRESETS[p].tile)
            if (m, p) not in pairs:
                pairs.append((m, p))
    return pairs
