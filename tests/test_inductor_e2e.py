"""The compiled path through Inductor end to end on CPU (a representative subset: Inductor compiles of a tiny decoder
take tens of seconds on the CI machine; every other model test uses the light eager backend for the same passes).
fp32 models keep the op's reference as an extern kernel; the generated-Triton path is covered by the lowering tests."""
from __future__ import annotations

import time

import pytest
import torch

from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=8, block_size=4, sink_tokens=3, local_tokens=5)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("gpt_neox", "eager")])
def test_inductor_compiled_model_matches_semantics(arch, attn):
    ids, mask = make_batch(lengths=(26, 17))
    start = time.perf_counter()
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), backend="inductor", **CFG)
    seq, logits = generate_logits(model, ids, mask, 5)
    print(f"{arch}/{attn}: lychee_compile + Inductor compile + 5 steps took {time.perf_counter() - start:.1f} s")
    c = state.counters
    assert c.decode_graphs == 1 and c.sites_rewritten == model.config.num_hidden_layers

    reference = make(arch, attn)
    sem = semantics_ref.Semantics(mixed_map(reference), list(range(reference.config.num_hidden_layers)), **CFG)
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 5)
    assert max_logit_diff(logits, ref_logits) < EXACT_TOL
    assert torch.equal(seq, ref_seq)
