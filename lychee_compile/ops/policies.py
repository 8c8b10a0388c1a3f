"""Selection policies of retrieval heads (LycheeDecode §4.4.1): how many of the ranked candidate blocks to keep.

Every policy ranks candidates by block score (sum over the G query heads of softmax probs; ties to the lower block;
a retrieval head's top-k at 12 significant bits, see RANK_DROP_BITS) and keeps a prefix of that ranking, at most K = LycheeConfig.num_select blocks -- the fixed
capacity of the index state, so kernels and CUDA graphs see a static size; unused slots hold EMPTY.

    topk       keep K
    topp       keep the shortest prefix whose attention mass, together with the always-attended sink and local
               blocks, reaches p (mass = the group's mean probability, so it sums to 1 over the valid positions)
    threshold  keep candidates whose mass is >= tau
    ratio      keep ceil(theta * valid blocks)

Codes are ints so they travel as op arguments. The Triton combine kernel (lowering/kernels/selection_helpers.py.jinja:
_lychee_keep_count) computes the same n on the device; its topp sums the masses in another order than cumsum, so a
prefix sum within fp32 rounding of p can end one block apart there.
"""
from __future__ import annotations

import torch

from .index_state import EMPTY, INDEX_DTYPE

POLICIES = {"topk": 0, "topp": 1, "threshold": 2, "ratio": 3}

# A retrieval head's top-k (reference.py) ranks scores with the low RANK_DROP_BITS bits of the fp32 mantissa cleared (rounded toward zero: 12
# significant bits). Two scores more than 2^-11 ~ 4.9e-4 apart (relative) keep their order, so the selected set is
# the exact-score top-k wherever the k-th and (k+1)-th scores differ by more than 1e-3 (the kernel issue's bar);
# closer ones are ties, resolved to the lower block. Why: the kernel's threshold search then covers 20 bits, not 31
# (10 counting passes instead of 16 in the device's single-program latency chain). The mass-based policies (topp,
# threshold, ratio) rank exact scores: the count they keep depends on exact masses. Quest and heat picks
# (select_top_blocks: plain tensor ops in the heat.py / quest_decode.py composites, no kernel search) rank exact
# scores too.
RANK_DROP_BITS = 11


def rank_score(score: torch.Tensor) -> torch.Tensor:
    """fp32 scores with the low RANK_DROP_BITS mantissa bits cleared (monotone: never reorders, only ties)."""
    bits = score.to(torch.float32).contiguous().view(torch.int32)
    return (bits & ~((1 << RANK_DROP_BITS) - 1)).view(torch.float32)


def keep_counts(policy: int, param: float, ranked_mass: torch.Tensor, n_candidates: torch.Tensor,
                fixed_mass: torch.Tensor, valid_blocks: torch.Tensor, capacity: int) -> torch.Tensor:
    """How many ranked candidates each (row, head) keeps: int64 [B, H].

    ranked_mass fp32 [..., R]: mass of the ranked candidates (0 past the last candidate); n_candidates int64 [...];
    fixed_mass fp32 [...]: mass of the sink and local blocks; valid_blocks int64 broadcastable to [...].
    """
    if policy == POLICIES["topk"]:
        n = torch.full(ranked_mass.shape[:-1], capacity, dtype=torch.int64, device=ranked_mass.device)
    elif policy == POLICIES["topp"]:
        need = (param - fixed_mass).clamp_min(0)[..., None]                          # [B, H, 1]
        reached = torch.cumsum(ranked_mass, dim=-1) >= need - 1e-6                    # first True = enough
        n = torch.where(need[..., 0] <= 0, torch.zeros_like(n_candidates),
                        reached.to(torch.int64).argmax(-1) + 1)
        n = torch.where(reached.any(-1), n, n_candidates)
    elif policy == POLICIES["threshold"]:
        n = (ranked_mass >= param).sum(-1)
    elif policy == POLICIES["ratio"]:
        n = torch.ceil(param * valid_blocks.to(torch.float32)).to(torch.int64).expand(ranked_mass.shape[:-1])
    else:
        raise ValueError(f"unknown selection policy code {policy}; known: {POLICIES}")
    return n.clamp(max=capacity)


def ranked_selection(block_score: torch.Tensor, candidate: torch.Tensor, capacity: int, group: int, policy: int,
                     param: float, fixed_mass: torch.Tensor, valid_blocks: torch.Tensor) -> torch.Tensor:
    """The policy's selection, sorted ascending and EMPTY-padded: int32 [..., capacity].

    block_score fp32 [..., nb] (sum over the group's G heads of probs); candidate bool [..., nb].
    """
    nb = block_score.shape[-1]
    # `capacity` non-candidate columns past the last block: the ranking is always >= capacity wide, so there is no
    # branch on nb (a symbolic size under dynamic shapes: a guard) and the padding slots come out EMPTY by themselves.
    score = torch.nn.functional.pad(block_score, (0, capacity))                   # [..., nb + capacity]
    candidate = torch.nn.functional.pad(candidate, (0, capacity), value=False)
    keyed = score.masked_fill(~candidate, float("-inf"))
    order = torch.sort(keyed, dim=-1, descending=True, stable=True).indices     # ties: the lower block first
    taken = torch.gather(candidate, -1, order)
    ranked_mass = torch.where(taken, torch.gather(score, -1, order) / group, 0.0)
    n = keep_counts(policy, param, ranked_mass, taken.sum(-1), fixed_mass, valid_blocks, capacity)
    rank = torch.arange(order.shape[-1], device=order.device)
    keep = taken & (rank < n[..., None])
    chosen = torch.sort(torch.where(keep, order, torch.full_like(order, nb)), dim=-1).values[..., :capacity]
    return torch.where(chosen == nb, torch.full_like(chosen, EMPTY), chosen).to(INDEX_DTYPE)


# Picks of at most this many blocks take k chained max-reductions over the row, which Inductor fuses into ONE
# reduction kernel; wider picks take torch.topk. Measured on the H100 (Llama-3-8B shapes, 2048 blocks of 64 at
# 128K, heat picks of 8): torch.topk over int64 keys is an extern radix select of ~36 us per layer.
CHAINED_TOPK_MAX = 16


def select_top_blocks(block_score: torch.Tensor, candidate: torch.Tensor, k: int) -> torch.Tensor:
    """Plain top-k (the default policy): [..., nb] scores and candidates -> int32 [..., k], ascending, EMPTY-padded:
    the k candidates with the largest exact score, ties to the lower block (= ranked_selection's top-k).

    Ranks unique int64 keys (score's order-preserving int32 bits, then the block reversed) instead of sorting twice:
    this runs per layer and step inside compiled graphs (heat and Quest picks), over every block."""
    nb = block_score.shape[-1]
    bits = (block_score.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)   # + 0.0: -0.0 -> +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                # monotone in the float value
    # low 32 bits: nb - 1 - block (small, so no int32 overflow where a compiler narrows the index arithmetic)
    rev = nb - 1 - torch.arange(nb, device=block_score.device, dtype=torch.int64)
    key = ordered * 2**32 + rev                                             # unique; larger = better
    low = torch.iinfo(torch.int64).min                                      # "not a candidate"
    top = _largest_keys(torch.where(candidate, key, low), k, low)           # [..., k] descending
    chosen = torch.where(top == low, nb, nb - 1 - (top - torch.div(top, 2**32, rounding_mode="floor") * 2**32))
    chosen = torch.sort(chosen, dim=-1).values
    return torch.where(chosen == nb, EMPTY, chosen).to(INDEX_DTYPE)


def _largest_keys(key: torch.Tensor, k: int, low: int) -> torch.Tensor:
    """The k largest of unique int64 keys [..., nb], descending, `low`-padded when fewer than k exceed `low`."""
    if k > CHAINED_TOPK_MAX:
        padded = torch.nn.functional.pad(key, (0, k), value=low)            # width >= k, no guard on nb
        return torch.topk(padded, k, dim=-1).values
    tops = [key.amax(-1, keepdim=True)]
    for _ in range(k - 1):       # the next key is the largest below the last one (keys are unique)
        tops.append(torch.where(key < tops[-1], key, low).amax(-1, keepdim=True))
    return torch.cat(tops, dim=-1)
