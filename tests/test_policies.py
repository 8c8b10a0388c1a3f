"""Selection policies: unit semantics on hand-made scores, and the compiled model with each policy equals
the independent semantics reference."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import LycheeConfig, LycheeConfigError
from lychee_compile.ops.index_state import EMPTY
from lychee_compile.ops.policies import POLICIES, ranked_selection
from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

# one row, one head (G = 1): 6 blocks, block 0 is sink (mass .1), the rest candidates with masses below
SCORES = torch.tensor([[[0.10, 0.05, 0.40, 0.05, 0.25, 0.15]]])
CAND = torch.tensor([[[False, True, True, True, True, True]]])


def select(policy, param, capacity=4):
    return ranked_selection(SCORES, CAND, capacity, 1, POLICIES[policy], param, torch.tensor([[0.10]]),
                            torch.tensor([[6]]))[0, 0].tolist()


def test_policies_on_known_masses():
    assert select("topk", 0) == [1, 2, 4, 5]                    # sorted ascending; tie .05/.05 keeps block 1 over 3
    assert select("topp", 0.5) == [2, EMPTY, EMPTY, EMPTY]      # .1 sink + .4 >= .5
    assert select("topp", 0.76) == [2, 4, 5, EMPTY]             # .1 + .4 + .25 = .75 < .76 -> + .15
    assert select("topp", 0.05) == [EMPTY] * 4                  # sink alone already holds the mass
    assert select("threshold", 0.2) == [2, 4, EMPTY, EMPTY]
    assert select("ratio", 0.5) == [2, 4, 5, EMPTY]             # ceil(.5 * 6 valid blocks) = 3
    assert select("ratio", 1.0) == [1, 2, 4, 5]                 # capped at the capacity


@pytest.mark.parametrize("kwargs,message", [(dict(selection="topq"), "selection must be one of"),
                                            (dict(selection="topp", selection_param=1.5), r"\(0, 1\]"),
                                            (dict(selection="ratio", selection_param=float("nan")), "number")])
def test_bad_policy_config(kwargs, message):
    with pytest.raises(LycheeConfigError, match=message):
        LycheeConfig(**kwargs)


@pytest.mark.parametrize("selection,param", [("topp", 0.6), ("threshold", 0.05), ("ratio", 0.3)])
def test_compiled_policy_matches_semantics(selection, param):
    cfg = dict(budget=16, block_size=2, sink_tokens=2, local_tokens=2, selection=selection, selection_param=param)
    ids, mask = make_batch(lengths=(26, 17))
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **cfg)
    seq, logits = generate_logits(model, ids, mask, 5)
    assert state.counters.sites_rewritten == 3

    reference = make("llama")
    sem = semantics_ref.Semantics(mixed_map(reference), [0, 1, 2], **cfg)
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 5)
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL and torch.equal(seq, ref_seq)


def test_select_top_blocks_equals_the_ranked_top_k():
    # the int64-key fast paths (heat / Quest picks) must pick exactly what the sort-based ranking picks:
    # ties (to the lower block), negative scores, -0.0 vs +0.0, fewer candidates than k
    from lychee_compile.ops.policies import POLICIES, ranked_selection, select_top_blocks
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        # k up to 29: both the chained-max path (k <= CHAINED_TOPK_MAX) and the torch.topk path
        nb, k = int(torch.randint(1, 40, (), generator=g)), int(torch.randint(1, 30, (), generator=g))
        score = torch.randint(-3, 4, (2, 3, nb), generator=g).float() * 0.37
        if trial % 3 == 0:
            score = torch.randn(2, 3, nb, generator=g)
        score[..., 0] = -0.0 if trial % 5 == 0 else score[..., 0]
        cand = torch.rand(2, 3, nb, generator=g) > 0.3
        unused = torch.zeros(2, 3)
        want = ranked_selection(score, cand, k, 1, POLICIES["topk"], 0.0, unused, unused)
        assert torch.equal(select_top_blocks(score, cand, k), want), (trial, score, cand, k)
