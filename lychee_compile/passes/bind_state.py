"""Pass `bind_state`: find the cross-step state buffers the wrapped forward announced with lychee::bind_state
(layout: lychee_compile/ops/state.py), remember their graph inputs by name, and drop the marker calls (no-ops whose
only job was to make Dynamo lift the buffer).
"""
from __future__ import annotations

import torch

from ..ops.op_arguments import get_arg
from .context import PassContext


def _is_bind(node) -> bool:
    bind = torch.ops.lychee.bind_state
    return node.op == "call_function" and node.target in (bind, bind.default)


def bind_buffers(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.nodes):
        if _is_bind(node):
            ctx.bound_buffers[get_arg(node, "name")] = get_arg(node, "state")
            ctx.gm.graph.erase_node(node)
