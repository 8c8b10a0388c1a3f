"""`torch.ops.lychee.hybrid_decode_quest`: hybrid_decode with Quest bounds from incrementally kept descriptors.

    hybrid_decode_quest(q, k, v, valid, retrieval, idx_in, desc, scale, block_size, sink_tokens, local_tokens,
                        policy, policy_param, quest_mode, quest_blocks) -> (out, idx_out, desc_out)

desc [B, Hkv, NB, 2, D] is this layer's slice of the `_lychee_quest` state (layout: quest.py): the descriptors as
the previous step left them. The op folds this step's key into its block (only that block is read from k), ranks
blocks by the bound from the result, and returns the updated copy; the thread_slots pass writes the layers' copies
back into the state at the end of the graph. Outputs equal lychee::hybrid_decode with the same quest_mode, which
recomputes the descriptors from the whole cache, as long as the state holds what the prefill, earlier decode steps
and rectification put there (state_buffers.py). quest_mode must be 1 ("all") or 2 ("sparse"); with Quest off the
rewrite emits lychee::hybrid_decode. No lowering yet: Inductor calls this eager reference as an extern kernel.
"""
from __future__ import annotations

import torch

from .reference import hybrid_decode_reference


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
