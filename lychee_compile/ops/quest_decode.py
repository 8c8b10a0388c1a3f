"""Quest decode step with incrementally kept descriptors: the composite `quest_decode_step` (what the rewrite emits)
and the opaque op `torch.ops.lychee.hybrid_decode_quest` (its eager definition, what tests compare against).

    quest_decode_step(q, k, v, valid, retrieval, idx_in, desc, slot, scale, block_size, sink_tokens,
                      local_tokens, policy, policy_param, quest_mode, quest_blocks) -> (out, idx_out)
        desc [B, Lg, Hkv, NB, 2, D]: the whole `_lychee_quest` buffer (layout: quest.py); slot: this layer's
        slot in it. The step writes this step's key's block of that slot into `desc` IN PLACE.
    hybrid_decode_quest(q, k, v, valid, retrieval, idx_in, desc, <the same scalars>) -> (out, idx_out, desc_out)
        desc [B, Hkv, NB, 2, D]: one slot; desc_out a new tensor (a functional custom op, so that tests and opcheck
        can compare it), desc left as it was.

Both fold this step's key into its block (only that block is read from k and written: fold_newest_key_), then rank
blocks by the bound from the updated descriptors; they agree on every block holding a valid key, the only blocks
the invariant in quest.py speaks of. The composite takes the whole buffer, not a view of its slot, because that is
the form Inductor turns back into an in-place scatter of one block per (row, KV head) after AOTAutograd has
functionalized it (fold_newest_key_ says why): no copy of the buffer, no write-back at the end of the graph.

Outputs equal lychee::hybrid_decode with the same quest_mode, which recomputes the descriptors from the whole cache,
as long as the buffer holds what the prefill, earlier decode steps and rectification put there (state_buffers.py).
quest_mode must be 1 ("all") or 2 ("sparse"); with Quest off the rewrite emits lychee::hybrid_decode.

The composite is plain tensor ops (descriptor update, bound, picks: AOTAutograd traces them into aten ops, which
Inductor fuses) around ONE attention op that has the Triton lowering: "all" ranks every head's own top-K by the
bound and runs lychee::hybrid_decode with every head sparse on them; "sparse" passes each sparse head's top
`quest_blocks` as lychee::hybrid_decode_mass's `extra` (its mass is dropped). Guard-free under symbolic cache lengths.
"""
from __future__ import annotations

import torch

from . import hybrid_decode  # noqa: F401  (registers lychee::hybrid_decode / hybrid_decode_mass)
from .quest import QUEST_MODES, fold_newest_key_
from .reference import block_masks, descriptor_bound, hybrid_decode_reference, pick_blocks, sparse_set


def quest_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                      retrieval: torch.Tensor, idx_in: torch.Tensor, desc: torch.Tensor, slot: int,
                      scale: float, block_size: int, sink_tokens: int, local_tokens: int, policy: int,
                      policy_param: float, quest_mode: int, quest_blocks: int,
                      ranges: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """lychee::hybrid_decode_quest as a composite that updates `desc[:, slot]` in place (module docstring).
    ranges: lychee::valid_ranges(valid), given once per graph by the rewrite (computed here when None)."""
    if quest_mode not in (QUEST_MODES["all"], QUEST_MODES["sparse"]):
        raise ValueError(f"quest_decode_step needs quest_mode 1 ('all') or 2 ('sparse'), got {quest_mode}.")
    nb = -(-k.shape[2] // block_size)
    ranges = torch.ops.lychee.valid_ranges(valid) if ranges is None else ranges                 # int32 [2, B]
    fold_newest_key_(desc, slot, k, valid, block_size, ranges)
    bound = descriptor_bound(q, desc[:, slot], nb)                                                # [B, Hkv, nb]
    valid_blk, fixed_blk = block_masks(valid, block_size, nb, sink_tokens, local_tokens, ranges)  # [B, nb]
    common = (scale, block_size, sink_tokens, local_tokens, policy, policy_param)
    if quest_mode == QUEST_MODES["all"]:
        # Every head is a sparse head on its own top-K (K = the index width); that selection is also idx_out.
        own = pick_blocks(bound, fixed_blk[:, None, :], valid_blk, idx_in.shape[-1])            # [B, Hkv, K]
        out, idx_out = torch.ops.lychee.hybrid_decode.default(q, k, v, valid, torch.zeros_like(retrieval), own,
                                                               *common)
        return out, idx_out
    extra = pick_blocks(bound, sparse_set(idx_in, fixed_blk, nb), valid_blk, quest_blocks)      # [B, Hkv, KX]
    out, idx_out, _ = torch.ops.lychee.hybrid_decode_mass.default(q, k, v, valid, retrieval, idx_in, extra, *common)
    return out, idx_out


@torch.library.custom_op("lychee::hybrid_decode_quest", mutates_args=())
def hybrid_decode_quest(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                        retrieval: torch.Tensor, idx_in: torch.Tensor, desc: torch.Tensor, scale: float,
                        block_size: int, sink_tokens: int, local_tokens: int, policy: int, policy_param: float,
                        quest_mode: int, quest_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens,
                                   policy, policy_param, quest_mode=quest_mode, quest_blocks=quest_blocks,
                                   quest_desc=desc)


@hybrid_decode_quest.register_fake
def _(q, k, v, valid, retrieval, idx_in, desc, scale, block_size, sink_tokens, local_tokens, policy, policy_param,
      quest_mode, quest_blocks):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be 4-D [B, H, T, D]")
    torch._check(q.shape[2] == 1, lambda: "hybrid_decode_quest takes query length 1")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of KV heads")
    torch._check(desc.dim() == 5, lambda: f"Quest descriptors must be [B, Hkv, NB, 2, D], got {desc.dim()}-D")
    torch._check(quest_mode in (1, 2), lambda: f"hybrid_decode_quest needs quest_mode 1 or 2, got {quest_mode}")
    return torch.empty_like(q), torch.empty_like(idx_in), torch.empty_like(desc)
