"""DynamicCache: decode steps on a DynamicCache run the rewrite with a
symbolic cache length -- equal to the independent semantics (mixed maps) and to dense (all retrieval), one graph for
every length, options that need the static cache refused, and bypasses still not silent in strict mode."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import LycheeConfigError
from lychee_compile.passes import LycheeCompileError
from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

STEPS = 8
CFG = dict(budget=8, block_size=4, sink_tokens=3, local_tokens=5)
BATCHES = {1: (26,), 2: (26, 17)}      # batch 2: row 1 left-padded by 9


def _semantics_logits(arch, attn, ids, mask, semantics):
    reference = make(arch, attn)
    semantics_ref.register(semantics)
    reference.config._attn_implementation = semantics_ref.NAME
    return generate_logits(reference, ids, mask, STEPS, cache="dynamic")


@pytest.mark.parametrize("arch,attn,batch", [("llama", "sdpa", 2), ("llama", "eager", 1), ("gemma3", "sdpa", 1),
                                             ("gemma3", "eager", 2), ("qwen2_gqa7", "sdpa", 2)])
def test_mixed_map_matches_semantics(arch, attn, batch):
    ids, mask = make_batch(lengths=BATCHES[batch])
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), **CFG)
    seq, logits = generate_logits(model, ids, mask, STEPS, cache="dynamic")
    c = state.counters
    assert c.decode_calls == STEPS - 1 and c.graphs_left_dense == 0
    assert c.sites_rewritten == c.decode_graphs * len(state.global_layers) >= 2

    sem = semantics_ref.Semantics(mixed_map(make(arch, attn)), state.global_layers, **CFG)
    ref_seq, ref_logits = _semantics_logits(arch, attn, ids, mask, sem)
    assert sem.decode_calls == (STEPS - 1) * len(state.global_layers)
    _, dense_logits = generate_logits(make(arch, attn), ids, mask, STEPS, cache="dynamic")
    assert max_logit_diff(ref_logits, dense_logits) > 1e-3, "the sparse setting must differ from dense"
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL
    assert torch.equal(seq, ref_seq)


@pytest.mark.parametrize("arch,attn,batch", [("llama", "sdpa", 1), ("llama", "eager", 2), ("gemma3", "sdpa", 2),
                                             ("gpt_neox", "eager", 1), ("qwen3", "sdpa", 2), ("phi3", "eager", 2)])
def test_all_retrieval_matches_dense(arch, attn, batch):
    ids, mask = make_batch(lengths=BATCHES[batch])
    dense_seq, dense_logits = generate_logits(make(arch, attn), ids, mask, STEPS, cache="dynamic")
    model, state = compiled(arch, attn, budget=4, block_size=2, sink_tokens=2, local_tokens=2)
    seq, logits = generate_logits(model, ids, mask, STEPS, cache="dynamic")
    c = state.counters
    assert c.decode_calls == STEPS - 1 and c.graphs_left_dense == 0 and c.sites_rewritten > 0
    assert max_logit_diff(logits, dense_logits) < EXACT_TOL
    assert torch.equal(seq, dense_seq)


@pytest.mark.parametrize("arch,graphs", [("llama", 1), ("gemma3", 2)])
def test_one_graph_for_every_cache_length(arch, graphs):
    """Counted by the backend (every graph Dynamo hands it). Gemma3: the first decode step specializes the full
    layers' length to the sliding layers' (Dynamo's duck sizing: both were the prompt length), one recompile."""
    model, state = compiled(arch, "sdpa", **CFG)
    ids, mask = make_batch(lengths=(12, 7))
    generate_logits(model, ids, mask, 10, cache="dynamic")
    assert state.counters.graphs == graphs
    longer, longer_mask = make_batch(lengths=(20, 15), seed=3)
    generate_logits(model, longer, longer_mask, 12, cache="dynamic")
    assert state.counters.graphs == graphs, "a new prompt or cache length must not recompile"
    assert state.counters.decode_calls == 9 + 11 and state.counters.prefill_graphs == 0


def test_cache_implementation_dynamic_equals_passed_cache():
    model, state = compiled("llama", "eager", retrieval=mixed_map(make("llama")), **CFG)
    ids, mask = make_batch(lengths=BATCHES[2])
    _, passed = generate_logits(model, ids, mask, STEPS, cache="dynamic")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             cache_implementation="dynamic", output_logits=True, return_dict_in_generate=True)
    assert state.counters.decode_calls == 2 * (STEPS - 1)
    assert torch.equal(torch.stack(out.logits), passed)


def test_heat_works_on_a_dynamic_cache():
    heat = dict(heat_blocks=2, heat_decay=0.8)
    ids, mask = make_batch(lengths=BATCHES[2])
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **CFG, **heat)
    seq, logits = generate_logits(model, ids, mask, STEPS, cache="dynamic")
    _, again = generate_logits(model, ids, mask, STEPS, cache="dynamic")
    assert torch.equal(logits, again), "heat leaked from the first generate() into the second"
    assert "heat" in state.snapshots[0]
    sem = semantics_ref.HeatSemantics(mixed_map(make("llama")), state.global_layers, **CFG, **heat)
    ref_seq, ref_logits = _semantics_logits("llama", "sdpa", ids, mask, sem)
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL and torch.equal(seq, ref_seq)


def test_rectification_is_refused_on_a_dynamic_cache():
    model, state = compiled("llama", "sdpa", rectify_every=2, **CFG)
    ids, mask = make_batch(lengths=BATCHES[1])
    with pytest.raises(LycheeConfigError, match="rectify_every needs the static cache"):
        generate_logits(model, ids, mask, STEPS, cache="dynamic")
    assert state.counters.graphs == 0, "refused before anything was compiled"
    seq, _ = generate_logits(model, ids, mask, STEPS)          # the static cache still works
    assert seq.shape[1] == ids.shape[1] + STEPS and state.counters.decode_calls > 0


def test_a_bypass_still_raises_in_strict_mode():
    model, state = compiled("llama", "sdpa", **CFG)
    ids, mask = make_batch(lengths=BATCHES[1])
    with pytest.raises(LycheeCompileError, match="without the lychee decode step"), torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, cache_implementation="dynamic", use_cache=False)
    assert state.counters.decode_calls == 0 and state.counters.generate_calls_dense == 1
