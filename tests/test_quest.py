"""Quest-style block bounds: the bound is an upper bound on every key's score; the compiled model in
both modes equals the independent Quest semantics."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import LycheeConfig, LycheeConfigError
from lychee_compile.ops.quest import block_min_max, quest_bound
from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map


def test_bound_is_an_upper_bound_on_every_key():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 1, 8, generator=g)                     # [B, H, G=1, D]
    k = torch.randn(2, 3, 20, 8, generator=g)
    valid = torch.ones(2, 20, dtype=torch.bool)
    valid[1, :6] = False
    bound = quest_bound(q, *block_min_max(k, valid, 4, 5))       # [B, H, 5]
    scores = torch.einsum("bhd,bhtd->bht", q[:, :, 0], k)
    for b, lo in enumerate((0, 6)):         # blocks count from each row's first valid position
        for t in range(20):
            if valid[b, t]:
                assert (scores[b, :, t] <= bound[b, :, (t - lo) // 4] + 1e-5).all()


@pytest.mark.parametrize("mode,extra", [("all", 0), ("sparse", 2)])
def test_quest_matches_semantics(mode, extra):
    cfg = dict(budget=4, block_size=2, sink_tokens=2, local_tokens=2)
    ids, mask = make_batch(lengths=(26, 17))
    retrieval = mixed_map(make("llama")) if mode == "sparse" else torch.zeros(3, 2, dtype=torch.bool)
    first = mode == "sparse"
    model, state = compiled("llama", "sdpa", retrieval=retrieval, quest=mode, quest_blocks=extra,
                            first_layer_retrieval=first, **cfg)
    seq, logits = generate_logits(model, ids, mask, 5)
    assert state.counters.sites_rewritten == 3 and f"quest_mode={1 if mode == 'all' else 2}" in state.snapshots[0]

    reference = make("llama")
    sem = semantics_ref.QuestSemantics(retrieval, [0, 1, 2], quest=mode, quest_blocks=extra,
                                       first_layer_retrieval=first, **cfg)
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 5)
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL and torch.equal(seq, ref_seq)


@pytest.mark.parametrize("kwargs,message", [(dict(quest="always"), "quest must be one of"),
                                            (dict(quest="sparse"), "quest_blocks > 0"),
                                            (dict(quest="all", heat_blocks=2), "cannot be combined")])
def test_bad_quest_config(kwargs, message):
    with pytest.raises(LycheeConfigError, match=message):
        LycheeConfig(**kwargs)
