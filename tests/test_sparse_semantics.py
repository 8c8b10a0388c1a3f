"""Acceptance 2: mixed head maps -- the compiled model equals the test's own plain re-implementation of the semantics.

The reference (tests/semantics_ref.py) runs inside an *uncompiled* copy of the same model as a transformers attention
function; it shares no code with lychee_compile. Each case also checks that the sparse configuration really differs
from dense attention, so agreement cannot come from both sides silently being dense.
"""
from __future__ import annotations

import pytest
import torch

from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch

STEPS = 5
LENGTHS = (26, 17)   # batch 2, 9 pad slots in row 1
LEVELS = {
    "token": dict(budget=4, block_size=1, sink_tokens=0, local_tokens=0),
    "block": dict(budget=8, block_size=4, sink_tokens=3, local_tokens=5),
}
ARCHS = [("llama", "sdpa"), ("llama", "eager"), ("qwen2_gqa7", "sdpa"), ("gemma3", "sdpa"), ("gemma3", "eager"),
         ("gpt_neox", "eager"), ("phi3", "sdpa"), ("qwen3", "eager")]


def mixed_map(model) -> torch.Tensor:
    """Retrieval [layers, kv heads]: layer 0 all retrieval; then alternate which heads retrieve, so every KV head is
    sparse in some layer right below a layer where it is a retrieval head (inheritance across layers is exercised)."""
    n_layers = model.config.num_hidden_layers
    n_kv = getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads
    r = torch.zeros(n_layers, n_kv, dtype=torch.bool)
    for layer in range(n_layers):
        for h in range(n_kv):
            r[layer, h] = (layer + h) % 2 == 0
    return r


@pytest.mark.parametrize("level", sorted(LEVELS))
@pytest.mark.parametrize("arch,attn", ARCHS)
def test_mixed_map_matches_plain_semantics(arch, attn, level):
    cfg = LEVELS[level]
    ids, mask = make_batch(lengths=LENGTHS)
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), **cfg)
    seq, logits = generate_logits(model, ids, mask, STEPS)
    assert state.counters.sites_rewritten >= len(state.global_layers) >= 2
    assert state.counters.graphs_left_dense == 0

    reference = make(arch, attn)
    cache_len = ids.shape[1] + STEPS
    sem = semantics_ref.Semantics(mixed_map(reference), semantics_ref.global_layers_of(reference.config, cache_len),
                                  **cfg)
    assert sem.global_layers == state.global_layers
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, STEPS)
    assert sem.decode_calls >= (STEPS - 1) * len(sem.global_layers)

    dense_seq, dense_logits = generate_logits(make(arch, attn), ids, mask, STEPS)
    assert max_logit_diff(ref_logits, dense_logits) > 1e-3, "the sparse setting must differ from dense to test anything"
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL
    assert torch.equal(seq, ref_seq)
