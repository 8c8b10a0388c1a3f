"""Several models compiled and generated in one process, as a notebook, a comparison script or a server hosting two
models does: no Dynamo reset between them. Their attention scales and head counts differ, which Dynamo's automatic
dynamic shapes would make symbolic if their decode steps shared one frame (install._own_compiled_call says why they do
not). All-retrieval maps, so each model's logits must equal its own dense run."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from tests.harness import EXACT_TOL, generate_logits, max_logit_diff
from tests.models import make, make_batch

ARCHS = ["llama", "gemma3", "granite", "olmo2", "qwen3", "phi3", "gpt_neox"]
# Inductor compiles of a tiny decoder take seconds each on the CPU: five of them, with four different scales
INDUCTOR_ARCHS = ["llama", "gemma3", "granite", "olmo2", "gpt_neox"]
STEPS = 2       # prefill + one decode step: one decode graph per model (a second would only repeat the compile)


def _scale(model) -> float:
    attention = next(m for m in model.modules() if hasattr(m, "scaling") and hasattr(m, "config"))
    return float(attention.scaling)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_models_of_different_scales_in_one_process(backend):
    ids, mask = make_batch(lengths=(10, 6))
    scales = {}
    for arch in ARCHS if backend == "eager" else INDUCTOR_ARCHS:    # no torch._dynamo.reset() in between
        model = make(arch, "sdpa")
        scales[arch] = _scale(model)
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(budget=8, block_size=4, sink_tokens=2,
                                                                     local_tokens=2, backend=backend))
        _, logits = generate_logits(model, ids, mask, STEPS)
        _, dense = generate_logits(make(arch, "sdpa"), ids, mask, STEPS)
        counters = state_of(model).counters
        assert counters.decode_calls == STEPS - 1, f"{arch}: the rewritten decode step did not run every step"
        assert counters.decode_graphs == 1 and counters.sites_rewritten == len(state_of(model).global_layers), arch
        assert counters.sites_refused == 0, arch
        assert max_logit_diff(logits, dense) < EXACT_TOL, arch
    assert len(set(scales.values())) >= 4, scales


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_models_of_different_scales_in_one_process_gpu():
    """The same on the GPU as users run it: bf16, Inductor with our Triton kernels, CUDA graphs."""
    from torch._dynamo.utils import counters as dynamo_counters
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    for arch in ["llama", "gemma3", "granite", "qwen3", "gpt_neox"]:
        model = make(arch, "sdpa").to("cuda", torch.bfloat16)
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(budget=32, block_size=16, sink_tokens=16,
                                                                     local_tokens=16, cuda_graphs=True))
        seq, logits = generate_logits(model, ids, mask, 8)
        ref_seq, ref_logits = generate_logits(make(arch, "sdpa").to("cuda", torch.bfloat16), ids, mask, 8)
        assert state_of(model).counters.decode_calls == 7, arch
        assert (logits.float() - ref_logits.float()).abs().max() < 5e-2, arch
        assert torch.equal(seq, ref_seq), arch
    assert dynamo_counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (see its log for why)"
