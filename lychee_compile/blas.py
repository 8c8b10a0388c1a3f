"""cuBLAS's workspace for a rewritten decode step's matrix products.

A decode step's matrix products have a few rows (the batch). For some of them cuBLAS splits the K dimension to fill
the GPU and reduces the parts in a second kernel, which needs its workspace: on the H200 (torch 2.11, cuBLAS 13)
o_proj and down_proj of Llama-3-8B at 1-4 rows ran as `nvjet_..._splitK` + `cublasLt::splitKreduce_kernel`, 14.1 and
32.3 us; without a workspace cuBLAS picks one kernel each, 11.5 and 30.3 us (`benchmarks/probes/blas_probe.py`). In the
whole 128K batch-4 step that was 7.70-7.73 -> 7.53 ms.

PyTorch reads CUBLAS_WORKSPACE_CONFIG each time it hands a cuBLAS handle its workspace (CublasHandlePool.cpp,
setWorkspaceForHandle; checked on torch 2.11), so the size can be chosen for a span of calls: `no_workspace()` sets
":0:0" and restores the environment after. It is needed where cuBLAS runs the decode step's products: around the
CUDA graph capture (the replays call no cuBLAS at all), or around each step that runs without CUDA graphs
(lowering/inductor_changes.py applies it there, and nowhere else). A workspace the user chose (the variable already
set, e.g. ":4096:8" for deterministic cuBLAS) is left alone, and LycheeConfig.decode_blas_workspace=True keeps
cuBLAS's default. Prefill graphs are not touched. The variable is set and removed in the process environment: a
thread reading the environment meanwhile (getenv is not safe against setenv in glibc) could race with it -- one more
reason lychee's compiled calls are one thread at a time (lowering/inductor_changes.py).
"""
from __future__ import annotations

import contextlib
import os

WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"


@contextlib.contextmanager
def no_workspace():
    """Run the enclosed cuBLAS calls without a workspace, unless the user set one."""
    if os.environ.get(WORKSPACE_ENV) is not None:
        yield
        return
    os.environ[WORKSPACE_ENV] = NO_WORKSPACE
    try:
        yield
    finally:
        os.environ.pop(WORKSPACE_ENV, None)
