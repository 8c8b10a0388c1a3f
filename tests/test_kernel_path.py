"""Which decode sites run the Triton kernels and which the op's eager reference (lowering/kernel_path.py): the one
predicate the lowering and the backend share, the per-site counters, and strict mode's refusal of a CUDA site on the
reference before any decode step runs. (That the lowering follows the predicate: tests/test_lowering.py, e.g. the
padded head dim and fp32 cases; the kernels at every head dim: tests/test_kernel_hybrid.py.)"""
from __future__ import annotations

import logging
import re
import types

import pytest
import torch
import torch.fx

from lychee_compile import HeadMap, LycheeCompileError, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from lychee_compile.lowering import kernel_path
from lychee_compile.passes import Counters
from lychee_compile.passes.context import Site
from tests.harness import generate_logits
from tests.models import make, make_batch

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.mark.parametrize("D", [8, 32, 64, 80, 96, 112, 128, 160, 192, 256])
def test_every_head_dim_up_to_256_takes_the_kernels(D):
    assert kernel_path.refusal(BF16, BF16, CUDA, 8, 2, D) is None
    assert kernel_path.refusal(torch.float16, torch.float16, CUDA, 4, 4, D) is None


@pytest.mark.parametrize("args,why", [
    ((torch.float32, torch.float32, CUDA, 4, 2, 64), "dtype torch.float32"),
    ((BF16, torch.float16, CUDA, 4, 2, 64), "k / v are torch.float16"),
    ((BF16, BF16, torch.device("cpu"), 4, 2, 64), "device cpu has no Triton"),
    ((BF16, BF16, CUDA, 4, 2, 320), "head_dim 320 > 256"),
    ((BF16, BF16, CUDA, 6, 4, 64), "6 query heads are not a multiple of 4 KV heads"),
    ((BF16, BF16, CUDA, 4, 2, 64, 1), "Quest bounds"),
])
def test_what_runs_the_reference_and_why(args, why):
    # (the CPU device: Inductor's default cpu_backend is C++, no Triton)
    assert why in kernel_path.refusal(*args)


def _site(layer: int, dtype, device, D: int = 96, Hq: int = 4, Hkv: int = 2) -> Site:
    """A rewritten site whose hybrid_decode call sees q [1, Hq, 1, D] and k / v [1, Hkv, 64, D] of `dtype` on
    `device` (Dynamo's metadata, as the backend reads it: only dtype, device and shape)."""
    graph = torch.fx.Graph()
    meta = {"q": (1, Hq, 1, D), "k": (1, Hkv, 64, D), "v": (1, Hkv, 64, D), "valid": (1, 64), "retrieval": (Hkv,),
            "idx_in": (1, Hkv, 2)}
    nodes = {}
    for name, shape in meta.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["example_value"] = types.SimpleNamespace(dtype=dtype, device=device, shape=shape)
    op = graph.call_function(torch.ops.lychee.hybrid_decode.default,
                             (*nodes.values(), D ** -0.5, 16, 16, 16))
    return Site(form="sdpa", q=nodes["q"], k=nodes["k"], v=nodes["v"], mask=None, output=op, matched=[],
                layer_idx=layer, op_node=op)


def test_sites_are_counted_per_path_with_their_reason(caplog):
    counters = Counters()
    sites = [_site(0, BF16, CUDA), _site(1, torch.float32, CUDA), _site(2, BF16, CUDA, D=320),
             _site(3, torch.float32, CUDA)]
    with caplog.at_level(logging.WARNING, logger="lychee_compile"):
        kernel_path.account_sites(sites, LycheeConfig(strict=False), counters)
        kernel_path.account_sites(sites, LycheeConfig(strict=False), counters)     # a recompile: reasons once
    assert (counters.sites_on_kernel, counters.sites_on_reference) == (2, 6)
    assert len(counters.reference_reasons) == 2
    assert "layers [1, 3]" in counters.reference_reasons[0] and "dtype torch.float32" in counters.reference_reasons[0]
    assert "layers [2]" in counters.reference_reasons[1] and "head_dim 320 > 256" in counters.reference_reasons[1]
    assert [r.getMessage() for r in caplog.records] == [f"lychee_compile: {m}" for m in counters.reference_reasons]


def test_strict_refuses_a_cuda_site_on_the_reference():
    counters = Counters()
    sites = [_site(0, BF16, CUDA), _site(3, BF16, CUDA, Hq=6, Hkv=4), _site(5, torch.float32, CUDA)]
    with pytest.raises(LycheeCompileError, match=r"layers \[3\] .*not a multiple.*; .*layers \[5\] .*dtype torch.float32"):
        kernel_path.account_sites(sites, LycheeConfig(strict=True), counters)
    # the kernel site passes; on CPU the reference is the expected path, and backend="eager" is the user's choice
    cpu = [_site(0, torch.float32, torch.device("cpu"))]
    kernel_path.account_sites(cpu, LycheeConfig(strict=True), counters)
    kernel_path.account_sites(sites, LycheeConfig(strict=True, backend="eager"), counters)
    assert counters.sites_on_kernel == 1 and counters.sites_on_reference == 2 + 1 + 3


def test_the_backend_counts_each_rewritten_site():
    model = make("phi3_d96")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager", budget=16, block_size=4,
                                                                    sink_tokens=4, local_tokens=4))
    ids, mask = make_batch(lengths=(9,))
    generate_logits(model, ids, mask, 3)
    c = state_of(model).counters
    assert c.sites_rewritten == c.sites_on_reference == model.config.num_hidden_layers and c.sites_on_kernel == 0
    assert c.reference_reasons == ["the decode sites of layers [0, 1, 2] run the op's eager reference, not the "
                                   "Triton kernels: backend='eager'"]


def test_strict_refusal_comes_before_inductor_and_any_decode_step(monkeypatch):
    # an fp32 model "on CUDA" (the site's device, as the backend reads it, stands in for a GPU here): strict mode
    # raises when the decode graph is compiled, before Inductor runs and before its first step
    calls = []
    monkeypatch.setattr(kernel_path, "site_device", lambda node: CUDA)
    import lychee_compile.lowering.compile as compile_module
    monkeypatch.setattr(compile_module, "compile_graph", lambda *a, **k: calls.append(a))
    model = make("phi3_d96")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="inductor", strict=True, budget=16,
                                                                    block_size=4, sink_tokens=4, local_tokens=4))
    ids, mask = make_batch(lengths=(9,))
    with pytest.raises(LycheeCompileError) as info:      # unwrapped from Dynamo's BackendCompilerFailed
        generate_logits(model, ids, mask, 3)
    refused = info.value
    assert re.search(r"layers \[0, 1, 2\] .*eager reference.*dtype torch.float32", str(refused)), refused
    c = state_of(model).counters
    assert calls == [] and c.decode_calls == 0 and c.sites_on_reference >= 1


def test_lychee_compile_refuses_reference_sites_on_cuda_before_any_change():
    # the probe's global sites carry what the decode call will get; strict: a CUDA site on the reference is refused
    # in lychee_compile (api runs refuse_probe_sites before install), naming layers and reason; CPU sites, eager and
    # non-strict configs pass (they are counted at compile time instead)
    import types
    from lychee_compile.lowering.kernel_path import refuse_probe_sites

    def site(layer, dtype, device="cuda", D=96):
        value = lambda heads: types.SimpleNamespace(meta={"example_value": types.SimpleNamespace(
            dtype=dtype, device=torch.device(device), shape=(1, heads, 1, D))})
        return types.SimpleNamespace(q=value(8), kv_k=value(2), k=None, layer_idx=layer)
    fp32 = [site(0, torch.float32), site(1, torch.float32)]
    with pytest.raises(LycheeCompileError, match=r"layers \[0, 1\] would run the op's eager reference.*float32"):
        refuse_probe_sites(fp32, LycheeConfig(backend="inductor"))
    refuse_probe_sites([site(0, torch.bfloat16), site(1, torch.float16, D=80)], LycheeConfig(backend="inductor"))
    refuse_probe_sites([site(0, torch.float32, device="cpu")], LycheeConfig(backend="inductor"))
    refuse_probe_sites(fp32, LycheeConfig(backend="eager"))
    refuse_probe_sites(fp32, LycheeConfig(backend="inductor", strict=False))
    with pytest.raises(LycheeCompileError, match="head_dim 320"):
        refuse_probe_sites([site(3, torch.bfloat16, D=320)], LycheeConfig(backend="inductor"))
