"""Pass fuse_linears (passes/fuse_linears.py, install side linear_groups.py): sibling linears -> one product.

Asserts the three things of every rewrite -- numerics (against the uncompiled model and the unfused compile), that
the pass fired (counters), and the graph shape (F.linear calls left) -- plus what the weight sharing must keep true
for a user: parameters, state_dict and in-place weight updates.
"""
from __future__ import annotations

import pytest
import torch

from lychee_compile import LycheeConfig
from lychee_compile.config import LycheeConfigError
from lychee_compile.linear_groups import GROUPS_ATTR
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch

CONFIG = dict(budget=8, block_size=4, sink_tokens=4, local_tokens=4)
# q/k/v (3 members) and gate/up (2) per layer; the bias case is Qwen2's q/k/v
CASES = [("llama", "sdpa", False), ("qwen2_gqa7", "eager", True), ("qwen3", "sdpa", False)]


def _linear_calls(state) -> list[str]:
    return [line for line in state.snapshots[0].splitlines() if line.startswith("linears:")]


@pytest.mark.parametrize("arch,attn,bias", CASES)
def test_sibling_linears_fused_exactly(arch, attn, bias):
    ids, mask = make_batch(lengths=(12, 7))
    _, dense = generate_logits(make(arch, attn), ids, mask, steps=4)
    model, state = compiled(arch, attn, **CONFIG)
    _, fused = generate_logits(model, ids, mask, steps=4)
    layers = model.config.num_hidden_layers

    assert max_logit_diff(fused, dense) < EXACT_TOL
    # counters: one decode graph, two groups per layer (q/k/v, gate/up), five linears replaced per layer
    assert state.counters.decode_graphs == 1
    assert state.counters.linear_groups_fused == 2 * layers
    assert state.counters.linears_fused == 5 * layers
    # graph shape: per layer qkv, o, gate_up, down + lm_head; members 3,2 per layer
    assert _linear_calls(state) == [f"linears: {4 * layers + 1}, fused products: {2 * layers} (members "
                                    + ",".join(["3,2"] * layers) + ")"]
    groups = getattr(model, GROUPS_ATTR)
    assert len(groups) == 2 * layers and all((b is not None) == (bias and i % 2 == 0)
                                             for i, (_k, _w, b) in enumerate(groups))


def test_unfused_compile_keeps_every_linear_and_agrees():
    ids, mask = make_batch(lengths=(12, 7))
    off, s_off = compiled("llama", "sdpa", fuse_linears=False, **CONFIG)
    on, s_on = compiled("llama", "sdpa", **CONFIG)
    _, a = generate_logits(off, ids, mask, steps=3)
    _, b = generate_logits(on, ids, mask, steps=3)
    layers = off.config.num_hidden_layers
    assert s_off.counters.linear_groups_fused == 0 and not getattr(off, GROUPS_ATTR, None)
    assert _linear_calls(s_off) == [f"linears: {7 * layers + 1}, fused products: 0 (members )"]
    assert max_logit_diff(a, b) < EXACT_TOL


def test_parameters_become_views_of_one_buffer_with_names_and_values_kept():
    model = make("llama", "sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_params = len(list(model.parameters()))
    model, _ = compiled("llama", "sdpa", **CONFIG)   # a fresh model of the same seed: same weights
    attn = model.model.layers[0].self_attn
    ptr = attn.q_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.untyped_storage().data_ptr() == ptr == attn.v_proj.weight.untyped_storage().data_ptr()
    assert attn.k_proj.weight.storage_offset() == attn.q_proj.weight.numel()
    assert isinstance(attn.q_proj.weight, torch.nn.Parameter)
    after = model.state_dict()
    assert set(after) == set(before) and len(list(model.parameters())) == n_params
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_in_place_weight_update_reaches_the_compiled_step():
    ids, mask = make_batch(lengths=(12, 7))
    model, _ = compiled("llama", "sdpa", **CONFIG)
    reference = make("llama", "sdpa")
    with torch.no_grad():
        for m in (model, reference):     # the same edit of a k projection (a fused group's middle member)
            m.model.layers[1].self_attn.k_proj.weight.mul_(-1.5)
    _, got = generate_logits(model, ids, mask, steps=3)
    _, want = generate_logits(reference, ids, mask, steps=3)
    assert max_logit_diff(got, want) < EXACT_TOL


def test_fuse_linears_must_be_a_bool():
    with pytest.raises(LycheeConfigError, match="fuse_linears must be a bool"):
        LycheeConfig(fuse_linears="yes")


def test_weight_sharing_copies_reuse_one_fused_buffer():
    from lychee_compile import HeadMap, lychee_compile
    from lychee_compile.eval.scoring import shared_weight_copy
    ids, mask = make_batch(lengths=(12, 7))
    base = make("llama", "sdpa")
    _, dense = generate_logits(make("llama", "sdpa"), ids, mask, steps=3)
    first = lychee_compile(shared_weight_copy(base), HeadMap.for_model(base), LycheeConfig(backend="eager", **CONFIG))
    second = lychee_compile(shared_weight_copy(base), HeadMap.for_model(base), LycheeConfig(backend="eager", **CONFIG))
    for (_k, w1, _b1), (_k2, w2, _b2) in zip(getattr(first, GROUPS_ATTR), getattr(second, GROUPS_ATTR)):
        assert getattr(first, w1).data_ptr() == getattr(second, w2).data_ptr()     # no second copy of the weights
    for model in (first, second):
        _, logits = generate_logits(model, ids, mask, steps=3)
        assert max_logit_diff(logits, dense) < EXACT_TOL
