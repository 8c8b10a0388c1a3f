"""Pass `one_shot_all_reduce`: a tensor-parallel graph's small all-reduces -> lychee::one_shot_all_reduce.

Under transformers' TP a decode step sums the ranks' partial outputs of o_proj and down_proj in every layer (2L
all-reduces of [B, 1, hidden], 32-64 KB each at Llama-3-8B shapes), each a functional all-reduce and its wait in the
Dynamo graph. NCCL spends ~20 us on each; the one-shot symmetric-memory kernel ~6 us (ops/one_shot_all_reduce.py).
Runs only where the wrapped forward announced the symmetric buffer ("all_reduce": LycheeConfig.symm_mem_all_reduce
resolved on, i.e. TP on CUDA with symmetric memory working on the group).

Matched, structurally: _c10d_functional.all_reduce(x, "sum", group) whose users are all _c10d_functional.wait_tensor;
x of static shape, bf16 / fp16 / fp32, its bytes a multiple of 16 and at most the buffer's. The waits' users read the
op's result instead. Anything else keeps the process group's all-reduce and is counted (all_reduces_kept).
"""
from __future__ import annotations

import torch
import torch.fx

from ..ops.one_shot_all_reduce import ALIGN_BYTES
from .context import PassContext

BUFFER_NAME = "all_reduce"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _is(node: torch.fx.Node, packet) -> bool:
    return node.op == "call_function" and node.target in (packet, packet.default)


def _fits(x: torch.fx.Node, capacity: int) -> bool:
    value = x.meta.get("example_value") if isinstance(x, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype not in DTYPES:
        return False
    if any(not isinstance(s, int) for s in value.shape):          # a dynamic shape: the buffer may not hold it
        return False
    nbytes = value.numel() * value.element_size()
    return 0 < nbytes <= capacity and nbytes % ALIGN_BYTES == 0


def one_shot_all_reduces(ctx: PassContext) -> None:
    buffer = ctx.bound_buffers.get(BUFFER_NAME)
    if buffer is None:
        return
    c10d = torch.ops._c10d_functional
    capacity = int(buffer.meta["example_value"].numel())
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if not _is(node, c10d.all_reduce):
            continue
        x, reduce_op, group = node.args[:3]
        waits = list(node.users)
        if reduce_op != "sum" or not waits or not all(_is(w, c10d.wait_tensor) for w in waits) or \
                not _fits(x, capacity):
            ctx.counters.all_reduces_kept += 1
            continue
        with graph.inserting_before(node):
            summed = graph.call_function(torch.ops.lychee.one_shot_all_reduce.default, (x, buffer, group))
        summed.meta.update(node.meta)
        for wait in waits:
            wait.replace_all_uses_with(summed)
            graph.erase_node(wait)
        graph.erase_node(node)
        ctx.counters.all_reduces_one_shot += 1
