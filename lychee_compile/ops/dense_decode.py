"""`torch.ops.lychee.dense_decode`: plain dense attention of a row's newest positions over exactly its valid keys,
native GQA.

    dense_decode(q, k, v, valid, scale, ranges=None, plan=None) -> out

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
    ranges int32 [2, B] or None   (start_b, end_b) of valid, as valid_ranges(valid) computes them: the rewrite
                             computes them once per graph for every layer's op instead of each op scanning valid
                             (two reductions over [B, T] a layer: ~1 ms a step at 128K x 4 under tensor
                             parallelism). The reference reads valid only.
    plan   int32 [4nS + 4n + 4] or None   the L > 1 path's sequence metadata (segment_plan below; n = B * Hkv,
                             S key segments): the rewrite computes it once per graph for every layer's op, as it does
                             ranges (~25 small kernels a layer otherwise). The reference reads valid only.
    out    [B, Hq, L, D]     q.dtype, contiguous; query i attends the valid positions up to end_b - L + i
On CUDA with fp16/bf16 it runs FlashAttention-2 varlen with `seqused_k` (no host sync, CUDA-graph safe): each
(row, KV head) is one variable-length sequence starting at start_b with end_b - start_b keys, its queries a sequence
whose G query heads are the heads of a multi-query group. With L > 1 the keys before the queries' own are cut into
KEY_SEGMENTS sequences (no mask; the L x G query rows as ONE head, so each segment's keys are read once) plus the
queries' own L keys (causal, G heads), merged by log-sum-exp (_segmented).
Elsewhere it runs the masked reference below.
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


# Key segments of the L > 1 path: FlashAttention-2 splits the keys over several blocks only for ONE query (its
# split-KV path); with L queries every (row, KV head) sequence is G thread blocks, each walking the whole context
# alone (32 blocks for Llama-3-8B at batch 1: 3.7 ms a layer at 128K on the H200). So the keys are cut into this many
# segments, each its own sequence, and the partial results merged by their log-sum-exp. 32: the fastest count at
# Llama-3-8B's shapes at 128K, batch 1, on the H200 (benchmarks/probes/reencode_segments.py: 0.322 ms a layer vs
# 0.347 at 16, 8 KV heads x 32 = 256 sequences for its 132 SMs; docs/performance.md has the end-to-end figure).
KEY_SEGMENTS = 32


@torch.library.custom_op("lychee::valid_ranges", mutates_args=())
def valid_ranges(valid: torch.Tensor) -> torch.Tensor:
    """Each row's valid range [start, end): bool [B, T] -> int32 [2, B] (no host sync); a row with no valid position
    gives (0, T) (row_alignment.row_range tells it apart). An op of its own, opaque to Inductor: eager reductions,
    computed once per graph by the rewrite (Inductor on torch 2.11 miscompiled fused mask reductions at 8K keys)."""
    T = valid.shape[-1]
    v8 = valid.to(torch.int8)
    start = v8.argmax(dim=-1).to(torch.int32)                            # first valid position  [B]
    end = (T - v8.flip(-1).argmax(dim=-1)).to(torch.int32)               # one past the last one [B]
    return torch.stack([start, end])


@valid_ranges.register_fake
def _(valid):
    return valid.new_empty((2, valid.shape[0]), dtype=torch.int32)


@torch.library.custom_op("lychee::segment_plan", mutates_args=())
def segment_plan(ranges: torch.Tensor, kv_heads: int, group: int, capacity: int, queries: int,
                 segments: int) -> torch.Tensor:
    """The L > 1 path's FlashAttention-2 varlen metadata for rows (b, h), n = B * kv_heads of them, from ranges
    (int32 [2, B], valid_ranges'), in one int32 tensor; plan_parts() names its pieces. An op of its own, opaque to
    Inductor like valid_ranges: the same for every layer of a graph, so the rewrite computes it once.
        seg_cu_q [nS + 1]   seg_cu_k [nS + 1]   seg_used [nS]     the S segments of each row's keys before its L own
        own_cu_q [n + 1]    own_cu_k [n + 1]    own_used [n]      each row's L own keys (causal)
        keys     [n * (S + 1)]                                    keys of each row's S segments, then L"""
    n, S, L, T = ranges.shape[1] * kv_heads, segments, queries, capacity
    torch._check(n * T < 2 ** 31, lambda: f"{n} rows x {T} keys overflow FlashAttention-2's int32 key offsets")
    start, end = ranges.repeat_interleave(kv_heads, dim=1)               # [n] each, one copy for both
    base = torch.arange(0, n * T, T, device=ranges.device, dtype=torch.int32)   # [n] where row (b, h)'s keys begin
    prefix = end - L - start                                              # [n] keys every query attends
    size = (prefix + (S - 1)) // S                                        # [n] keys per segment (the last may be short)
    offset = torch.arange(S, device=ranges.device, dtype=torch.int32) * size[:, None]   # [n, S] from prefix's start
    count = torch.minimum((prefix[:, None] - offset).clamp_min(0), size[:, None])       # [n, S]
    own = torch.full_like(end, L)
    first = ((base + start)[:, None] + offset).view(-1)                   # [nS] each segment's first key
    return torch.cat([_cumulative(n * S, L * group, ranges.device), _closed(first), count.view(-1),
                      _cumulative(n, L, ranges.device), _closed(base + end - L), own,
                      torch.cat([count, own[:, None]], 1).view(-1)])


@segment_plan.register_fake
def _(ranges, kv_heads, group, capacity, queries, segments):
    n = ranges.shape[1] * kv_heads
    return ranges.new_empty((4 * n * segments + 4 * n + 4,), dtype=torch.int32)


def plan_parts(plan: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """segment_plan's pieces as views (S from the length; a plan of another row count is refused)."""
    S, rest = divmod(plan.shape[0] - 4 * n - 4, 4 * n)
    torch._check(S >= 1 and rest == 0, lambda: f"a segment plan of {plan.shape[0]} entries is not one for {n} rows")
    sizes = dict(seg_cu_q=n * S + 1, seg_cu_k=n * S + 1, seg_used=n * S, own_cu_q=n + 1, own_cu_k=n + 1, own_used=n,
                 keys=n * (S + 1))
    parts = dict(zip(sizes, plan.split(list(sizes.values()))))
    parts["keys"] = parts["keys"].view(n, S + 1)
    return parts


def _flash_attend(rows, k_flat, v_flat, cu_q, cu_k, used, max_q: int, max_k: int, causal: bool, scale: float):
    """FlashAttention-2 varlen, rows [total_q, H, D] over one KV head: (out [total_q, H, D], lse [H, total_q] fp32;
    +inf where a sequence has no key)."""
    out, lse = torch.ops.aten._flash_attention_forward(
        rows, k_flat, v_flat, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, seqused_k=used)[:2]
    return out, lse


def _flash_varlen(q, k, v, valid, scale: float, attend=_flash_attend, ranges=None, plan=None) -> torch.Tensor:
    B, Hq, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G, n = Hq // Hkv, B * Hkv
    if ranges is None and (L == 1 or plan is None):
        ranges = valid_ranges(valid)                                     # int32 Tensor [2, B]
    rows = q.view(B, Hkv, G, L, D).transpose(2, 3).reshape(n, L, G, D)  # sequence (b, h): L tokens x G heads
    k_flat, v_flat = k.reshape(n * T, 1, D), v.reshape(n * T, 1, D)
    if L == 1:                                                            # a decode step: FA2 splits the keys itself
        start, end = ranges
        base = torch.arange(n, device=q.device, dtype=torch.int32) * T   # [n] where sequence (b, h)'s keys begin
        out = attend(rows.reshape(n, G, D), k_flat, v_flat, _cumulative(n, 1, q.device),
                     _closed(base + start.repeat_interleave(Hkv)), (end - start).repeat_interleave(Hkv), 1, T,
                     False, scale)[0]
        return out.view(B, Hkv, L, G, D).transpose(2, 3).reshape(B, Hq, L, D).contiguous()
    # L > 1: rectification's re-encode; every eager op here is a launch per layer (a host launch without CUDA
    # graphs, a graph node with them): the metadata comes once per graph (plan), the merge is spelled in as few ops
    # as give the same values bit for bit
    if plan is None:
        plan = segment_plan(ranges, Hkv, G, T, L, KEY_SEGMENTS)
    out = _segmented(rows, k_flat, v_flat, plan_parts(plan, n), T, scale, attend)   # [n, L, G, D]
    # cast and layout in one copy where the dtype changes (the fp32 merge of a bf16 / fp16 model), not a reshape
    # copy and then a cast; the same dtype: `to` returns the view and reshape copies it
    return out.view(B, Hkv, L, G, D).transpose(2, 3).to(q.dtype, memory_format=torch.contiguous_format).reshape(
        B, Hq, L, D)


def _cumulative(sequences: int, length: int, device) -> torch.Tensor:
    """[0, length, 2 * length, ..., sequences * length] int32: one arange (not an arange and a multiply)."""
    return torch.arange(0, (sequences + 1) * length, length, device=device, dtype=torch.int32)


def _closed(first: torch.Tensor) -> torch.Tensor:
    """cu_seqlens from each sequence's first key (lengths come from seqused_k; the closing entry is never read)."""
    return torch.cat([first, first[-1:]])


def _segmented(rows, k_flat, v_flat, parts: dict, T: int, scale: float, attend):
    """L queries per sequence over [start, end): S segments of the keys before the queries' own L (no mask) and one
    causal segment of their own L keys, merged by log-sum-exp; parts: plan_parts(segment_plan(...)).
        rows   [n, L, G, D]   ->   [n, L, G, D] fp32"""
    n, L, G, D = rows.shape
    keys = parts["keys"]                                                  # [n, S + 1]
    S = keys.shape[1] - 1
    # No mask before the queries' own keys, so a sequence's L x G query rows are one head of L * G rows: each
    # segment's keys are read once (as G heads FlashAttention-2 reads them G times, in row tiles of 128 of which L
    # rows are used -- 32 of 128 for Llama-3 8B's G = 4 at rectify_every = 32).
    seg_out, seg_lse = attend(rows[:, None].expand(n, S, L, G, D).reshape(n * S * L * G, 1, D), k_flat, v_flat,
                              parts["seg_cu_q"], parts["seg_cu_k"], parts["seg_used"], L * G, T, False, scale)
    own_out, own_lse = attend(rows.reshape(n * L, G, D), k_flat, v_flat, parts["own_cu_q"], parts["own_cu_k"],
                              parts["own_used"], L, L, True, scale)
    outs = torch.cat([seg_out.view(n, S, L, G, D), own_out.view(n, 1, L, G, D)], 1).float()
    lse = torch.cat([seg_lse.reshape(n, S, L, G), own_lse.t().reshape(n, 1, L, G)], 1)   # seg_lse [1, n*S*L*G]
    # a segment with no key weighs nothing, whatever log-sum-exp the kernel wrote for it (FlashAttention-2: +inf).
    # `lse < inf` keeps what isfinite(lse) keeps (a -inf it also keeps becomes -inf anyway) in one launch, not four
    lse = torch.where((keys > 0)[:, :, None, None] & (lse < float("inf")), lse, float("-inf"))
    weight = torch.exp(lse - lse.amax(1, keepdim=True))                   # the own segment is never empty: finite max
    outs = torch.where(weight[..., None] > 0, outs, 0.0)
    return (weight[..., None] * outs).sum(1) / weight.sum(1)[..., None]


def flash_path(q, k) -> bool:
    """Whether dense_decode runs FlashAttention-2 varlen for these tensors (else its masked reference): fp16/bf16 on
    a GPU of compute capability >= 8.0, head dim a multiple of 8 up to 256 (what its kernels take)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and k.is_contiguous() and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
            and torch.cuda.get_device_capability(q.device)[0] >= 8)


@torch.library.custom_op("lychee::dense_decode", mutates_args=())
def dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                 scale: float, ranges: torch.Tensor | None = None, plan: torch.Tensor | None = None) -> torch.Tensor:
    if flash_path(q, k) and v.is_contiguous():
        return _flash_varlen(q.contiguous(), k, v, valid, scale, ranges=ranges, plan=plan)
    return dense_decode_reference(q, k, v, valid, scale)


@dense_decode.register_fake
def _(q, k, v, valid, scale, ranges=None, plan=None):
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of KV heads")
    return q.new_empty(q.shape)                      # contiguous, as both implementations return it
