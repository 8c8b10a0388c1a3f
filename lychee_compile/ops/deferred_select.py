"""Deferred selection: a retrieval head's top-k finished off the critical path, and the op that waits for it.

Why: at batch 1 the top-k over a 128K cache is ~12.6 us of ONE GPU program per layer (H100, docs/design-notes.md), and
the rest of the GPU waits for it, although nothing reads the new index state before the next global layer's
attention: the o_proj, MLP and q/k/v products of ~150 us come first. With `hybrid_decode(..., defer_select=True)`
the lowering's combine launch only writes the selection keys, and `select_rows` (a third launch) selects on a
side stream while the main stream runs those products; `index_ready` joins the two streams before anything reads
the index state. The `defer_selection` pass (passes/defer_selection.py) inserts `index_ready` before the first
reader. Inside a CUDA graph the pair is a fork and a join of two branches.

    select_rows(keys, idx, rowlo, rowhi, tvp, retrieval, select, block_size, group, policy, policy_param,
                nb_hint) -> ()
        keys     int32 [B, Hkv, NB]  the combine's selection keys (lowering/kernels/glossary.py.jinja: KEYS): fp32 bits of
                                     the ranked block score for candidates (>= 0), bits of -score for sink / local
                                     blocks (< -1), -1 for the rest
        idx      int32 [B, Hkv, K]   index state (ops/index_state.py), MUTATED: row (b, h) with retrieval[h] and
                                     select[h] becomes the policy's selection from keys[b, h, :NBV]; other rows
                                     are left as the combine wrote them
        rowlo, rowhi int32 [B]       row b's valid positions [lo, hi);  tvp int32 [1]: max_b hi, NBV = ceil(tvp / bs)
        retrieval, select  int8 or bool [Hkv]
        group    G, query heads per KV head (a candidate's mass is key / G);  policy, policy_param: ops/policies.py
        nb_hint  the key-row width the kernel's register tiers are sized for (the lowering's; never the values)
      CUDA: the Triton kernel lychee_select_rows on the device's side stream, returning at once (an event marks its
      end); elsewhere: the eager reference below, synchronously.
    index_ready(idx, hold) -> ()
        Formally mutates idx: nothing may read the index state before this op (that ordering is why it declares a
        mutation; its data is not changed). CUDA: the current stream waits for the pending select_rows that writes
        idx. `hold`: tensors the side stream reads (the lowering passes keys, retrieval, select), listed so that
        Inductor keeps their memory alive, unreused, until the join.
"""
from __future__ import annotations

import torch

from .index_state import INDEX_DTYPE
from .policies import ranked_selection


def select_rows_reference(keys, idx, rowlo, rowhi, tvp, retrieval, select, block_size, group, policy,
                          policy_param) -> None:
    """Eager twin of the kernel: idx rows of selecting retrieval heads <- the policy's pick from the keys."""
    B, Hkv, nb = keys.shape
    nbv = (int(tvp.reshape(-1)[0]) + block_size - 1) // block_size
    blk = torch.arange(nb, device=keys.device)
    candidate = (keys >= 0) & (blk < nbv)                                                # [B, Hkv, NB]
    score = torch.where(candidate, keys.view(torch.float32), 0.0)
    fixed = torch.where((keys < -1) & (blk < nbv), -(keys.view(torch.float32)), 0.0).sum(-1) / group
    lo, hi = rowlo.to(torch.int64), rowhi.to(torch.int64)
    valid_blocks = (hi - lo + block_size - 1).clamp_min(0) // block_size                    # text-relative
    valid_blocks = valid_blocks[:, None]                                                              # [B, 1]
    picked = ranked_selection(score, candidate, idx.shape[-1], group, policy, policy_param, fixed, valid_blocks)
    rows = (retrieval.to(torch.bool) & select.to(torch.bool))[None, :, None]
    idx.copy_(torch.where(rows, picked.to(INDEX_DTYPE), idx))


@torch.library.custom_op("lychee::select_rows", mutates_args=("idx",))
def select_rows(keys: torch.Tensor, idx: torch.Tensor, rowlo: torch.Tensor, rowhi: torch.Tensor,
                tvp: torch.Tensor, retrieval: torch.Tensor, select: torch.Tensor, block_size: int, group: int,
                policy: int, policy_param: float, nb_hint: int) -> None:
    if keys.is_cuda:
        from ..lowering.deferred import launch_select_rows
        launch_select_rows(keys, idx, rowlo, rowhi, tvp, retrieval, select, block_size, group, policy,
                           policy_param, nb_hint)
    else:
        select_rows_reference(keys, idx, rowlo, rowhi, tvp, retrieval, select, block_size, group, policy,
                              policy_param)


@select_rows.register_fake
def _(keys, idx, rowlo, rowhi, tvp, retrieval, select, block_size, group, policy, policy_param, nb_hint):
    torch._check(keys.dim() == 3 and idx.dim() == 3, lambda: "keys [B, Hkv, NB] and idx [B, Hkv, K] must be 3-D")
    return None


@torch.library.custom_op("lychee::index_ready", mutates_args=("idx",))
def index_ready(idx: torch.Tensor, hold: list[torch.Tensor]) -> None:
    if idx.is_cuda:
        from ..lowering.deferred import wait_select_rows
        wait_select_rows(idx)


@index_ready.register_fake
def _(idx, hold):
    return None


def index_ready_op():
    return torch.ops.lychee.index_ready.default
