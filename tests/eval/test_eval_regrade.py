"""``regrade`` / ``kvarn eval --regrade``: stored outputs graded again, files rewritten atomically."""

import json

import pytest

from kvarn.eval import load_task, regrade


def _row(task, rec, output, correct, reason, finish="stop"):
    return {"task": task, "model": "m", "method": "kvarn", "preset": "k2v2_g128", "id": rec["id"],
            "group": None, "seed": 0, "sample": 0, "prompt": "p", "output": output,
            "generated_tokens": 5, "finish_reason": finish, "correct": correct, "reason": reason,
            "extracted": None, "answer": rec.get("answer"), "sampling": {}}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_regrade_fixes_stale_grades(tmp_path):
    he = load_task("humaneval")[0]
    gsm = load_task("gsm8k")[:2]
    good_code = f"```python\n{he['prompt']}{he['canonical_solution']}```"
    _write(tmp_path / "humaneval__m__kvarn__k2v2_g128.jsonl",
           [_row("humaneval", he, good_code, False, "sandbox_unavailable")])
    _write(tmp_path / "gsm8k__m__kvarn__k2v2_g128.jsonl", [
        _row("gsm8k", gsm[0], f"so \\boxed{{{gsm[0]['answer']}}}", False, "mismatch"),
        _row("gsm8k", gsm[1], "so \\boxed{-12345}", True, "match"),
        _row("gsm8k", gsm[1], f"\\boxed{{{gsm[1]['answer']}}} and more", True, "match", finish="length"),
    ])
    (path, changed), = regrade(tmp_path, "humaneval", [he])
    assert changed == 1
    row, = [json.loads(x) for x in path.read_text().splitlines()]
    assert row["correct"] is True and row["reason"] == "passed"
    (path, changed), = regrade(tmp_path, "gsm8k", gsm)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert changed == 3
    assert [(r["correct"], r["reason"]) for r in rows] == [(True, "match"), (False, "mismatch"), (False, "truncated")]
    assert rows[0]["output"].startswith("so ")  # outputs untouched


def test_regrade_unknown_id_leaves_files_alone(tmp_path):
    gsm = load_task("gsm8k")[:1]
    path = tmp_path / "gsm8k__m__kvarn__k2v2_g128.jsonl"
    _write(path, [_row("gsm8k", {"id": "gsm8k/99999", "answer": "1"}, "\\boxed{1}", False, "mismatch")])
    before = path.read_text()
    with pytest.raises(ValueError, match="gsm8k/99999"):
        regrade(tmp_path, "gsm8k", gsm)
    assert path.read_text() == before


def test_cli_regrade_rewrites_summary(tmp_path):
    from kvarn.cli import main

    gsm = load_task("gsm8k")[0]
    _write(tmp_path / "gsm8k__m__kvarn__k2v2_g128.jsonl",
           [_row("gsm8k", gsm, f"\\boxed{{{gsm['answer']}}}", False, "mismatch")])
    assert main(["eval", "gsm8k", "--regrade", "--out", str(tmp_path), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary) == 1 and summary[0]["accuracy_mean"] == pytest.approx(1.0)
    assert summary[0]["reasons"] == {"match": 1}


@pytest.mark.parametrize("device,match", [("cuda", "no CUDA device"), ("gpu0", "not a torch device")])
def test_cli_bad_device_is_refused_before_loading(tmp_path, device, match):
    import torch

    from kvarn.cli import main

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("a CUDA device is present, so --device cuda is valid here")
    with pytest.raises(SystemExit, match=match):
        main(["eval", "gsm8k", "--device", device, "--out", str(tmp_path), "--no-progress"])
    assert not list(tmp_path.iterdir())  # nothing written


def test_cli_regrade_without_runs_is_refused(tmp_path):
    from kvarn.cli import main

    with pytest.raises(SystemExit, match=r"no humaneval runs .* in "):
        main(["eval", "humaneval", "--regrade", "--out", str(tmp_path), "--no-progress"])
    assert not list(tmp_path.iterdir())  # no empty summary written
