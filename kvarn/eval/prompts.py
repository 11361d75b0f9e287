r"""Prompts: the model's chat template when it has one, plain text (optionally few-shot) otherwise.

Math tasks end the user turn with the DeepSeek-R1 / Qwen3 instruction
"Please reason step by step, and put your final answer within \boxed{}.". HumanEval asks for the
completed function in one fenced block under a chat template, and is a raw completion of the
prompt (the function body) for base models. Few-shot examples for base models are taken from the
end of the same dataset (never from the first ``len - n_shots`` records, which are what ``--limit``
evaluates), with answers written in the boxed format the grader reads.
"""

from __future__ import annotations

import re

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, including the "
    "imports it needs, in a single ```python code block.\n\n```python\n{prompt}```"
)
FEWSHOT_SEPARATOR = "\n\n"
# Stop a base model when it starts inventing the next few-shot example.
FEWSHOT_STOP = ("\n\nProblem:", "\n\nQuestion:")
CODE_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _user_message(task: str, record: dict) -> str:
    if task == "humaneval":
        return CODE_INSTRUCTION.format(prompt=record["prompt"])
    if task == "line_retrieval":
        return record["question"]
    return f"{record['question']}\n{MATH_INSTRUCTION}"


def _shot_solution(task: str, record: dict) -> str:
    if task == "gsm8k":
        steps = re.sub(r"<<[^>]*>>", "", record["solution"].rsplit("####", 1)[0]).strip()
        return f"{steps}\nThe final answer is \\boxed{{{record['answer']}}}."
    if "\\boxed" in record.get("solution", ""):
        return record["solution"]
    return f"The final answer is \\boxed{{{record['answer']}}}."


def fewshot_prefix(task: str, pool: list[dict], n_shots: int) -> str:
    """``n_shots`` worked examples from the end of ``pool`` (math tasks only)."""
    if n_shots <= 0 or task in ("humaneval", "line_retrieval"):
        return ""
    shots = pool[-n_shots:]
    return "".join(
        f"Problem: {r['question']}\nSolution: {_shot_solution(task, r)}{FEWSHOT_SEPARATOR}" for r in shots
    )


def build_prompt(task: str, record: dict, tokenizer, *, fewshot: str = "") -> str:
    """The exact text given to the tokenizer (special tokens of the chat template included)."""
    if has_chat_template(tokenizer):
        messages = [{"role": "user", "content": _user_message(task, record)}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if task == "humaneval":
        return record["prompt"]
    if task == "line_retrieval":
        return f"{record['question']}\nAnswer: The <REGISTER_CONTENT> in line {record['line']} is"
    return f"{fewshot}Problem: {record['question']}\n{MATH_INSTRUCTION}\nSolution:"


def stop_strings(task: str, tokenizer) -> list[str]:
    """Strings that end generation early for base models (none under a chat template)."""
    if has_chat_template(tokenizer):
        return []
    if task == "humaneval":
        return list(CODE_STOP)
    if task == "line_retrieval":
        return ["\n"]
    return list(FEWSHOT_STOP)


def trim_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut ``text`` at the first stop string; True if one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
