"""Evaluation tasks, loaded offline from the copies shipped in ``kvarn/data`` (see its SOURCES.md).

Every task is a list of plain dicts with at least ``id`` (str), ``task``, ``question`` (the text the
model sees, before prompting) and ``answer`` (the gold answer as a string; HumanEval has none).
Dataset quirks are repaired here, once, so graders and prompts see clean records:

- AIME 2024 answers carry leading zeros ("025"): stored as the canonical integer string ("25").
- AIME 2025 rows 18, 19 and 27 had LaTeX ``\\f`` and ``\\t`` decoded as JSON escapes (U+000C, TAB):
  restored to ``\\f`` / ``\\t`` (safe for that file only, which has no other control characters).
- GSM8K answers follow ``#### `` and 14 contain thousands separators ("2,125"): stored as "2125";
  the reference solution keeps its ``<<calc>>`` annotations in ``solution``.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources

MATH_TASKS = ("math500", "aime24", "aime25", "gsm8k")
TASKS = MATH_TASKS + ("humaneval", "line_retrieval")

_FILES = {
    "math500": "math500.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "gsm8k": "gsm8k_test.jsonl",
    "humaneval": "humaneval.jsonl.gz",
}


def data_path(name: str):
    """The bundled file of a task (an importlib Traversable)."""
    return resources.files("kvarn") / "data" / _FILES[name]


def _read_jsonl(name: str) -> list[dict]:
    raw = data_path(name).read_bytes()
    if _FILES[name].endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


def canonical_int(text) -> str:
    """'025' -> '25', 70 -> '70', '2,125' -> '2125'. Raises ValueError if not an integer."""
    return str(int(str(text).replace(",", "").strip()))


def _math500() -> list[dict]:
    return [
        {"id": r["unique_id"], "task": "math500", "question": r["problem"], "answer": r["answer"],
         "solution": r["solution"], "subject": r["subject"], "level": r["level"]}
        for r in _read_jsonl("math500")
    ]


def _aime24() -> list[dict]:
    return [
        {"id": f"aime24/{r['id']}", "task": "aime24", "question": r["problem"],
         "answer": canonical_int(r["answer"]), "solution": r["solution"], "url": r["url"]}
        for r in _read_jsonl("aime24")
    ]


def repair_aime25(problem: str) -> str:
    r"""Undo the JSON-escape damage of three upstream rows (``\f`` -> form feed, ``\t`` -> TAB)."""
    return problem.replace("\x0c", "\\f").replace("\t", "\\t")


def _aime25() -> list[dict]:
    return [
        {"id": f"aime25/{r['id']}", "task": "aime25", "question": repair_aime25(r["problem"]),
         "answer": canonical_int(r["answer"])}
        for r in _read_jsonl("aime25")
    ]


def gsm8k_final_answer(solution: str) -> str:
    """The number after ``#### `` in a GSM8K reference solution, without thousands separators."""
    return canonical_number(solution.rsplit("####", 1)[1])


def canonical_number(text: str) -> str:
    """'2,125' -> '2125', '18.00' -> '18', '-3.50' -> '-3.5'. Raises ValueError if not a number."""
    s = str(text).replace(",", "").replace("$", "").strip()
    value = float(s)
    if value == int(value) and "e" not in s.lower():
        return str(int(value))
    return repr(value)


def _gsm8k() -> list[dict]:
    return [
        {"id": f"gsm8k/{i}", "task": "gsm8k", "question": r["question"],
         "answer": gsm8k_final_answer(r["answer"]), "solution": r["answer"]}
        for i, r in enumerate(_read_jsonl("gsm8k"))
    ]


def _humaneval() -> list[dict]:
    return [
        {"id": r["task_id"], "task": "humaneval", "question": r["prompt"], "answer": None,
         "prompt": r["prompt"], "entry_point": r["entry_point"], "test": r["test"],
         "canonical_solution": r["canonical_solution"]}
        for r in _read_jsonl("humaneval")
    ]


def load_task(name: str, **options) -> list[dict]:
    """The records of a task: ``math500``, ``aime24``, ``aime25``, ``gsm8k``, ``humaneval`` or
    ``line_retrieval`` (synthetic; ``options`` go to :func:`kvarn.eval.retrieval.make_records`)."""
    if name == "line_retrieval":
        from .retrieval import make_records

        return make_records(**options)
    loaders = {"math500": _math500, "aime24": _aime24, "aime25": _aime25, "gsm8k": _gsm8k,
               "humaneval": _humaneval}
    if name not in loaders:
        raise ValueError(f"unknown task {name!r}; valid tasks: {list(TASKS)}")
    if options:
        raise TypeError(f"task {name!r} takes no options, got {sorted(options)}")
    return loaders[name]()
