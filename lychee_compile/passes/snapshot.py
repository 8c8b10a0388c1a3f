"""A stable text rendering of a rewritten graph, for snapshot tests reviewed as diffs.

Only what the rewrite decides is printed -- the lychee ops with their inputs named as the op's schema (a
composite's signature) names them, the index-state chain, and the attention left dense -- so a snapshot changes when
our rewrite changes, not when Dynamo renames a node:

    lychee graph v6: 3 lychee ops, 1 valid mask node, dense attention left: sdpa=0 softmax=0
    linears: 13, fused products: 6 (members 3,2,3,2,3,2)
    op 0 hybrid_decode layer=0 q=[2,4,1,16] k=cache.layers.0.keys v=cache.layers.0.values
         valid=valid_from_bool_mask(attention_mask) retrieval=kinds_slot(state.kinds, 0) idx_in=empty(K=4) scale=0.25
         block_size=4 ...
    index_ready(idx_out(op 0), after=q(op 1)) before op 1
"""
from __future__ import annotations

import re

import torch
import torch.fx

from ..ops.heat import heat_decode_step
from ..ops.hybrid_decode import hybrid_decode_op
from ..ops.op_arguments import get_arg, given
from ..ops.quest_decode import quest_decode_step
from ..ops.state import STATE_NAMES
from .graph_query import arg, is_op, shape


_SLOT_OF = {"layer_slot": "buffer", "kinds_slot": "kinds"}     # helper -> the argument it takes a slot of


def _lychee_ops() -> dict:
    """target -> the name printed for it (its arguments are printed under their schema / signature names)."""
    return {hybrid_decode_op(): "hybrid_decode", torch.ops.lychee.dense_decode.default: "dense_decode",
            heat_decode_step: "heat_decode_step", quest_decode_step: "quest_decode_step"}


def graph_snapshot(gm: torch.fx.GraphModule) -> str:
    known = _lychee_ops()
    ops = [n for n in gm.graph.nodes if n.target in known]
    layer_of = {op: i for i, op in enumerate(ops)}
    dense = {name: sum(is_op(n, name) for n in gm.graph.nodes) for name in ("sdpa", "softmax")}
    n_valid = len({get_arg(op, "valid") for op in ops})          # ops share one valid node per mask (rewrite pass)
    lines = [f"lychee graph v6: {len(ops)} lychee ops, {n_valid} valid mask node{'s' * (n_valid != 1)}, "
             "dense attention left: "
             + " ".join(f"{k}={v}" for k, v in dense.items()), _linears_line(gm)]
    for i, op in enumerate(ops):
        parts = [f"{name}={_render(a, layer_of)}" for name, a in given(op).items()]
        lines.append(f"op {i} {known[op.target]} layer={op.meta.get('lychee_layer')} " + " ".join(parts))
    for n in gm.graph.nodes:
        if n.target is torch.ops.lychee.index_ready.default:
            after = [f"q(op {layer_of[o]})" for a in get_arg(n, "hold") for o in a.users
                     if o in layer_of and get_arg(o, "q") is a]
            lines.append(f"index_ready({_render(get_arg(n, 'idx'), layer_of)}, after={','.join(after) or '-'}) before "
                         f"{_first_reader(n, layer_of)}")
    writes = [n for n in gm.graph.nodes if n.target is torch.ops.lychee.write_state.default]
    for n in writes:
        buffer = _render(get_arg(n, "state"), layer_of)
        lines.append(f"write_state({buffer} <- stack of {len(get_arg(n, 'value').args)} {buffer.split('.')[-1]} "
                     "slices)")
    return "\n".join(lines) + "\n"


def _first_reader(ready: torch.fx.Node, layer_of) -> str:
    """The first node after `ready` that reads its index state: `op j`, or the helper's name (drop_inherited)."""
    node = ready.next
    while node.op != "output" and get_arg(ready, "idx") not in node.all_input_nodes:
        node = node.next
    if node in layer_of:
        return f"op {layer_of[node]}"
    return getattr(node.target, "__name__", node.op)


def _linears_line(gm: torch.fx.GraphModule) -> str:
    """F.linear calls left, and the fused products among them (pass fuse_linears) with their member counts."""
    linears = [n for n in gm.graph.nodes if is_op(n, "linear")]
    fused = [n for n in linears if isinstance(arg(n, 1, "weight"), torch.fx.Node)
             and "lychee_linear_group" in str(arg(n, 1, "weight").target)]
    return (f"linears: {len(linears)}, fused products: {len(fused)} (members "
            + ",".join(str(len(n.users)) for n in fused) + ")")


def _render(a, layer_of) -> str:
    if not isinstance(a, torch.fx.Node):
        return repr(a)
    if a.op == "placeholder":
        return _placeholder_name(a.target)
    if a.op == "call_function" and isinstance(a.target, torch._ops.OpOverload) and a.target.namespace == "lychee":
        return f"{a.target._opname}({','.join(_render(x, layer_of) for x in a.args)})"     # lychee::valid_ranges
    if a.op == "call_function" and a.target.__module__.startswith("lychee_compile"):
        name = a.target.__name__
        if name == "drop_inherited":
            rows = ",".join("T" if r else "-" for r in get_arg(a, "streaming_row"))
            return f"drop_inherited({_render(get_arg(a, 'idx'), layer_of)}, streaming={rows})"
        if name in _SLOT_OF:
            return f"{name}({_render(get_arg(a, _SLOT_OF[name]), layer_of)}, {get_arg(a, 'slot')})"
        if name == "selection_readers":
            row = get_arg(a, "streaming_next")
            streaming = f", streaming={','.join('T' if r else '-' for r in row)}" if any(row) else ""
            return f"{name}({_render(get_arg(a, 'kinds'), layer_of)}, {get_arg(a, 'slot')}{streaming})"
        if name == "empty_index_state_like":
            return f"empty(K={get_arg(a, 'num_select')})"
        inner = ",".join(_render(x, layer_of) for x in a.args if isinstance(x, torch.fx.Node) and x.op == "placeholder")
        return f"{name}({inner})"
    if a.op == "call_function" and a.args and a.args[0] in layer_of:
        return f"idx_out(op {layer_of[a.args[0]]})"
    s = shape(a)
    return "[" + ",".join(str(d) for d in s) + "]" if s is not None else a.op


def _placeholder_name(target: str) -> str:
    """Dynamo's L_kwargs_past_key_values_layers_0_keys (transformers <= 5.23; L_kwargs_cache_layers_0_keys from
    5.24) -> cache.layers.0.keys (stable across versions)."""
    for name in STATE_NAMES:
        if f"lychee_{name}" in str(target):
            return f"state.{name}"
    name = re.sub(r"^L_(kwargs_|self_)?", "", str(target)).strip("_")
    return re.sub(r"(?:past_key_values|cache)_layers_(\d+)_(keys|values)", r"cache.layers.\1.\2", name)
