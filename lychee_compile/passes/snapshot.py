"""A stable text rendering of a rewritten graph, for snapshot tests reviewed as diffs.

Only what the rewrite decides is printed -- the lychee ops with their inputs named by role, the index-state chain,
and the attention left dense -- so a snapshot changes when our rewrite changes, not when Dynamo renames a node:

    lychee graph v1: 3 lychee ops, dense attention left: sdpa=0 softmax=0
    op 0 layer=0 q=[2,4,1,16] k=past_key_values.layers.0.keys v=past_key_values.layers.0.values
         valid=valid_from_bool_mask(attention_mask) kinds=head_kinds(R,R) idx_in=empty(K=4) scale=0.25 block=4 ...
"""
from __future__ import annotations

import re

import torch.fx

from ..ops.hybrid_decode import hybrid_decode_op
from .graph_query import is_op, shape

_ARG_NAMES = ("q", "k", "v", "valid", "kinds", "idx_in", "scale", "block", "sink", "local", "policy", "param")


def graph_snapshot(gm: torch.fx.GraphModule) -> str:
    op_target = hybrid_decode_op()
    ops = [n for n in gm.graph.nodes if n.target is op_target]
    layer_of = {op: i for i, op in enumerate(ops)}
    dense = {name: sum(is_op(n, name) for n in gm.graph.nodes) for name in ("sdpa", "softmax")}
    lines = [f"lychee graph v1: {len(ops)} lychee ops, dense attention left: "
             + " ".join(f"{k}={v}" for k, v in dense.items())]
    for i, op in enumerate(ops):
        parts = [f"{name}={_render(a, layer_of)}" for name, a in zip(_ARG_NAMES, op.args)]
        lines.append(f"op {i} layer={op.meta.get('lychee_layer')} " + " ".join(parts))
    return "\n".join(lines) + "\n"


def _render(a, layer_of) -> str:
    if not isinstance(a, torch.fx.Node):
        return repr(a)
    if a.op == "placeholder":
        return _placeholder_name(a.target)
    if a.op == "call_function" and a.target.__module__.startswith("lychee_compile"):
        name = a.target.__name__
        if name == "head_kinds":
            return "head_kinds(" + ",".join("R" if r else "S" for r in a.args[1]) + ")"
        if name == "drop_inherited":
            rows = ",".join("T" if r else "-" for r in a.args[1])
            return f"drop_inherited({_render(a.args[0], layer_of)}, streaming={rows})"
        if name == "empty_index_state_like":
            return f"empty(K={a.args[1]})"
        inner = ",".join(_render(x, layer_of) for x in a.args if isinstance(x, torch.fx.Node) and x.op == "placeholder")
        return f"{name}({inner})"
    if a.op == "call_function" and a.args and a.args[0] in layer_of:
        return f"idx_out(op {layer_of[a.args[0]]})"
    s = shape(a)
    return "[" + ",".join(str(d) for d in s) + "]" if s is not None else a.op


def _placeholder_name(target: str) -> str:
    """Dynamo's L_kwargs_past_key_values_layers_0_keys -> cache.layers.0.keys (stable across versions)."""
    name = re.sub(r"^L_(kwargs_|self_)?", "", str(target)).strip("_")
    return re.sub(r"past_key_values_layers_(\d+)_(keys|values)", r"cache.layers.\1.\2", name)
