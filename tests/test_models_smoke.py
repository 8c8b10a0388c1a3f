"""Every tiny test model builds and greedy-generates on the current stack (dense, no lychee)."""
from __future__ import annotations

import pytest
import torch

from tests.models import ARCHS, ATTN_IMPLS, SLIDING_WINDOW, make, make_batch

NEW = 4


def _generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_sdpa_eager_and_padding(arch):
    ids, mask = make_batch((12, 7))
    outs = {}
    for impl in ATTN_IMPLS:
        model = make(arch, impl)
        assert model.config._attn_implementation == impl
        assert not model.training and next(model.parameters()).dtype == torch.float32
        out = _generate(model, ids, mask)
        assert out.shape == (2, ids.shape[1] + NEW)
        assert torch.equal(out[:, :ids.shape[1]], ids)
        outs[impl] = out
    # Same weights (same seed) in both attention implementations: same greedy tokens.
    assert torch.equal(outs["sdpa"], outs["eager"])
    # Left padding is masked: the short row alone (no padding) generates the same tokens.
    alone = _generate(model, ids[1:, 5:], mask[1:, 5:])
    assert torch.equal(alone[0, -NEW:], outs["eager"][1, -NEW:])


def test_seeded_and_deterministic():
    a, b = make("llama", "sdpa"), make("llama", "sdpa")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def test_zoo_shapes():
    qwen = make("qwen2_gqa7", "sdpa").config
    assert qwen.num_attention_heads // qwen.num_key_value_heads == 7
    gemma = make("gemma3", "sdpa").config
    assert gemma.layer_types.count("full_attention") >= 2 and "sliding_attention" in gemma.layer_types
    assert gemma.sliding_window == SLIDING_WINDOW
    assert make("mistral_swa", "sdpa").config.sliding_window == SLIDING_WINDOW < 12 + NEW
    assert make("mistral", "sdpa").config.sliding_window is None
    ids, mask = make_batch((12, 7))
    assert ids.shape == mask.shape == (2, 12) and mask.sum(1).tolist() == [12, 7]
    assert mask[1, :5].sum() == 0  # left padding
