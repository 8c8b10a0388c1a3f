"""lychee::one_shot_all_reduce: a tensor-parallel step's small all-reduce as one symmetric-memory kernel.

    y = one_shot_all_reduce(x, buffer, group_name)

  x, y        any shape, bf16 or fp32 (the dtypes torch's kernel takes); a decode step: the hidden state
              [B, 1, hidden] after o_proj or down_proj; y = the sum of x over the ranks of the process group
              `group_name`, on every rank
  buffer      uint8 [ONE_SHOT_BYTES], this rank's symmetric-memory buffer (`_lychee_all_reduce`,
              state_buffers.py), rendezvoused over the group at lychee_compile (tensor_parallel.resolved_all_reduce):
              outside any CUDA-graph pool, one address for the model's life (a copy of the model -- deepcopy, a
              move -- holds a plain tensor there, which the kernel refuses). Scratch: its contents after a call
              mean nothing (declared mutated, which it is).

On CUDA: torch's one-shot kernel (torch.ops.symm_mem.one_shot_all_reduce_copy) copies x into the buffer, waits for
every rank (a barrier on the group's signal pads), reads the ranks' buffers over NVLink and sums them into y, then
waits for every rank again before it returns -- so the next call may overwrite the buffer while no rank still reads
it. One kernel and two barriers, against NCCL's launch and protocol for a few tens of KB (docs/tensor-parallel.md).
The eager reference is what the graph held before the pass `one_shot_all_reduce` (passes/one_shot_all_reduce.py):
the functional all-reduce and its wait; it also runs where x is not on CUDA (CPU ranks in tests).
"""
from __future__ import annotations

import torch

ONE_SHOT_BYTES = 128 * 1024     # the buffer; also where one-shot stops paying against NCCL (Inductor's threshold)
ALIGN_BYTES = 16                # the kernel's vector width: x's bytes must be a multiple of it


def one_shot_all_reduce_reference(x: torch.Tensor, group_name: str) -> torch.Tensor:
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))


@torch.library.custom_op("lychee::one_shot_all_reduce", mutates_args=("buffer",))
def one_shot_all_reduce(x: torch.Tensor, buffer: torch.Tensor, group_name: str) -> torch.Tensor:
    if x.device.type != "cuda":
        return one_shot_all_reduce_reference(x, group_name)
    flat = x.contiguous().view(-1)
    symm = buffer.view(x.dtype)[: flat.numel()]      # offset 0 of the rendezvoused buffer
    ops = torch.ops.symm_mem
    if hasattr(ops, "one_shot_all_reduce_copy"):
        out = ops.one_shot_all_reduce_copy(symm, flat, "sum", group_name)
    else:                                             # the copy first, then the kernel on the buffer
        symm.copy_(flat)
        out = ops.one_shot_all_reduce(symm, "sum", group_name)
    return out.view(x.shape)


@one_shot_all_reduce.register_fake
def _(x, buffer, group_name):
    return x.new_empty(x.shape)
