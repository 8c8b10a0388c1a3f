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

    desc: [B, Lg, Hkv, NB, 2, D]   desc[..., 0, :] = kmin, desc[..., 1, :] = kmax (+inf / -inf: no valid key)
        Lg  global layers (slot i = the i-th global layer in layer order)
        NB  >= ceil(cache capacity / block_size): a static cache's capacity, or max_position_embeddings for a
            cache that grows (DynamicCache)
        dtype: the KV cache's dtype (fp32 for dtypes without an infinity). Min and max pick one of the keys, so
            they are exact in the keys' own dtype: fp32 would double the size for nothing.
        Size: 2 * D values per (block, layer, KV head) against 2 * block_size * D for K and V: 1 / block_size of
        the KV cache at the same capacity (6.25% at block_size 16).
Maintenance (state_buffers.py, rectify.py): every eager forward that carries a cache (the prefill, and each
rectification's dense re-encode) recomputes every block from the cache after it returns; a compiled decode step
appends one key per row and recomputes that key's block only (update_descriptors). Blocks without a valid key are
reset to +inf / -inf on every step, so the buffer never describes keys the mask does not allow (a cache reused
from a longer sequence, say).
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


def descriptor_dtype(key_dtype: torch.dtype) -> torch.dtype:
    """The state's dtype: the keys' own when it has an infinity (min / max are exact there), else fp32."""
    return key_dtype if key_dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def block_descriptors(k: torch.Tensor, valid: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Every block's descriptor from scratch: [B, H, num_blocks, 2, D] in descriptor_dtype(k.dtype)."""
    return torch.stack(block_min_max(k, valid, block_size, num_blocks), dim=3).to(descriptor_dtype(k.dtype))


def update_descriptors(desc: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """One decode step: desc [B, H, NB, 2, D] from the previous step -> an updated copy.

    Only the block of each row's newest valid key, (hi - 1) // block_size, is recomputed from k (block_size keys);
    the other blocks with valid keys keep their descriptor (their keys and validity did not change: a decode step
    appends one key), and blocks with no valid key get +inf / -inf. Blocks past the cache (>= ceil(T / block_size))
    are left as they are.
    """
    B, H, T, D = k.shape
    nb = -(-T // block_size)
    if desc.dim() != 5 or tuple(desc.shape[:2]) != (B, H) or desc.shape[2] < nb or tuple(desc.shape[3:]) != (2, D):
        raise ValueError(f"Quest descriptors of shape {tuple(desc.shape)} do not fit keys {tuple(k.shape)}: expected "
                         f"[{B}, {H}, NB >= {nb}, 2, {D}] (NB blocks of {block_size} must cover the cache).")
    pos = torch.arange(T, device=k.device)
    newest = torch.where(valid, pos, -1).amax(-1)                                  # [B]; -1: no valid key
    blk = newest.clamp_min(0) // block_size                                        # [B]
    tok = blk[:, None] * block_size + torch.arange(block_size, device=k.device)    # [B, bs] the block's positions
    inside = tok < T                                                               # the last block may be short
    tok = tok.clamp(max=T - 1)
    ok = (torch.gather(valid, 1, tok) & inside)[:, None, :, None]                  # [B, 1, bs, 1]
    keys = torch.gather(k, 2, tok[:, None, :, None].expand(B, H, block_size, D)).float()
    inf = torch.tensor(float("inf"), device=k.device)
    fresh = torch.stack([torch.where(ok, keys, inf).amin(2), torch.where(ok, keys, -inf).amax(2)], 2)  # [B,H,2,D]
    out = desc.clone()
    rows = torch.arange(B, device=k.device)
    out[rows, :, blk] = torch.where((newest >= 0)[:, None, None, None], fresh.to(desc.dtype), out[rows, :, blk])
    pad = nb * block_size - T
    has_key = torch.nn.functional.pad(valid, (0, pad), value=False).unflatten(-1, (nb, block_size)).any(-1)
    # Full width (blocks past the cache count as keeping theirs), not out[:, :, :nb]: at a symbolic nb (DynamicCache)
    # that view of the static-size state guards nb != NB, a recompile at the buffer's last block.
    keep = torch.nn.functional.pad(has_key, (0, desc.shape[2] - nb), value=True)  # [B, NB]
    empty = torch.stack([inf, -inf]).to(desc.dtype)[:, None]                       # [2, 1]
    return torch.where(keep[:, None, :, None, None], out, empty)


def quest_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q fp32 [B, H, G, D] (pooled over G), descriptors [B, H, nb, D] -> bound fp32 [B, H, nb]."""
    qbar = q.mean(dim=2)[:, :, None, :]                                   # [B, H, 1, D]
    lo, hi = qbar * kmin, qbar * kmax
    both = torch.maximum(lo, hi)
    return torch.where(torch.isfinite(both), both, 0.0).sum(-1)
