"""Cross-step heat (EvoSparse §3.2-3.3): ops and the state they thread.

State layout (one buffer per compiled model, registered on it as the non-persistent buffer `_lychee_heat`, so its
address is static across steps, as CUDA graphs need):

    heat: fp32 [B, Lg, Hkv, NBH]
        Lg   global layers (slot i = the i-th global layer in layer order)
        NBH  = ceil(max_position_embeddings / block_size) blocks, >= any cache's block count
    heat[b, i, h, blk] = sum over past decode steps t of decay^(now - t) * (probability mass the head put on the
    block at step t, summed over its G query heads; 0 where it did not attend). Zeroed at every prefill. Blocks are
    text-relative (row_alignment.py: block j of row b starts at the row's first valid position + j * block_size).
    Memory: 4 bytes per block per (layer, KV head) -- for block_size 16, 1/(16 * D * 2 * 2 / 4) of the bf16 KV cache
    (0.05% at D = 128).

Per decode step the pass threads it functionally (heat_in slice -> heat_decode_step -> heat_out slice) and writes
the stacked result back with `lychee::write_state` at the end of the graph; `lychee::bind_state`, called by the
model's wrapped forward, is what makes the buffer a graph input in the first place (both ops: ops/state.py).

Two definitions of one step, equal to the last bit:
    heat_decode_step     what the rewrite emits: a composite, plain tensor ops around ONE lychee::hybrid_decode_mass
                         call. It picks each sparse head's hottest blocks (`extra`) and folds the op's per-block mass
                         into the heat; AOTAutograd traces it into aten ops, which Inductor fuses, and the mass op gets
                         the Triton lowering of hybrid_decode. Guard-free under symbolic cache lengths (DynamicCache).
    lychee::hybrid_decode_heat   the opaque op over the eager reference (reference.py's heat branch): what the tests
                         compare the composite against.
"""
from __future__ import annotations

import torch

from . import hybrid_decode  # noqa: F401  (registers lychee::hybrid_decode_mass, called by the composite)
from .reference import block_masks, heat_picks, heat_update, hybrid_decode_reference, sparse_set


def heat_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     retrieval: torch.Tensor, idx_in: torch.Tensor, heat: torch.Tensor, scale: float,
                     block_size: int, sink_tokens: int, local_tokens: int, policy: int, policy_param: float,
                     heat_decay: float, heat_blocks: int,
                     ranges: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lychee::hybrid_decode_heat as a composite: (out, idx_out, heat_out), heat fp32 [B, Hkv, NBH] in and out.
    ranges: lychee::valid_ranges(valid), given once per graph by the rewrite (computed here when None)."""
    nb = -(-k.shape[2] // block_size)
    valid_blk, fixed_blk = block_masks(valid, block_size, nb, sink_tokens, local_tokens, ranges)  # [B, nb]
    extra = heat_picks(heat, sparse_set(idx_in, fixed_blk, nb), valid_blk, heat_blocks)         # [B, Hkv, KX]
    out, idx_out, mass = torch.ops.lychee.hybrid_decode_mass.default(
        q, k, v, valid, retrieval, idx_in, extra, scale, block_size, sink_tokens, local_tokens, policy, policy_param)
    return out, idx_out, heat_update(heat, mass, heat_decay)


@torch.library.custom_op("lychee::hybrid_decode_heat", mutates_args=())
def hybrid_decode_heat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                       retrieval: torch.Tensor, idx_in: torch.Tensor, heat: torch.Tensor, scale: float,
                       block_size: int, sink_tokens: int, local_tokens: int, policy: int, policy_param: float,
                       heat_decay: float, heat_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hybrid_decode plus heat: heat fp32 [B, Hkv, NBH] in, updated copy out (the eager definition; the rewrite
    emits heat_decode_step)."""
    return hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens,
                                   policy, policy_param, heat, heat_decay, heat_blocks)


@hybrid_decode_heat.register_fake
def _(q, k, v, valid, retrieval, idx_in, heat, scale, block_size, sink_tokens, local_tokens, policy, policy_param,
      heat_decay, heat_blocks):
    return torch.empty_like(q), torch.empty_like(idx_in), torch.empty_like(heat)
