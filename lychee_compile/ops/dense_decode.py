"""`torch.ops.lychee.dense_decode`: plain dense attention of a row's newest positions over exactly its valid keys,
native GQA.

    dense_decode(q, k, v, valid, scale) -> out

This is NOT lychee's method. With one query (a decode step) it is the "best dense path" that speed claims are
measured against (LycheeConfig attention="flash_dense"): the same rewritten model, but every global layer attends
densely, reading only the valid keys (no repeat_kv copy, no masked attention over max_cache_len as HF does). With L
queries it is rectification's re-encode (passes/rewrite.py, rectify.py): the R re-encoded tokens attend the cache
densely, causally among themselves.

Names and shapes:
    q      [B, Hq, L, D]     Hq = Hkv * G; the queries are each row's L newest valid positions end_b - L ... end_b - 1
                             (their keys are in k already: the cache write precedes attention)
    k, v   [B, Hkv, T, D]    un-expanded cache, T = capacity (static) or length (dynamic)
    valid  bool [B, T]       each row's valid positions form ONE contiguous range [start_b, end_b) -- what the last
                             query's mask row gives (left padding, then every position up to the newest one); the
                             same contract the hybrid Triton kernel relies on. end_b - start_b >= L
    out    [B, Hq, L, D]     q.dtype, contiguous; query i attends the valid positions up to end_b - L + i
On CUDA with fp16/bf16 it runs FlashAttention-2 varlen with `seqused_k` (no host sync, CUDA-graph safe): each
(row, KV head) is one variable-length sequence starting at start_b with end_b - start_b keys, its L queries a
sequence of L tokens whose G query heads are the heads of a multi-query group, causal (aligned to the last key, as
FlashAttention-2 aligns a shorter query). Elsewhere it runs the masked reference below.
"""
from __future__ import annotations

import torch

from .reference import masked_softmax


def dense_decode_reference(q, k, v, valid, scale: float) -> torch.Tensor:
    """The definition of correctness: softmax over the valid positions up to each query's own, fp32 scores, GQA by
    grouping."""
    B, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, L, D)                          # [B, Hkv, G, L, D]
    scores = torch.einsum("bhgld,bhtd->bhglt", qg, k.float()) * scale     # [B, Hkv, G, L, T]
    pos = torch.arange(T, device=q.device)
    end = torch.where(valid, pos, -1).amax(-1) + 1                        # [B] one past the newest valid position
    own = end[:, None] - L + torch.arange(L, device=q.device)             # [B, L] each query's position
    allowed = valid[:, None, :] & (pos[None, None, :] <= own[:, :, None])  # [B, L, T]
    probs = masked_softmax(scores, allowed[:, None, None])
    out = torch.einsum("bhglt,bhtd->bhgld", probs, v.float())
    return out.reshape(B, Hq, L, D).to(q.dtype).contiguous()


def _flash_varlen(q, k, v, valid, scale: float) -> torch.Tensor:
    B, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, n = Hq // Hkv, B * Hkv
    v8 = valid.to(torch.int8)
    start = v8.argmax(dim=-1).to(torch.int32)                            # first valid position  [B]
    end = (T - v8.flip(-1).argmax(dim=-1)).to(torch.int32)               # one past the last one [B]
    offsets = torch.arange(n + 1, device=q.device, dtype=torch.int32) * T
    cu_k = offsets + torch.nn.functional.pad(start.repeat_interleave(Hkv), (0, 1))
    used = (end - start).repeat_interleave(Hkv)                          # [B * Hkv]
    cu_q = torch.arange(n + 1, device=q.device, dtype=torch.int32) * L
    rows = q.view(B, Hkv, G, L, D).transpose(2, 3).reshape(n * L, G, D)  # sequence (b, h): L tokens x G heads
    out = torch.ops.aten._flash_attention_forward(
        rows, k.reshape(n * T, 1, D), v.reshape(n * T, 1, D), cu_q, cu_k, L, T, 0.0, L > 1,
        False, scale=scale, seqused_k=used)[0]                            # [B * Hkv * L, G, D]
    return out.view(B, Hkv, L, G, D).transpose(2, 3).reshape(B, Hq, L, D).contiguous()


def flash_path(q, k) -> bool:
    """Whether dense_decode runs FlashAttention-2 varlen for these tensors (else its masked reference)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and k.is_contiguous() and q.shape[-1] <= 256)


@torch.library.custom_op("lychee::dense_decode", mutates_args=())
def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                 scale: float) -> torch.Tensor:
    if flash_path(q, k) and v.is_contiguous():
        return _flash_varlen(q.contiguous(), k, v, valid, scale)
    return dense_decode_reference(q, k, v, valid, scale)


@dense_decode.register_fake
def _(q, k, v, valid, scale):
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of KV heads")
    return q.new_empty(q.shape)                      # contiguous, as both implementations return it
