"""EvoSparse heat: the compiled model with heat equals the independent heat semantics; the state is wired
in the graph (snapshot tokens); it resets between generate() calls; a nonsense decay is refused."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import LycheeConfig, LycheeConfigError
from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=4, block_size=2, sink_tokens=2, local_tokens=2)
HEAT = dict(heat_blocks=2, heat_decay=0.8)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("gemma3", "eager")])
def test_heat_matches_semantics_and_resets(arch, attn):
    ids, mask = make_batch(lengths=(26, 17))
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), **CFG, **HEAT)
    seq, logits = generate_logits(model, ids, mask, 6)
    seq2, logits2 = generate_logits(model, ids, mask, 6)
    assert torch.equal(logits, logits2), "heat leaked from the first generate() into the second"
    snap = state.snapshots[0]
    assert "heat" in snap and state.counters.sites_rewritten >= 2

    reference = make(arch, attn)
    sem = semantics_ref.HeatSemantics(mixed_map(reference), state.global_layers, **CFG, **HEAT)
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 6)
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL and torch.equal(seq, ref_seq)

    no_heat, _ = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), **CFG)
    _, plain = generate_logits(no_heat, ids, mask, 6)
    assert max_logit_diff(plain, logits) > 1e-4, "heat must change something here, or this test shows nothing"


@pytest.mark.parametrize("decay,message", [(1.0, "never forgets"), (0.0, r"\(0, 1\)"), (1.5, r"\(0, 1\)")])
def test_bad_decay(decay, message):
    with pytest.raises(LycheeConfigError, match=message):
        LycheeConfig(heat_blocks=2, heat_decay=decay)


def test_heat_survives_rectification_and_one_token_prompt_resets_it(monkeypatch):
    # rectification's re-encode is a multi-token eager forward of the SAME sequence: it must not zero the heat (it
    # did: every eager call longer than one token counted as a prefill); a one-token prompt starts a new sequence
    from lychee_compile.rectify import Rectifier
    ids, mask = make_batch(lengths=(26, 17))
    model, _ = compiled("llama", "sdpa", retrieval=mixed_map(make("llama", "sdpa")), **CFG, **HEAT, rectify_every=3)
    seen = []
    real = Rectifier._reencode

    def spy(self, cache, m):
        before = model._lychee_heat.clone()
        real(self, cache, m)
        seen.append((before, model._lychee_heat.clone()))
    monkeypatch.setattr(Rectifier, "_reencode", spy)
    generate_logits(model, ids, mask, 7)
    assert len(seen) == 2, "7 decode steps with rectify_every=3 re-encode twice"
    for before, after in seen:
        assert before.abs().sum() > 0, "no heat accumulated before the re-encode: the check would show nothing"
        assert torch.equal(before, after), "the re-encode changed the heat"

    heat_before = model._lychee_heat.clone()
    assert heat_before.abs().sum() > 0
    one = torch.tensor([[5], [7]])
    with torch.no_grad():    # an eager one-token prompt (a prefill): a new sequence, no heat
        model(input_ids=one, attention_mask=torch.ones_like(one))
    assert model._lychee_heat.abs().sum() == 0
