"""Text inputs for the drift study: a bundled corpus by name, a plain text file or one field of a
JSONL file (either may be gzip-compressed), tokenized.

Bundled corpora (``kvarn/data/``, origin and license in ``kvarn/data/SOURCES.md``):

- ``wikitext2``: the WikiText-2 raw test split (60 Wikipedia articles, about 320k tokens);
- ``reasoning``: 29 DeepSeek-R1 reasoning traces on MATH-500 problems (``full_response``: the
  ``<think>`` trace and the answer), joined with blank lines;
- ``book``: Jane Austen, *Pride and Prejudice* (Project Gutenberg #1342, public domain).
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parents[1] / "data"

#: name -> (file in kvarn/data, JSONL field or None for plain text)
CORPORA: dict[str, tuple[str, str | None]] = {
    "wikitext2": ("wikitext2_test.raw.gz", None),
    "reasoning": ("r1_reasoning_traces.jsonl.gz", "full_response"),
    "book": ("pride_and_prejudice.txt.gz", None),
}


def corpus_path(name: str) -> Path:
    """The bundled file of corpus ``name`` (one of :data:`CORPORA`)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; bundled corpora: {sorted(CORPORA)}")
    return DATA / CORPORA[name][0]


def _read(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def load_text(path: str | Path, field: str | None = None, record: int | None = None) -> str:
    """The text of a bundled corpus (a name of :data:`CORPORA`) or of the file ``path``.

    A ``.jsonl`` file (``.jsonl.gz`` too, or any file when ``field`` is given) is read as JSON
    lines: ``record`` selects one record (0-based); without it the field of every record is joined
    with blank lines. A bundled JSONL corpus uses its own field unless ``field`` is given.
    """
    if isinstance(path, str) and path in CORPORA:
        field = field or CORPORA[path][1]
        path = corpus_path(path)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"text file {str(path)!r} does not exist (bundled corpora by name: {sorted(CORPORA)})")
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    is_jsonl = ".jsonl" in suffixes
    if field is None and not is_jsonl:
        if record is not None:
            raise ValueError("record is only meaningful for a JSONL file (give field too)")
        return _read(path)
    rows = [json.loads(line) for line in _read(path).splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{str(path)!r} has no JSON records")
    if field is None:
        field = "text"
    missing = [i for i, r in enumerate(rows) if field not in r]
    if missing:
        raise ValueError(f"field {field!r} missing in record {missing[0]} of {str(path)!r}; fields: {sorted(rows[missing[0]])}")
    if record is not None:
        if not 0 <= record < len(rows):
            raise ValueError(f"record={record} out of range: {str(path)!r} has {len(rows)} records")
        return str(rows[record][field])
    return "\n\n".join(str(r[field]) for r in rows)


def tokenize(tokenizer, text: str, n_tokens: int, multiple_of: int = 1, bos: bool = False) -> torch.Tensor:
    """The first ``n_tokens`` tokens of ``text`` (with the tokenizer's special prefix), ``[1, n]``.

    ``bos``: make sure the ids start with the tokenizer's BOS token (Gemma needs it; its GGUF
    tokenizer does not add it).

    The count is rounded down to a multiple of ``multiple_of``; a text that is too short is used whole
    (rounded down too), with a warning.
    """
    if n_tokens < 1:
        raise ValueError(f"n_tokens={n_tokens!r} must be >= 1")
    # Tokenizing a whole book is slow and pointless: about 4 characters per token, generous margin.
    ids = tokenizer(text[: max(64, n_tokens * 16)], return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens + 1:
        ids = tokenizer(text, return_tensors="pt").input_ids
    if bos:
        if tokenizer.bos_token_id is None:
            raise ValueError("bos=True but the tokenizer has no BOS token")
        if ids.shape[1] == 0 or ids[0, 0] != tokenizer.bos_token_id:
            ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]], dtype=ids.dtype), ids], dim=1)
    if ids.shape[1] < n_tokens:
        log.warning("text has %d tokens, fewer than the %d asked for", ids.shape[1], n_tokens)
    n = min(n_tokens, ids.shape[1]) // multiple_of * multiple_of
    if n == 0:
        raise ValueError(f"text has {ids.shape[1]} tokens, fewer than one chunk of {multiple_of}")
    return ids[:, :n]
