"""Acceptance 1: with an all-retrieval head map, the compiled model's logits equal the uncompiled model's (1e-4)."""
from __future__ import annotations

import pytest
import torch

from lychee_compile.passes import LycheeCompileError
from tests.harness import EXACT_TOL, batch, compiled, generate_logits, max_logit_diff
from tests.models import make

ARCHS = ["llama", "qwen2_gqa7", "qwen3", "mistral", "gemma3", "phi3", "gpt_neox"]
STEPS = 5
# Small budget on purpose: all-retrieval must be exact whatever the budget (selection only feeds sparse heads).
CONFIG = dict(budget=4, block_size=2, sink_tokens=2, local_tokens=2)


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_all_retrieval_matches_dense(arch, attn, batch_size):
    ids, mask = batch(batch_size)
    dense_seq, dense_logits = generate_logits(make(arch, attn), ids, mask, STEPS)
    model, state = compiled(arch, attn, **CONFIG)
    seq, logits = generate_logits(model, ids, mask, STEPS)

    c = state.counters
    # HF's static sliding-window cache guards on a Python int, so Gemma3 compiles its decode step twice (dense too).
    expected_graphs = 2 if c.sites_sliding else 1
    assert c.decode_graphs == expected_graphs and c.graphs_left_dense == 0
    assert c.sites_rewritten == expected_graphs * len(state.global_layers) > 0
    assert c.sites_rewritten + c.sites_sliding == expected_graphs * model.config.num_hidden_layers
    assert max_logit_diff(logits, dense_logits) < EXACT_TOL
    assert torch.equal(seq, dense_seq)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_all_sliding_model_has_nothing_to_rewrite(attn):
    model = make("mistral_swa", attn)
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    with pytest.raises(LycheeCompileError, match="nothing to rewrite"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
    assert not hasattr(model, "_lychee_state")
    assert model.generation_config.compile_config is None
