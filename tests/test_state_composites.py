"""The heat and Quest decode steps as composites (ops/heat.py heat_decode_step, ops/quest_decode.py
quest_decode_step): equal to the opaque eager ops they replace in rewritten graphs (hybrid_decode_heat /
hybrid_decode_quest), and traceable by Dynamo + AOTAutograd with a symbolic cache length: one graph for every length."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

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
    # the previous step's descriptors: the newest key of each row not folded in yet
    older = valid.clone()
    older[:, -1] = False
    desc = block_descriptors(k, older, BS, NBH)
    args = (q, k, v, valid, RETRIEVAL, idx, desc, SCALE, BS, SINK, LOCAL, 0, 0.0, mode, quest_blocks)
    assert_same(quest_decode_step(*args), QUEST_OP(*args))


def test_quest_composite_refuses_quest_off():
    q, k, v, valid, idx = step_inputs(0)
    with pytest.raises(ValueError, match="quest_mode"):
        quest_decode_step(q, k, v, valid, RETRIEVAL, idx, block_descriptors(k, valid, BS, NBH), SCALE, BS, SINK,
                          LOCAL, 0, 0.0, 0, 1)


def _heat_step(q, k, v, valid, retrieval, idx, heat):
    return heat_decode_step(q, k, v, valid, retrieval, idx, heat, SCALE, BS, SINK, LOCAL, 0, 0.0, 0.8, 2)


def _quest_step(mode):
    def step(q, k, v, valid, retrieval, idx, desc):
        return quest_decode_step(q, k, v, valid, retrieval, idx, desc, SCALE, BS, SINK, LOCAL, 0, 0.0, mode, 1)
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
        state = heat_state(T) if kind == "heat" else block_descriptors(k, valid, BS, NBH)
        torch._dynamo.mark_static(state)
        args = (q, k, v, valid, RETRIEVAL, idx, state)
        assert_same(compiled(*args), step(*args))
        backend_calls.append(counter.frame_count)
    # The first length may call the backend twice: the static state's B / Hkv specialize the dynamic ones, and
    # Dynamo restarts that one compile. Later lengths must reuse the graph.
    assert backend_calls[0] >= 1 and backend_calls[1:] == [backend_calls[0]] * 2, backend_calls
