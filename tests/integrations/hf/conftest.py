"""The fused transformers path runs the Triton kernels: on CUDA, or on CPU under triton's
interpreter (tests/conftest.py switches it on). Its tests skip, with the reason, where transformers
or triton is missing (``pytest.importorskip`` in each module)."""

import pytest


@pytest.fixture(autouse=True)
def _seeded_rng(seeded_rng):
    """Every test draws its random inputs from the same seed, whatever ran before it."""
