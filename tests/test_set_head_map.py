"""set_head_map(): head kinds are runtime data (the `_lychee_kinds` buffer), so swapping a map on a compiled model
gives exactly what a fresh compile with that map gives, with no new graph; bad maps are refused, old map kept."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, HeadMapError, set_head_map
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make_batch
from tests.test_sparse_semantics import LEVELS, mixed_map

CFG = dict(LEVELS["block"], backend="eager")


def test_swapped_map_equals_fresh_compile_without_recompiling():
    ids, mask = make_batch(lengths=(26, 17))
    model, state = compiled("llama", "sdpa", **CFG)                 # starts all retrieval (= dense)
    all_retrieval_logits = generate_logits(model, ids, mask, 5)[1]
    graphs = state.counters.graphs
    mixed = mixed_map(model)
    set_head_map(model, HeadMap(mixed).with_model_metadata(model))
    seq, logits = generate_logits(model, ids, mask, 5)
    assert state.counters.graphs == graphs, "set_head_map must not cause a new graph"
    assert torch.equal(model._lychee_kinds.cpu(), state.retrieval[state.global_layers])

    fresh, _ = compiled("llama", "sdpa", retrieval=mixed, **CFG)
    fresh_seq, fresh_logits = generate_logits(fresh, ids, mask, 5)
    assert max_logit_diff(logits, fresh_logits) < EXACT_TOL and torch.equal(seq, fresh_seq)
    assert max_logit_diff(logits, all_retrieval_logits) > 1e-3, "the swapped map must change the attention"


def test_bad_map_is_refused_and_old_map_kept():
    model, state = compiled("llama", "sdpa", **CFG)
    before = model._lychee_kinds.clone()
    with pytest.raises(HeadMapError, match="does not match the model"):
        set_head_map(model, HeadMap(torch.zeros(2, 1, dtype=torch.bool)))
    streaming = torch.zeros_like(state.head_map.retrieval)
    streaming[1, 0] = True
    with pytest.raises(HeadMapError, match="streaming heads change the graph"):
        set_head_map(model, HeadMap(torch.zeros_like(streaming), streaming=streaming).with_model_metadata(model))
    assert torch.equal(model._lychee_kinds, before)
