"""CUDA graphs (LycheeConfig(cuda_graphs=True)) on the GPU: the decode step is captured once and replayed; tokens
equal the same compiled model without graphs; set_head_map() reaches the replayed graph with no re-capture."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, LycheeConfigError, lychee_compile, set_head_map
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


def _cuda_model(retrieval, cuda_graphs):
    model = make("llama", "sdpa").to("cuda", torch.bfloat16)
    lychee_compile(model, HeadMap(retrieval).with_model_metadata(model), LycheeConfig(cuda_graphs=cuda_graphs, **CFG))
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
