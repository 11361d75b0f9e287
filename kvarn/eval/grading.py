r"""Graders: one response in, ``Grade(correct, reason, extracted)`` out.

Math (math500, aime24, aime25, gsm8k): the answer is read from the text after the last
``</think>`` (an opened but unclosed ``<think>`` means the model never answered), from the last
``\boxed{...}`` with brace matching; only that one box is compared, so listing several candidate
boxes cannot score. A missing box, or an output cut at ``max_new_tokens`` (``finish_reason ==
"length"``), is wrong and says so in ``reason``. MATH-500 answers are compared by math-verify;
GSM8K numerically (a ``#### N`` line is accepted when there is no box, as in GSM8K's own format);
AIME as integers ("025" == "25").

math-verify bounds its work with ``signal.alarm``, which works in the main thread only: elsewhere
its timeouts are turned off (logged once). In the main thread an interval timer that was pending
before the call (pytest-timeout's, for one) is re-armed afterwards, since math-verify cancels it.

HumanEval: the last fenced code block (or the whole answer without one); a full program that
defines the entry point replaces the prompt's stub, anything else is a function body appended to
the prompt; the result runs with the task's tests in :mod:`kvarn.eval.execution`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
import time
from dataclasses import dataclass

from .retrieval import grade_retrieval
from .tasks import TASKS, canonical_int, canonical_number

log = logging.getLogger(__name__)

MATH_VERIFY_TIMEOUT_S = 5
_warned_thread = False


@dataclass(frozen=True)
class Grade:
    correct: bool
    reason: str
    extracted: str | None = None


def final_answer_text(response: str) -> str | None:
    """The text after the last ``</think>``; None if a ``<think>`` block is left open."""
    if "</think>" in response:
        return response.rsplit("</think>", 1)[1]
    if "<think>" in response:
        return None
    return response


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces matched; ``\boxed 5`` too.

    None when there is no box or the last one is never closed.
    """
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\b", text)]
    if not starts:
        return None
    i = starts[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth, begin = 0, i + 1
    for j in range(i, len(text)):
        if text[j] == "{" and text[j - 1] != "\\":
            depth += 1
        elif text[j] == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[begin:j]
    return None


def _strip_latex(text: str) -> str:
    text = re.sub(r"\\text\{[^{}]*\}|\\mbox\{[^{}]*\}", " ", text)
    for tok in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "^\\circ", "^{\\circ}", "\\left", "\\right"):
        text = text.replace(tok, "")
    return text.strip()


@contextlib.contextmanager
def _keep_interval_timer():
    """Re-arm a pending ITIMER_REAL that math-verify's ``signal.alarm(0)`` would cancel."""
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield
    finally:
        if delay > 0:
            left = max(delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


def math_equal(gold: str, pred: str, timeout_s: int = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Equivalence of two LaTeX answers through math-verify (exact string match first)."""
    global _warned_thread
    if _strip_latex(gold).replace(" ", "") == _strip_latex(pred).replace(" ", ""):
        return True
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    if not main:
        if not _warned_thread:
            log.warning("math-verify runs without timeouts outside the main thread")
            _warned_thread = True
        timeout_s = None
    # One box each: math-verify then sees exactly one candidate on either side.
    ctx = _keep_interval_timer() if main else contextlib.nullcontext()
    with ctx:
        g = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout_s)
        p = parse(f"\\boxed{{{pred}}}", parsing_timeout=timeout_s)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=timeout_s))


def _numbers_equal(gold: str, pred: str, integer: bool) -> bool:
    text = _strip_latex(pred)
    m = re.fullmatch(r"\\(?:d|t)?frac\{(-?\d+)\}\{(\d+)\}", text)
    candidates = [text] if m is None else []
    if m is not None:
        value = int(m.group(1)) / int(m.group(2))
        candidates = [str(value)]
    else:
        nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
        if len(nums) == 1 and nums[0] != text:
            candidates.append(nums[0])
    for c in candidates:
        try:
            got = canonical_int(c) if integer else canonical_number(c)
        except ValueError:
            continue
        if integer:
            return got == gold
        return abs(float(got) - float(gold)) <= 1e-6 * max(1.0, abs(float(gold)))
    return False


def extract_code(response: str) -> str:
    """The last fenced code block (a final fence left open counts), else the whole text."""
    parts = response.split("```")
    if len(parts) == 1:
        return response
    block = parts[len(parts) - 1 - (len(parts) % 2 == 1)]  # last odd-indexed part
    first, _, rest = block.partition("\n")
    return rest if re.fullmatch(r"[ \t]*(?:python3?|py|Python)?[ \t]*", first) else block


def humaneval_program(record: dict, code: str) -> str:
    """A runnable program: prompt + completion (body or full program) + tests + ``check(...)``."""
    entry = record["entry_point"]
    if re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, flags=re.MULTILINE):
        # Full program: keep the prompt first for its imports and helper functions.
        body = record["prompt"] + "\n\n" + code
    else:
        lines = [ln for ln in code.splitlines() if ln.strip()]
        if lines and not any(ln[0] in " \t" for ln in lines):
            code = "\n".join("    " + ln for ln in code.splitlines())  # a body written flush left
        body = record["prompt"] + code
    return f"{body}\n\n{record['test']}\n\ncheck({entry})\n"


def grade(task: str, record: dict, response: str, *, finish_reason: str | None = None,
          exec_timeout_s: float = 10.0) -> Grade:
    """Grade one ``response`` to ``record`` of ``task`` (a name in ``TASKS``).

    ``finish_reason == "length"`` (the output hit max_new_tokens) makes math and HumanEval wrong;
    line retrieval only needs the first number, so there it matters only when none was written.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {list(TASKS)}")
    answer = final_answer_text(response)
    if answer is None:
        reason = "truncated" if finish_reason == "length" else "unclosed_think"
        return Grade(False, reason)
    if task == "humaneval":
        if finish_reason == "length":
            return Grade(False, "truncated", extract_code(answer))
        from .execution import run_program

        code = extract_code(answer)
        res = run_program(humaneval_program(record, code), timeout_s=exec_timeout_s)
        return Grade(res.passed, res.reason, code)
    if task == "line_retrieval":
        # The number comes first, so a cut-off tail does not matter unless no number was written.
        ok, reason, got = grade_retrieval(record, answer)
        if finish_reason == "length" and got is None:
            reason = "truncated"
        return Grade(ok, reason, got)
    boxed = last_boxed(answer)
    if boxed is None and task == "gsm8k":
        m = re.findall(r"####\s*([^\n]+)", answer)
        boxed = m[-1].strip() if m else None
    if finish_reason == "length":
        return Grade(False, "truncated", boxed)
    if boxed is None:
        return Grade(False, "no_box")
    if task == "math500":
        ok = math_equal(record["answer"], boxed)
    else:
        ok = _numbers_equal(record["answer"], boxed, integer=task in ("aime24", "aime25"))
    return Grade(ok, "match" if ok else "mismatch", boxed)
