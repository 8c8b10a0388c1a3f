"""Eager PyTorch reference of one hybrid decode step: the definition of correctness for every other path.

Names and shapes (one global layer, decode step, query length 1):
    q        [B, Hq, 1, D]   queries; Hq = Hkv * G (G query heads per KV head, GQA group)
    k, v     [B, Hkv, T, D]  the un-expanded KV cache; T = cache capacity (static) or current length (dynamic)
    valid    bool [B, T]     positions the row's attention mask allows (left padding: [pad_b, pos+1))
Blocks are text-relative (row_alignment.py): block j of row b is the positions [lo_b + j*bs, lo_b + (j+1)*bs),
lo_b = the row's first valid position, so a padded prompt gets the blocks it gets alone; idx, extra, mass, heat and
the Quest descriptors all number blocks this way, nb = ceil(T / bs) per row (blocks past the row's end hold no
valid position). Without padding block j is the positions [j*bs, (j+1)*bs).
    retrieval bool [Hkv]     True: retrieval head (full attention + selection); False: sparse head
    idx_in   int32 [B, Hkv, K]  index state from the previous global layer (see index_state.py)
    out      [B, Hq, 1, D]   attention output, q.dtype
    idx_out  int32 [B, Hkv, K]
    policy, policy_param   how many ranked blocks a retrieval head keeps (policies.py; default top-K)
    select   bool [Hkv] or None   retrieval heads whose selection is read downstream; the others output EMPTY rows
    extra    int32 [B, Hkv, KX] or None   blocks a sparse head attends in addition, in this layer only (heat picks,
             Quest picks: the composites in heat.py / quest_decode.py); EMPTY = unused slot. Not passed on in
             idx_out. Kernels require each row's blocks distinct and disjoint from idx_in's row (the composites
             pick among blocks outside it); the reference takes the union either way
    mass     fp32 [B, Hkv, nb] (with_mass=True)   probability mass the head put on each block this step, summed
             over its G query heads (0 where it attended nothing): the heat update's input
    quest_desc  [B, Hkv, NB, 2, D] or None   Quest descriptors of the previous step (ops/quest.py); given, the
             bound uses them after updating the newest key's block, and the updated copy is returned (the input is
             not written: the composite quest_decode_step is the in-place form)
All scores and probabilities are fp32; a retrieval head's top-k ranks block scores at 12 significant bits
(policies.RANK_DROP_BITS: closer scores are ties, to the lower block).
"""
from __future__ import annotations

import torch

from . import sparsity
from .index_state import EMPTY, INDEX_DTYPE
from .quest import QUEST_MODES, block_min_max, fold_newest_key_, quest_bound
from .policies import POLICIES, rank_score, ranked_selection, select_top_blocks
from .row_alignment import row_range, to_cache, to_text


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to `mask`; a row with nothing allowed gives zeros, never NaN."""
    neg_inf = torch.finfo(scores.dtype).min
    masked = scores.masked_fill(~mask, neg_inf)
    row_max = masked.amax(dim=-1, keepdim=True)
    e = torch.where(mask, torch.exp(masked - row_max), torch.zeros((), dtype=scores.dtype))
    return e / e.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


def block_any(tok: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """[..., T] bool -> [..., num_blocks] bool: does any position of the block hold True."""
    pad = num_blocks * block_size - tok.shape[-1]
    padded = torch.nn.functional.pad(tok, (0, pad), value=False)
    return padded.unflatten(-1, (num_blocks, block_size)).any(dim=-1)


def block_sum(tok: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    pad = num_blocks * block_size - tok.shape[-1]
    padded = torch.nn.functional.pad(tok, (0, pad), value=0.0)
    return padded.unflatten(-1, (num_blocks, block_size)).sum(dim=-1)


def sink_local_blocks(valid: torch.Tensor, block_size: int, num_blocks: int, sink_tokens: int, local_tokens: int,
                      n_valid: torch.Tensor | None = None):
    """Blocks holding the first `sink_tokens` / last `local_tokens` valid positions of each row: valid bool [..., T]
    -> 2 x bool [..., nb].
    Blocks are counted from position 0 of `valid`'s axis: pass it text-relative (block_masks does), so each row's
    valid positions are [0, n) (row_alignment.py) and the i-th valid position is position i. n_valid int [...]:
    n when known (else valid's sum)."""
    # Positions, not a running count (cumsum): a scan in the Quest / heat decode graphs met an Inductor bug
    # (row_alignment.row_range says which).
    t = torch.arange(valid.shape[-1], device=valid.device)                        # [T]
    n = valid.sum(dim=-1, keepdim=True) if n_valid is None else n_valid[..., None]   # [..., 1]
    sink_tok = valid & (t < sink_tokens)
    local_tok = valid & (t >= n - local_tokens)
    return block_any(sink_tok, block_size, num_blocks), block_any(local_tok, block_size, num_blocks)


def block_masks(valid: torch.Tensor, block_size: int, num_blocks: int, sink_tokens: int, local_tokens: int,
                ranges: torch.Tensor | None = None):
    """(valid_blk, fixed_blk) bool [B, nb] of valid bool [B, T] (cache positions), in text-relative blocks: blocks
    holding a valid position; sink | local blocks (every head attends them, no index row stores them). ranges:
    row_range's."""
    lo, n = row_range(valid, ranges)
    text = to_text(valid, lo, fill=False)
    sink_blk, local_blk = sink_local_blocks(text, block_size, num_blocks, sink_tokens, local_tokens, n)
    return block_any(text, block_size, num_blocks), sink_blk | local_blk


def text_block_sum(tok: torch.Tensor, lo: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """[B, ..., T] per cache position -> [B, ..., nb] sums over text-relative blocks (row b's start lo [B])."""
    return block_sum(to_text(tok, lo), block_size, num_blocks)


def block_tokens(blk: torch.Tensor, lo: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """bool [B, ..., nb] text-relative blocks -> bool [B, ..., T = length]: the cache positions they cover."""
    return to_cache(blk.repeat_interleave(block_size, dim=-1)[..., :length], lo, fill=False)


def blocks_of_index(idx: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """int32 [B, H, K] index state -> bool [B, H, nb] membership (EMPTY and out-of-range slots ignored)."""
    idx = idx.to(torch.int64)
    real = (idx >= 0) & (idx < num_blocks)
    member = torch.zeros(*idx.shape[:-1], num_blocks + 1, dtype=torch.bool, device=idx.device)
    member.scatter_(-1, torch.where(real, idx, torch.full_like(idx, num_blocks)), True)
    return member[..., :num_blocks]


def sparse_set(idx: torch.Tensor, fixed_blk: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """What a sparse head attends: its index row's blocks | sink / local blocks, bool [B, H, nb]."""
    return blocks_of_index(idx, num_blocks) | fixed_blk[:, None, :]


def pick_blocks(score: torch.Tensor, excluded: torch.Tensor, valid_blk: torch.Tensor, n: int,
                eligible: torch.Tensor | None = None) -> torch.Tensor:
    """Top n blocks by exact score [B, H, nb] among valid blocks outside `excluded` (and inside `eligible`), ties to
    the lower block: int32 [B, H, max(n, 1)], ascending, EMPTY-padded (n = 0: one EMPTY slot, since kernels take no
    zero-width `extra`). The heat / Quest picks; outside the sparse set, they meet hybrid_decode_mass's contract."""
    if n == 0:
        return torch.full((*score.shape[:-1], 1), EMPTY, dtype=INDEX_DTYPE, device=score.device)
    allowed = (valid_blk[:, None, :] & ~excluded).expand_as(score)                  # [B, H, nb]
    if eligible is not None:
        allowed = allowed & eligible
    return select_top_blocks(score, allowed, n)


def heat_picks(heat: torch.Tensor, sparse_blk: torch.Tensor, valid_blk: torch.Tensor, n: int) -> torch.Tensor:
    """EvoSparse: a sparse head also attends its n hottest blocks (heat fp32 [B, H, NBH >= nb] of earlier steps, > 0
    only) outside its sparse set [B, H, nb]: int32 [B, H, max(n, 1)]."""
    # A copy cut to nb (negative pad), not heat[..., :nb]: at a symbolic nb that view of the static-width buffer
    # guards nb != NBH (its contiguity), a recompile at the buffer's last block.
    hot = torch.nn.functional.pad(heat, (0, sparse_blk.shape[-1] - heat.shape[-1]))          # [B, H, nb]
    return pick_blocks(hot, sparse_blk, valid_blk, n, eligible=hot > 0)


def heat_update(heat: torch.Tensor, mass: torch.Tensor, heat_decay: float) -> torch.Tensor:
    """h_t = decay * h_{t-1} + mass [B, H, nb] (the probabilities this head computed this step, summed over its G
    query heads, per block) on the cache's blocks; heat's tail [nb, NBH) is returned unchanged."""
    nb, nbh = mass.shape[-1], heat.shape[-1]
    # Full-width where, not heat[..., nb:] + cat: slicing the static-width buffer at a symbolic nb (DynamicCache)
    # guards on the tail's size (empty, one block), i.e. a recompile near the buffer's end.
    grown = torch.nn.functional.pad(mass, (0, nbh - nb))                             # [B, H, NBH], 0 past nb
    cache_blk = torch.arange(nbh, device=heat.device) < nb                           # [NBH]
    return torch.where(cache_blk, heat_decay * heat + grown, heat)


def grouped_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [B, Hq, 1, D] -> fp32 [B, Hkv, G, D] (query head j belongs to KV head j // G)."""
    return q.float().reshape(q.shape[0], kv_heads, -1, q.shape[-1])


def descriptor_bound(q: torch.Tensor, desc: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Quest bound fp32 [B, Hkv, nb] of q [B, Hq, 1, D] from descriptors [B, Hkv, NB >= nb, 2, D] (ops/quest.py)."""
    # a copy cut to nb, not a view: see heat_picks
    cut = torch.nn.functional.pad(desc, (0, 0, 0, 0, 0, num_blocks - desc.shape[2]))    # [B, H, nb, 2, D]
    kmin, kmax = cut.float().unbind(3)
    return quest_bound(grouped_queries(q, desc.shape[1]), kmin, kmax)


def hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, scale: float, block_size: int,
                            sink_tokens: int, local_tokens: int, policy: int = POLICIES["topk"],
                            policy_param: float = 0.0, heat=None, heat_decay: float = 0.0, heat_blocks: int = 0,
                            quest_mode: int = 0, quest_blocks: int = 0, select=None, quest_desc=None, extra=None,
                            with_mass: bool = False):
    """-> (out, idx_out) or, with `heat` fp32 [B, Hkv, NBH >= nb] given, (out, idx_out, heat_out) (see heat.py),
    or, with `quest_desc` given, (out, idx_out, desc_out) (see quest.py), or, with_mass, (out, idx_out, mass)."""
    B, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    if L != 1:
        raise ValueError(f"lychee::hybrid_decode is a decode-step op (query length 1); got query length {L}.")
    if quest_desc is not None and (not quest_mode or heat is not None):
        raise ValueError("Quest descriptors need quest_mode 'all' (1) or 'sparse' (2), and cannot be combined with "
                         f"heat yet; got quest_mode={quest_mode}, heat {'given' if heat is not None else 'absent'}.")
    G = Hq // Hkv
    nb = -(-T // block_size)
    k_sel = idx_in.shape[-1]

    scores = torch.einsum("bhgd,bhtd->bhgt", grouped_queries(q, Hkv), k.float()) * scale            # [B,Hkv,G,T]
    ranges = torch.ops.lychee.valid_ranges(valid)                                                  # int32 [2, B]
    lo = row_range(valid, ranges)[0]                                                               # [B]
    valid_blk, fixed_blk = block_masks(valid, block_size, nb, sink_tokens, local_tokens, ranges)   # [B, nb]

    # Retrieval heads: full attention over valid positions, block scores for the next layer's selection.
    p_full = masked_softmax(scores, valid[:, None, None, :])
    block_score = text_block_sum(p_full.sum(dim=2), lo, block_size, nb)                            # [B,Hkv,nb]
    candidate = (valid_blk & ~fixed_blk)[:, None, :].expand(B, Hkv, nb)
    fixed_mass = (block_score * fixed_blk[:, None, :]).sum(-1) / G                                 # [B, Hkv]
    ranked = rank_score(block_score) if policy == POLICIES["topk"] else block_score   # 12 significant bits
    selected = ranked_selection(ranked, candidate, k_sel, G, policy, policy_param, fixed_mass,
                                valid_blk.sum(-1, keepdim=True))

    # Sparse heads: inherited blocks plus sink and local blocks, valid positions only.
    sparse_blk = sparse_set(idx_in, fixed_blk, nb)                                                 # [B,Hkv,nb]
    if extra is not None:
        sparse_blk = sparse_blk | blocks_of_index(extra, nb)
    is_retrieval = retrieval.to(torch.bool)[None, :, None]                                          # [1,Hkv,1]
    if quest_mode:
        # Quest bound per block from min/max of its valid keys; QUEST_ALL: every head is a Quest head.
        if quest_desc is None:       # stateless: the definition, min / max over the whole cache
            bound = quest_bound(grouped_queries(q, Hkv), *block_min_max(k, valid, block_size, nb))
        else:                        # incremental: the state, with this step's key folded in (the same values)
            desc_out = quest_desc.clone()        # the functional form: the caller's state is left as it was
            fold_newest_key_(desc_out[:, None], 0, k, valid, block_size)          # a one-slot view of the copy
            bound = descriptor_bound(q, desc_out, nb)
        if quest_mode == QUEST_MODES["all"]:
            own = pick_blocks(bound, fixed_blk[:, None, :], valid_blk, k_sel)
            sparse_blk = sparse_set(own, fixed_blk, nb)
            is_retrieval = torch.zeros_like(is_retrieval)
            selected = idx_in = own
        else:
            sparse_blk = sparse_blk | blocks_of_index(pick_blocks(bound, sparse_blk, valid_blk, quest_blocks), nb)
    if heat is not None and heat_blocks > 0:
        # EvoSparse: a sparse head also attends its hottest blocks (heat of earlier steps), this layer only.
        sparse_blk = sparse_blk | blocks_of_index(heat_picks(heat, sparse_blk, valid_blk, heat_blocks), nb)
    sparse_tok = block_tokens(sparse_blk, lo, block_size, T) & valid[:, None, :]                   # [B,Hkv,T]

    attend = torch.where(is_retrieval, valid[:, None, :], sparse_tok)                              # [B,Hkv,T]
    p = torch.where(is_retrieval[..., None], p_full, masked_softmax(scores, attend[:, :, None, :]))
    out = torch.einsum("bhgt,bhtd->bhgd", p, v.float()).reshape(B, Hq, 1, D).to(q.dtype)
    if select is not None:   # a retrieval head nobody reads from selects nothing (kernels skip the top-k)
        selected = torch.where(select.to(torch.bool)[None, :, None], selected, torch.full_like(selected, EMPTY))
    idx_out = torch.where(is_retrieval, selected, idx_in)
    if sparsity.ACTIVE is not None:   # evaluation only (ops/sparsity.py): reads what was computed, changes nothing
        sparsity.ACTIVE.record(attend, valid, is_retrieval, idx_out, select)
    if quest_desc is not None:
        return out, idx_out, desc_out
    if heat is None and not with_mass:
        return out, idx_out
    mass = text_block_sum(p.sum(dim=2), lo, block_size, nb)                                        # [B,Hkv,nb]
    return (out, idx_out, mass) if with_mass else (out, idx_out, heat_update(heat, mass, heat_decay))
