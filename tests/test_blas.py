"""cuBLAS's workspace during a rewritten decode step (lychee_compile/blas.py)."""
from __future__ import annotations

import os

import pytest
import torch

import lychee_compile.blas as blas
from lychee_compile import LycheeConfig
from lychee_compile.config import LycheeConfigError


def test_no_workspace_inside_and_the_environment_restored_after(monkeypatch):
    monkeypatch.delenv(blas.WORKSPACE_ENV, raising=False)
    with blas.no_workspace():
        assert os.environ[blas.WORKSPACE_ENV] == ":0:0"
    assert blas.WORKSPACE_ENV not in os.environ
    with pytest.raises(RuntimeError, match="boom"):
        with blas.no_workspace():
            raise RuntimeError("boom")
    assert blas.WORKSPACE_ENV not in os.environ


def test_a_workspace_the_user_chose_is_left_alone(monkeypatch):
    monkeypatch.setenv(blas.WORKSPACE_ENV, ":4096:8")      # e.g. deterministic cuBLAS
    with blas.no_workspace():
        assert os.environ[blas.WORKSPACE_ENV] == ":4096:8"
    assert os.environ[blas.WORKSPACE_ENV] == ":4096:8"


@pytest.mark.parametrize("on_cuda,decode,keep,expect", [(True, True, False, True), (True, True, True, False),
                                                         (True, False, False, False), (False, True, False, False)],
                         ids=["cuda-decode", "keep-workspace", "prefill", "cpu"])
def test_only_cuda_decode_graphs_run_without_a_workspace(on_cuda, decode, keep, expect):
    # compile_graph's scope for a graph: a CUDA decode graph without decode_blas_workspace (inductor_changes.running
    # applies it: tests/test_inductor_changes.py); prefill graphs and CPU graphs are left alone
    from lychee_compile.lowering.compile import graph_scope
    assert graph_scope(LycheeConfig(decode_blas_workspace=keep), on_cuda, decode).no_blas_workspace is expect


def test_decode_blas_workspace_must_be_a_bool():
    with pytest.raises(LycheeConfigError, match="decode_blas_workspace must be a bool"):
        LycheeConfig(decode_blas_workspace="yes")
    assert LycheeConfig().cache_key() != LycheeConfig(decode_blas_workspace=True).cache_key()


def _kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_reads_the_workspace_per_call_and_cublas_then_splits_no_product_gpu(monkeypatch):
    # the mechanism itself on this torch / cuBLAS: a Llama-3-8B o_proj at 4 rows splits K (a reduce kernel) with
    # the default workspace, and runs as one kernel inside no_workspace() in the same process
    monkeypatch.delenv(blas.WORKSPACE_ENV, raising=False)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ref = torch.mm(x, w.t())
    default = _kernels(lambda: torch.mm(x, w.t()))
    if not any("splitK" in k for k in default):
        pytest.skip(f"cuBLAS splits no K here with its workspace ({default}): nothing to remove")
    with blas.no_workspace():
        inside = _kernels(lambda: torch.mm(x, w.t()))
        out = torch.mm(x, w.t())
    assert len(inside) == 1 and not any("splitK" in k for k in inside), (default, inside)
    exact = x.float() @ w.float().t()       # same product, another summation order: bf16 rounding apart
    assert (out.float() - exact).abs().max() <= 1e-2 * exact.abs().max()
    assert any("splitK" in k for k in _kernels(lambda: torch.mm(x, w.t()))), "default not restored"
