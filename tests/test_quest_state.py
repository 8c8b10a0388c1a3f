"""Quest block descriptors kept incrementally: the `_lychee_quest` state equals a fresh min / max over the
valid keys after prefill, decode steps and rectification, across generate() calls and batch sizes; the stateful op
equals the stateless definition step by step; the compiled model still equals the independent Quest semantics."""
from __future__ import annotations

import pytest
import torch

from lychee_compile.ops.quest import block_descriptors
from lychee_compile.rectify import Rectifier
from lychee_compile.state_buffers import QUEST_ATTR
from tests import semantics_ref
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_ops import inputs
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=4, block_size=2, sink_tokens=2, local_tokens=2)
MODES = {"all": dict(quest="all", quest_blocks=0), "sparse": dict(quest="sparse", quest_blocks=1)}
QUEST_OP = torch.ops.lychee.hybrid_decode_quest.default
STATELESS_OP = torch.ops.lychee.hybrid_decode.default


def plain_descriptors(keys: torch.Tensor, valid: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """keys [B, H, T, D], valid bool [B, T] -> [B, H, num_blocks, 2, D] fp32, one key at a time (the test's own
    recomputation: min / max over each block's valid keys, +inf / -inf where there is none). A row's blocks count
    from its first valid position."""
    B, H, T, D = keys.shape
    out = torch.empty(B, H, num_blocks, 2, D)
    out[..., 0, :], out[..., 1, :] = float("inf"), float("-inf")
    for b in range(B):
        first = next((t for t in range(T) if valid[b, t]), 0)
        for t in range(T):
            if valid[b, t]:
                blk = out[b, :, (t - first) // block_size]
                blk[:, 0] = torch.minimum(blk[:, 0], keys[b, :, t].float())
                blk[:, 1] = torch.maximum(blk[:, 1], keys[b, :, t].float())
    return out


def cache_valid(cache, prompt_mask: torch.Tensor, written: int) -> torch.Tensor:
    """bool [B, T]: the first `written` positions, minus the prompt's left padding."""
    T = cache.layers[0].keys.shape[2]
    valid = torch.zeros(prompt_mask.shape[0], T, dtype=torch.bool)
    valid[:, :written] = True
    valid[:, :prompt_mask.shape[1]] &= prompt_mask.bool()
    return valid


def holding_a_key(valid: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """bool [B, 1, num_blocks, 1, 1]: blocks with a valid key, the only ones the state specifies (ops/quest.py);
    a row's blocks count from its first valid position, so those are its first ceil(valid count / block_size)."""
    count = valid.sum(-1, keepdim=True)                                                   # [B, 1]
    held = torch.arange(num_blocks) * block_size < count                                  # [B, num_blocks]
    return held[:, None, :, None, None]


def assert_fresh_where_specified(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor, block_size: int,
                                 what: str) -> None:
    """got, want [B, H, NB, 2, D]: equal on every block holding a valid key."""
    on = holding_a_key(valid, block_size, got.shape[2]).expand_as(got)
    assert on.any() and torch.equal(got.float()[on], want[on]), f"{what}: descriptors differ from a fresh min / max"


def assert_state_is_fresh(model, state, cache, valid, block_size: int = CFG["block_size"]) -> None:
    buf = getattr(model, QUEST_ATTR)
    for slot, layer in enumerate(state.global_layers):
        want = plain_descriptors(cache.layers[layer].keys, valid, block_size, buf.shape[3])
        assert_fresh_where_specified(buf[:, slot], want, valid, block_size, f"layer {layer}")


def run(model, ids, mask, steps, **kwargs):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences, out.past_key_values


@pytest.mark.parametrize("mode", ["all", "sparse"])
def test_state_follows_prefill_decode_and_new_sequences(mode):
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **CFG, **MODES[mode])
    steps = 7
    for lengths in [(26, 17), (26, 17), (9, 5), (11,)]:   # again (no recompile), shorter, a new batch size
        ids, mask = make_batch(lengths=lengths)
        before = state.counters.decode_calls
        _, cache = run(model, ids, mask, steps)
        assert state.counters.decode_calls - before == steps - 1, "the decode steps did not run the rewritten graph"
        assert getattr(model, QUEST_ATTR).shape[0] == len(lengths)
        assert_state_is_fresh(model, state, cache, cache_valid(cache, mask, ids.shape[1] + steps - 1))
        if lengths == (26, 17):
            assert state.counters.decode_graphs == 1, "a generate() of the same shapes recompiled the decode step"
    snap = state.snapshots[0]
    assert snap.count("quest_decode_step") == 3 and "desc=state.quest slot=2" in snap
    assert "write_state" not in snap, "Quest descriptors are written in place by their ops, not stacked back"


@pytest.mark.parametrize("mode", ["all", "sparse"])
def test_compiled_matches_semantics_on_both_caches(mode):
    ids, mask = make_batch(lengths=(26, 17))
    retrieval = mixed_map(make("llama")) if mode == "sparse" else torch.zeros(3, 2, dtype=torch.bool)
    first = mode == "sparse"
    reference = make("llama")
    sem = semantics_ref.QuestSemantics(retrieval, [0, 1, 2], first_layer_retrieval=first, **CFG, **MODES[mode])
    semantics_ref.register(sem)
    reference.config._attn_implementation = semantics_ref.NAME
    ref_seq, ref_logits = generate_logits(reference, ids, mask, 6)
    for cache in ("static", "dynamic"):
        model, state = compiled("llama", "sdpa", retrieval=retrieval, first_layer_retrieval=first, **CFG,
                                **MODES[mode])
        seq, logits = generate_logits(model, ids, mask, 6, cache=cache)
        assert state.counters.decode_calls == 5 and "quest_decode_step" in state.snapshots[0], cache
        assert max_logit_diff(logits, ref_logits) < EXACT_TOL and torch.equal(seq, ref_seq), cache


def test_inductor_runs_the_quest_op_and_writes_the_state():
    # Inductor keeps the op's reference as an extern kernel (no Quest lowering); the write-back must survive
    # functionalization and reinplacing: the state after the steps is the fresh min / max, logits as the eager FX run
    ids, mask = make_batch(lengths=(26, 17))
    eager, _ = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **CFG, **MODES["sparse"])
    _, want = generate_logits(eager, ids, mask, 5)
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), backend="inductor", **CFG,
                            **MODES["sparse"])
    _, cache = run(model, ids, mask, 5)
    assert state.counters.decode_calls == 4 and "quest_decode_step" in state.snapshots[0]
    assert_state_is_fresh(model, state, cache, cache_valid(cache, mask, ids.shape[1] + 4))
    _, logits = generate_logits(model, ids, mask, 5)
    assert max_logit_diff(logits, want) < EXACT_TOL


def test_state_is_rebuilt_after_each_rectification(monkeypatch):
    R = 4
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), rectify_every=R, **CFG,
                            **MODES["sparse"])
    ids, mask = make_batch(lengths=(26, 17))
    seen = []
    inner = Rectifier._reencode

    def reencode(self, cache, step_mask):
        before = getattr(model, QUEST_ATTR).clone()
        inner(self, cache, step_mask)
        written = int(cache.layers[0].cumulative_length)
        assert_state_is_fresh(model, state, cache, cache_valid(cache, mask, written))
        seen.append(not torch.equal(before, getattr(model, QUEST_ATTR)))

    monkeypatch.setattr(Rectifier, "_reencode", reencode)
    _, cache = run(model, ids, mask, 2 * R + 1)            # 2R decode steps: the last one ends with a rectification
    assert len(seen) == 2 and all(seen), "rectification must change some descriptors, or this test shows nothing"
    assert_state_is_fresh(model, state, cache, cache_valid(cache, mask, ids.shape[1] + 2 * R))


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stateful_op_equals_stateless_definition_step_by_step(mode, dtype):
    bs, T, prompt = 4, 37, 21
    q, k, v, valid, idx = inputs(T=T, dtype=dtype, pads=(0, 5), lengths=(prompt, prompt), K=2)
    retrieval = torch.tensor([True, False])
    # Start from a stale state past the prompt (what a longer, earlier sequence on a reused buffer could leave; 12
    # blocks > ceil(37 / 4)): bounds far above any real block's, so any pick that read a block without a valid key
    # would take it. Only the prompt's blocks (and row 1's left padding, +inf / -inf) are current.
    desc = block_descriptors(k, valid, bs, 12)
    desc[:, :, 6:, 0], desc[:, :, 6:, 1] = -100.0, 100.0
    assert desc.dtype == dtype
    g = torch.Generator().manual_seed(1)
    for pos in range(prompt, T):
        valid[:, pos] = True                                # the step's key was written at `pos`
        q = torch.randn(q.shape, generator=g).to(dtype)
        args = (q, k, v, valid, retrieval, idx)
        tail = (0.25, bs, 4, 4, 0, 0.0, mode, 1)
        out, idx_out, desc = QUEST_OP(*args, desc, *tail)
        want_out, want_idx = STATELESS_OP(*args, *tail)
        assert torch.equal(out, want_out) and torch.equal(idx_out, want_idx), f"step at position {pos}"
        assert_fresh_where_specified(desc, plain_descriptors(k, valid, bs, 12), valid, bs, f"after position {pos}")
        # the stale blocks past the newest key's were not rewritten (no per-step reset): the picks read around them
        assert (desc[:, :, pos // bs + 1:, 1] == 100.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    q, k, v, valid, idx = inputs(dtype=dtype, K=2)
    desc = block_descriptors(k, valid, 4, 10)
    torch.library.opcheck(QUEST_OP, (q, k, v, valid, torch.tensor([True, False]), idx, desc, 0.25, 4, 4, 4, 0,
                                     0.0, 2, 1))


def test_bad_op_input_is_refused_clearly():
    q, k, v, valid, idx = inputs(K=2)
    retrieval = torch.tensor([True, False])
    desc = block_descriptors(k, valid, 4, 10)
    with pytest.raises(ValueError, match=r"do not fit keys .* NB >= 10"):
        QUEST_OP(q, k, v, valid, retrieval, idx, desc[:, :, :9], 0.25, 4, 4, 4, 0, 0.0, 1, 0)
    with pytest.raises(ValueError, match="need quest_mode"):
        QUEST_OP(q, k, v, valid, retrieval, idx, desc, 0.25, 4, 4, 4, 0, 0.0, 0, 0)


def test_decode_on_a_cache_this_model_did_not_prefill_rebuilds_first():
    # the eval harness prefills on the base model and scores copies of that cache through the compiled call: the
    # descriptors must describe each new cache (another prompt here), not what the previous sequence left, nor be
    # missing the first time
    from lychee_compile.eval.scoring import dense_prefill, score_steps
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (1, 20), generator=g) for _ in range(2)]
    dense = make("llama")
    targets = [5, 6, 7, 8, 9]
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **CFG, **MODES["all"])
    call = model.get_compiled_call(model.generation_config.compile_config)
    for ids in prompts:
        pre = dense_prefill(dense, ids, 32)
        got = score_steps(call, pre, targets, copy_cache=False)
        assert_state_is_fresh(model, state, pre.cache, cache_valid(pre.cache, torch.ones(1, 20), 24))
    fresh, _ = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **CFG, **MODES["all"])
    want = score_steps(fresh.get_compiled_call(fresh.generation_config.compile_config),
                       dense_prefill(dense, prompts[1], 32), targets)
    assert got.logprobs == want.logprobs and state.counters.decode_calls == 8


def test_decode_that_bypasses_the_wrappers_is_refused_clearly():
    # compiled by hand around a cache filled by another model: nothing ever described that cache
    from lychee_compile.eval.scoring import dense_prefill
    pre = dense_prefill(make("llama"), torch.randint(3, 120, (1, 20), generator=torch.Generator().manual_seed(0)), 32)
    model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama")), **CFG, **MODES["all"])
    step = torch.compile(model, backend=state.backend, fullgraph=True)
    with pytest.raises(Exception, match="Quest descriptors are built from the cache"), torch.no_grad():
        step(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[20]]), cache_position=torch.tensor([20]),
             past_key_values=pre.cache, attention_mask=torch.ones(1, 21, dtype=torch.long), use_cache=True)
