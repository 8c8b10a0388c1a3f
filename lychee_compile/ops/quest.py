"""Quest-style block descriptors (ReSA §2.1): per KV block, element-wise min and max of its valid keys, and the
upper bound they give on any query's score against the block:

    bound(q, blk) = sum_i max(q_i * kmin_i, q_i * kmax_i)        (>= q . k for every key k of the block)

With GQA the group's G queries are pooled into their mean (one bound per KV head). Modes (LycheeConfig.quest):
    QUEST_OFF     0  unused
    QUEST_ALL     1  every head attends sink + local + its own top-K blocks by the bound (the Quest baseline)
    QUEST_SPARSE  2  a sparse head attends its inherited blocks + its own top `quest_blocks` blocks by the bound
The reference computes the descriptors from the cache on every call (exactly min/max over valid keys); keeping them
incrementally in a cache-side buffer is a kernel-side optimisation not built yet.
"""
from __future__ import annotations

import torch

QUEST_MODES = {"off": 0, "all": 1, "sparse": 2}


def block_min_max(k: torch.Tensor, valid: torch.Tensor, block_size: int, num_blocks: int):
    """k [B, H, T, D], valid bool [B, T] -> (kmin, kmax) fp32 [B, H, nb, D] over valid keys (+inf / -inf if none)."""
    B, H, T, D = k.shape
    pad = num_blocks * block_size - T
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, pad))
    ok = torch.nn.functional.pad(valid, (0, pad), value=False)[:, None, :, None]
    inf = torch.tensor(float("inf"))
    kmin = torch.where(ok, kf, inf).unflatten(2, (num_blocks, block_size)).amin(3)
    kmax = torch.where(ok, kf, -inf).unflatten(2, (num_blocks, block_size)).amax(3)
    return kmin, kmax


def quest_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q fp32 [B, H, G, D] (pooled over G), descriptors [B, H, nb, D] -> bound fp32 [B, H, nb]."""
    qbar = q.mean(dim=2)[:, :, None, :]                                   # [B, H, 1, D]
    lo, hi = qbar * kmin, qbar * kmax
    both = torch.maximum(lo, hi)
    return torch.where(torch.isfinite(both), both, torch.zeros(())).sum(-1)
