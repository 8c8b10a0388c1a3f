"""Fused weights of sibling linears (install side of passes/fuse_linears.py, which says why and what matches).

`fuse_weights` concatenates each group's weights (and biases) into one non-persistent buffer, marked static for
Dynamo (CUDA graphs replay against its address), and re-points every member parameter at its rows of it. The
parameters stay the model's parameters -- same names, shapes and values, now views of one block of memory -- so
the model takes no extra memory and its eager forward is unchanged. `announce` (called by the wrapped forward)
makes the buffers graph inputs through lychee::bind_state.

What a user must know: after lychee_compile the members share storage. A later `model.to(...)` converts the
buffers and the parameters separately (the parameters stop being views: correct, but the fused weights then take
memory of their own, and the pass leaves those linears unfused); move the model before lychee_compile. Update weights in place
(`load_state_dict`, `param.copy_`), never by rebinding `param.data` (the compiled step would keep reading the
buffer), and save weights from a model that did not go through lychee_compile (safetensors refuses tensors that
share memory), or compile with LycheeConfig(fuse_linears=False).

Tensor parallel: members may be DTensor parameters (transformers' TP); their local shards are what the decode graph
multiplies (tensor_parallel.LocalLinearShards), so the buffer holds the local shards and each DTensor's local tensor
is re-pointed at its rows -- the DTensor keeps its global shape and placements, and its eager forward reads the
same memory.
"""
from __future__ import annotations

import torch

from .passes.fuse_linears import BIAS_PREFIX, GROUP_PREFIX

GROUPS_ATTR = "_lychee_linear_groups"     # [(group key, weight buffer attr, bias buffer attr or None), ...]


@torch.no_grad()
def fuse_weights(model, groups: list[list[tuple]]) -> None:
    """groups: [[(weight, bias or None), ...], ...] parameters (passes.fuse_linears.sibling_groups)."""
    entries = []
    for i, members in enumerate(groups):
        w_attr = f"_lychee_linear_group_{i}"
        _register(model, w_attr, _fused([_values(w) for w, _ in members]))
        _repoint([w for w, _ in members], getattr(model, w_attr))
        b_attr = None
        if members[0][1] is not None:
            b_attr = f"_lychee_linear_bias_{i}"
            _register(model, b_attr, _fused([_values(b) for _, b in members]))
            _repoint([b for _, b in members], getattr(model, b_attr))
        entries.append((str(i), w_attr, b_attr))
    setattr(model, GROUPS_ATTR, entries)


def announce(model) -> None:
    """Inside the wrapped forward: make each fused buffer a graph input (a no-op marker when run eagerly)."""
    for key, w_attr, b_attr in getattr(model, GROUPS_ATTR, ()):
        torch.ops.lychee.bind_state(getattr(model, w_attr), GROUP_PREFIX + key)
        if b_attr is not None:
            torch.ops.lychee.bind_state(getattr(model, b_attr), BIAS_PREFIX + key)


def _fused(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding `tensors` back to back along dim 0. When they already are consecutive row ranges of one
    storage -- parameters a model shares with another that went through lychee_compile (the eval harness compiles
    weight-sharing copies) -- it is that memory again, not a new copy."""
    first = tensors[0]
    shape = (sum(t.shape[0] for t in tensors),) + tuple(first.shape[1:])
    offset = first.storage_offset()
    for t in tensors:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or not t.is_contiguous()
                or t.storage_offset() != offset):
            return torch.cat(tensors, 0)
        offset += t.numel()
    stride = torch.empty(shape, device="meta").stride()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, stride)


def _register(model, attr: str, value: torch.Tensor) -> None:
    model.register_buffer(attr, value, persistent=False)     # state_dict() keeps the parameters' own names
    torch._dynamo.mark_static_address(getattr(model, attr))


def _values(p: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's values of a parameter: itself, or a DTensor's local shard."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p


def _repoint(params, buf: torch.Tensor) -> None:
    row = 0
    for p in params:
        n = _values(p).shape[0]
        _values(p).data = buf[row:row + n]         # a view: same shape and values, the buffer's memory
        row += n
