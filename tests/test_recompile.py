"""No recompilation between decode steps (our backend counts every graph it is handed), nor across generate() calls
of the same shape; prefill stays eager and dense (no graph for it)."""
from __future__ import annotations

import torch

from tests.harness import compiled, generate_logits
from tests.models import make_batch


def test_one_decode_graph_for_all_steps_and_calls():
    model, state = compiled("llama", "sdpa", budget=8, block_size=4, sink_tokens=4, local_tokens=4)
    ids, mask = make_batch(lengths=(12, 7))
    generate_logits(model, ids, mask, steps=10)
    assert state.counters.graphs == 1 and state.counters.decode_graphs == 1
    ids2 = torch.randint(3, 128, ids.shape, generator=torch.Generator().manual_seed(1))
    generate_logits(model, ids2, mask, steps=10)
    assert state.counters.graphs == 1, "a second generate() of the same shape must reuse the compiled decode step"
    assert state.counters.prefill_graphs == 0


def test_no_recompile_over_200_steps_by_dynamo_counters():
    # Dynamo's own count of compiled graphs, not only ours: the decode step compiles once for 200 steps.
    from torch._dynamo.utils import counters
    model, state = compiled("llama", "sdpa", budget=8, block_size=4, sink_tokens=4, local_tokens=4)
    ids, mask = make_batch(lengths=(12, 7))
    before = counters["stats"]["unique_graphs"]
    generate_logits(model, ids, mask, steps=200)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert state.counters.decode_graphs == 1 and state.counters.decode_calls == 199
