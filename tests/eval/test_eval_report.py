"""pass@k, summaries and the Markdown table."""

import itertools
import json
import math

import pytest

from kvarn.eval import pass_at_k, summarize, write_summary
from kvarn.eval.runner import SamplingConfig, expand_runs


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (5, 2, 3), (5, 2, 4), (10, 3, 5), (4, 4, 2)])
def test_pass_at_k_matches_enumeration(n, c, k):
    # Probability that a random k-subset of n samples (c correct) holds a correct one.
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(i < c for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), expected, rel_tol=1e-12, abs_tol=1e-12)


def test_pass_at_1_is_fraction_correct():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def _row(task, pid, seed, sample, correct, tokens=10, finish="stop", group=None):
    return {"task": task, "model": "m", "method": "kvarn", "preset": "k2v2_g128", "id": pid,
            "seed": seed, "sample": sample, "correct": correct, "reason": "match" if correct else "mismatch",
            "generated_tokens": tokens, "finish_reason": finish, "group": group}


def test_summary_mean_std_over_seeds(tmp_path):
    rows = [_row("gsm8k", "a", 0, 0, True), _row("gsm8k", "b", 0, 0, False),
            _row("gsm8k", "a", 1, 0, True, finish="length", tokens=30), _row("gsm8k", "b", 1, 0, True)]
    s = summarize(rows)
    assert s["accuracy_per_seed"] == [0.5, 1.0]
    assert s["accuracy_mean"] == pytest.approx(0.75)
    assert s["accuracy_std"] == pytest.approx(math.sqrt(0.125))
    assert s["truncation_rate"] == 0.25 and s["mean_generated_tokens"] == 15
    assert s["problems"] == 2 and s["samples_per_problem"] == 1


def test_summary_pass_at_k_and_groups(tmp_path):
    rows = [_row("humaneval", p, 0, k, k < c) for p, c in (("x", 1), ("y", 0)) for k in range(4)]
    s = summarize(rows)
    assert s["pass_at_k"]["1"] == pytest.approx(0.125) and s["pass_at_k"]["2"] == pytest.approx(0.25)
    lr = [_row("line_retrieval", f"{n}/{i}", 0, 0, i == 0, group=f"{n} lines") for n in (20, 100) for i in range(2)]
    assert summarize(lr)["groups"] == {"20 lines": 0.5, "100 lines": 0.5}
    with (tmp_path / "run.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    jpath, mpath = write_summary(tmp_path)
    assert json.loads(jpath.read_text())[0]["rows"] == 8
    table = mpath.read_text()
    assert "| humaneval | m | kvarn | k2v2_g128 | 2 | 4 x 1 |" in table and "pass@1 12.5" in table


def test_sampling_config_validation_and_runs():
    assert SamplingConfig().temperature == 0.6 and SamplingConfig().top_p == 0.95
    for bad in (dict(temperature=-1), dict(top_p=0), dict(max_new_tokens=0), dict(seeds=())):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    assert expand_runs(["fp16", "kivi"], ["k2v2_g128", "k4v2_g128"]) == [
        ("fp16", None), ("kivi", "k2v2_g128"), ("kivi", "k4v2_g128")]
    assert expand_runs(["fp8"], ["k2v2_g128", "k4v2_g128", "k4v2_g64"]) == [
        ("fp8", "k2v2_g128"), ("fp8", "k4v2_g64")]
