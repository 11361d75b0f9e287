"""A 2-problem run on the bundled SmolLM2: generation, grading, JSONL, resume, summary, CLI."""

import json

from kvarn.eval import RunSpec, SamplingConfig, load_task, run_eval, write_summary

CFG = SamplingConfig(temperature=0.0, max_new_tokens=12, batch_size=2)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_problems_and_resume(smollm2, tmp_path, method="kvarn", preset="k2v2_g128"):
    model, tokenizer = smollm2
    records = load_task("gsm8k")[:2]
    spec = RunSpec("gsm8k", "smollm2-135m", method, preset, records)
    path = run_eval(spec, model, tokenizer, CFG, tmp_path, progress=False)
    rows = _rows(path)
    assert [r["id"] for r in sorted(rows, key=lambda r: r["id"])] == ["gsm8k/0", "gsm8k/1"]
    for r in rows:
        assert r["generated_tokens"] <= 12 and r["finish_reason"] in ("stop", "length")
        assert r["output"] and r["prompt"].startswith("<|im_start|>")
        assert "Please reason step by step" in r["prompt"]
        assert isinstance(r["correct"], bool) and r["reason"]
        if r["finish_reason"] == "length":
            assert not r["correct"] and r["reason"] == "truncated"
    # An interruption mid-line: the broken line is dropped and only that sample is redone.
    text = path.read_text().splitlines()
    path.write_text(text[0] + "\n" + text[1][: len(text[1]) // 2])
    run_eval(spec, model, tokenizer, CFG, tmp_path, progress=False)
    again = _rows(path)
    assert len(again) == 2 and again[0] == rows[0]
    assert again[1]["output"] == rows[1]["output"]  # greedy: the same text
    run_eval(spec, model, tokenizer, CFG, tmp_path, progress=False)  # complete: nothing to do
    assert len(_rows(path)) == 2
    jpath, mpath = write_summary(tmp_path)
    assert "| gsm8k | smollm2-135m |" in mpath.read_text()


def test_cli_runs_humaneval_and_line_retrieval(smollm2, tmp_path):
    from kvarn.cli import main

    out = tmp_path / "out"
    code = main(["eval", "humaneval,line_retrieval", "--model", "smollm2-135m", "--method", "kivi",
                 "--preset", "k4v2_g128", "--limit", "1", "--lines", "4", "--temperature", "0",
                 "--max-new-tokens", "12", "--out", str(out), "--no-progress"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(s["task"] for s in summary) == ["humaneval", "line_retrieval"]
    assert all(s["method"] == "kivi" and s["preset"] == "k4v2_g128" for s in summary)
    assert "| line_retrieval |" in (out / "summary.md").read_text()
