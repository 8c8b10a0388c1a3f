"""Head-map training pieces: HardKuma closed forms vs Monte Carlo, gradients to (α, β), the Lagrange multiplier, and
the mixed attention (z = 1 is full attention, z = 0 is the spine's sparse attention, row by row)."""
from __future__ import annotations

import math

import pytest
import torch

from lychee_compile.ops.index_state import EMPTY
from lychee_compile.ops.reference import hybrid_decode_reference
from lychee_compile.training import hardkuma
from lychee_compile.training.gates import DuoGates, HardConcreteGates, HardKumaGates
from lychee_compile.training.lagrangian import Lagrangian
from lychee_compile.training.mixed_attention import MixedAttention, mixed_attention, use_mixed_attention
from lychee_compile.training.trainer import map_from_scores

PARAMS = [(1.0, 1.0), (0.5, 3.0), (2.0, 0.4), (0.3, 0.3), (4.0, 5.0)]


@pytest.mark.parametrize("a,b", PARAMS)
def test_hardkuma_monte_carlo_matches_closed_form(a, b):
    n = 400_000
    g = torch.Generator().manual_seed(0)
    log_a = torch.full((1,), math.log(a), dtype=torch.float64)
    log_b = torch.full((1,), math.log(b), dtype=torch.float64)
    u = torch.rand(n, 1, generator=g, dtype=torch.float64)
    z = hardkuma.sample(log_a.expand(n, 1), log_b.expand(n, 1), u=u)
    assert float(z.min()) >= 0.0 and float(z.max()) <= 1.0
    p0, p1 = float(hardkuma.prob_zero(log_a, log_b)), float(hardkuma.prob_one(log_a, log_b))
    tol = 4 * math.sqrt(0.25 / n) + 1e-4
    assert abs(float((z == 0).double().mean()) - p0) < tol
    assert abs(float((z == 1).double().mean()) - p1) < tol
    assert abs(float(z.mean()) - float(hardkuma.expected_z(log_a, log_b))) < tol


def test_uniform_start_closed_forms():
    zero = torch.zeros(1)
    assert float(hardkuma.prob_zero(zero, zero)) == pytest.approx(1 / 12, abs=1e-5)
    assert float(hardkuma.prob_one(zero, zero)) == pytest.approx(1 / 12, abs=1e-5)
    assert float(hardkuma.expected_z(zero, zero)) == pytest.approx(0.5, abs=1e-4)


def test_expected_l0_is_sum_over_heads_and_matches_monte_carlo():
    log_a = torch.log(torch.tensor([1.0, 0.5, 2.0, 0.3], dtype=torch.float64))
    log_b = torch.log(torch.tensor([1.0, 3.0, 0.4, 0.3], dtype=torch.float64))
    el0 = float(hardkuma.expected_l0(log_a, log_b))
    assert el0 == pytest.approx(float((1 - hardkuma.prob_zero(log_a, log_b)).sum()))
    g = torch.Generator().manual_seed(1)
    n = 200_000
    u = torch.rand(n, 4, generator=g, dtype=torch.float64)
    z = hardkuma.sample(log_a.expand(n, 4), log_b.expand(n, 4), u=u)
    assert float((z != 0).double().sum(dim=1).mean()) == pytest.approx(el0, abs=0.02)


def test_gradients_reach_alpha_beta():
    gates = HardKumaGates(6)
    z = gates.sample(8, generator=torch.Generator().manual_seed(0))
    (z * torch.arange(6.0)).sum().backward()
    for name in ("log_a", "log_b"):
        grad = gates.params[name].grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    gates.params["log_a"].grad = None
    gates.params["log_b"].grad = None
    gates.constraint().backward()
    assert gates.params["log_a"].grad.abs().sum() > 0 and gates.params["log_b"].grad.abs().sum() > 0
    # raising E‖z‖0 needs larger α or smaller β: d/dlogα > 0, d/dlogβ < 0
    assert (gates.params["log_a"].grad > 0).all() and (gates.params["log_b"].grad < 0).all()


def test_other_gate_families_have_gradients():
    hc = HardConcreteGates(5)
    (hc.sample(16, torch.Generator().manual_seed(0)).sum() + hc.constraint()).backward()
    assert hc.params["log_alpha"].grad.abs().sum() > 0
    duo = DuoGates(5, l1=0.1)
    (duo.sample(2).sum() + duo.penalty()).backward()
    assert torch.allclose(duo.params["alpha"].grad, torch.full((5,), 2.1))


def test_lagrangian_rises_over_budget_falls_under_and_stays_nonnegative():
    lag = Lagrangian(target=10, lr=0.1, equality=False)     # an at-most budget
    assert lag.step(15.0) == pytest.approx(0.5)         # over budget: λ rises
    assert lag.step(14.0) == pytest.approx(0.9)
    assert lag.step(8.0) == pytest.approx(0.7)          # under budget: λ falls
    assert lag.step(0.0) == 0.0                         # clamped at 0
    assert float(lag.term(torch.tensor(12.0))) == 0.0


def test_equality_lagrangian_goes_negative_and_pulls_expected_l0_up_to_the_target():
    lag = Lagrangian(target=10, lr=0.1)                     # the default: E‖z‖₀ = target
    assert lag.step(15.0) == pytest.approx(0.5) and lag.step(0.0) == pytest.approx(-0.5)
    gates = HardKumaGates(40)
    target = float(gates.constraint().detach()) + 3.0       # under the target: the term must raise E‖z‖₀
    lag = Lagrangian(target=target, lr=0.5, rho=1.0)
    opt = torch.optim.SGD(gates.parameters(), lr=0.5)
    for _ in range(30):
        opt.zero_grad()
        el0 = gates.constraint()
        lag.term(el0).backward()
        opt.step()
        lag.step(float(el0.detach()))
    assert abs(float(gates.constraint().detach()) - target) < 1.0
    quad = Lagrangian(target=2.0, rho=4.0)                  # (ρ/2)·c² alone, λ = 0
    assert float(quad.term(torch.tensor(5.0))) == pytest.approx(18.0)


def test_target_moves_from_the_initial_expected_l0_to_n_target_over_the_warmup():
    import types
    from lychee_compile.training.trainer import Trainer, TrainConfig
    cfg = TrainConfig(retrieval_heads=10, steps=20, target_warmup=10)
    t = types.SimpleNamespace(cfg=cfg, history=[], step=0)
    assert Trainer.target_now(t, 50.0) == pytest.approx(50.0)         # step 0: where the gates start
    t.history, t.step = [{"expected_l0": 50.0}], 5
    assert Trainer.target_now(t, 31.0) == pytest.approx(30.0)         # halfway through the 10 warm-up steps
    t.step = 10
    assert Trainer.target_now(t, 12.0) == pytest.approx(10.0)         # then N_target
    t.history = [{"expected_l0": 4.0}]
    assert Trainer.target_now(t, 4.0) == pytest.approx(10.0)          # a start below the target: no path


def test_lagrangian_term_pushes_expected_l0_down_when_over_budget():
    gates = HardKumaGates(4)
    lag = Lagrangian(target=1, lr=1.0)
    lag.step(float(gates.constraint().detach()))               # E‖z‖0 = 44/12 > 1 -> λ > 0
    opt = torch.optim.SGD(gates.parameters(), lr=0.5)
    before = float(gates.constraint().detach())
    for _ in range(5):
        opt.zero_grad()
        lag.term(gates.constraint()).backward()
        opt.step()
    assert float(gates.constraint().detach()) < before


def _random_case(seed, B=1, Hkv=2, G=3, L=4, T=70, D=8, bs=8, k_sel=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, L, D, generator=g)
    k = torch.randn(B, Hkv, T, D, generator=g)
    v = torch.randn(B, Hkv, T, D, generator=g)
    nb = -(-T // bs)
    inherited = torch.rand(B, Hkv, L, nb, generator=g) < 0.3
    return q, k, v, inherited


def _idx_of(member, k_sel):
    """bool [B, H, nb] membership -> int32 [B, H, k_sel] ascending, EMPTY padded (at most k_sel members used)."""
    B, H, nb = member.shape
    out = torch.full((B, H, k_sel), EMPTY, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            ids = member[b, h].nonzero().flatten()[:k_sel]
            out[b, h, :len(ids)] = ids.to(torch.int32)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_attention_equals_full_at_z1_and_sparse_at_z0_per_decode_row(seed):
    B, Hkv, G, L, T, D, bs, k_sel = 1, 2, 3, 4, 70, 8, 8, 3
    q, k, v, _ = _random_case(seed, B, Hkv, G, L, T, D, bs, k_sel)
    nb = -(-T // bs)
    g = torch.Generator().manual_seed(100 + seed)
    # an inherited selection of at most k_sel blocks per (head, row)
    inherited = torch.zeros(B, Hkv, L, nb, dtype=torch.bool)
    for h in range(Hkv):
        for i in range(L):
            inherited[0, h, i, torch.randperm(nb - 2, generator=g)[:k_sel]] = True
    scale = D ** -0.5
    for zval, retrieval in ((1.0, True), (0.0, False)):
        st = MixedAttention(torch.full((3, Hkv), zval), num_select=k_sel, block_size=bs, sink_tokens=4,
                            local_tokens=10)
        st.inherited = inherited.clone()
        out = mixed_attention(q, k, v, st, layer=1, scale=scale)
        for i in range(L):
            t_i = T - L + i + 1
            valid = torch.zeros(B, T, dtype=torch.bool)
            valid[:, :t_i] = True
            idx_in = _idx_of(inherited[:, :, i], k_sel)
            ref, idx_out = hybrid_decode_reference(q[:, :, i:i + 1], k, v, valid,
                                                   torch.full((Hkv,), retrieval), idx_in, scale, bs, 4, 10)
            torch.testing.assert_close(out[:, :, i:i + 1], ref, rtol=1e-5, atol=1e-5)
            if retrieval:   # the next layer inherits the full map's selection (same as the spine's retrieval heads)
                from lychee_compile.ops.reference import blocks_of_index
                assert torch.equal(st.inherited[:, :, i], blocks_of_index(idx_out, nb))


def test_mixed_attention_counts_blocks_from_each_rows_first_position():
    # left-padded rows (row_start): each decode row equals the spine's op with that row's valid range, whose blocks
    # are text-relative (ops/row_alignment.py), for the full map's selection and the sparse map alike
    from lychee_compile.ops.reference import blocks_of_index
    B, Hkv, G, L, T, D, bs, k_sel = 2, 2, 2, 3, 60, 8, 4, 3
    q, k, v, _ = _random_case(7, B, Hkv, G, L, T, D, bs, k_sel)
    row_start = torch.tensor([0, 13])
    scale = D ** -0.5
    st = MixedAttention(torch.full((3, Hkv), 1.0), num_select=k_sel, block_size=bs, sink_tokens=4, local_tokens=6,
                        row_start=row_start)
    mixed_attention(q, k, v, st, layer=0, scale=scale)         # layer 0: full; its selection is inherited below
    inherited = st.inherited.clone()
    st.gates = torch.zeros(3, Hkv)
    out = mixed_attention(q, k, v, st, layer=1, scale=scale)     # layer 1: sparse map only (z = 0)
    for i in range(L):
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b in range(B):
            valid[b, int(row_start[b]):T - L + i + 1] = True
        ref, _ = hybrid_decode_reference(q[:, :, i:i + 1], k, v, valid, torch.zeros(Hkv, dtype=torch.bool),
                                         _idx_of(inherited[:, :, i], k_sel), scale, bs, 4, 6)
        torch.testing.assert_close(out[:, :, i:i + 1], ref, rtol=1e-5, atol=1e-5)
        _, idx_out = hybrid_decode_reference(q[:, :, i:i + 1], k, v, valid, torch.ones(Hkv, dtype=torch.bool),
                                             _idx_of(inherited[:, :, i], k_sel), scale, bs, 4, 6)
        assert torch.equal(st.inherited[:, :, i], blocks_of_index(idx_out, -(-T // bs)))


def test_mixed_attention_interpolates_linearly_in_z():
    q, k, v, inherited = _random_case(5)
    outs = {}
    for zval in (0.0, 0.25, 1.0):
        st = MixedAttention(torch.full((3, 2), zval), num_select=3, block_size=8, sink_tokens=4, local_tokens=10)
        st.inherited = inherited.clone()
        outs[zval] = mixed_attention(q, k, v, st, layer=1, scale=0.3)
    torch.testing.assert_close(outs[0.25], 0.25 * outs[1.0] + 0.75 * outs[0.0], rtol=1e-5, atol=1e-5)


def test_mixed_attention_in_a_model_at_z1_equals_dense_and_gradients_reach_z():
    from transformers import DynamicCache
    from tests.models import make
    model = make("llama", "sdpa")
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids[:, :34], past_key_values=cache, use_cache=True)
        kv = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
        dense = model(input_ids=ids[:, 34:], past_key_values=DynamicCache(ddp_cache_data=kv)).logits
    n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    st = MixedAttention(torch.ones(n_layers, n_kv), num_select=1, block_size=4, sink_tokens=4, local_tokens=4)
    with use_mixed_attention(model, st):
        mixed = model(input_ids=ids[:, 34:], past_key_values=DynamicCache(ddp_cache_data=kv)).logits
    assert model.config._attn_implementation == "sdpa"          # restored
    torch.testing.assert_close(mixed, dense, rtol=1e-4, atol=1e-4)

    z = torch.full((n_layers, n_kv), 0.5, requires_grad=True)
    st = MixedAttention(z, num_select=1, block_size=4, sink_tokens=4, local_tokens=4)
    with use_mixed_attention(model, st):
        out = model(input_ids=ids[:, 34:], past_key_values=DynamicCache(ddp_cache_data=kv)).logits
    ((out - dense) ** 2).sum().backward()
    assert z.grad[0].abs().sum() == 0                    # first layer: all full attention, z unused
    assert z.grad[1:].abs().sum() > 0


def test_map_from_scores_threshold_and_topk():
    s = torch.tensor([[0.1, 0.2], [0.9, 0.4], [0.6, 0.7]])
    t = map_from_scores(s, "threshold")
    assert t.tolist() == [[True, True], [True, False], [True, True]]
    k = map_from_scores(s, "topk", n=2)
    assert k.tolist() == [[True, True], [True, False], [False, True]]
