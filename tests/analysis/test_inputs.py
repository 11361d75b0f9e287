"""Bundled corpora by name, gzip and JSONL inputs of the drift study (no model needed)."""

import gzip
import hashlib
import json
import re

import pytest

from kvarn.analysis import load_text
from kvarn.analysis.inputs import CORPORA, DATA, corpus_path


def _sources_sha256():
    """file -> sha256 of its uncompressed content, from the table in kvarn/data/SOURCES.md."""
    rows = re.findall(r"^\| (\S+\.gz) \| .*? \| ([0-9a-f]{64}) \|", (DATA / "SOURCES.md").read_text(), re.M)
    return dict(rows)


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_bundled_corpora_match_their_recorded_sha256(name):
    path = corpus_path(name)
    expected = _sources_sha256()
    assert path.name in expected, f"{path.name} has no row in kvarn/data/SOURCES.md"
    assert hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest() == expected[path.name]


def test_corpora_by_name():
    wiki = load_text("wikitext2")
    assert wiki.startswith(" = Robert Boulter = ") and len(wiki) == 1285622
    book = load_text("book")
    assert book.startswith("It is a truth universally acknowledged")
    reasoning = load_text("reasoning")
    assert reasoning.count("</think>") >= 25
    one = load_text("reasoning", record=3)
    assert one in reasoning and len(one) < len(reasoning)
    assert load_text("reasoning", field="problem", record=0).startswith("Convert the point $(0,3)$")


def test_package_data_stays_small():
    total = sum(p.stat().st_size for p in DATA.iterdir() if p.is_file())
    assert total < 3_000_000, total


def test_unknown_names_and_missing_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist \(bundled corpora by name: \['book', 'reasoning', 'wikitext2'\]\)"):
        load_text("wikitext3")
    with pytest.raises(ValueError, match="unknown corpus 'x'"):
        corpus_path("x")


def test_gzip_jsonl_files(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(json.dumps({"text": f"row {i}"}).encode() + b"\n" for i in range(3))))
    assert load_text(path) == "row 0\n\nrow 1\n\nrow 2"
    assert load_text(path, record=2) == "row 2"
    plain = tmp_path / "p.txt.gz"
    plain.write_bytes(gzip.compress("héllo".encode()))
    assert load_text(plain) == "héllo"
