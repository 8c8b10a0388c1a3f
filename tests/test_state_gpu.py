"""Heat and Quest on the GPU: the Inductor-compiled model with CUDA graphs -- our Triton templates plus the
fused picks / in-place Quest state -- equals the same configuration on the eager reference op, in bf16 on CUDA.
The CPU suite checks the same lowering under the Triton interpreter; this is the one check on real hardware."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from tests.harness import generate_logits
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=32, block_size=16, sink_tokens=16, local_tokens=16)
FEATURES = {"heat": dict(heat_blocks=2, heat_decay=0.8), "quest_sparse": dict(quest="sparse", quest_blocks=2),
            "quest_all": dict(quest="all")}
TOL = 5e-2                                           # bf16 logits of a tiny model (the CUDA-graph test's bound)


def _run(backend, feature, ids, mask, steps=24):
    model = make("llama", "sdpa").to("cuda", torch.bfloat16)
    # the state buffers cover max_position_embeddings positions (rotary positions need no more than the default)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, ids.shape[1] + steps + 64)
    retrieval = mixed_map(make("llama", "sdpa"))
    extra = dict(cuda_graphs=True) if backend == "inductor" else {}
    lychee_compile(model, HeadMap(retrieval).with_model_metadata(model),
                   LycheeConfig(backend=backend, **CFG, **FEATURES.get(feature, {}), **extra))
    seq, logits = generate_logits(model, ids, mask, steps)
    return seq, logits.float(), state_of(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_compiled_state_features_equal_the_reference_on_cuda(feature):
    from torch._dynamo.utils import counters
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    seq, logits, state = _run("inductor", feature, ids, mask)
    ref_seq, ref_logits, _ = _run("eager", feature, ids, mask)
    assert torch.isfinite(logits).all()
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (see its log for why)"
    assert state.counters.sites_rewritten >= 2 and state.counters.decode_calls >= 23     # 24 new tokens: 23 decode steps
    wired = "heat" if feature == "heat" else "quest"
    assert any(wired in snap for snap in state.snapshots), f"{feature}: the state is not in the rewritten graph"
    assert torch.equal(seq, ref_seq), f"{feature}: compiled tokens differ from the reference op's"
    assert (logits - ref_logits).abs().max().item() < TOL
    _, plain, _ = _run("inductor", "none", ids, mask)
    assert (plain - logits).abs().max().item() > 1e-3, f"{feature} must change the output here, or this shows nothing"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("feature", ["heat", "quest_sparse"])
def test_state_features_compile_at_batch_1_and_8k_keys(feature):
    # Inductor (torch 2.11) miscompiled these composites' mask reductions on rows of 8K+ keys at batch 1 (a reduction
    # fused into a split-scan kernel; a split reduction's second stage in a pointwise kernel): their row ranges now
    # come from one lychee::valid_ranges per graph.
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 8300), device="cuda")
    mask = torch.ones_like(ids)
    seq, logits, state = _run("inductor", feature, ids, mask, steps=6)
    ref_seq, ref_logits, _ = _run("eager", feature, ids, mask, steps=6)
    assert state.counters.decode_calls >= 5 and state.counters.sites_on_reference == 0
    assert torch.equal(seq, ref_seq) and (logits - ref_logits).abs().max().item() < TOL
