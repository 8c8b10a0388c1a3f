"""Pass `defer_selection`: take each retrieval head's top-k off the critical path (ops/deferred_select.py says why).

For every lychee::hybrid_decode op whose index state someone reads (every global layer but the last), the op gets
`defer_select=True` and `lychee::index_ready(idx_out, [q of the next global layer's op])` goes in right before the
first node that reads idx_out (in practice the next op, or its drop_inherited). index_ready formally mutates
idx_out, so functionalization orders every later read after it; holding the next layer's q makes it depend on
that, so no scheduler can hoist it: everything between the op and its first reader (o_proj, the MLP, the next
layer's q/k/v products) overlaps the selection.
Ops whose index state nobody reads (the last layer) and the heat / Quest composites (their selection is plain
tensor ops, or the mass variant's combine) are left alone. LycheeConfig.defer_selection=False turns the pass off.
"""
from __future__ import annotations

import torch
import torch.fx

from ..ops.deferred_select import index_ready_op
from ..ops.hybrid_decode import IDX_OUT, hybrid_decode_op
from ..ops.op_arguments import get_arg, set_arg
from .context import PassContext
from .graph_query import output_of


def defer_selections(ctx: PassContext) -> None:
    if not ctx.config.defer_selection:
        return
    graph = ctx.gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    ops = [s.op_node for s in sorted(ctx.sites, key=lambda s: s.layer_idx) if s.op_node is not None]
    for op, next_op in zip(ops, ops[1:]):
        if op.target is not hybrid_decode_op():
            continue
        idx = output_of(op, IDX_OUT)
        if idx is None or not idx.users:
            continue
        first = min(idx.users, key=order.__getitem__)
        # the next layer's q: index_ready holds it, so it depends on it and no scheduler can hoist the join above
        # it (Inductor's peak-memory reordering put it right after the fork: nothing overlapped)
        q = get_arg(next_op, "q")
        anchor = [q] if isinstance(q, torch.fx.Node) and order[q] < order[first] else []
        with graph.inserting_before(first):
            graph.call_function(index_ready_op(), (idx, anchor))
        set_arg(op, "defer_select", True)
        ctx.counters.selections_deferred += 1
