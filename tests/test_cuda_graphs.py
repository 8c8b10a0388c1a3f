"""CUDA graphs: the default (cuda_graphs=None) decided per model and logged (CPU); on the GPU the decode step is
captured once and replayed, tokens equal the same compiled model without graphs, set_head_map() reaches the replayed
graph with no re-capture, and the default config captures them (a DynamicCache decodes without)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from lychee_compile import HeadMap, KernelOptions, LycheeConfig, LycheeConfigError, lychee_compile, set_head_map
from lychee_compile.api import state_of
from tests.harness import generate_logits
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=32, block_size=16, sink_tokens=16, local_tokens=16)


def test_cuda_graphs_need_a_cuda_model():
    model = make("llama", "sdpa")
    with pytest.raises(LycheeConfigError, match="needs the model on a CUDA device"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(cuda_graphs=True))
    assert not hasattr(model, "_lychee_state")


def _cuda_model(retrieval, cuda_graphs, kernels=KernelOptions()):
    model = make("llama", "sdpa").to("cuda", torch.bfloat16)
    lychee_compile(model, HeadMap(retrieval).with_model_metadata(model),
                   LycheeConfig(cuda_graphs=cuda_graphs, kernels=kernels, **CFG))
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_replay_and_head_map_swap():
    from torch._dynamo.utils import counters
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    probe = make("llama", "sdpa")
    mixed = mixed_map(probe)
    full = torch.ones_like(mixed)
    plain_seq, plain_logits = generate_logits(_cuda_model(mixed, False), ids, mask, 24)
    model = _cuda_model(full, True)
    generate_logits(model, ids, mask, 24)
    graphs = counters["stats"]["unique_graphs"]
    set_head_map(model, HeadMap(mixed).with_model_metadata(model))
    seq, logits = generate_logits(model, ids, mask, 24)
    assert counters["stats"]["unique_graphs"] == graphs, "set_head_map must not recompile"
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (see its log for why)"
    assert torch.equal(seq, plain_seq)
    assert (logits.float() - plain_logits.float()).abs().max() < 5e-2
    assert state_of(model).counters.decode_calls >= 2 * 23


PDL_KERNEL = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)'''", re.S)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs CUDA compute capability 9+ (programmatic dependent launch)")
def test_pdl_kernels_all_wait_and_change_no_token_gpu(monkeypatch):
    # PDL is on by default on sm_90+ (lowering/compile.py): every part of every kernel of the step launched with it
    # calls griddepcontrol.wait (inductor_changes._pdl_waits, our templates' own), and launches its dependents only
    # after it; the tokens are those of the same model compiled without PDL, and two runs of one compiled model
    # give bit-identical logits (a race between overlapping kernels would show as a difference)
    from torch._inductor import config as icfg
    from torch._inductor.utils import run_and_get_code
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    mixed = mixed_map(make("llama", "sdpa"))
    torch._dynamo.reset()
    plain_seq, plain_logits = generate_logits(_cuda_model(mixed, True, KernelOptions(pdl=False)), ids, mask, 24)
    torch._dynamo.reset()
    model = _cuda_model(mixed, True)
    with icfg.patch(fx_graph_cache=False):       # the code must be generated here to be read
        (seq, logits), codes = run_and_get_code(generate_logits, model, ids, mask, 24)
    seq2, logits2 = generate_logits(model, ids, mask, 24)
    kernels = [(name, src) for code in codes for name, src in PDL_KERNEL.findall(code)
               if "'launch_pdl': True" in src]
    assert kernels, "no kernel of the compiled step was generated with PDL"
    for name, src in kernels:
        body = src.split("):\n", 1)[1]
        assert waits_before_release(body), (name, [x for x in body.splitlines() if "pid" in x or "gdc_" in x])
    ours = [(name, src) for code in codes for name, src in PDL_KERNEL.findall(code) if name.startswith("triton_tem")
            and "hybrid_decode" in name]
    # our templates launch with PDL too (compile.pdl_templates), each waiting before its first access
    assert ours and all("'launch_pdl': True" in src for _, src in ours), [n for n, _ in ours]
    for name, src in ours:
        body = src.split("):\n", 1)[1]
        first_access = min(i for i in (body.find("tl.load("), body.find("tl.store("), body.find("tl.atomic"))
                           if i >= 0)
        assert -1 < body.find("tl.extra.cuda.gdc_wait()") < first_access, name
    assert torch.equal(seq, plain_seq)
    assert (logits.float() - plain_logits.float()).abs().max() < 5e-2
    assert torch.equal(seq2, seq) and torch.equal(logits2, logits)


def waits_before_release(body: str) -> bool:
    """Each part of a kernel body (a combo kernel's `if pid ...` branches, by range or round robin; else the whole
    body) calls gdc_wait, and calls gdc_launch_dependents, if at all, after it."""
    parts = (re.split(r"\n\s*(?:el)?if pid\b[^\n]*:\n", body)[1:] if body.lstrip().startswith("pid = tl.program_id")
             else [body])
    for part in parts:
        wait = part.find("tl.extra.cuda.gdc_wait()")
        launch = part.find("tl.extra.cuda.gdc_launch_dependents()")
        if wait < 0 or (launch >= 0 and launch < wait):
            return False
    return bool(parts)


def test_waits_before_release_reads_kernel_bodies():
    # the GPU test's checker itself: a wait in every part, ahead of any launch_dependents, passes; nothing else
    w, r = "tl.extra.cuda.gdc_wait()", "tl.extra.cuda.gdc_launch_dependents()"
    assert waits_before_release(f"    x = tl.load(a)\n    {w}\n    {r}\n    tl.store(b, x)\n")
    assert not waits_before_release(f"    x = tl.load(a)\n    {r}\n    {w}\n    tl.store(b, x)\n")
    assert not waits_before_release("    tl.store(b, 1)\n")
    combo = ("    pid = tl.program_id(0)\n    if pid < n0:\n        {a}\n        x = tl.load(a)\n"
             "    elif pid < n1:\n        {b}\n        tl.store(c, 1)\n    else:\n        pass\n")
    assert waits_before_release(combo.format(a=w, b=w))
    assert not waits_before_release(combo.format(a=w, b="pass"))
    round_robin = combo.replace("if pid < n0", "if pid % 2 == 0").replace("elif pid < n1", "elif pid % 2 == 1")
    assert waits_before_release(round_robin.format(a=w, b=w))
    assert not waits_before_release(round_robin.format(a="pass", b=w))


def test_cuda_graphs_default_is_decided_per_model_and_logged(caplog):
    # LycheeConfig(cuda_graphs=None), the default: on only for a CUDA model with the Inductor backend (with
    # rectification too); off elsewhere, and the log says why (a warning where a CUDA model decodes without them)
    config = LycheeConfig(**CFG)
    assert config.cuda_graphs is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert config.resolved_for(cuda)[0].cuda_graphs is True
    assert config.resolved_for(cpu) == (dataclasses.replace(config, cuda_graphs=False),
                                        "CUDA graphs off: the model is not on a CUDA device")
    assert "backend='eager'" in LycheeConfig(backend="eager", **CFG).resolved_for(cuda)[1]
    assert LycheeConfig(rectify_every=4, **CFG).resolved_for(cuda)[0].cuda_graphs is True
    assert LycheeConfig(cuda_graphs=False, **CFG).resolved_for(cuda)[0].cuda_graphs is False
    with pytest.raises(LycheeConfigError, match="must be a bool"):
        LycheeConfig(cuda_graphs="yes")
    model = make("llama", "sdpa")
    with caplog.at_level("INFO", logger="lychee_compile"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager", **CFG))
    assert state_of(model).config.cuda_graphs is False
    assert "CUDA graphs off: the model is not on a CUDA device" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_config_runs_cuda_graphs_on_cuda_and_none_on_a_dynamic_cache_gpu(caplog):
    from torch._dynamo.utils import counters
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    probe = make("llama", "sdpa")
    mixed = HeadMap(mixed_map(probe)).with_model_metadata(probe)
    tuned = make("llama", "sdpa").to("cuda", torch.bfloat16)
    lychee_compile(tuned, mixed, LycheeConfig(cuda_graphs=True, **CFG))
    model = make("llama", "sdpa").to("cuda", torch.bfloat16)
    with caplog.at_level("INFO", logger="lychee_compile"):
        lychee_compile(model, mixed, LycheeConfig(**CFG))
        seq, logits = generate_logits(model, ids, mask, 12)
        before = state_of(model).counters.decode_calls
        _, dyn_logits = generate_logits(model, ids, mask, 12, cache="dynamic")
    assert state_of(model).config.cuda_graphs is True and "CUDA graphs on (default" in caplog.text
    assert "DynamicCache run without CUDA graphs" in caplog.text
    assert state_of(model).counters.decode_calls == before + 11 and torch.isfinite(dyn_logits).all()
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (see its log for why)"
    tuned_seq, tuned_logits = generate_logits(tuned, ids, mask, 12)
    assert torch.equal(seq, tuned_seq)
    assert (logits.float() - tuned_logits.float()).abs().max() < 5e-2
