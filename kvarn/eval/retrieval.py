"""Line retrieval, the long-context check of the KVarN paper (after LongChat's "lines" test).

A synthetic record holds ``n_lines`` lines ``line N: REGISTER_CONTENT is <V>`` with N = 1..n_lines
and V a random integer of ``digits`` digits; the question asks for the value of one random line.
The score is exact match: the first integer in the answer must equal V. Each line costs about
15 tokens with a Llama-style tokenizer, so ``n_lines`` sets the context length.
"""

from __future__ import annotations

import random
import re

HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' "
    "and ends with a <REGISTER_CONTENT>, a number. For each line index, memorize its "
    "<REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve the "
    "<REGISTER_CONTENT> of one line index. Now the record starts:\n\n"
)
QUESTION = (
    "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {line}? "
    "I need the number only."
)


def make_document(values: list[int]) -> str:
    return "\n".join(f"line {i + 1}: REGISTER_CONTENT is <{v}>" for i, v in enumerate(values))


def make_records(n_lines: int | list[int] | tuple[int, ...] = (20, 60), n_samples: int = 20,
                 seed: int = 0, digits: int = 5) -> list[dict]:
    """``n_samples`` records for every length in ``n_lines``; deterministic in ``seed``."""
    lengths = [n_lines] if isinstance(n_lines, int) else list(n_lines)
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"n_lines={n_lines!r} must be a positive int or a list of them")
    if n_samples < 1:
        raise ValueError(f"n_samples={n_samples!r} must be >= 1")
    if not 1 <= digits <= 9:
        raise ValueError(f"digits={digits!r} must be in 1..9")
    records = []
    for n in lengths:
        rng = random.Random(f"{seed}/{n}")
        for i in range(n_samples):
            values = [rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(n)]
            line = rng.randrange(n)
            question = HEADER + make_document(values) + QUESTION.format(line=line + 1)
            records.append({
                "id": f"lines{n}/{i}", "task": "line_retrieval", "question": question,
                "answer": str(values[line]), "line": line + 1, "n_lines": n, "group": f"{n} lines",
            })
    return records


def first_integer(text: str) -> str | None:
    """The first run of digits in ``text`` (None if there is none)."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def grade_retrieval(record: dict, answer_text: str) -> tuple[bool, str, str | None]:
    """Exact match of the first integer after an optional ``line N`` echo. Returns (ok, reason, got)."""
    text = re.sub(rf"\bline\s*{record['line']}\b\s*:?", " ", answer_text, flags=re.IGNORECASE)
    got = first_integer(text)
    if got is None:
        return False, "no_number", None
    if got == record["answer"]:
        return True, "exact_match", got
    return False, "mismatch", got
