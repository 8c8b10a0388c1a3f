"""Fuzzing, model level: random tiny configs, head maps and LycheeConfigs; the compiled generate() equals the
independent semantics reference (tests/semantics_ref.py) token for token over 8 steps, logits within 1e-4, on a
static cache or a DynamicCache (drawn; the reference runs on the same cache kind).

Fixed seed (derandomized); a failure prints hypothesis' falsifying example, which is the reproducer: paste it into
test_fuzz_regressions.py as a regular test. LYCHEE_FUZZ_EXAMPLES sets the case count (CI default below).
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import semantics_ref
from tests.harness import compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.fuzz_counts import record

EXAMPLES = int(os.environ.get("LYCHEE_FUZZ_EXAMPLES", "16"))
STEPS = 8
ARCHS = ["llama", "qwen2_gqa7", "qwen3", "mistral", "gemma3", "phi3", "gpt_neox"]


@st.composite
def cases(draw):
    arch = draw(st.sampled_from(ARCHS))
    attn = draw(st.sampled_from(["sdpa", "eager"]))
    batch = draw(st.integers(1, 3))
    lengths = tuple(draw(st.lists(st.integers(1, 28), min_size=batch, max_size=batch)))
    block = draw(st.sampled_from([1, 2, 4, 8]))
    budget = block * draw(st.integers(1, 4)) + draw(st.integers(0, block - 1))   # >= block_size, not aligned
    sink = draw(st.integers(0, budget // 2))
    local = draw(st.integers(0, budget - sink))
    model = make(arch, attn)
    n_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    kind = draw(st.sampled_from(["all_retrieval", "first_only", "random"]))
    if kind == "all_retrieval":
        retrieval = torch.ones(model.config.num_hidden_layers, n_kv, dtype=torch.bool)
    elif kind == "first_only":
        retrieval = torch.zeros(model.config.num_hidden_layers, n_kv, dtype=torch.bool)
    else:
        bits = draw(st.lists(st.booleans(), min_size=model.config.num_hidden_layers * n_kv,
                             max_size=model.config.num_hidden_layers * n_kv))
        retrieval = torch.tensor(bits).reshape(model.config.num_hidden_layers, n_kv)
    seed = draw(st.integers(0, 2**16))
    cache = draw(st.sampled_from(["static", "dynamic"]))
    return arch, attn, lengths, dict(budget=budget, block_size=block, sink_tokens=sink, local_tokens=local), \
        retrieval, seed, cache


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cases())
def test_compiled_generate_equals_semantics(case):
    arch, attn, lengths, cfg, retrieval, seed, cache = case
    print(f"case: arch={arch} attn={attn} lengths={lengths} config={cfg} seed={seed} cache={cache} "
          f"retrieval={retrieval.int().tolist()}")
    torch._dynamo.reset()
    ids, mask = make_batch(lengths=lengths, seed=seed)
    model, state = compiled(arch, attn, retrieval=retrieval, **cfg)
    seq, logits = generate_logits(model, ids, mask, STEPS, cache=cache)
    assert state.counters.graphs_left_dense == 0 and state.counters.sites_rewritten >= len(state.global_layers) > 0
    assert state.counters.decode_calls == STEPS - 1

    reference = make(arch, attn)
    sem = semantics_ref.Semantics(retrieval, semantics_ref.global_layers_of(reference.config, ids.shape[1] + STEPS),
                                  **cfg)
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, STEPS, cache=cache)
    assert torch.equal(seq, ref_seq)
    assert max_logit_diff(logits, ref_logits) < 1e-4
    record(f"model level (compiled generate vs semantics, {cache} cache)")
