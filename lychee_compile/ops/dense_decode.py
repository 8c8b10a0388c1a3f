"""`torch.ops.lychee.dense_decode`: plain dense decode attention over exactly the valid length, native GQA.

    dense_decode(q, k, v, valid, scale) -> out

This is NOT lychee's method: it is the "best dense path" that speed claims are measured against (LycheeConfig
attention="flash_dense"): the same rewritten model, but every global layer attends densely, reading only the valid
keys (no repeat_kv copy, no masked attention over max_cache_len as HF does).

Names and shapes (query length 1):
    q      [B, Hq, 1, D]     Hq = Hkv * G
    k, v   [B, Hkv, T, D]    un-expanded cache, T = capacity (static) or length (dynamic)
    valid  bool [B, T]       each row's valid positions form ONE contiguous range [start_b, end_b) -- what a decode
                             step's mask gives (left padding, then every position up to the current one); the same
                             contract the hybrid Triton kernel relies on
    out    [B, Hq, 1, D]     q.dtype
On CUDA with fp16/bf16 it runs FlashAttention-2 varlen with `seqused_k` (no host sync, CUDA-graph safe): each
(row, KV head) is one variable-length sequence starting at start_b with end_b - start_b keys, and its G query heads
are the query heads of a multi-query group. Elsewhere it runs the masked reference below.
"""
from __future__ import annotations

import torch

from .reference import masked_softmax


def dense_decode_reference(q, k, v, valid, scale: float) -> torch.Tensor:
    """The definition of correctness: softmax over the valid positions, fp32 scores, GQA by grouping."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = q.float().view(B, Hkv, Hq // Hkv, D)                            # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, k.float()) * scale       # [B, Hkv, G, T]
    probs = masked_softmax(scores, valid[:, None, None, :])
    out = torch.einsum("bhgt,bhtd->bhgd", probs, v.float())
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def _flash_varlen(q, k, v, valid, scale: float) -> torch.Tensor:
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    n = B * Hkv
    v8 = valid.to(torch.int8)
    start = v8.argmax(dim=-1).to(torch.int32)                            # first valid position  [B]
    end = (T - v8.flip(-1).argmax(dim=-1)).to(torch.int32)               # one past the last one [B]
    offsets = torch.arange(n + 1, device=q.device, dtype=torch.int32) * T
    cu_k = offsets + torch.nn.functional.pad(start.repeat_interleave(Hkv), (0, 1))
    used = (end - start).repeat_interleave(Hkv)                          # [B * Hkv]
    cu_q = torch.arange(n + 1, device=q.device, dtype=torch.int32)
    out = torch.ops.aten._flash_attention_forward(
        q.reshape(n, Hq // Hkv, D), k.reshape(n * T, 1, D), v.reshape(n * T, 1, D), cu_q, cu_k, 1, T, 0.0, False,
        False, scale=scale, seqused_k=used)[0]                             # [B * Hkv, G, D]
    return out.reshape(B, Hq, 1, D)


def _flash_ok(q, k) -> bool:
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and k.is_contiguous() and q.shape[-1] <= 256)


@torch.library.custom_op("lychee::dense_decode", mutates_args=())
def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                 scale: float) -> torch.Tensor:
    if _flash_ok(q, k) and v.is_contiguous():
        return _flash_varlen(q.contiguous(), k, v, valid, scale)
    return dense_decode_reference(q, k, v, valid, scale)


@dense_decode.register_fake
def _(q, k, v, valid, scale):
    torch._check(q.shape[2] == 1, lambda: "dense_decode takes query length 1")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of KV heads")
    return torch.empty_like(q)
