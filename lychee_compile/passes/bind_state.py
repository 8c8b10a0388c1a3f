"""Pass `bind_state`: find the cross-step state buffers the wrapped forward announced with lychee::bind_state,
remember their graph inputs, and drop the marker calls (no-ops whose only job was to make Dynamo lift the buffer).
"""
from __future__ import annotations

import torch

from .context import PassContext


def _is_bind(node) -> bool:
    bind = torch.ops.lychee.bind_state
    return node.op == "call_function" and node.target in (bind, bind.default)


def bind_state_inputs(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.nodes):
        if _is_bind(node):
            ctx.heat_input = node.args[0]
            ctx.gm.graph.erase_node(node)
    if ctx.config.heat_blocks > 0 and ctx.rewrite and ctx.heat_input is None:
        ctx.refuse_graph("heat is enabled but the graph carries no heat state (the model's forward was not "
                         "wrapped by lychee_compile?)")
