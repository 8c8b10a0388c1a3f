"""Cross-step state buffers of a compiled model, and the two marker ops that thread them through captured graphs.

The buffers are non-persistent buffers registered on the model by lychee_compile/state_buffers.py; they keep one
address for the model's life, as CUDA graphs need (marked static for Dynamo):

    _lychee_kinds: bool [Lg, Hkv]
        Lg = number of global layers (slot i = the i-th global layer in layer order), Hkv = KV heads.
        True = retrieval head, False = sparse (or streaming) head. Read-only inside graphs: each rewritten op reads
        its slot's row as runtime data, so `set_head_map()` swaps head maps by writing this buffer in place -- no
        recompile, and the same CUDA graph replays with the new kinds.
    _lychee_heat: fp32 [B, Lg, Hkv, NBH]   (only when heat is enabled; layout and update rule in ops/heat.py)
    _lychee_quest: [B, Lg, Hkv, NB, 2, D]  (only with Quest bounds; Quest block descriptors, layout and upkeep in
                                           ops/quest.py; created by the first eager forward with a cache)
    _lychee_all_reduce: uint8 [ONE_SHOT_BYTES]  (only under tensor parallelism on CUDA with symm_mem_all_reduce:
                                           the symmetric-memory scratch of lychee::one_shot_all_reduce,
                                           ops/one_shot_all_reduce.py; rendezvoused at lychee_compile)

    bind_state(state, name)   no-op marker the wrapped forward calls on each buffer; it makes Dynamo lift the buffer
                              into the graph as an input. The `bind_state` pass records the input under `name`
                              (one of STATE_NAMES) and erases the marker.
    write_state(state, value) state <- value in place; the last node of a graph that updates the heat state (Quest
                              descriptors are written in place by their op instead: ops/quest_decode.py).
"""
from __future__ import annotations

import torch

STATE_NAMES = ("kinds", "heat", "quest", "all_reduce")


@torch.library.custom_op("lychee::bind_state", mutates_args=("state",))
def bind_state(state: torch.Tensor, name: str) -> None:
    """No-op (see the module docstring). It declares a mutation only so that nothing drops it before the pass runs."""


@bind_state.register_fake
def _(state, name):
    return None


@torch.library.custom_op("lychee::write_state", mutates_args=("state",))
def write_state(state: torch.Tensor, value: torch.Tensor) -> None:
    """state <- value, in place (the end of the decode graph's functional heat chain)."""
    state.copy_(value)


@write_state.register_fake
def _(state, value):
    return None
