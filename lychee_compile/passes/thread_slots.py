"""Pass `thread_slots`: close the chains of the per-layer cross-step states of a decode graph that are threaded
functionally (SLOT_STATES: heat, when enabled).

Each rewritten op read state[:, i] (its global-layer slot, `layer_slot`) and returned an updated slice; here, per
state, the slices are stacked back in slot order and written into the state buffer in place with
lychee::write_state -- the only mutation, at the end of the graph, so every earlier use reads the previous step's
values. Heat is threaded that way because its update rewrites every block anyway. The Quest descriptors are not:
a decode step changes one block per (row, layer, KV head), so quest_decode_step writes that block into the buffer
in place (ops/quest_decode.py) and nothing is left to close here. Layouts: lychee_compile/ops/heat.py, ops/quest.py.
"""
from __future__ import annotations

import torch

from .context import PassContext

SLOT_STATES = ("heat",)     # functionally threaded states, one slot per global layer (dim 1)


def layer_slot(buffer: torch.Tensor, slot: int) -> torch.Tensor:
    """buffer [B, Lg, ...] -> the slot's [B, ...] (a view: the op reads the previous step's values)."""
    return buffer[:, slot]


def stack_slots(*slices: torch.Tensor) -> torch.Tensor:
    return torch.stack(slices, dim=1)


def thread_slots(ctx: PassContext) -> None:
    sites = sorted(ctx.sites, key=lambda s: s.layer_idx)
    graph = ctx.gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    for name in SLOT_STATES:
        outs = [s.slot_out[name] for s in sites if name in s.slot_out]
        if not outs:
            continue
        with graph.inserting_before(output):
            stacked = graph.call_function(stack_slots, tuple(outs))
            graph.call_function(torch.ops.lychee.write_state.default, (ctx.bound_buffers[name], stacked))
