"""Training-time attention: every head computes a full map and a sparse map; the output is z·A_full + (1−z)·A_sparse.

A transformers AttentionInterface function ("lychee_mixed") used while a `MixedAttention` context is active.
It runs on *decode-style target tokens*: the prompt was encoded densely into the KV cache (shared by teacher and
student), and the L target tokens are fed with that cache, so query i sits at absolute position T − L + i and sees
keys [lo_b, T − L + i] (lo_b: row b's first real position, `MixedAttention.row_start`; 0 without padding). Each query
row is treated as one decode step of the spine (`ops/reference.py`):

- full map (per KV head's query group): softmax over every visible key; its block scores (sum over the group's query
  heads, per block of `block_size` positions aligned at the row's first real position lo_b, as the decode op's
  text-relative blocks: ops/row_alignment.py) pick the top-k candidate blocks (sink and local blocks
  excluded, ties to the lower block) — that selection is what the *next* global layer inherits, whatever z is
  (LycheeDecode Eq. 5);
- sparse map: softmax over the blocks inherited from the previous layer's selection of the same KV head, plus the
  sink blocks (first `sink_tokens` visible positions) and local blocks (last `local_tokens` visible positions);
- output = z_h·(A_full V) + (1 − z_h)·(A_sparse V), z_h shared by the KV head's query group.

The first layer (nothing to inherit) is all full attention (z = 1). The top-k selection is not differentiable (and
need not be): gradients reach z through the mixing only. Left-padded rows: set `row_start` (the attention function
gets no padding mask; the trainer uses batch 1 without padding).
"""
from __future__ import annotations

import contextlib

import torch

from ..ops.reference import (blocks_of_index, block_any, block_tokens, masked_softmax, select_top_blocks,
                             sink_local_blocks, text_block_sum)
from ..ops.row_alignment import to_text

NAME = "lychee_mixed"
_ACTIVE: list["MixedAttention"] = []


class MixedAttention:
    """State of one mixed forward. gates: float [num_layers, Hkv] (may require grad) or None (all full = dense).

    num_select: blocks a retrieval head selects (ceil(budget / block_size)).
    record: keep each layer's full-attention argmax positions per query head ([B, Hq, L] int64) in `argmax`.
    row_start: int [B] each row's first real position (its left padding), or None (no padding).
    """

    def __init__(self, gates: torch.Tensor | None, num_select: int, block_size: int = 16, sink_tokens: int = 16,
                 local_tokens: int = 64, first_layer: int = 0, record: bool = False,
                 row_start: torch.Tensor | None = None):
        self.row_start = row_start
        self.gates = gates
        self.num_select = int(num_select)
        self.block_size = int(block_size)
        self.sink_tokens = int(sink_tokens)
        self.local_tokens = int(local_tokens)
        self.first_layer = first_layer
        self.record = record
        self.inherited: torch.Tensor | None = None      # bool [B, Hkv, L, nb] blocks selected by the previous layer
        self.argmax: dict[int, torch.Tensor] = {}

    def reset(self):
        self.inherited = None
        self.argmax = {}


def mixed_attention(q, k, v, state: MixedAttention, layer: int, scale: float):
    """q [B, Hq, L, D]; k, v [B, Hkv, T, D] (cache + the L targets) -> out [B, Hq, L, D] (q.dtype)."""
    B, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bs = state.block_size
    nb = -(-T // bs)
    pos = torch.arange(T, device=q.device)
    last = T - L + torch.arange(L, device=q.device)                  # absolute position of each query
    lo = (torch.zeros(B, dtype=torch.long, device=q.device) if state.row_start is None
          else state.row_start.to(device=q.device, dtype=torch.long))                          # [B]
    valid = (pos <= last[:, None]) & (pos >= lo[:, None, None])      # [B, L, T]
    text = to_text(valid, lo, fill=False)                             # [B, L, T] text-relative (row_alignment.py)

    scores = torch.einsum("bhgld,bhtd->bhglt", q.float().reshape(B, Hkv, G, L, D), k.float()) * scale
    p_full = masked_softmax(scores, valid[:, None, None])              # [B, Hkv, G, L, T]
    out_full = torch.einsum("bhglt,bhtd->bhgld", p_full, v.float())
    if state.record:
        state.argmax[layer] = p_full.argmax(dim=-1).reshape(B, Hq, L)

    sink_blk, local_blk = (x[:, None] for x in sink_local_blocks(text, bs, nb, state.sink_tokens,
                                                                  state.local_tokens))          # [B, 1, L, nb]
    with torch.no_grad():
        block_score = text_block_sum(p_full.detach().sum(dim=2), lo, bs, nb)                    # [B, Hkv, L, nb]
        candidate = (block_any(text, bs, nb)[:, None] & ~sink_blk & ~local_blk).expand(B, Hkv, L, nb)
        selected = select_top_blocks(block_score, candidate, state.num_select)                  # [B, Hkv, L, K]
        selected = blocks_of_index(selected, nb)                                                 # bool [B,Hkv,L,nb]

    z = None
    if state.gates is not None and state.inherited is not None and layer != state.first_layer:
        z = state.gates[layer]
    if z is None:
        out = out_full
    else:
        sparse_blk = state.inherited | (sink_blk | local_blk)                                    # [B, Hkv, L, nb]
        sparse_tok = block_tokens(sparse_blk, lo, bs, T) & valid[:, None]                         # [B, Hkv, L, T]
        p_sparse = masked_softmax(scores, sparse_tok[:, :, None])
        out_sparse = torch.einsum("bhglt,bhtd->bhgld", p_sparse, v.float())
        z = z.to(device=out_full.device, dtype=out_full.dtype)      # gates live on the CPU, the model may not
        zz = z.reshape(-1, Hkv, 1, 1, 1) if z.dim() == 2 else z.reshape(1, Hkv, 1, 1, 1)
        out = zz * out_full + (1.0 - zz) * out_sparse
    state.inherited = selected
    return out.reshape(B, Hq, L, D).to(q.dtype)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The AttentionInterface entry: (module, q [B,Hq,L,D], k/v [B,Hkv,T,D], mask, ...) -> ([B,L,Hq,D], None)."""
    if not _ACTIVE:
        raise RuntimeError(f"attention '{NAME}' is only usable inside a lychee_compile.training MixedAttention "
                           "context (use_mixed_attention(model, state)).")
    state = _ACTIVE[-1]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if key.shape[1] != query.shape[1] and query.shape[1] % key.shape[1] != 0:
        raise ValueError(f"query heads {query.shape[1]} are not a multiple of KV heads {key.shape[1]}")
    out = mixed_attention(query, key, value, state, module.layer_idx, float(scaling))
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention_forward)


@contextlib.contextmanager
def use_mixed_attention(model, state: MixedAttention):
    """Route the model's attention through `attention_forward` with `state` for the duration of the block."""
    register()
    config = model.config
    old = config._attn_implementation
    config._attn_implementation = NAME
    for sub in model.modules():   # sub-configs (if any) share the object on Llama-like models; set where different
        c = getattr(sub, "config", None)
        if c is not None and c is not config and getattr(c, "_attn_implementation", None) == old:
            c._attn_implementation = NAME
    _ACTIVE.append(state)
    state.reset()
    try:
        yield state
    finally:
        _ACTIVE.pop()
        config._attn_implementation = old
        for sub in model.modules():
            c = getattr(sub, "config", None)
            if c is not None and getattr(c, "_attn_implementation", None) == NAME:
                c._attn_implementation = old
