"""The op contract: `torch.ops.lychee.hybrid_decode`, one decode step of hybrid attention for one global layer.

    hybrid_decode(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens,
                  policy=0, policy_param=0.0, quest_mode=0, quest_blocks=0, select=None,
                  defer_select=False) -> (out, idx_out)

`select` bool [Hkv] (optional; None = every head): the retrieval heads whose selection someone reads (the
thread_state pass passes the heads that are sparse in the next global layer). A retrieval head outside it skips the
top-k and outputs an EMPTY row -- its selection would be dead, and it is ~1/8 of a retrieval head's layer time.

`defer_select` (the defer_selection pass sets it): idx_out is not complete when the op returns; it must pass
through `lychee::index_ready` (ops/deferred_select.py) before anything reads it. Eager (the reference) it is
complete anyway; the Triton lowering then selects on a side stream, off the critical path. The values are the same.

Shapes and dtypes are documented in reference.py (the math) and index_state.py (idx_in / idx_out). The op is
functional (mutates nothing), so FX passes may move it like any pure node and Inductor may lower it. Its CPU/CUDA
implementation is the eager reference; a lowering (lychee_compile.lowering) replaces it inside Inductor without
touching this contract. `retrieval` is runtime data, not a compile-time constant, so one compiled kernel serves every
layer and every head map.
"""
from __future__ import annotations

import torch

from .reference import hybrid_decode_reference

OP_NAME = "lychee::hybrid_decode"
# Output positions (a schema names no outputs): every decode op returns (out, idx_out, ...); hybrid_decode_mass adds
# mass, the heat composite its new heat slot, at SLOT_OUT.
OUT, IDX_OUT, SLOT_OUT = 0, 1, 2


@torch.library.custom_op(OP_NAME, mutates_args=())
def hybrid_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                  retrieval: torch.Tensor, idx_in: torch.Tensor, scale: float, block_size: int,
                  sink_tokens: int, local_tokens: int, policy: int = 0, policy_param: float = 0.0,
                  quest_mode: int = 0, quest_blocks: int = 0,
                  select: torch.Tensor | None = None, defer_select: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    # defer_select changes where the lowering selects, never what: the reference ignores it (module docstring)
    return hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens,
                                   policy, policy_param, quest_mode=quest_mode, quest_blocks=quest_blocks,
                                   select=select)


@hybrid_decode.register_fake
def _(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens, policy=0, policy_param=0.0,
      quest_mode=0, quest_blocks=0, select=None, defer_select=False):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be 4-D [B, H, T, D]")
    torch._check(q.shape[2] == 1, lambda: "hybrid_decode takes query length 1")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of KV heads")
    return torch.empty_like(q), torch.empty_like(idx_in)


@torch.library.custom_op("lychee::hybrid_decode_mass", mutates_args=())
def hybrid_decode_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                       retrieval: torch.Tensor, idx_in: torch.Tensor, extra: torch.Tensor, scale: float,
                       block_size: int, sink_tokens: int, local_tokens: int, policy: int = 0,
                       policy_param: float = 0.0,
                       select: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hybrid_decode where sparse heads also attend `extra` int32 [B, Hkv, KX] (this layer only; EMPTY = unused;
    each row distinct and disjoint from idx_in's row), returning the per-block probability mass fp32
    [B, Hkv, ceil(T / block_size)] as well (reference.py). The building block of heat and Quest (heat.py,
    quest_decode.py): they pick `extra` and fold `mass` into their state with plain tensor ops, which Inductor fuses,
    around this one op, which the lowering turns into the same two Triton kernels as hybrid_decode."""
    return hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens,
                                   policy, policy_param, select=select, extra=extra, with_mass=True)


@hybrid_decode_mass.register_fake
def _(q, k, v, valid, retrieval, idx_in, extra, scale, block_size, sink_tokens, local_tokens, policy=0,
      policy_param=0.0, select=None):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be 4-D [B, H, T, D]")
    torch._check(q.shape[2] == 1, lambda: "hybrid_decode_mass takes query length 1")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of KV heads")
    torch._check(extra.dim() == 3, lambda: f"extra must be int32 [B, Hkv, KX], got {extra.dim()}-D")
    nb = (k.shape[2] + block_size - 1) // block_size
    mass = q.new_empty((q.shape[0], k.shape[1], nb), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(idx_in), mass


def hybrid_decode_op():
    """The OpOverload to insert into graphs (`.default`: an OpOverloadPacket can be treated as impure-less and
    dropped on torch 2.11)."""
    return torch.ops.lychee.hybrid_decode.default
