"""Bundled task data: counts, repaired quirks, synthetic line retrieval."""

import hashlib

import pytest

from kvarn.eval import TASKS, load_task
from kvarn.eval.retrieval import grade_retrieval, make_records
from kvarn.eval.tasks import data_path

SHA256 = {  # from kvarn/data/SOURCES.md
    "math500": "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
    "aime24": "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
    "aime25": "b4e273c02d3e7fe1b74b59eae768fc8230bfb0f79539890cb56f4361caac0331",
    "gsm8k": "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    "humaneval": "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
}


@pytest.mark.parametrize("name", sorted(SHA256))
def test_bundled_copy_is_byte_identical(name):
    assert hashlib.sha256(data_path(name).read_bytes()).hexdigest() == SHA256[name]


@pytest.mark.parametrize("name,count", [("math500", 500), ("aime24", 30), ("aime25", 30),
                                        ("gsm8k", 1319), ("humaneval", 164)])
def test_counts_and_fields(name, count):
    records = load_task(name)
    assert len(records) == count
    assert len({r["id"] for r in records}) == count
    for r in records:
        assert r["task"] == name and r["question"]


def test_aime_answers_are_canonical_integers():
    for name in ("aime24", "aime25"):
        for r in load_task(name):
            assert r["answer"] == str(int(r["answer"]))
    answers = {r["id"]: r["answer"] for r in load_task("aime24")}
    assert "25" in answers.values()  # upstream "025"


def test_aime25_control_characters_repaired():
    records = {r["id"]: r["question"] for r in load_task("aime25")}
    assert not any(ch in q for q in records.values() for ch in "\x0c\t")
    assert "\\frac" in records["aime25/18"] and "\\frac" in records["aime25/27"]
    assert "\\triangle" in records["aime25/19"]


def test_gsm8k_thousands_separators():
    records = load_task("gsm8k")
    assert all("," not in r["answer"] for r in records)
    with_commas = [r for r in records if "," in r["solution"].rsplit("####", 1)[1]]
    assert len(with_commas) == 14
    assert all(float(r["answer"]) >= 1000 for r in with_commas)


def test_unknown_task_names_valid_set():
    with pytest.raises(ValueError, match="math500"):
        load_task("mmlu")
    assert set(TASKS) == {"math500", "aime24", "aime25", "gsm8k", "humaneval", "line_retrieval"}


def test_line_retrieval_records():
    records = load_task("line_retrieval", n_lines=[5, 30], n_samples=3, seed=1)
    assert records == make_records(n_lines=[5, 30], n_samples=3, seed=1)  # deterministic
    assert [r["n_lines"] for r in records] == [5, 5, 5, 30, 30, 30]
    for r in records:
        assert f"line {r['line']}: REGISTER_CONTENT is <{r['answer']}>" in r["question"]
        assert r["question"].count("REGISTER_CONTENT is <") == r["n_lines"]
        assert r["question"].rstrip().endswith("I need the number only.")
        assert grade_retrieval(r, f"Line {r['line']}: the content is {r['answer']}.")[0]
        assert not grade_retrieval(r, "It is 12.")[0]
        assert grade_retrieval(r, "I don't know")[1] == "no_number"
    with pytest.raises(ValueError):
        make_records(n_lines=0)
