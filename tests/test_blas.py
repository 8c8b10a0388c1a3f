"""cuBLAS's workspace during a rewritten decode step (lychee_compile/blas.py)."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import lychee_compile.blas as blas
from lychee_compile import LycheeConfig
from lychee_compile.config import LycheeConfigError
from tests.harness import batch, compiled, generate_logits


def test_no_workspace_inside_and_the_environment_restored_after(monkeypatch):
    monkeypatch.delenv(blas.WORKSPACE_ENV, raising=False)
    with blas.decode_products(keep_workspace=False):
        assert os.environ[blas.WORKSPACE_ENV] == ":0:0"
    assert blas.WORKSPACE_ENV not in os.environ
    with pytest.raises(RuntimeError, match="boom"):
        with blas.decode_products(keep_workspace=False):
            raise RuntimeError("boom")
    assert blas.WORKSPACE_ENV not in os.environ


def test_a_workspace_the_user_chose_or_keep_workspace_is_left_alone(monkeypatch):
    monkeypatch.setenv(blas.WORKSPACE_ENV, ":4096:8")      # e.g. deterministic cuBLAS
    with blas.decode_products(keep_workspace=False):
        assert os.environ[blas.WORKSPACE_ENV] == ":4096:8"
    assert os.environ[blas.WORKSPACE_ENV] == ":4096:8"
    monkeypatch.delenv(blas.WORKSPACE_ENV)
    with blas.decode_products(keep_workspace=True):
        assert blas.WORKSPACE_ENV not in os.environ


@pytest.mark.parametrize("keep", [False, True])
def test_every_decode_step_and_only_decode_steps_run_inside_it(monkeypatch, keep):
    seen = []
    real = blas.decode_products

    @contextlib.contextmanager
    def recording(keep_workspace):
        with real(keep_workspace):
            seen.append((keep_workspace, os.environ.get(blas.WORKSPACE_ENV)))
            yield

    monkeypatch.delenv(blas.WORKSPACE_ENV, raising=False)
    monkeypatch.setattr(blas, "decode_products", recording)
    model, state = compiled("llama", "sdpa", decode_blas_workspace=keep)
    ids, mask = batch(2)
    generate_logits(model, ids, mask, 5)
    # prefill is not a rewritten decode step: 4 decode steps, each once inside the context
    assert state.counters.decode_calls == 4 and len(seen) == 4
    assert seen == [(keep, None if keep else ":0:0")] * 4
    assert blas.WORKSPACE_ENV not in os.environ


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
    # the default workspace, and runs as one kernel inside decode_products() in the same process
    monkeypatch.delenv(blas.WORKSPACE_ENV, raising=False)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ref = torch.mm(x, w.t())
    default = _kernels(lambda: torch.mm(x, w.t()))
    if not any("splitK" in k for k in default):
        pytest.skip(f"cuBLAS splits no K here with its workspace ({default}): nothing to remove")
    with blas.decode_products(keep_workspace=False):
        inside = _kernels(lambda: torch.mm(x, w.t()))
        out = torch.mm(x, w.t())
    assert len(inside) == 1 and not any("splitK" in k for k in inside), (default, inside)
    exact = x.float() @ w.float().t()       # same product, another summation order: bf16 rounding apart
    assert (out.float() - exact).abs().max() <= 1e-2 * exact.abs().max()
    assert any("splitK" in k for k in _kernels(lambda: torch.mm(x, w.t()))), "default not restored"
