"""bench_vllm_gpu's bookkeeping across calls (``--append``): a published table pairs each kvarn row
with the default row it was measured against, so a later call must neither re-pair an earlier row
with another run's default nor drop the default an earlier row still needs."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_vllm_gpu.py"
spec = importlib.util.spec_from_file_location("bench_vllm_gpu", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _row(scenario, backend, run, tokens_per_s, capacity=100):
    return {"scenario": scenario, "backend": backend, "run": run, "tokens_per_s": tokens_per_s,
            "kv_capacity_tokens": capacity}


def _call(old, rows, skip_default=False):
    bench.compare(rows, old if skip_default else [])
    return bench.merge(old, rows)


def _cells(rows):
    return {(r["scenario"], r["backend"], r["run"]): (r.get("baseline_run"), round(r.get("vs_default", 0), 6))
            for r in rows}


def test_each_row_keeps_the_default_of_its_own_run():
    first = _call([], [_row("reasoning", "default", 1, 10), _row("reasoning", "kvarn:k4v2_g128", 1, 13, 400)])
    # a later call re-runs the default beside another preset: the first preset's row keeps its ratio
    # and its default
    later = _call(first, [_row("reasoning", "default", 2, 20), _row("reasoning", "kvarn:k2v2_g128", 2, 28)])
    cells = _cells(later)
    assert cells[("reasoning", "kvarn:k4v2_g128", 1)] == (1, 1.3)
    assert cells[("reasoning", "kvarn:k2v2_g128", 2)] == (2, 1.4)
    assert ("reasoning", "default", 1) in cells and ("reasoning", "default", 2) in cells
    assert first[1]["capacity_vs_default"] == 4.0


def test_skip_default_pairs_with_the_newest_default_and_drops_an_unneeded_one():
    rows = _call([], [_row("reasoning", "default", 1, 10), _row("reasoning", "kvarn:k4v2_g128", 1, 13)])
    rows = _call(rows, [_row("reasoning", "default", 2, 20), _row("reasoning", "kvarn:k2v2_g128", 2, 28)])
    rows = _call(rows, [_row("reasoning", "kvarn:k4v2_g128", 3, 30)], skip_default=True)
    cells = _cells(rows)
    assert cells[("reasoning", "kvarn:k4v2_g128", 3)] == (2, 1.5)
    assert ("reasoning", "kvarn:k4v2_g128", 1) not in cells
    assert ("reasoning", "default", 1) not in cells  # nothing is measured against it any more


def test_a_dead_engine_row_goes_once_one_of_its_scenarios_runs_again():
    rows = _call([], [_row("reasoning", "default", 1, 10)])
    rows = _call(rows, [{"scenario": "equal_load,reasoning", "backend": "kvarn:k2v2_g128", "run": 2, "error": "died"}])
    assert sum("error" in r for r in rows) == 1
    rows = _call(rows, [_row("reasoning", "kvarn:k2v2_g128", 3, 12)], skip_default=True)
    assert not any("error" in r for r in rows)
    assert _cells(rows)[("reasoning", "kvarn:k2v2_g128", 3)] == (1, 1.2)
