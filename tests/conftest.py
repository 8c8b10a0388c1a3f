"""Shared pytest setup for lychee_compile tests.

- Puts the repository root on sys.path, so tests import the tiny-model factory as `from tests.models import make`.
- Without CUDA, TRITON_INTERPRET=1 (unless set), before any test module imports triton.
- Torch threads: LYCHEE_TEST_THREADS (default 1; on the 2-core CI machine more threads were measured slower).
- Resets Dynamo before every test, so compile caches and recompile limits never leak between tests.
- `gpu`-marked tests are skipped when no CUDA device is present.
- The run's header names the stack (torch / transformers / triton versions); its end (tests/ci_report.py) prints
  per-file durations, the selected test-id count and the fuzz case counts.
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before triton is imported
# anywhere: a test module that imports Inductor (it imports triton) must not come first and leave triton's own
# @jit helpers compiled-mode for the interpreter tests collected after it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ["tests.ci_report"]   # per-file durations, test-id counts, fuzz counts at the end of a run

torch.set_num_threads(int(os.environ.get("LYCHEE_TEST_THREADS", "1")))


def pytest_report_header(config):
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001  (no triton in this venv)
        triton_version = "absent"
    import importlib.util
    spec = importlib.util.find_spec("lychee_compile")
    where = os.path.dirname(spec.origin) if spec and spec.origin else "not importable"
    return (f"lychee_compile from {where}; stack: torch {torch.__version__}, transformers {transformers.__version__}, triton {triton_version}, "
            f"cuda available: {torch.cuda.is_available()}, torch threads: {torch.get_num_threads()}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
