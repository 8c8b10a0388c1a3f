"""The heat and Quest decode steps as composites (ops/heat.py heat_decode_step, ops/quest_decode.py
quest_decode_step): equal to the opaque eager ops they replace in rewritten graphs (hybrid_decode_heat /
hybrid_decode_quest; Quest's composite updates its descriptors in place, equal to the op's copy on every block holding
a valid key), and traceable by Dynamo + AOTAutograd with a symbolic cache length: one graph for every length."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx

from lychee_compile.ops.heat import heat_decode_step
from lychee_compile.ops.quest import block_descriptors
from lychee_compile.ops.quest_decode import quest_decode_step
from tests.test_ops import inputs

HEAT_OP = torch.ops.lychee.hybrid_decode_heat.default
QUEST_OP = torch.ops.lychee.hybrid_decode_quest.default
BS, SINK, LOCAL, SCALE = 4, 4, 4, 0.25
NBH = 16                                   # state blocks: >= ceil(T / BS) for every T below
RETRIEVAL = torch.tensor([True, False, False, False])


def step_inputs(seed: int, T: int = 45):
    """Batch 2 with left padding, 4 KV heads (1 retrieval, 3 sparse), K = 3 with inherited rows of every shape."""
    q, k, v, valid, idx = inputs(B=2, hkv=4, G=2, T=T, K=3, seed=seed, pads=(0, 6), lengths=(T - 2, T))
    idx[:, 1, :2] = torch.tensor([3, 6], dtype=torch.int32)      # a sparse head with 2 inherited blocks
    idx[:, 2] = torch.tensor([2, 5, 7], dtype=torch.int32)       # a full row
    return q, k, v, valid, idx                                   # head 3 inherits nothing


def heat_state(seed: int) -> torch.Tensor:
    """fp32 [2, 4, NBH]: ~1/3 zeros (not eligible), a run of tied values, and hot blocks inside the sparse set."""
    g = torch.Generator().manual_seed(100 + seed)
    heat = torch.rand(2, 4, NBH, generator=g)
    heat[torch.rand(2, 4, NBH, generator=g) < 0.35] = 0.0
    heat[:, :, 8:11] = 0.5                                      # ties: the lower block wins
    heat[:, :, 3] = 2.0                                         # hottest, but inherited by head 1 already
    return heat


def assert_same(got, want) -> None:
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def valid_blocks(valid: torch.Tensor, nb: int) -> torch.Tensor:
    """bool [B, nb]: blocks holding a valid key (where Quest descriptors are specified, ops/quest.py)."""
    return torch.nn.functional.pad(valid, (0, nb * BS - valid.shape[1])).unflatten(1, (nb, BS)).any(-1)


def assert_quest_same(got, desc_after, want, valid) -> None:
    """got = the composite's (out, idx_out) with desc_after [B, Hkv, NB, 2, D] its slot after the in-place update;
    want = the op's (out, idx_out, desc_out): equal outputs, equal descriptors on every block holding a valid key."""
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=0) and torch.equal(got[1], want[1])
    on = valid_blocks(valid, desc_after.shape[2])[:, None, :, None, None].expand_as(desc_after)
    assert torch.equal(desc_after[on], want[2][on])


def previous_step_state(k, valid, slot: int = 1) -> torch.Tensor:
    """[B, 2, Hkv, NBH, 2, D]: slot `slot` = the previous step's descriptors (the newest key of row 1, at T - 1, not
    folded in yet); the other slot = arbitrary values that the step must leave alone."""
    older = valid.clone()
    older[:, -1] = False
    desc = block_descriptors(k, older, BS, NBH)
    other = torch.full_like(desc, 7.0)
    return torch.stack([desc, other] if slot == 0 else [other, desc], dim=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("heat_blocks", [0, 1, 3])
def test_heat_composite_equals_the_heat_op(seed, heat_blocks):
    q, k, v, valid, idx = step_inputs(seed)
    heat = heat_state(seed)
    args = (q, k, v, valid, RETRIEVAL, idx, heat, SCALE, BS, SINK, LOCAL, 0, 0.0, 0.8, heat_blocks)
    got, want = heat_decode_step(*args), HEAT_OP(*args)
    assert_same(got, want)
    assert torch.equal(got[2][..., 12:], heat[..., 12:])           # blocks past the cache keep their heat
    if heat_blocks:   # the picks changed what a sparse head attended, so the test can tell
        no_picks = HEAT_OP(*args[:-1], 0)
        assert not torch.equal(no_picks[0], want[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode,quest_blocks", [(1, 0), (2, 1), (2, 3)])
def test_quest_composite_equals_the_quest_op(seed, mode, quest_blocks):
    q, k, v, valid, idx = step_inputs(seed)
    before = previous_step_state(k, valid, slot=1)
    desc = before[:, 1].clone()
    tail = (SCALE, BS, SINK, LOCAL, 0, 0.0, mode, quest_blocks)
    want = QUEST_OP(q, k, v, valid, RETRIEVAL, idx, desc, *tail)
    assert torch.equal(desc, before[:, 1]), "the opaque op is functional: it must not write its input"
    state = before.clone()
    got = quest_decode_step(q, k, v, valid, RETRIEVAL, idx, state, 1, *tail)
    assert_quest_same(got, state[:, 1], want, valid)
    # in place, one block per row: the newest key's is fresh, every other block and the other slot are untouched
    assert torch.equal(state[:, 0], before[:, 0])
    # blocks count from each row's first valid position: row 1 (6 padding) has its new key 44 in block (44 - 6) // 4
    newest = [(int(row.nonzero().max()) - int(row.nonzero().min())) // BS for row in valid]
    assert newest == [10, 9]
    fresh = block_descriptors(k, valid, BS, NBH)
    for b, blk in enumerate(newest):
        assert torch.equal(state[b, 1, :, blk], fresh[b, :, blk])
        others = torch.arange(NBH) != blk
        assert torch.equal(state[b, 1, :, others], before[b, 1, :, others])
    assert not torch.equal(state[1, 1, :, newest[1]], before[1, 1, :, newest[1]]), \
        "the new key must change its block, or this test shows nothing"


def test_quest_composite_refuses_quest_off_and_a_bad_state():
    q, k, v, valid, idx = step_inputs(0)
    state = previous_step_state(k, valid)
    with pytest.raises(ValueError, match="quest_mode"):
        quest_decode_step(q, k, v, valid, RETRIEVAL, idx, state, 1, SCALE, BS, SINK, LOCAL, 0, 0.0, 0, 1)
    for bad, slot in ((state[:, 1], 0), (state, 2), (state[:, :, :, :11], 1)):
        with pytest.raises(ValueError, match=r"do not fit keys .* NB >= 12"):
            quest_decode_step(q, k, v, valid, RETRIEVAL, idx, bad, slot, SCALE, BS, SINK, LOCAL, 0, 0.0, 1, 0)


def _heat_step(q, k, v, valid, retrieval, idx, heat):
    return heat_decode_step(q, k, v, valid, retrieval, idx, heat, SCALE, BS, SINK, LOCAL, 0, 0.0, 0.8, 2)


def _quest_step(mode):
    def step(q, k, v, valid, retrieval, idx, state):
        return quest_decode_step(q, k, v, valid, retrieval, idx, state, 1, SCALE, BS, SINK, LOCAL, 0, 0.0, mode, 1)
    return step


@pytest.mark.parametrize("kind", ["heat", "quest_all", "quest_sparse"])
def test_composite_traces_once_for_every_cache_length(kind):
    # As the DynamicCache route compiles them: dynamic=True, the state buffer static, scalars constant.
    step = {"heat": _heat_step, "quest_all": _quest_step(1), "quest_sparse": _quest_step(2)}[kind]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    backend_calls = []
    for T in (45, 52, 37):        # a partial last block, a full one, a shorter cache
        q, k, v, valid, idx = step_inputs(T, T=T)
        state = heat_state(T) if kind == "heat" else previous_step_state(k, valid)
        eager_state = state.clone()               # Quest writes its state: each run gets its own
        torch._dynamo.mark_static(state)
        args = (q, k, v, valid, RETRIEVAL, idx)
        got, want = compiled(*args, state), step(*args, eager_state)
        if kind == "heat":
            assert_same(got, want)
        else:   # the compiled step's write reached the caller's buffer (row 1's new key changes its block)
            assert not torch.equal(state, previous_step_state(k, valid))
            assert_quest_same(got, state[:, 1], (*want, eager_state[:, 1]), valid)
            assert torch.equal(state, eager_state)
        backend_calls.append(counter.frame_count)
    # The first length may call the backend twice: the static state's B / Hkv specialize the dynamic ones, and
    # Dynamo restarts that one compile. Later lengths must reuse the graph.
    assert backend_calls[0] >= 1 and backend_calls[1:] == [backend_calls[0]] * 2, backend_calls


_REDUCTIONS = ("argmax", "argmin", "amax", "amin", "sum", "any", "all", "cumsum", "cumprod", "max.", "min.")


def _reduces_over(node, length: int) -> bool:
    """Whether an aten node reduces (or scans) its first input over a dimension of size `length`."""
    if not any(r in str(node.target) for r in _REDUCTIONS) or not node.args:
        return False
    shape = node.args[0].meta["val"].shape
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    return any(shape[d % len(shape)] == length for d in dims)


@pytest.mark.parametrize("kind", ["heat", "quest_all", "quest_sparse"])
@pytest.mark.parametrize("given_ranges", [False, True])
def test_composite_graph_reduces_the_mask_only_in_the_opaque_op(kind, given_ranges):
    # Inductor (torch 2.11) miscompiled the mask reductions these composites fused at batch 1 and 8K keys on a GPU
    # (a split-scan kernel with a reduction fused in; a split reduction's second stage in a pointwise kernel). Their
    # row ranges come from lychee::valid_ranges (opaque to Inductor; the rewrite passes one per graph as `ranges`),
    # so nothing computed from `valid` is reduced or scanned over the cache positions in their graphs.
    step = {"heat": heat_decode_step, "quest_all": quest_decode_step, "quest_sparse": quest_decode_step}[kind]
    q, k, v, valid, idx = step_inputs(0)
    T = valid.shape[1]
    if kind == "heat":
        tail = (heat_state(0), SCALE, BS, SINK, LOCAL, 0, 0.0, 0.8, 2)
    else:
        tail = (previous_step_state(k, valid), 1, SCALE, BS, SINK, LOCAL, 0, 0.0, 1 if kind == "quest_all" else 2, 1)

    def traced(q, k, v, valid, retrieval, idx, state, ranges):
        return step(q, k, v, valid, retrieval, idx, state, *tail[1:], ranges=ranges)
    ranges = torch.ops.lychee.valid_ranges(valid) if given_ranges else None
    gm = make_fx(traced)(q, k, v, valid, RETRIEVAL, idx, tail[0], ranges)
    mask = [n for n in gm.graph.nodes if n.op == "placeholder"][3]              # valid, bool [B, T]
    derived, todo = set(), [mask]
    while todo:                                                                 # everything computed from valid
        node = todo.pop()
        for user in node.users:
            if user not in derived:
                derived.add(user)
                todo.append(user)
    calls = [n for n in derived if n.op == "call_function"]
    assert sum("valid_ranges" in str(n.target) for n in calls) == (0 if given_ranges else 1)
    assert not [n.target for n in calls if "cum" in str(n.target)]
    reduced = [str(n.target) for n in calls if _reduces_over(n, T)]
    assert not reduced, reduced


def test_row_range_of_full_partial_and_empty_rows():
    from lychee_compile.ops.row_alignment import row_range, row_start
    valid = torch.zeros(4, 9, dtype=torch.bool)
    valid[0] = True
    valid[1, 3:7] = True
    valid[2, 8] = True                                       # row 3: no valid position (valid_ranges: (0, T))
    lo, n = row_range(valid)
    assert lo.tolist() == [0, 3, 8, 0] and n.tolist() == [9, 4, 1, 0]
    given = row_range(valid, torch.ops.lychee.valid_ranges(valid))
    assert torch.equal(given[0], lo) and torch.equal(given[1], n) and torch.equal(row_start(valid), lo)
