"""Pass `one_shot_all_reduce`: a tensor-parallel graph's small all-reduces -> lychee::one_shot_all_reduce.

Under transformers' TP a decode step sums the ranks' partial outputs of o_proj and down_proj in every layer (2L
all-reduces of [B, 1, hidden], 32-64 KB each at Llama-3-8B shapes), each a functional all-reduce and its wait in the
Dynamo graph. NCCL spends ~20 us on each; the one-shot symmetric-memory kernel ~6 us (ops/one_shot_all_reduce.py).
Runs only where the wrapped forward announced the symmetric buffer ("all_reduce": LycheeConfig.symm_mem_all_reduce
resolved on, i.e. TP on CUDA with symmetric memory working on the group).

Matched, structurally: _c10d_functional.all_reduce(input, "sum", group_name) whose users are all
_c10d_functional.wait_tensor; input of static shape, bf16 or fp32 (the kernel's dtypes), its bytes a multiple of 16
and at most the buffer's. The waits' users read the op's result instead. Anything else keeps the process group's
all-reduce, counted (all_reduces_kept) and logged with the reason (a warning in a decode graph: a batch whose hidden
state outgrows the buffer, say).
"""
from __future__ import annotations

import logging

import torch
import torch.fx

from ..ops.one_shot_all_reduce import ALIGN_BYTES
from ..ops.op_arguments import get_arg
from .context import PassContext

log = logging.getLogger("lychee_compile")
BUFFER_NAME = "all_reduce"
DTYPES = (torch.bfloat16, torch.float32)     # torch's one-shot kernel dispatches these two


def _is(node: torch.fx.Node, packet) -> bool:
    """node calls `packet` (an OpOverloadPacket) or its default overload."""
    return node.op == "call_function" and node.target in (packet, packet.default)


def _refusal(node: torch.fx.Node, capacity: int) -> str | None:
    """Why this all-reduce stays the process group's, or None."""
    waits = list(node.users)
    if get_arg(node, "reduce_op") != "sum":
        return f"reduce_op {get_arg(node, 'reduce_op')!r}"
    if not waits or not all(_is(w, torch.ops._c10d_functional.wait_tensor) for w in waits):
        return "a user other than its wait"
    x = get_arg(node, "input")
    value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype not in DTYPES:
        return f"dtype {getattr(value, 'dtype', None)}"
    if any(not isinstance(s, int) for s in value.shape):
        return "a dynamic shape"
    nbytes = value.numel() * value.element_size()
    if not 0 < nbytes <= capacity or nbytes % ALIGN_BYTES:
        return f"{nbytes} bytes (the buffer holds {capacity}, in multiples of {ALIGN_BYTES})"
    return None


def one_shot_all_reduces(ctx: PassContext) -> None:
    buffer = ctx.bound_buffers.get(BUFFER_NAME)
    if buffer is None:
        return
    value = buffer.meta["example_value"]
    capacity = int(value.numel() * value.element_size())
    graph = ctx.gm.graph
    kept = []
    for node in list(graph.nodes):
        if not _is(node, torch.ops._c10d_functional.all_reduce):
            continue
        refusal = _refusal(node, capacity)
        if refusal is not None:
            kept.append(refusal)
            continue
        with graph.inserting_before(node):
            summed = graph.call_function(torch.ops.lychee.one_shot_all_reduce.default,
                                         (get_arg(node, "input"), buffer, get_arg(node, "group_name")))
        summed.meta.update(node.meta)
        for wait in list(node.users):
            wait.replace_all_uses_with(summed)
            graph.erase_node(wait)
        graph.erase_node(node)
        ctx.counters.all_reduces_one_shot += 1
    if kept:
        ctx.counters.all_reduces_kept += len(kept)
        (log.warning if ctx.is_decode else log.info)(
            "lychee_compile: %d all-reduce(s) of this %s graph stay the process group's: %s", len(kept),
            "decode" if ctx.is_decode else "non-decode", "; ".join(sorted(set(kept))))
