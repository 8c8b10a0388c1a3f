"""Pass `fuse_linears`: sibling linear layers -- several F.linear calls on the SAME input node (a decoder's q / k / v
projections, an MLP's gate / up) -- become one matrix product over a fused weight, cut back with narrow views.

Why: a decode step's linear is a matrix-vector product bound by reading its weight. The small ones (k / v: a
quarter of q's rows in a GQA model) run far below the copy rate, and each brings its own launch (and a cuBLAS
split-K reduce). One product over the rows of all of them reads the same bytes in one kernel.

Two steps, both structural (graph + tensor metadata, no model names):
  1. Install time (`sibling_groups` on the probe graph, then `linear_groups.fuse_weights`): a group is >= 2 linears
     on one input whose weights are distinct parameters of one dtype / device / in_features, each used by nothing
     but its linear, all with or all without bias. Each group's weights (biases) are concatenated into one
     non-persistent buffer and every member parameter is re-pointed at its rows of it (views: no extra memory).
     The wrapped forward announces the buffers with lychee::bind_state("linear_group:<i>" / "linear_bias:<i>"),
     so Dynamo lifts them as static inputs.
  2. This pass, in every graph our backend compiles: a linear whose weight is a view of an announced buffer joins
     that buffer's group (per input node); a group whose members cover the buffer's rows exactly, in order, is
     replaced by one linear over the buffer and one narrow per member. Anything else is left as it is -- correct
     either way, since each member's parameter reads its own rows of the same memory.
"""
from __future__ import annotations

import torch
import torch.fx

from .context import PassContext
from .graph_query import arg, is_op

GROUP_PREFIX = "linear_group:"
BIAS_PREFIX = "linear_bias:"
LINEAR = torch._C._nn.linear


def _linear_parts(node: torch.fx.Node):
    """(input, weight, bias) nodes of an F.linear call, else None."""
    if not is_op(node, "linear"):
        return None
    return arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")


def _placeholder_values(gm: torch.fx.GraphModule, example_inputs) -> dict:
    """placeholder node -> the tensor Dynamo bound to it (parameters are lifted as inputs)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n: t for n, t in zip(phs, example_inputs) if isinstance(t, torch.Tensor)}


def sibling_groups(gm: torch.fx.GraphModule, example_inputs, params: dict) -> list[list[tuple]]:
    """Install-time discovery on the probe's graph: [[(weight, bias or None), ...], ...] of parameter objects
    (`params`: id(parameter) -> parameter of the model), members in graph order, groups of >= 2."""
    values = _placeholder_values(gm, example_inputs)
    by_input: dict = {}
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is None:
            continue
        x, w, b = parts
        wt, bt = values.get(w), values.get(b) if b is not None else None
        if wt is None or id(wt) not in params or len(w.users) != 1 or wt.dim() != 2:
            continue
        if b is not None and (bt is None or id(bt) not in params or len(b.users) != 1):
            continue
        by_input.setdefault(x, []).append((params[id(wt)], None if b is None else params[id(bt)], wt))
    groups, seen = [], set()
    for members in by_input.values():
        # compared on the tensors the graph multiplies (under TP the local shards, not the DTensors' global shapes)
        first_w, first_b, first_v = members[0]
        same = [(w, b) for w, b, v in members
                if v.dtype == first_v.dtype and v.device == first_v.device and v.shape[1] == first_v.shape[1]
                and (b is None) == (first_b is None) and id(w) not in seen]
        if len(same) >= 2:
            seen.update(id(w) for w, _ in same)
            groups.append(same)
    return groups


def _row_offset(view: torch.Tensor, base: torch.Tensor) -> int | None:
    """First row of `view` inside the 2-D (or 1-D) buffer `base`, or None if it is not a row range of it."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() or not view.is_contiguous():
        return None
    offset = view.storage_offset() - base.storage_offset()
    row = base.stride(0) if base.dim() == 2 else 1
    if offset < 0 or offset % row or (base.dim() == 2 and view.shape[1:] != base.shape[1:]):
        return None
    return offset // row


def fuse_sibling_linears(ctx: PassContext) -> None:
    groups = {name[len(GROUP_PREFIX):]: node for name, node in ctx.bound_buffers.items()
              if name.startswith(GROUP_PREFIX)}
    if not groups or not ctx.config.fuse_linears or ctx.example_inputs is None:
        return
    values = _placeholder_values(ctx.gm, ctx.example_inputs)
    by_storage = {values[node].untyped_storage().data_ptr(): key for key, node in groups.items()}
    found: dict = {}          # (group, input node) -> [(row offset, rows, linear node, bias node)], graph order
    for node in list(ctx.gm.graph.nodes):
        parts = _linear_parts(node)
        w = values.get(parts[1]) if parts is not None else None
        if hasattr(w, "_local_tensor"):      # a DTensor weight (a graph compiled without the local-shard swap)
            continue
        key = by_storage.get(w.untyped_storage().data_ptr()) if w is not None else None
        row = _row_offset(w, values[groups[key]]) if key is not None else None
        if row is not None:
            found.setdefault((key, parts[0]), []).append((row, w.shape[0], node, parts[2]))
    for (key, x), members in found.items():
        _replace_group(ctx, x, groups[key], ctx.bound_buffers.get(BIAS_PREFIX + key), values, members)


def _replace_group(ctx, x, buf_node, bias_node, values, members) -> None:
    rows = values[buf_node].shape[0]
    first = members[0][2]          # the first member in graph order: the fused product goes before it
    members.sort(key=lambda m: m[0])
    # exactly the buffer's rows, in order, each with bias iff the group has one, that bias the same rows of its buffer
    covered = 0
    for row, n, _node, b in members:
        if row != covered or (b is None) != (bias_node is None):
            return
        if b is not None and (values.get(b) is None or _row_offset(values[b], values[bias_node]) != row):
            return
        covered += n
    if covered != rows or len(members) < 2:
        return
    graph = ctx.gm.graph
    with graph.inserting_before(first):
        args = (x, buf_node) if bias_node is None else (x, buf_node, bias_node)
        fused = graph.call_function(LINEAR, args)   # y: [..., rows of every member]
        parts = [graph.call_function(torch.narrow, (fused, -1, row, n)) for row, n, _node, _b in members]
    for part, (_row, _n, node, _b) in zip(parts, members):    # erased only now: `first` was the insertion point
        node.replace_all_uses_with(part)
        graph.erase_node(node)
    ctx.counters.linear_groups_fused += 1
    ctx.counters.linears_fused += len(members)
