"""Shrunk fuzz failures, kept as regular tests. Each says what it found.

1. test_fuzz_model (2026-11-22): prompt of 2 tokens, batch 1, all-retrieval, budget 1, block 1. The compiled model was
   right; the test's own reference treated a mask-less prefill as bottom-right causal over the whole static cache
   (SDPA's is_causal is top-left aligned). Kept so the reference and the product stay in agreement on it.
"""
from __future__ import annotations

import torch

from tests import semantics_ref
from tests.harness import compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch


def test_two_token_prompt_all_retrieval_budget_one():
    cfg = dict(budget=1, block_size=1, sink_tokens=0, local_tokens=0)
    ids, mask = make_batch(lengths=(2,), seed=0)
    model, _ = compiled("llama", "sdpa", **cfg)
    seq, logits = generate_logits(model, ids, mask, 8)
    reference = make("llama")
    semantics_ref.register(semantics_ref.Semantics(torch.ones(3, 2, dtype=torch.bool), [0, 1, 2], **cfg))
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 8)
    _, dense = generate_logits(make("llama"), ids, mask, 8)
    assert torch.equal(seq, ref_seq) and max_logit_diff(logits, ref_logits) < 1e-4
    assert max_logit_diff(logits, dense) < 1e-4
