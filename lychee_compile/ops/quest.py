"""Quest-style block descriptors (ReSA §2.1): per KV block, element-wise min and max of its valid keys, and the
upper bound they give on any query's score against the block:

    bound(q, blk) = sum_i max(q_i * kmin_i, q_i * kmax_i)        (>= q . k for every key k of the block)

With GQA the group's G queries are pooled into their mean (one bound per KV head). Modes (LycheeConfig.quest):
    QUEST_OFF     0  unused
    QUEST_ALL     1  every head attends sink + local + its own top-K blocks by the bound (the Quest baseline)
    QUEST_SPARSE  2  a sparse head attends its inherited blocks + its own top `quest_blocks` blocks by the bound

Two ways to get the descriptors, with the same values:
  - stateless (lychee::hybrid_decode with quest_mode != 0): block_min_max over the whole cache on every call; the
    definition, and what the op-level tests compare against;
  - incremental (what rewritten models use: quest_decode_step in quest_decode.py, and the eager definition it is
    tested against, lychee::hybrid_decode_quest): descriptors live in a cross-step state buffer and a decode step
    recomputes only the block holding each row's newest valid key.

State layout (one buffer per compiled model, the non-persistent buffer `_lychee_quest`, static address):

    desc: [B, Lg, Hkv, NB, 2, D]   desc[..., 0, :] = kmin, desc[..., 1, :] = kmax (+inf / -inf: no valid key);
        block j of row b is text-relative: positions [lo_b + j * block_size, ...) (row_alignment.py)
        Lg  global layers (slot i = the i-th global layer in layer order)
        NB  >= ceil(cache capacity / block_size): a static cache's capacity, or max_position_embeddings for a
            cache that grows (DynamicCache)
        dtype: the KV cache's dtype (fp32 for dtypes without an infinity). Min and max pick one of the keys, so
            they are exact in the keys' own dtype: fp32 would double the size for nothing.
        Size: 2 * D values per (block, layer, KV head) against 2 * block_size * D for K and V: 1 / block_size of
        the KV cache at the same capacity (6.25% at block_size 16).
Maintenance (state_buffers.py, rectify.py): every eager forward that carries a cache (the prefill) recomputes every
block from the cache after it returns (+inf / -inf where a block has no valid key); a compiled decode step appends
one key per row and recomputes that key's block only, in place in the buffer (fold_newest_key_: one block per row,
layer and KV head written, nothing copied); a rectification's re-encode of each row's R newest keys recomputes the
blocks holding them (fold_recent_keys_, at most ceil((R - 1) / block_size) + 1 per row, layer and KV head).
Invariant: every block holding a valid key describes exactly its valid keys. Blocks without a valid key are
unspecified (normally +inf / -inf from the last rebuild, but a decode step on a cache whose mask lost positions --
a cache reused from a longer sequence, say -- leaves the old values there); nothing reads them, because every
pick is restricted to valid blocks (reference.pick_blocks / block_masks' valid_blk), and a block that gains a
valid key is the newest key's block, recomputed from scratch in that step.
"""
from __future__ import annotations

import torch

from .row_alignment import row_range, row_start, to_text

QUEST_MODES = {"off": 0, "all": 1, "sparse": 2}


def block_min_max(k: torch.Tensor, valid: torch.Tensor, block_size: int, num_blocks: int):
    """k [B, H, T, D], valid bool [B, T] -> (kmin, kmax) fp32 [B, H, nb, D] over valid keys (+inf / -inf if none),
    per text-relative block (row_alignment.py)."""
    B, H, T, D = k.shape
    pad = num_blocks * block_size - T
    lo = row_start(valid)
    kf = torch.nn.functional.pad(to_text(k.float(), lo, dim=2), (0, 0, 0, pad))
    ok = torch.nn.functional.pad(to_text(valid, lo, fill=False), (0, pad), value=False)[:, None, :, None]
    inf = torch.tensor(float("inf"))
    kmin = torch.where(ok, kf, inf).unflatten(2, (num_blocks, block_size)).amin(3)
    kmax = torch.where(ok, kf, -inf).unflatten(2, (num_blocks, block_size)).amax(3)
    return kmin, kmax


def descriptor_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """The state's dtype: the keys' own when it has an infinity (min / max are exact there), else fp32."""
    return key_dtype if key_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def block_descriptors(k: torch.Tensor, valid: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Every block's descriptor from scratch: [B, H, num_blocks, 2, D] in descriptor_dtype(k.dtype)."""
    return torch.stack(block_min_max(k, valid, block_size, num_blocks), dim=3).to(descriptor_dtype(k.dtype))


def fold_newest_key_(desc: torch.Tensor, slot: int, k: torch.Tensor, valid: torch.Tensor, block_size: int,
                     ranges: torch.Tensor | None = None) -> None:
    """One decode step of one layer, IN PLACE: in desc [B, Lg, H, NB, 2, D] (the whole descriptor buffer, the
    previous step's), slot `slot`'s block of each row's newest valid key, (hi - 1 - lo) // block_size
    (text-relative), is recomputed from k [B, H, T, D] (block_size keys); nothing else is written. A row with no
    valid key writes +inf / -inf into its block 0, which holds no valid
    key then (unspecified blocks: module docstring).

    The write is one index_put_ on the desc itself, not on a view of its slot: functionalized, an in-place write
    through a view of a graph input becomes view-scatters of the whole slot that Inductor's reinplace pass leaves
    as copies (a slot copy per layer and a whole-desc copy back per step); a write to the input itself is an
    index_put chain ending in a copy_ into that input, which it turns back into an in-place scatter of these
    B * H * 2 * D values.
    """
    fold_recent_keys_(desc, slot, k, valid, block_size, 1, ranges)


def fold_recent_keys_(desc: torch.Tensor, slot: int, k: torch.Tensor, valid: torch.Tensor, block_size: int,
                      n: int, ranges: torch.Tensor | None = None) -> None:
    """fold_newest_key_ for each row's `n` newest valid positions (a rectification's re-encode rewrote their keys):
    the ceil((n - 1) / block_size) + 1 blocks from the one holding position hi - n up to the newest key's are
    recomputed from k, in place; none past the newest key's block (a block index repeated there writes the same
    values). Every other block's keys are unchanged, so the buffer describes the cache as a full rebuild would."""
    B, H, T, D = k.shape
    nb = -(-T // block_size)
    if (desc.dim() != 6 or desc.shape[0] != B or not 0 <= slot < desc.shape[1] or desc.shape[2] != H
            or desc.shape[3] < nb or tuple(desc.shape[4:]) != (2, D)):
        raise ValueError(f"Quest descriptors of shape {tuple(desc.shape)} (slot {slot}) do not fit keys "
                         f"{tuple(k.shape)}: expected [{B}, Lg > {slot}, {H}, NB >= {nb}, 2, {D}] (NB blocks of "
                         f"{block_size} must cover the cache).")
    dev = k.device
    count = -(-(n - 1) // block_size) + 1                                          # blocks n positions can touch
    lo, n_valid = row_range(valid, ranges)                                         # [B]; (0, 0): no valid key
    newest = lo + n_valid - 1                                                      # [B]; -1: no valid key
    last = (newest - lo).clamp_min(0) // block_size                                # [B] text-relative
    first = (newest - lo - (n - 1)).clamp_min(0) // block_size                     # [B]
    blk = torch.minimum(first[:, None] + torch.arange(count, device=dev), last[:, None])   # [B, count]
    tok = (lo[:, None, None] + blk[:, :, None] * block_size
           + torch.arange(block_size, device=dev)).flatten(1)                      # [B, count * bs] positions
    inside = tok < T                                                               # the last block may be short
    tok = tok.clamp(max=T - 1)
    ok = (torch.gather(valid, 1, tok) & inside)[:, None, :, None]                  # [B, 1, count * bs, 1]
    keys = torch.gather(k, 2, tok[:, None, :, None].expand(B, H, tok.shape[1], D)).float()
    inf = torch.tensor(float("inf"), device=dev)
    per_block = (B, H, count, block_size, D)
    fresh = torch.stack([torch.where(ok, keys, inf).view(per_block).amin(3),
                         torch.where(ok, keys, -inf).view(per_block).amax(3)], 3)  # [B, H, count, 2, D]
    where = (torch.arange(B, device=dev)[:, None, None], torch.full((1, 1, 1), slot, dtype=torch.long, device=dev),
             torch.arange(H, device=dev)[None, :, None], blk[:, None, :])          # each broadcasts to [B, H, count]
    desc.index_put_(where, fresh.to(desc.dtype))


def quest_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q fp32 [B, H, G, D] (pooled over G), descriptors [B, H, nb, D] -> bound fp32 [B, H, nb]."""
    qbar = q.mean(dim=2)[:, :, None, :]                                   # [B, H, 1, D]
    lo, hi = qbar * kmin, qbar * kmax
    both = torch.maximum(lo, hi)
    return torch.where(torch.isfinite(both), both, 0.0).sum(-1)
