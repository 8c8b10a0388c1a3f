"""Pass `thread_heat`: close the heat chain of a decode graph (heat enabled only).

Each rewritten op read heat[:, i] (its global-layer slot) and returned an updated slice; here the slices are stacked
back in slot order and written into the state buffer in place with lychee::write_state -- the only mutation, at the
end of the graph, so every earlier use reads the previous step's heat. Layout: lychee_compile/ops/heat.py.
"""
from __future__ import annotations

import torch

from .context import PassContext


def heat_slot(heat: torch.Tensor, slot: int) -> torch.Tensor:
    """heat fp32 [B, Lg, Hkv, NBH] -> the slot's [B, Hkv, NBH]."""
    return heat[:, slot]


def stack_heat(*slices: torch.Tensor) -> torch.Tensor:
    return torch.stack(slices, dim=1)


def thread_heat(ctx: PassContext) -> None:
    outs = [s.heat_out for s in sorted(ctx.sites, key=lambda s: s.layer_idx) if s.heat_out is not None]
    if not outs:
        return
    graph = ctx.gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        stacked = graph.call_function(stack_heat, tuple(outs))
        graph.call_function(torch.ops.lychee.write_state.default, (ctx.heat_input, stacked))
