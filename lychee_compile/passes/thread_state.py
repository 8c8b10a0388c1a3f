"""Pass `thread_state`: wire the index state from each rewritten op to the next, in layer order.

A streaming head (HeadMap.streaming) attends sink + local only: its inherited row is replaced by EMPTY on the way
in (drop_inherited), so as a sparse head it attends nothing else and passes EMPTY on.
The first global layer's op gets a fresh EMPTY index state (all its heads are retrieval heads, so it is read by no
one); op l+1 reads op l's idx_out. The last idx_out is unused: the index state never outlives its decode step.
Liveness: op l's `select` input = the heads that are sparse (neither retrieval nor streaming) in layer l+1 -- the
only readers of a selection, since a sparse head passes its row on unchanged and a retrieval head makes its own.
It is computed from the head kinds buffer at run time (selection_readers), so set_head_map() keeps it right; the last
layer selects for no one. A retrieval head outside `select` skips its top-k and passes EMPTY.
Layout of the index state: lychee_compile/ops/index_state.py. Arguments are addressed by name (ops/op_arguments.py).
"""
from __future__ import annotations

import torch

from ..ops.hybrid_decode import IDX_OUT, hybrid_decode_op
from ..ops.index_state import EMPTY, INDEX_DTYPE
from ..ops.op_arguments import get_arg, set_arg
from .context import PassContext
from .graph_query import output_of


def empty_index_state_like(k: torch.Tensor, num_select: int) -> torch.Tensor:
    """int32 [B, Hkv, K] filled with EMPTY, on k's device."""
    return torch.full((k.shape[0], k.shape[1], num_select), EMPTY, dtype=INDEX_DTYPE, device=k.device)


def drop_inherited(idx: torch.Tensor, streaming_row: tuple) -> torch.Tensor:
    """idx int32 [B, Hkv, K] -> the same with the rows of streaming heads set to EMPTY."""
    keep = ~torch.tensor(streaming_row, dtype=torch.bool, device=idx.device)[None, :, None]
    return torch.where(keep, idx, torch.full_like(idx, EMPTY))


def selection_readers(kinds: torch.Tensor, slot: int, streaming_next: tuple) -> torch.Tensor:
    """kinds bool [Lg, Hkv] -> bool [Hkv]: heads that read global layer `slot`'s selection, i.e. the sparse heads
    of layer slot + 1 (streaming heads drop what they inherit); none after the last global layer."""
    if slot + 1 >= kinds.shape[0]:
        return torch.zeros_like(kinds[0])
    readers = ~kinds[slot + 1]
    if any(streaming_next):
        readers = readers & ~torch.tensor(streaming_next, dtype=torch.bool, device=kinds.device)
    return readers


def _mark_readers(ctx: PassContext, op, next_layer) -> None:
    """Give a hybrid_decode op its `select` input (the heat / Quest composites keep selecting for every head)."""
    if op.target is not hybrid_decode_op() or ctx.kinds_input is None:
        return
    slot = get_arg(get_arg(op, "retrieval"), "slot")         # the op's head kinds are kinds_slot(kinds, slot)
    row = ctx.streaming[next_layer].tolist() if ctx.streaming is not None and next_layer is not None else []
    with ctx.gm.graph.inserting_before(op):
        readers = ctx.gm.graph.call_function(selection_readers, (ctx.kinds_input, slot, tuple(bool(x) for x in row)))
    set_arg(op, "select", readers)


def thread_index_state(ctx: PassContext) -> None:
    sites = [s for s in sorted(ctx.sites, key=lambda s: s.layer_idx) if s.op_node is not None]
    if not sites:
        return
    graph = ctx.gm.graph
    with graph.inserting_before(sites[0].op_node):
        idx = graph.call_function(empty_index_state_like, (get_arg(sites[0].op_node, "k"), ctx.config.num_select))
    for site in sites:
        op = site.op_node
        row = ctx.streaming[site.layer_idx].tolist() if ctx.streaming is not None else []
        if any(row):
            with graph.inserting_before(op):
                idx = graph.call_function(drop_inherited, (idx, tuple(bool(x) for x in row)))
        set_arg(op, "idx_in", idx)
        idx = output_of(op, IDX_OUT)
    for i, site in enumerate(sites):
        _mark_readers(ctx, site.op_node, sites[i + 1].layer_idx if i + 1 < len(sites) else None)
