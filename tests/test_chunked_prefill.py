"""Chunked prefill (generate(prefill_chunk_size=N)): transformers runs the chunks through the compiled call; they are
prefill graphs (query length > 1, or symbolic: passes/classify.py), left dense, and the decode steps after them are
rewritten. With a sparse map (plain, heat, Quest) the result equals the unchunked prefill's; with every head a
retrieval head, dense's."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from lychee_compile.ops.sparsity import collect_sparsity
from tests.harness import EXACT_TOL, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=8, block_size=4, sink_tokens=2, local_tokens=2, backend="eager")
STEPS = 5
FEATURES = {"plain": {}, "heat": dict(heat_blocks=1), "quest": dict(quest="sparse", quest_blocks=1)}


def _run(model, lengths=(90, 77), **kwargs):
    ids, mask = make_batch(lengths=lengths, seed=5)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _compiled(retrieval, **config):
    model = make("llama", "sdpa")
    lychee_compile(model, HeadMap(retrieval).with_model_metadata(model), LycheeConfig(**dict(CFG, **config)))
    return model


@pytest.mark.parametrize("feature,lengths", [("plain", (90, 77)), ("heat", (90, 77)), ("quest", (90, 77)),
                                             ("plain", (97, 80))], ids=["plain", "heat", "quest", "one-token-chunk"])
def test_chunked_prefill_equals_one_prefill_with_a_sparse_map(feature, lengths):
    # (97, 80) in chunks of 16: the last prompt chunk is one token, which is part of the prefill, not a decode step
    retrieval = mixed_map(make("llama", "sdpa"))
    whole = _run(_compiled(retrieval, **FEATURES[feature]), lengths)
    model = _compiled(retrieval, **FEATURES[feature])
    with collect_sparsity() as sp:
        seq, logits = _run(model, lengths, prefill_chunk_size=16)
    counters = state_of(model).counters
    assert counters.decode_calls == STEPS - 1 and counters.prefill_graphs >= 1
    assert sp.summary()["attended"]["max"] < 0.5, sp.summary()
    assert torch.equal(seq, whole[0])
    assert max_logit_diff(logits, whole[1]) < EXACT_TOL


def test_chunked_prefill_all_retrieval_equals_dense():
    model = make("llama", "sdpa")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(**CFG))
    seq, logits = _run(model, prefill_chunk_size=16)
    ref_seq, ref_logits = _run(make("llama", "sdpa"))
    assert state_of(model).counters.decode_calls == STEPS - 1
    assert torch.equal(seq, ref_seq) and max_logit_diff(logits, ref_logits) < EXACT_TOL
