"""The repository's own text: results and code, not a record of how they were made.

Tracked files must not name work sessions or issue numbers (the history is in git), and the two
front pages stay short enough to read: BENCHMARKS.md at most 300 lines, README.md at most 150.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A work session named by number, or an issue or task by number.
NARRATION = re.compile(r"\bsessions? [0-9]+|\(session [0-9]|\bissue #?[0-9]+|\btask #?[0-9]+", re.IGNORECASE)
# Data, not prose: results written by commands, and the bundled corpora.
SKIPPED_SUFFIXES = (".json", ".jsonl")
SKIPPED_DIRS = ("kvarn/data/",)
LIMITS = {"BENCHMARKS.md": 300, "README.md": 150}


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not inside a git checkout ({exc})")
    files = [f for f in out.stdout.decode().split("\0") if f]
    if not files:
        pytest.skip("not inside a git checkout (git ls-files lists nothing)")
    return files


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def test_no_file_names_a_work_session_or_an_issue_number():
    offenders = []
    for name in _tracked_files():
        if name.endswith(SKIPPED_SUFFIXES) or name.startswith(SKIPPED_DIRS):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        text = _text(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            match = NARRATION.search(line)
            if match:
                offenders.append(f"{name}:{lineno}: {match.group(0)!r}")
    assert not offenders, "history narration in tracked files:\n" + "\n".join(offenders)


@pytest.mark.parametrize("name", sorted(LIMITS))
def test_front_pages_stay_short(name):
    _tracked_files()
    lines = (ROOT / name).read_text(encoding="utf-8").count("\n")
    assert lines <= LIMITS[name], f"{name} has {lines} lines, at most {LIMITS[name]}"
