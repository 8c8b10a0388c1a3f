"""Shared pytest setup for lychee_compile tests.

- Puts the repository root on sys.path, so tests import the tiny-model factory as `from tests.models import make`.
- Without CUDA, TRITON_INTERPRET=1 (unless set), before any test module imports triton.
- Torch threads: LYCHEE_TEST_THREADS (default 1; on the 2-core CI machine more threads were measured slower).
- Resets Dynamo before every test, so compile caches and recompile limits never leak between tests.
- `gpu`-marked tests are skipped when no CUDA device is present.
- The fixture `inductor_triton_on_cpu`: Inductor -> Triton on CPU tensors under the interpreter (kernel-path tests).
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


CHECKED = {("2.13", "3.9"), ("2.11", "3.6")}


def _short(v):
    return ".".join(v.split("+")[0].split(".")[:2])


@pytest.fixture
def inductor_triton_on_cpu():
    """Inductor -> Triton for CPU tensors, run by the interpreter. Workarounds (all here, nowhere else):
    cpu_backend="triton"; a stub active driver that reports an sm_90 target; triton_helpers.libdevice -> tl.math;
    caches off (stale FX-graph cache hits while editing lowerings)."""
    triton = pytest.importorskip("triton")
    if (_short(torch.__version__), _short(triton.__version__)) not in CHECKED:
        pytest.skip(f"CPU Inductor->Triton workaround checked only on {sorted(CHECKED)}")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported (CPU machines)")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    import torch._inductor.config as cfg
    import torch._inductor.runtime.triton_helpers as th

    class StubDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def is_active(self):
            return True

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            return triton.testing.do_bench

        def get_empty_cache_for_benchmark(self):
            return torch.empty(1)

        def clear_cache(self, cache):
            pass

    drv = triton.runtime.driver
    prev_driver = getattr(drv, "_active", None)  # reset_active() would build the real (absent) GPU driver
    prev_libdevice = th.libdevice
    th.libdevice = tl.math
    drv.set_active(StubDriver())
    torch._dynamo.reset()
    with cfg.patch(cpu_backend="triton", force_disable_caches=True):
        yield
    torch._dynamo.reset()
    th.libdevice = prev_libdevice
    drv._active = prev_driver
