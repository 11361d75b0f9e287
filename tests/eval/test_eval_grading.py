r"""Graders: reference solutions accepted, wrong / truncated / multi-box answers rejected."""

import pytest

from kvarn.eval import grade, load_task
from kvarn.eval.grading import extract_code, final_answer_text, humaneval_program, last_boxed, math_equal


@pytest.fixture(scope="module")
def math500():
    return load_task("math500")


def test_all_math500_reference_solutions_accepted(math500):
    bad = [r["id"] for r in math500 if not grade("math500", r, r["solution"]).correct]
    assert bad == []


def test_math500_wrong_answers_rejected(math500):
    # Each problem paired with the next problem's answer, where the two differ as values.
    accepted = []
    for i, r in enumerate(math500[:40]):
        other = math500[i + 1]["answer"]
        if other.split("=")[-1].strip() == r["answer"]:
            continue  # "x=5" against "5": the same value
        if grade("math500", r, f"So the answer is $\\boxed{{{other}}}$.").correct:
            accepted.append((r["answer"], other))
    assert accepted == []


@pytest.mark.parametrize("gold,pred", [
    ("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "\\dfrac12"), ("10\\sqrt{2}", "\\sqrt{200}"),
    ("(3,\\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"), ("x^2+2x+1", "(x+1)^2"),
    ("\\text{(C)}", "C"), ("18.90", "\\$18.90"), ("\\{1,2\\}", "\\{2,1\\}"),
])
def test_math_equivalences(gold, pred):
    assert math_equal(gold, pred)


@pytest.mark.parametrize("gold,pred", [("2", "3"), ("\\frac{1}{2}", "\\frac{1}{3}"), ("x+1", "x-1"), ("5", "")])
def test_math_non_equivalences(gold, pred):
    assert not math_equal(gold, pred)


def test_last_boxed_brace_matching():
    assert last_boxed(r"\boxed{\frac{1}{2}} then \boxed{\sqrt{\frac{3}{4}}}") == r"\sqrt{\frac{3}{4}}"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"
    assert last_boxed(r"so $\boxed 5$") == "5"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{3") is None and last_boxed("no box") is None


def test_multi_box_traps_rejected():
    r = {"task": "math500", "answer": "7", "id": "x"}
    g = grade("math500", r, r"Maybe \boxed{7}, or maybe \boxed{8}.")
    assert not g.correct and g.extracted == "8"
    assert grade("math500", r, r"\boxed{8} no wait \boxed{7}").correct
    assert not grade("math500", r, r"\boxed{7, 8, 9}").correct
    assert not grade("math500", r, r"\boxed{7 \text{ or } 8}").correct
    gsm = {"task": "gsm8k", "answer": "18", "id": "y"}
    assert not grade("gsm8k", gsm, r"\boxed{18} \boxed{20}").correct
    assert not grade("gsm8k", gsm, r"\boxed{16, 18, 20}").correct


def test_missing_box_truncation_and_thinking():
    r = {"task": "math500", "answer": "7", "id": "x"}
    assert grade("math500", r, "The answer is 7.").reason == "no_box"
    g = grade("math500", r, r"... \boxed{7}", finish_reason="length")
    assert not g.correct and g.reason == "truncated"
    assert grade("math500", r, r"<think>it is \boxed{7}").reason == "unclosed_think"
    assert grade("math500", r, r"<think>\boxed{8}</think> so \boxed{7}").correct
    assert not grade("math500", r, r"<think>\boxed{7}</think> so \boxed{8}").correct
    assert not grade("math500", r, r"<think>\boxed{7}</think> I am not sure.").correct
    assert final_answer_text("a</think>b</think>c") == "c"


def test_gsm8k_numeric():
    r = {"task": "gsm8k", "answer": "2125", "id": "g"}
    for ok in (r"\boxed{2125}", r"\boxed{2,125}", r"\boxed{\$2,125}", r"\boxed{2125.00}",
               r"\boxed{2125 \text{ dollars}}", "#### 2,125"):
        assert grade("gsm8k", r, ok).correct, ok
    for bad in (r"\boxed{2124}", r"\boxed{21.25}", "2125", r"\boxed{2125 or 2124}"):
        assert not grade("gsm8k", r, bad).correct, bad
    assert grade("gsm8k", r, r"\boxed{2125} #### 3").correct  # the box wins over the marker


def test_gsm8k_reference_solutions_accepted():
    records = load_task("gsm8k")
    assert all(grade("gsm8k", r, r["solution"]).correct for r in records)


def test_aime_integer():
    r = {"task": "aime24", "answer": "25", "id": "a"}
    assert grade("aime24", r, r"\boxed{025}").correct
    assert grade("aime24", r, r"\boxed{25}").correct
    assert not grade("aime24", r, r"\boxed{25.5}").correct
    assert not grade("aime24", r, r"\boxed{250}").correct
    assert all(grade(t, r, f"\\boxed{{{r['answer']}}}").correct
               for t in ("aime24", "aime25") for r in load_task(t))


def test_unknown_task():
    with pytest.raises(ValueError, match="humaneval"):
        grade("mmlu", {}, "")


def test_extract_code():
    assert extract_code("x\n```python\na=1\n```\ny\n```py\nb=2\n```\n") == "b=2\n"
    assert extract_code("```python\na=1\n```\n```python\nb=2\n") == "b=2\n"  # truncated last block
    assert extract_code("```\nc=3\n```") == "c=3\n"
    assert extract_code("    return 1\n") == "    return 1\n"


def test_humaneval_body_and_full_program():
    rec = {"prompt": "import math\n\ndef f(x):\n    \"\"\"Doc.\"\"\"\n", "entry_point": "f",
           "test": "def check(c):\n    assert c(4) == 2\n"}
    body = humaneval_program(rec, "    return int(math.sqrt(x))\n")
    full = humaneval_program(rec, "def f(x):\n    return int(math.sqrt(x))\n")
    flush = humaneval_program(rec, "return int(math.sqrt(x))\n")
    for program in (body, full, flush):
        ns = {}
        exec(program, ns)  # trusted strings here; the grader itself runs them in the sandbox
    assert grade("humaneval", rec, "```python\ndef f(x):\n    return 2\n```").correct
    assert not grade("humaneval", rec, "```python\ndef f(x):\n    return 3\n```").correct
    assert grade("humaneval", rec, "```python\ndef f(x):\n    return 2\n```",
                 finish_reason="length").reason == "truncated"
