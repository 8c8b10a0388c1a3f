"""Pass `bind_state`: find the cross-step state buffers the wrapped forward announced with lychee::bind_state
(layout: lychee_compile/ops/state.py), remember their graph inputs by name, and drop the marker calls (no-ops whose
only job was to make Dynamo lift the buffer).
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
            ctx.state_inputs[node.args[1]] = node.args[0]
            ctx.gm.graph.erase_node(node)
