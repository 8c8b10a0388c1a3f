"""Triton source of the hybrid decode kernels, written once as Jinja templates and rendered two ways:

* by Inductor (`torch._inductor.select_algorithm.TritonTemplate`, see lower.py), which supplies `def_kernel`,
  `size`, `stride` and `store_output` (epilogue fusion of the attention output);
* standalone (`render_standalone` / `hybrid_decode_triton` below), which turns the same text into a plain
  `@triton.jit` kernel with explicit size/stride arguments. That is what the TRITON_INTERPRET=1 tests, the sm_90
  cross-compile checks and the benchmark's "kernel only" timing run. One source, so both paths run the same math.

Two launches per layer (three with DEFER):
  1. SPLIT  grid (NUM_SPLITS,): flash-decoding over a pooled work list. Every (row b, KV head h) is a segment of
     BLOCK_N-token tiles: a retrieval head's segment is [0, TV) of its cache, streamed contiguously (addresses from
     the tile number; the row's range [lo, hi) masks it, so tiles outside it move no KV bytes); a sparse head's
     segment is its sink blocks, local blocks and its K inherited blocks (gathered rows, masked to [lo, hi)). Segment sizes depend on the runtime head kinds (`RETR`), so the
     pool and its cut into NUM_SPLITS equal slices are computed on the device by every program: no host sync, one
     compiled kernel for every layer and head map. A slice writes one partial (max, sum, acc) per segment it
     touches; retrieval tiles also write the log-sum-exp of each KV block per query head (for block scores).
  2. COMBINE grid (B * HKV, G + ceil(NB / KC)): programs (seg, g < G) merge query head g's partials into the
     output; for a retrieval head, programs (seg, G + c) turn blocks [c*KC, (c+1)*KC) into selection keys (block
     score = sum over the G query heads of exp2(block lse - row lse), normalised by the row's global log-sum-exp
     rebuilt from the partials) and the last of them to finish (atomic ticket, zeroed by the split launch) asks
     the selection policy (POLICY, PARAM: topk / topp / threshold / ratio, ops/policies.py) how many candidates n
     <= KSEL to keep and selects the top n exactly (counting passes over the fp32 bit pattern, ties to the lower
     block), sorted ascending, EMPTY-padded; for a sparse head program (seg, G) copies its index row through.
  3. DEFER = 1 only (hybrid_decode(defer_select=True), the default in compiled models): the combine stops after
     writing the keys (4 warps, no ticket), and SELECT = lychee_select_rows (SELECT_KERNEL_SOURCE, grid (B * HKV,),
     the same selection helpers) does the top-n, launched by lychee::select_rows on a side stream (deferred.py).

Preconditions (documented, not checked on the device): each row's valid positions are one contiguous range
(left padding: [pad_b, pos+1)); idx_in rows hold distinct blocks (the index-state invariant).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import math
import os
import sys
import tempfile

import jinja2

from ..ops.policies import RANK_DROP_BITS

GLOSSARY = '''
    # ---- glossary (names and shapes) -------------------------------------------------------------------------
    # B        batch rows (runtime)            T      cache length of K/V (runtime)     NB = ceil(T / BS) KV blocks
    # HKV      KV heads (constexpr)            G      query heads per KV head (GQA group; constexpr)
    # GP       G padded for tl.dot (>= 16)     G2     G padded to a power of two (combine)
    # D        head dim (constexpr: 64/128/256)
    # BS       tokens per KV block             BLOCK_N tokens per tile (multiple of BS)   NBT = BLOCK_N // BS
    # SBN      tokens per gathered (sparse-head) tile (multiple of BS)                   NBTS = SBN // BS
    # SPARSE_STAGES  software-pipelining depth of the gathered-tile loop (the streamed loop takes the launch's)
    # KSEL     index-state width K             KP     KSEL padded to a power of two
    # NBR      widest key row kept in registers by the selection; NR1 <= NR2 <= NBR narrower tiers, NRT = NR2 / 8
    #          a tail row beside NR2 (combine only)
    # LOWB     low key bits cleared (top-k: policies.RANK_DROP_BITS; other policies 0): the threshold searches
    #          cover bits 30..LOWB only
    # SEL_PROBE 0 (always, in the library); 1 / 2: benchmark timing probes of the selection's stages (combine only)
    # DEFER    0: the combine selects (the last key program of a segment); 1: it only writes KEYS, and
    #          lychee_select_rows (SELECT_SOURCE, a third launch on a side stream) selects later (combine only)
    # POLICY, PARAM  selection policy code (policies.POLICIES: 0 topk, 1 topp, 2 threshold, 3 ratio) and its
    #          p / tau / theta: a retrieval head keeps the top n <= KSEL candidates (combine only)
    # SINK, LOCAL   sink / local token counts;  S_MAX, L_MAX  most blocks they can touch (ceil(n / BS) + 1, or 0)
    # SPARSE_COST work units per gathered tile in the pool (a streamed retrieval tile is 1 unit); default
    #             SBN 128 / SPARSE_STAGES 2 / SPARSE_COST 3: the split 2-9% faster than 64 / 3 / 2 on five H100
    #             rows (BENCHMARKS.md, session 15): twice the K/V bytes in flight per index round trip
    # BLSE_SUMS   0: block sums of a tile by reshape, 1: by NBT masked row sums (a tuning variant, same math)
    # SC       partial slots the combine's merge loop reads per iteration (one load round trip each)
    # PDL      1: launched with programmatic dependent launch (sm_90+, compat.pdl_templates): each program waits
    #          (griddepcontrol.wait) before its first access, and the split releases its dependents when done
    # NUM_SPLITS  programs of the split launch (fixed grid, from the SM count); a segment's partials use slots
    #             [0, splits touching it) of its NUM_SPLITS-wide row
    # Q     [B, HKV*G, 1, D]  q.dtype        K, V  [B, HKV, T, D]          VALID int8 [B, T]   RETR int8 [HKV]
    # SEL   int8 [HKV]  retrieval heads whose selection is read downstream (others write an EMPTY row, no top-k)
    # ROWLO, ROWHI  int32 [B]  row b's valid positions are [lo, hi) ((0, 0) if none)
    # TVP   int32 [1]  TV = max_b hi: retrieval work and selection cover blocks below TV only
    # IDX   int32 [B, HKV, KSEL]  index state in (EMPTY = -1)         IDXO int32 [B, HKV, KSEL] index state out
    # MASS  0 / 1 (constexpr): the mass variant (lychee::hybrid_decode_mass; heat and Quest build on it) takes
    #       EXTRA int32 [B, HKV, KX]  blocks a sparse head attends in addition, this layer only (EMPTY = unused;
    #                                 distinct, disjoint from IDX's row); KX = 0 without it
    #       MASSO fp32 [B, HKV, NB] (contiguous)  per-block probability mass of each head, summed over its G query
    #                                 heads (0 where it attended nothing); zeroed by the split launch
    #       VBLSE fp32 [B*HKV, G, NVB]  per virtual block log2-sum-exp2 of a sparse head's scores
    # NVB   = S_MAX + L_MAX + KSEL + KX virtual blocks of a sparse segment;  NVBP  NVB padded to a power of two
    # PM, PL  fp32 [B*HKV, NUM_SPLITS, G]   per-slot running max (log2 units) and sum of exp2
    # PACC    fp32 [B*HKV, NUM_SPLITS, G, D] per-slot unnormalised output
    # BLSE    fp32 [B, HKV, G, NB]   per-block log2-sum-exp2 of the scaled scores (retrieval heads)
    # KEYS    int32 [B, HKV, NB]     selection keys: fp32 bits of the ranked block score (low LOWB bits 0) for
    #                                candidates, of -score for
    #                                sink / local blocks (negative ints), -1 for the other blocks
    # OUT     [B, HKV*G, 1, D] q.dtype
    # seg = b * HKV + h; tile lt of a retrieval segment covers tokens [lt*BLOCK_N, (lt+1)*BLOCK_N), of a sparse
    #     segment virtual tokens [lt*SBN, (lt+1)*SBN)
    # sparse virtual blocks: [0, S_MAX) sink, [S_MAX, S_MAX+L_MAX) local, then KSEL inherited slots, then KX extra
    # ---------------------------------------------------------------------------------------------------------
'''

# Helpers both kernels' modules need; one text serves both templates. The split and combine launches MUST agree on
# the work pool (which split wrote which partial slot), so both build it with _lychee_work_pool. Row extents come in
# precomputed (ROWLO/ROWHI/TVP, Inductor reductions over VALID once per graph): scanning VALID inside every program cost
# ~0.15 ms per layer at 4K valid tokens in a 128K cache on the H100.
KERNEL_HELPERS_SOURCE = '''
@triton.jit
def _lychee_work_pool(RETR, TVP, NTS, HKV: tl.constexpr, HKV_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPARSE_COST: tl.constexpr):
    """Per KV head h (padded to HKV_P): rflag (retrieval?), ntile (work units of its segment: one per BLOCK_N tile
    of [0, TV) for a retrieval head, SPARSE_COST per tile for the NTS gathered tiles of a sparse one), cum_incl
    (inclusive prefix sum of ntile); R = units of one row; TV = the largest row end (TVP[0]): work follows the valid
    length, not the cache capacity T. A gathered tile costs more than a streamed one (scattered rows, an index
    load ahead of its K/V loads); weighting it keeps the equal cut into splits balanced in time."""
    TV = tl.load(TVP)       # precomputed: a loop over rows here stopped the K/V loads' pipelining (sm_90 PTX)
    hh = tl.arange(0, HKV_P)
    rflag = tl.load(RETR + hh, mask=hh < HKV, other=0).to(tl.int32)
    ntile = tl.where(hh < HKV, tl.where(rflag != 0, (TV + BLOCK_N - 1) // BLOCK_N, NTS * SPARSE_COST), 0)
    cum_incl = tl.cumsum(ntile, 0)
    return hh, rflag, ntile, cum_incl, tl.sum(ntile, 0), TV


@triton.jit
def _lychee_sink_local(lo, hi, SINK: tl.constexpr, LOCAL: tl.constexpr, BS: tl.constexpr):
    """Row [lo, hi)'s sink blocks [sb0, sb1) and local blocks [lb0, lb1) (empty ranges when SINK / LOCAL is 0)."""
    has = lo < hi
    sb0 = lo // BS
    sb1 = tl.where(has & (SINK > 0), (tl.minimum(lo + SINK, hi) - 1) // BS + 1, sb0)
    lb0 = tl.maximum(hi - LOCAL, lo) // BS
    lb1 = tl.where(has & (LOCAL > 0), (hi - 1) // BS + 1, lb0)
    return sb0, sb1, lb0, lb1


@triton.jit
def _lychee_virtual_blocks(vb, sb0, sb1, lb0, lb1, IDX_ROW, stride_ik, X_ROW, stride_xk, NB,
                           S_MAX: tl.constexpr, L_MAX: tl.constexpr, KSEL: tl.constexpr, KX: tl.constexpr):
    """A sparse head's virtual blocks vb -> (real block, attended?): [0, S_MAX) sink, L_MAX local (after the sink:
    no block twice), KSEL inherited, KX extra slots. An inherited / extra block inside the sink or local range is
    skipped (that slot already reads it); EMPTY and out-of-range slots read nothing."""
    j = vb - (S_MAX + L_MAX)
    ib = tl.load(IDX_ROW + j * stride_ik, mask=(j >= 0) & (j < KSEL), other=-1)
    if KX > 0:
        jx = j - KSEL
        ib = tl.where(jx >= 0, tl.load(X_ROW + jx * stride_xk, mask=(jx >= 0) & (jx < KX), other=-1), ib)
    in_sink = vb < S_MAX
    in_local = (vb >= S_MAX) & (vb < S_MAX + L_MAX)
    blk = tl.where(in_sink, sb0 + vb, tl.where(in_local, tl.maximum(lb0, sb1) + (vb - S_MAX), ib))
    ok_idx = (ib >= 0) & (ib < NB) & ((ib < sb0) | (ib >= sb1)) & ((ib < lb0) | (ib >= lb1))
    ok = tl.where(in_sink, blk < sb1, tl.where(in_local, blk < lb1, ok_idx))
    return blk, ok


@triton.jit
def _lychee_row_lse(PM, PL, prow0, sl, live, G: tl.constexpr, G2: tl.constexpr):
    """Global log2-sum-exp2 of each query head of a segment from its per-slot partials: (lse [G2], gg, g_ok)."""
    gg = tl.arange(0, G2)
    g_ok = gg < G
    pm2 = tl.load(PM + (prow0 + sl)[:, None] * G + gg[None, :], mask=live[:, None] & g_ok[None, :],
                  other=float("-inf"))
    pl2 = tl.load(PL + (prow0 + sl)[:, None] * G + gg[None, :], mask=live[:, None] & g_ok[None, :], other=0.0)
    M2 = tl.max(pm2, 0)
    M2s = tl.where(M2 == float("-inf"), 0.0, M2)
    L2 = tl.sum(pl2 * tl.exp2(pm2 - M2s[None, :]), 0)
    return tl.where(L2 > 0.0, M2s + tl.log2(tl.maximum(L2, 1.1754943508222875e-38)), 0.0), gg, g_ok


@triton.jit
def _lychee_segment(h, hh, rflag, ntile, cum_incl):
    """Head h's segment within its row's pool: (tiles, first tile, retrieval flag)."""
    seg_n = tl.sum(tl.where(hh == h, ntile, 0), 0)
    return seg_n, tl.sum(tl.where(hh == h, cum_incl, 0), 0) - seg_n, tl.sum(tl.where(hh == h, rflag, 0), 0)
'''

SPLIT_BODY = '''
    B = {{size("Q", 0)}}
    T = {{size("K", 2)}}
    stride_qb, stride_qh, stride_qm, stride_qd = {{stride("Q")}}
    stride_kb, stride_kh, stride_kt, stride_kd = {{stride("K")}}
    stride_vb, stride_vh, stride_vt, stride_vd = {{stride("V")}}
    stride_ib, stride_ih, stride_ik = {{stride("IDX")}}
    {{extra_strides}}
    NB = (T + BS - 1) // BS
    NBT: tl.constexpr = BLOCK_N // BS
    NBTS: tl.constexpr = SBN // BS
    NTS: tl.constexpr = (NVB * BS + SBN - 1) // SBN
    if PDL:     # launched early (PDL): nothing above reads memory; below, everything the kernels before wrote is
        tl.extra.cuda.gdc_wait()

    # work pool: tiles per segment from the runtime head kinds, prefix sums over heads, equal cut into slices
    hh, rflag, ntile, cum_incl, R, TV = _lychee_work_pool(RETR, TVP, NTS, HKV, HKV_P, BLOCK_N, SPARSE_COST)
    W = B * R
    s = tl.program_id(0)
    g_cur = (s * W) // NUM_SPLITS
    g_end = ((s + 1) * W) // NUM_SPLITS

    # zero the selection tickets of the combine launch (read only after this launch completes)
    for z in range(s, B * HKV, NUM_SPLITS):
        tl.store(CNT + z, 0)
        if MASS:    # the combine writes every retrieval block and a sparse head's attended blocks: the rest is 0
            for c in range(0, NB, 1024):
                zc = c + tl.arange(0, 1024)
                tl.store(MASSO + z * NB + zc, tl.zeros([1024], tl.float32), mask=zc < NB)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    while g_cur < g_end:
        b = g_cur // R
        r = g_cur - b * R
        h = tl.sum((cum_incl <= r).to(tl.int32), 0)
        seg_n, seg_first_local, retr_i = _lychee_segment(h, hh, rflag, ntile, cum_incl)
        lt0 = r - seg_first_local
        lt1 = tl.minimum(seg_n, lt0 + (g_end - g_cur))
        s0 = ((b * R + seg_first_local + 1) * NUM_SPLITS - 1) // W
        slot = s - s0
        seg = b * HKV + h
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)

        # row b's valid positions are [lo, hi) (the kernels' precondition: one contiguous range per row)
        lo = tl.load(ROWLO + b)
        hi = tl.load(ROWHI + b)
        q = tl.load(Q + b64 * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                    mask=g_ok[:, None], other=0.0)
        k_base = K + b64 * stride_kb + h64 * stride_kh
        v_base = V + b64 * stride_vb + h64 * stride_vh
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        if retr_i != 0:
            # retrieval head: a contiguous stream of the row's tiles, addresses from the tile number alone (no
            # index or VALID loads in the chain before the K/V loads, so the loads pipeline like flash-decoding)
            blse_base = BLSE + (seg.to(tl.int64) * G) * NB
            for lt in range(lt0, lt1):
                n = lt * BLOCK_N + offs_n
                ok = (n >= lo) & (n < hi)
                kt = tl.load(k_base + n[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=ok[:, None],
                             other=0.0)
                vt = tl.load(v_base + n[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=ok[:, None],
                             other=0.0)
                m_i, l_i, acc, p, m_use = _lychee_tile(q, kt, vt, ok, m_i, l_i, acc, QK_SCALE_LOG2, DOT_UPCAST)
                _lychee_store_block_lse(blse_base, p, m_use, lt, offs_g, g_ok, NB, GP, BS, NBT, BLSE_SUMS)
        else:
            # sparse head: sink blocks, local blocks, its KSEL inherited blocks, KX extra ones (gathered rows)
            sb0, sb1, lb0, lb1 = _lychee_sink_local(lo, hi, SINK, LOCAL, BS)
            idx_base = IDX + b64 * stride_ib + h64 * stride_ih
            x_base = {{extra_row}}
            # units [lt0, lt1) of the segment -> the tiles whose first unit lies in them (an empty range still
            # writes its (empty) partial, which the combine merges as nothing)
            for lt in tl.range((lt0 + SPARSE_COST - 1) // SPARSE_COST, (lt1 + SPARSE_COST - 1) // SPARSE_COST,
                               num_stages=SPARSE_STAGES):
                n = lt * SBN + tl.arange(0, SBN)
                blk, ok = _lychee_virtual_blocks(n // BS, sb0, sb1, lb0, lb1, idx_base, stride_ik, x_base,
                                                 stride_xk, NB, S_MAX, L_MAX, KSEL, KX)
                tok = blk * BS + (n % BS)
                ok = ok & (tok >= lo) & (tok < hi)      # the row's valid range (no VALID load in the chain)
                kt = tl.load(k_base + tok[:, None] * stride_kt + offs_d[None, :] * stride_kd, mask=ok[:, None],
                             other=0.0)
                vt = tl.load(v_base + tok[:, None] * stride_vt + offs_d[None, :] * stride_vd, mask=ok[:, None],
                             other=0.0)
                m_i, l_i, acc, p, m_use = _lychee_tile(q, kt, vt, ok, m_i, l_i, acc, QK_SCALE_LOG2, DOT_UPCAST)
                if MASS:    # per virtual block (the combine maps them to real blocks)
                    _lychee_store_block_lse(VBLSE + (seg.to(tl.int64) * G) * NVB, p, m_use, lt, offs_g, g_ok, NVB,
                                            GP, BS, NBTS, BLSE_SUMS)
        prow = seg * NUM_SPLITS + slot
        tl.store(PM + prow * G + offs_g, m_i, mask=g_ok)
        tl.store(PL + prow * G + offs_g, l_i, mask=g_ok)
        xs = seg
        xt = slot
        xg = offs_g[:, None]
        xd = offs_d[None, :]
        amask = g_ok[:, None] & (offs_d[None, :] < D)
        {{store_output(("xs", "xt", "xg", "xd"), "acc", "amask", indent_width=8, val_shape=("GP", "D"))}}
        g_cur += lt1 - lt0
    if PDL:     # the combine may launch now: it waits for this whole grid before its first access
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _lychee_tile(q, kt, vt, ok, m_i, l_i, acc, QK_SCALE_LOG2: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One BLOCK_N tile of online softmax (log2 units): q [GP, D], kt/vt [BLOCK_N, D], ok bool [BLOCK_N].
    Returns the updated (m_i, l_i, acc) and this tile's p = exp2(qk - m_use) [GP, BLOCK_N] with its m_use [GP]."""
    if DOT_UPCAST:  # TRITON_INTERPRET=1: the interpreter's bf16 tl.dot is wrong (triton 3.9), use fp32
        qk = tl.dot(q.to(tl.float32), tl.trans(kt).to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(kt))
    qk = tl.where(ok[None, :], qk * QK_SCALE_LOG2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return m_new, l_i, acc, p, m_use


@triton.jit
def _lychee_store_block_lse(blse_base, p, m_use, lt, offs_g, g_ok, NB, GP: tl.constexpr, BS: tl.constexpr,
                            NBT: tl.constexpr, BLSE_SUMS: tl.constexpr):
    """Per-block log2-sum-exp2 of one retrieval tile (its NBT blocks) into BLSE (block scores of the selection).
    From p = exp2(qk - m_use): a block below 2^-126 of the running max underflows to -inf, as the reference's fp32
    probabilities, normalised by the global max, underflow to 0. BLSE_SUMS=1 sums each block with a masked row
    reduction instead of a reshape (no layout conversion; a tuning variant)."""
    if BLSE_SUMS:
        col = tl.arange(0, NBT * BS) // BS
        for i in tl.static_range(NBT):
            s_i = tl.sum(tl.where(col[None, :] == i, p, 0.0), 1)
            bi = lt * NBT + i
            tl.store(blse_base + offs_g * NB + bi, m_use + tl.log2(s_i), mask=g_ok & (offs_g * 0 + bi < NB))
    else:
        blse = m_use[:, None] + tl.log2(tl.sum(tl.reshape(p, (GP, NBT, BS)), 2))
        bidx = lt * NBT + tl.arange(0, NBT)
        tl.store(blse_base + offs_g[:, None] * NB + bidx[None, :], blse, mask=g_ok[:, None] & (bidx[None, :] < NB))
''' + '''

''' + KERNEL_HELPERS_SOURCE + ''''''

COMBINE_BODY = '''
    # grid (B * HKV, G + NKC): program (seg, j < G) merges query head j of the segment's partials into OUT;
    # program (seg, G + c) of a retrieval head turns blocks [c*KC, (c+1)*KC) into selection keys, and the last of
    # the NKC key programs to finish (atomic ticket in CNT, zeroed by the split kernel) runs the policy's top-n;
    # for a sparse head program (seg, G) copies the index row through. MASS: the key programs of a retrieval head
    # also write its blocks' mass, and program (seg, G) of a sparse head its attended blocks' (MASSO).
    B = {{size("VALID", 0)}}
    T = {{size("VALID", 1)}}
    stride_mb, stride_mt = {{stride("VALID")}}
    stride_ib, stride_ih, stride_ik = {{stride("IDX")}}
    stride_ob, stride_oh, stride_ok = {{stride("IDXO")}}
    {{extra_strides}}
    NB = (T + BS - 1) // BS
    NKC = (NB + KC - 1) // KC
    NTS: tl.constexpr = (NVB * BS + SBN - 1) // SBN
    if PDL:     # launched early (PDL): wait for the split (and every kernel before it) to complete
        tl.extra.cuda.gdc_wait()
    # the same work pool as the split launch (one helper, so the two can never disagree on who wrote which slot)
    hh, rflag, ntile, cum_incl, R, TV = _lychee_work_pool(RETR, TVP, NTS, HKV, HKV_P, BLOCK_N, SPARSE_COST)
    W = B * R

    pid = tl.program_id(0)
    j = tl.program_id(1)
    b = pid // HKV
    h = pid - b * HKV
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    seg = pid
    seg_n, seg_first_local, retr_i = _lychee_segment(h, hh, rflag, ntile, cum_incl)
    seg_first = b * R + seg_first_local
    s0 = ((seg_first + 1) * NUM_SPLITS - 1) // W
    s1 = ((seg_first + seg_n) * NUM_SPLITS - 1) // W
    nslot = s1 - s0 + 1

    offs_d = tl.arange(0, D)
    sl = tl.arange(0, NSP)
    sp = s0 + sl  # a split with an empty slice (W < NUM_SPLITS) wrote nothing: its slot is skipped
    live = (sl < nslot) & ((sp * W) // NUM_SPLITS < ((sp + 1) * W) // NUM_SPLITS)
    prow0 = seg * NUM_SPLITS
    if j < G:
        # ---- merge query head g = j (flash-decoding combine) ----
        pm = tl.load(PM + (prow0 + sl) * G + j, mask=live, other=float("-inf"))
        pl = tl.load(PL + (prow0 + sl) * G + j, mask=live, other=0.0)
        M = tl.max(pm, 0)
        Ms = tl.where(M == float("-inf"), 0.0, M)
        L = tl.sum(pl * tl.exp2(pm - Ms), 0)
        acc = tl.zeros([D], tl.float32)
        offs_c = tl.arange(0, SC)
        for c in range(0, nslot, SC):
            slc = c + offs_c
            spc = s0 + slc
            livec = (slc < nslot) & ((spc * W) // NUM_SPLITS < ((spc + 1) * W) // NUM_SPLITS)
            rows = (prow0 + slc) * G + j
            pmc = tl.load(PM + rows, mask=livec, other=float("-inf"))
            pa = tl.load(PACC + rows.to(tl.int64)[:, None] * D + offs_d[None, :], mask=livec[:, None], other=0.0)
            acc += tl.sum(pa * tl.exp2(pmc - Ms)[:, None], 0)
        o = acc / tl.maximum(L, 1.1754943508222875e-38)
        xb = b
        xq = h * G + j
        xm = 0
        xd = offs_d
        omask = offs_d < D
        {{store_output(("xb", "xq", "xm", "xd"), "o", "omask", indent_width=8, val_shape=("D",))}}
    else:
        c_key = j - G
        out_base = IDXO + b64 * stride_ob + h64 * stride_oh
        slots = tl.arange(0, KP)
        sel_i = tl.load(SEL + h).to(tl.int32)
        if retr_i == 0 or sel_i == 0:
            if c_key == 0:  # sparse head: its index row passes through; unread retrieval head: EMPTY
                row = tl.load(IDX + b64 * stride_ib + h64 * stride_ih + slots * stride_ik,
                              mask=(slots < KSEL) & (slots * 0 + retr_i == 0), other=-1)
                tl.store(out_base + slots * stride_ok, row, mask=slots < KSEL)
        lo = tl.load(ROWLO + b)
        hi = tl.load(ROWHI + b)
        sb0, sb1, lb0, lb1 = _lychee_sink_local(lo, hi, SINK, LOCAL, BS)
        if retr_i != 0 and (sel_i != 0 or MASS):
            # block score = sum over the query heads of exp2(block lse - the head's global lse)
            lse_row, gg, g_ok = _lychee_row_lse(PM, PL, prow0, sl, live, G, G2)
            blk = c_key * KC + tl.arange(0, KC)
            NBV = (TV + BS - 1) // BS        # blocks the split launch scored (BLSE beyond them is stale)
            lse = tl.load(BLSE + (seg.to(tl.int64) * G + gg[:, None]) * NB + blk[None, :],
                          mask=g_ok[:, None] & (blk < NBV)[None, :], other=float("-inf"))
            score = tl.sum(tl.exp2(lse - lse_row[:, None]), 0)
            if MASS:
                tl.store(MASSO + seg.to(tl.int64) * NB + blk, score, mask=blk < NB)
            if sel_i != 0:
                _lychee_block_keys(KEYS + seg.to(tl.int64) * NB, blk, score, NBV, lo, hi, sb0, sb1, lb0, lb1, BS,
                                   LOWB)
                if DEFER == 0:     # DEFER: lychee_select_rows selects later, off the critical path (SELECT_SOURCE)
                    tl.debug_barrier()
                    ticket = tl.atomic_add(CNT + seg, 1)
                else:
                    ticket = -1
                if ticket == NKC - 1:
                    tl.store(CNT + seg, 0)
                    key_base = KEYS + seg.to(tl.int64) * NB
                    if SEL_PROBE == 0:
                        n = _lychee_keep_count(key_base, NBV, lo, hi, POLICY, PARAM, KSEL, G, BS, NBR, LOWB)
                        _lychee_select(key_base, NBV, out_base, stride_ok, n, KSEL, KP, NBR, NR1, NR2, NRT, LOWB)
                    else:   # timing probe (benchmarks only; WRONG index rows): stop after the ticket (1) or
                        # after reloading the keys and one reduction over them (2)
                        cnt = tl.zeros([], tl.int32)
                        if SEL_PROBE == 2:
                            cnt = tl.sum((_lychee_keys(key_base, NBV, 0, tl.arange(0, NR2)) >= 0).to(tl.int32), 0)
                        tl.store(out_base + slots * stride_ok, tl.where(slots == cnt, -2, -1), mask=slots < KSEL)
        if MASS:
            if retr_i == 0 and c_key == 0:
                # a sparse head's attended blocks: mass per virtual block, stored at its real block
                lse_row, gg, g_ok = _lychee_row_lse(PM, PL, prow0, sl, live, G, G2)
                vb = tl.arange(0, NVBP)
                vl = tl.load(VBLSE + (seg.to(tl.int64) * G + gg[:, None]) * NVB + vb[None, :],
                             mask=g_ok[:, None] & (vb < NVB)[None, :], other=float("-inf"))
                vmass = tl.sum(tl.exp2(vl - lse_row[:, None]), 0)
                vblk, vok = _lychee_virtual_blocks(vb, sb0, sb1, lb0, lb1,
                                                   IDX + b64 * stride_ib + h64 * stride_ih, stride_ik,
                                                   {{extra_row}}, stride_xk, NB, S_MAX, L_MAX, KSEL, KX)
                tl.store(MASSO + seg.to(tl.int64) * NB + vblk, vmass, mask=vok & (vb < NVB))

'''

SELECTION_HELPERS_SOURCE = '''

@triton.jit
def _lychee_block_keys(KEYS_ROW, blk, score, NBV, lo, hi, sb0, sb1, lb0, lb1, BS: tl.constexpr, LOWB: tl.constexpr):
    """Selection keys of blocks `blk`: fp32 bits of the block score with the low LOWB bits cleared (non-negative
    floats order like their bits; top-k: policies.rank_score) for candidates, the bits of -score for sink / local
    blocks (negative ints, never -1 = NaN bits: topp needs their mass, the counting passes ignore every negative
    key), -1 for the rest."""
    cand = (blk < NBV) & (blk * BS < hi) & ((blk + 1) * BS > lo) & ((blk < sb0) | (blk >= sb1)) \\
        & ((blk < lb0) | (blk >= lb1))
    fixed = ((blk >= sb0) & (blk < sb1)) | ((blk >= lb0) & (blk < lb1))
    key = tl.where(cand, score.to(tl.int32, bitcast=True) & (-(1 << LOWB)),
                   tl.where(fixed, (-score).to(tl.int32, bitcast=True), -1))
    tl.store(KEYS_ROW + blk, key, mask=blk < NBV)
''' + '''

@triton.jit
def _lychee_keys(KEYS_ROW, NB, c, offs):
    """Keys [c, c + len(offs)) of a row, -1 past its end. ".cg": written by other programs of this launch."""
    return tl.load(KEYS_ROW + c + offs, mask=c + offs < NB, other=-1, cache_modifier=".cg")


@triton.jit
def _lychee_mass(keys, G: tl.constexpr):
    """A candidate's attention mass as policies.ranked_selection forms it (block score / G, fp32); 0 otherwise.
    div_rn: IEEE division like torch's (`/` compiles to the approximate div.full.f32 on CUDA)."""
    return tl.where(keys >= 0, tl.div_rn(keys.to(tl.float32, bitcast=True), G), 0.0)


@triton.jit
def _lychee_keep_count(KEYS_ROW, NB, lo, hi, POLICY: tl.constexpr, PARAM: tl.constexpr, KSEL: tl.constexpr,
                       G: tl.constexpr, BS: tl.constexpr, NBR: tl.constexpr, LOWB: tl.constexpr):
    """n: how many of the ranked candidates the selection policy keeps (policies.keep_counts), capped at KSEL."""
    offs = tl.arange(0, NBR)
    if POLICY == 0:      # topk
        n = tl.full([], KSEL, tl.int32)
    elif POLICY == 1:    # topp
        n = _lychee_topp_count(KEYS_ROW, NB, PARAM, G, NBR, LOWB)
    elif POLICY == 2:    # threshold: candidates whose mass >= tau (compared in fp32, as the reference)
        n = tl.zeros([], tl.int32)
        for c in range(0, NB, NBR):
            keys = _lychee_keys(KEYS_ROW, NB, c, offs)
            n += tl.sum(((keys >= 0) & (_lychee_mass(keys, G) >= PARAM)).to(tl.int32), 0)
    else:                # ratio: ceil(theta * valid blocks); the row's valid positions are [lo, hi)
        x = PARAM * tl.where(hi > lo, (hi - 1) // BS - lo // BS + 1, 0).to(tl.float32)
        n = _lychee_ceil(x)
    return tl.minimum(n, KSEL)


@triton.jit
def _lychee_ceil(x):
    """ceil of a non-negative fp32 below 2^31 as int32 (no libdevice call: the interpreter and sm_90 agree)."""
    n = x.to(tl.int32)
    return n + (n.to(tl.float32) < x).to(tl.int32)


@triton.jit
def _lychee_topp_count(KEYS_ROW, NB, P: tl.constexpr, G: tl.constexpr, NBR: tl.constexpr, LOWB: tl.constexpr):
    # keep_counts' topp: need = max(p - fixed mass, 0), n = the shortest prefix of the ranking whose mass reaches
    # need - 1e-6 (0 if need <= 0; every candidate if none does). 31 passes (one per key bit, high to low) find thr =
    # the largest key such that the mass of the keys >= thr reaches the target, i.e. the last key the prefix needs;
    # keys > thr are all kept, ties == thr (block order) as many as the remaining mass needs. The kernel sums in
    # another order than the reference's cumsum: a prefix within fp32 rounding of the target may end one block
    # apart (tests keep clear of that boundary).
    offs = tl.arange(0, NBR)
    fixed = tl.zeros([], tl.float32)
    for c in range(0, NB, NBR):      # sink / local blocks hold -score (see the key programs)
        keys = _lychee_keys(KEYS_ROW, NB, c, offs)
        fixed += tl.sum(tl.where(keys < -1, -keys.to(tl.float32, bitcast=True), 0.0), 0)
    need = tl.maximum(P - tl.div_rn(fixed, G), 0.0)
    tgt = need - 1e-6
    thr = tl.zeros([], tl.int32)
    for bit in range(31 - LOWB):      # candidate keys have their low LOWB bits clear
        trial = thr | (tl.full([], 1, tl.int32) << (30 - bit))
        mass = tl.zeros([], tl.float32)
        for c in range(0, NB, NBR):
            keys = _lychee_keys(KEYS_ROW, NB, c, offs)
            mass += tl.sum(tl.where(keys >= trial, _lychee_mass(keys, G), 0.0), 0)
        thr = tl.where(mass >= tgt, trial, thr)
    ncand = tl.zeros([], tl.int32)
    ngt = tl.zeros([], tl.int32)
    neq = tl.zeros([], tl.int32)
    total = tl.zeros([], tl.float32)
    above = tl.zeros([], tl.float32)
    for c in range(0, NB, NBR):
        keys = _lychee_keys(KEYS_ROW, NB, c, offs)
        ncand += tl.sum((keys >= 0).to(tl.int32), 0)
        ngt += tl.sum((keys > thr).to(tl.int32), 0)
        neq += tl.sum((keys == thr).to(tl.int32), 0)
        total += tl.sum(_lychee_mass(keys, G), 0)
        above += tl.sum(tl.where(keys > thr, _lychee_mass(keys, G), 0.0), 0)
    m_thr = tl.div_rn(thr.to(tl.float32, bitcast=True), G)
    ties = (tgt - above) / tl.where(m_thr > 0.0, m_thr, 1.0)     # NaN-free even where thr is meaningless
    n = ngt + _lychee_ceil(tl.minimum(tl.maximum(ties, 1.0), neq.to(tl.float32)))
    n = tl.where(total >= tgt, n, ncand)
    # need in (0, 1e-6]: the reference's first cumsum entry (>= 0) already reaches the target
    n = tl.where(tgt <= 0.0, 1, n)
    return tl.where(need <= 0.0, 0, n)


@triton.jit
def _lychee_select(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL: tl.constexpr, KP: tl.constexpr, NBR: tl.constexpr,
                   NR1: tl.constexpr, NR2: tl.constexpr, NRT: tl.constexpr, LOWB: tl.constexpr):
    # Top-n (n <= KSEL, runtime) of the int32 keys of one row (larger first, ties to the lower block; negative = not
    # a candidate), written ascending and EMPTY-padded to KSEL. Exact: counting passes over the key bits find the
    # n-th largest key thr; then keys > thr and the first (n - #greater) keys == thr in block order are taken. No
    # passes at all when every candidate fits. The keys live in registers, in the narrowest width tier that holds
    # the row's NB keys at run time: NR1, NR2, NR2 plus a tail of NRT (a row just past a power of two -- 128K
    # tokens plus the generated ones -- must not pay twice the width), NBR. The width follows the valid length,
    # not the cache capacity. A row longer than NBR is walked in NBR chunks per pass (same result).
    if NB <= NR1:
        _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NR1, True, 0, LOWB)
    else:
        if NR2 > NR1:
            if NB <= NR2:
                _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NR2, True, 0, LOWB)
            else:
                _lychee_select_wide(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NBR, NR2, NRT, LOWB)
        else:
            _lychee_select_wide(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NBR, NR2, NRT, LOWB)


@triton.jit
def _lychee_select_wide(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL: tl.constexpr, KP: tl.constexpr,
                        NBR: tl.constexpr, NR2: tl.constexpr, NRT: tl.constexpr, LOWB: tl.constexpr):
    """NB > NR2: NR2 + its tail, the NBR tier, or NBR-wide chunks. NBR == NR2 (kernel_params leaves the NBR
    register tier out when the cache cannot need it): the tail, else chunks."""
    if NB <= NR2 + NRT:
        _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NR2, True, NRT, LOWB)
    else:
        if NBR > NR2:
            if NB <= NBR:
                _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NBR, True, 0, LOWB)
            else:
                _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NBR, False, 0, LOWB)
        else:
            _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL, KP, NBR, False, 0, LOWB)


@triton.jit
def _lychee_select_tier(KEYS_ROW, NB, OUT_ROW, stride_o, n, KSEL: tl.constexpr, KP: tl.constexpr, NR: tl.constexpr,
                        ONE_CHUNK: tl.constexpr, TAIL: tl.constexpr, LOWB: tl.constexpr):
    """_lychee_select with keys [0, NB) read NR at a time (ONE_CHUNK: NB <= NR + TAIL, the row stays in registers:
    keys [0, NR) and, TAIL > 0, keys [NR, NR + TAIL) in a second, narrower register row).
    Candidate keys have their low LOWB bits clear. thr = the n-th largest key, found over bits 30..LOWB, high to low.
    In registers the search is latency-bound (one block-wide reduction per pass and row, each a barrier round
    through shared memory), so it runs as few as it can: a first pass over 3 bits that also counts the candidates
    (7 + 1 counts in a two-operand reduction), then 2 bits per pass (3 counts in one int64); the count of keys
    above thr falls out of the passes, and the write pass needs no totals of its last row. Else (chunks) one bit per
    pass. n = 0 ends with thr = every searched bit set (above any candidate key): nothing is taken. Measured slower
    on the H100 (BENCHMARKS.md): a 4-pass histogram radix select (similar scores share leading digits: its
    shared-memory atomics serialise on one bin) and 4 bits per pass (15 counts: the per-key count work, not the
    syncs, bounds a pass with 16 keys per thread)."""
    offs = tl.arange(0, NR)
    zero = tl.zeros([], tl.int32)
    if ONE_CHUNK:
        keys = _lychee_keys(KEYS_ROW, NB, 0, offs)
        if TAIL > 0:
            keys_t = _lychee_keys(KEYS_ROW, NB, NR, tl.arange(0, TAIL))
        else:
            keys_t = keys      # unused
        FB: tl.constexpr = 2 + (31 - LOWB) % 2      # so that the remaining bits come in pairs
        sh0: tl.constexpr = 31 - FB
        lo4, hi4 = _lychee_first_pass(keys, keys_t, sh0, TAIL)
        ncand = (lo4 & 0xFFFF).to(tl.int32)
        d = zero
        above = zero          # keys >= the top of thr's current bucket ([0, 2^31) at first: none)
        for f in tl.static_range(1, 1 << FB):
            d += (_lychee_field(lo4, hi4, f) >= n).to(tl.int32)
        for f in tl.static_range(1, 1 << FB):
            above = tl.where(d + 1 == f, _lychee_field(lo4, hi4, f), above)
        thr = d << sh0
        take_all = ncand <= n
        if not take_all:    # else every candidate is taken: no threshold to find (short rows)
            for ip in range((31 - LOWB - FB) // 2):      # the remaining bits, two per pass
                sh = sh0 - 2 - 2 * ip
                one = tl.full([], 1, tl.int32) << sh
                tot = _lychee_pass3(keys, keys_t, thr, one, TAIL)
                c1 = (tot & 0x1FFFFF).to(tl.int32)
                c2 = ((tot >> 21) & 0x1FFFFF).to(tl.int32)
                c3 = (tot >> 42).to(tl.int32)
                dd = (c1 >= n).to(tl.int32) + (c2 >= n).to(tl.int32) + (c3 >= n).to(tl.int32)
                above = tl.where(dd == 0, c1, tl.where(dd == 1, c2, tl.where(dd == 2, c3, above)))
                thr = thr | (dd << sh)
        _lychee_write_regs(keys, keys_t, OUT_ROW, stride_o, thr, take_all, n - above, NR, TAIL)
        _lychee_empty_past(OUT_ROW, stride_o, tl.where(take_all, ncand, n), KSEL, KP)
    else:
        thr = zero
        ngt = zero
        ncand = zero
        for c in range(0, NB, NR):
            keys = _lychee_keys(KEYS_ROW, NB, c, offs)
            ncand += tl.sum((keys >= 0).to(tl.int32), 0)
        if ncand > n:
            for bit in range(31 - LOWB):
                trial = thr | (tl.full([], 1, tl.int32) << (30 - bit))
                cnt = zero
                for c in range(0, NB, NR):
                    cnt += tl.sum((_lychee_keys(KEYS_ROW, NB, c, offs) >= trial).to(tl.int32), 0)
                thr = tl.where(cnt >= n, trial, thr)
            for c in range(0, NB, NR):
                ngt += tl.sum((_lychee_keys(KEYS_ROW, NB, c, offs) > thr).to(tl.int32), 0)
        take_all = ncand <= n
        need = n - ngt
        eq_before = zero
        ntaken = zero
        for c in range(0, NB, NR):
            eq_before, ntaken = _lychee_write_chunk(_lychee_keys(KEYS_ROW, NB, c, offs), c + offs, OUT_ROW,
                                                    stride_o, thr, take_all, need, eq_before, ntaken, True)
        _lychee_empty_past(OUT_ROW, stride_o, ntaken, KSEL, KP)


@triton.jit
def _lychee_first_counts(keys, sh0: tl.constexpr):
    """The first pass's counts, 16 bits each (<= NR + TAIL <= 2^16 - 1 keys): lo = [key >= 0] + [key >= 1<<sh0] << 16
    + [key >= 2<<sh0] << 32 + [key >= 3<<sh0] << 48; hi = [key >= (4..7)<<sh0] likewise (0 where those are out of
    range of a 2-bit first pass)."""
    one = tl.full([], 1, tl.int32) << sh0
    lo = ((keys >= 0).to(tl.int64) + ((keys >= one).to(tl.int64) << 16) + ((keys >= 2 * one).to(tl.int64) << 32)
          + ((keys >= 3 * one).to(tl.int64) << 48))
    if sh0 == 28:
        hi = ((keys >= 4 * one).to(tl.int64) + ((keys >= 5 * one).to(tl.int64) << 16)
              + ((keys >= 6 * one).to(tl.int64) << 32) + ((keys >= 7 * one).to(tl.int64) << 48))
    else:
        hi = tl.zeros_like(lo)
    return lo, hi


@triton.jit
def _lychee_field(lo, hi, i: tl.constexpr):
    """Count i (1..7) of the first pass (see _lychee_first_counts)."""
    if i < 4:
        return ((lo >> (16 * i)) & 0xFFFF).to(tl.int32)
    else:
        return ((hi >> (16 * (i - 4))) & 0xFFFF).to(tl.int32)


@triton.jit
def _lychee_add2(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _lychee_first_pass(keys, keys_t, sh0: tl.constexpr, TAIL: tl.constexpr):
    """The first pass's packed counts (_lychee_first_counts) over the row and, TAIL > 0, the tail row, each row in
    one two-operand reduction. Not folded into one reduction: folding the wider row onto the tail's width (reshape,
    sum) made Triton move it back to the tail's layout through shared memory, slower in the model (+0.1 ms a step,
    H100; BENCHMARKS.md, session 10)."""
    lo, hi = _lychee_first_counts(keys, sh0)
    slo, shi = tl.reduce((lo, hi), 0, _lychee_add2)
    if TAIL > 0:
        lot, hit = _lychee_first_counts(keys_t, sh0)
        tlo, thi = tl.reduce((lot, hit), 0, _lychee_add2)
        slo += tlo
        shi += thi
    return slo, shi


@triton.jit
def _lychee_pass3(keys, keys_t, thr, one, TAIL: tl.constexpr):
    """A 2-bit pass's three packed counts (_lychee_count3) over the row and, TAIL > 0, the tail row."""
    tot = tl.sum(_lychee_count3(keys, thr, one), 0)
    if TAIL > 0:
        tot += tl.sum(_lychee_count3(keys_t, thr, one), 0)
    return tot


@triton.jit
def _lychee_count3(keys, thr, one):
    """One int64 per key: [key >= thr|one] + [key >= thr|2one] << 21 + [key >= thr|3one] << 42 (summed: 3 counts)."""
    return ((keys >= (thr | one)).to(tl.int64) + ((keys >= (thr | (one * 2))).to(tl.int64) << 21)
            + ((keys >= (thr | (one * 3))).to(tl.int64) << 42))


@triton.jit
def _lychee_write_regs(keys, keys_t, OUT_ROW, stride_o, thr, take_all, need, NR: tl.constexpr, TAIL: tl.constexpr):
    # keys > thr (every candidate if take_all) and the first `need` keys == thr, written ascending with the block
    # number: the register row [0, NR), then the tail row [NR, NR + TAIL) when TAIL > 0
    zero = tl.zeros([], tl.int32)
    if TAIL > 0:
        eq_before, taken = _lychee_write_chunk(keys, tl.arange(0, NR), OUT_ROW, stride_o, thr, take_all, need, zero,
                                               zero, True)
        _lychee_write_chunk(keys_t, NR + tl.arange(0, TAIL), OUT_ROW, stride_o, thr, take_all, need, eq_before,
                            taken, False)
    else:
        _lychee_write_chunk(keys, tl.arange(0, NR), OUT_ROW, stride_o, thr, take_all, need, zero, zero, False)


@triton.jit
def _lychee_empty_past(OUT_ROW, stride_o, ntaken, KSEL: tl.constexpr, KP: tl.constexpr):
    """EMPTY (-1) in the index row's slots [ntaken, KSEL)."""
    slots = tl.arange(0, KP)
    tl.store(OUT_ROW + slots * stride_o, tl.full([KP], -1, tl.int32), mask=(slots >= ntaken) & (slots < KSEL))


@triton.jit
def _lychee_write_chunk(keys, blk, OUT_ROW, stride_o, thr, take_all, need, eq_before, ntaken,
                        TOTALS: tl.constexpr):
    """Keys of blocks `blk` in the write pass. One scan: taken count (low 16 bits) and ties at thr seen so far
    (high bits) packed together (both <= len(blk) <= 2^14). TOTALS: also returns the updated (eq_before, ntaken)
    (one packed reduction), which a later chunk needs; else (0, 0)."""
    eq = ((keys == thr) & (~take_all)).to(tl.int32)
    gt = tl.where(take_all, keys >= 0, keys > thr).to(tl.int32)
    scan = tl.cumsum(gt + (eq << 16), 0)                       # inclusive
    rank = eq_before + (scan >> 16) - eq                        # ties at thr before this one
    take = (gt != 0) | ((eq != 0) & (rank < need))
    # position = taken before it: the chunk's greater keys before it + the ties taken before it (first `need`)
    pos = ntaken + (scan & 0xFFFF) - gt + tl.minimum(rank, need) - tl.minimum(eq_before, need)
    tl.store(OUT_ROW + pos * stride_o, blk, mask=take)
    if TOTALS:
        tot = tl.sum(take.to(tl.int32) + (eq << 16), 0)
        return eq_before + (tot >> 16), ntaken + (tot & 0xFFFF)
    else:
        return tl.zeros([], tl.int32), tl.zeros([], tl.int32)


''' + KERNEL_HELPERS_SOURCE
COMBINE_BODY += SELECTION_HELPERS_SOURCE

# The deferred selection (DEFER = 1): a third launch, on a side stream (ops/deferred_select.py), running the same
# selection helpers the combine would have run. Not a Jinja template: Inductor never generates it; the
# lychee::select_rows op launches it (lowering/deferred.py).
SELECT_KERNEL_SOURCE = '''
@triton.jit
def lychee_select_rows(KEYS, ROWLO, ROWHI, TVP, RETR, SEL, IDXO, NB, stride_ob, stride_oh, stride_ok,
                       HKV: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, KSEL: tl.constexpr, KP: tl.constexpr,
                       NBR: tl.constexpr, NR1: tl.constexpr, NR2: tl.constexpr, NRT: tl.constexpr,
                       LOWB: tl.constexpr, POLICY: tl.constexpr, PARAM: tl.constexpr):
    # grid (B * HKV,): program seg = b * HKV + h selects IDXO's row (b, h) from KEYS' row when h is a retrieval
    # head whose selection is read (RETR[h] and SEL[h]); the combine launch wrote KEYS and every other row
    seg = tl.program_id(0)
    b = seg // HKV
    h = seg - b * HKV
    if (tl.load(RETR + h) != 0) & (tl.load(SEL + h) != 0):
        lo = tl.load(ROWLO + b)
        hi = tl.load(ROWHI + b)
        NBV = (tl.load(TVP) + BS - 1) // BS      # blocks the split launch scored (the combine's NBV)
        key_base = KEYS + seg.to(tl.int64) * NB
        out_base = IDXO + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        n = _lychee_keep_count(key_base, NBV, lo, hi, POLICY, PARAM, KSEL, G, BS, NBR, LOWB)
        _lychee_select(key_base, NBV, out_base, stride_ok, n, KSEL, KP, NBR, NR1, NR2, NRT, LOWB)
'''
SELECT_CONSTEXPRS = ("HKV", "G", "BS", "KSEL", "KP", "NBR", "NR1", "NR2", "NRT", "LOWB", "POLICY", "PARAM")

SPLIT_NAMES = ("Q", "K", "V", "ROWLO", "ROWHI", "TVP", "RETR", "IDX", "PM", "PL", "BLSE", "CNT")
COMBINE_NAMES = ("PACC", "PM", "PL", "BLSE", "VALID", "ROWLO", "ROWHI", "TVP", "RETR", "SEL", "IDX", "IDXO", "KEYS",
                 "CNT")
MASS_NAMES = ("EXTRA", "VBLSE", "MASSO")      # the mass variant's extra inputs, appended to both kernels'


def _source(names, body, mass: bool) -> str:
    """One kernel's template text: def_kernel over its tensors, the glossary, the body; the mass variant names
    EXTRA / VBLSE / MASSO (the plain one never touches them: its MASS branches are constexpr-dead)."""
    names = names + MASS_NAMES if mass else names
    head = "{{def_kernel(" + ", ".join(f'"{n}"' for n in names) + ")}}\n"
    body = body.replace("{{extra_strides}}", 'stride_xb, stride_xh, stride_xk = {{stride("EXTRA")}}' if mass
                        else "stride_xk = 0")
    return head + GLOSSARY + body.replace("{{extra_row}}", "EXTRA + b64 * stride_xb + h64 * stride_xh" if mass
                                          else "IDX")


SPLIT_SOURCE, SPLIT_MASS_SOURCE = (_source(SPLIT_NAMES, SPLIT_BODY, m) for m in (False, True))
COMBINE_SOURCE, COMBINE_MASS_SOURCE = (_source(COMBINE_NAMES, COMBINE_BODY, m) for m in (False, True))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def kernel_params(*, G: int, Hkv: int, D: int, K_sel: int, block_size: int, sink_tokens: int, local_tokens: int,
                  scale: float, num_splits: int, nb_hint: int, block_n: int = 64, nbr_max: int = 16384,
                  blse_sums: int = 0, sparse_cost: int = 3, sparse_bn: int | None = 128, sparse_stages: int = 2,
                  policy: int = 0,
                  policy_param: float = 0.0, select_tiers: tuple = (1024, 8192), mass: bool = False,
                  extra_width: int = 0, sel_probe: int = 0, defer: bool = False, slot_chunk: int = 64):
    """Constexpr parameters shared by both kernels (a plain dict, hashable inputs only). mass / extra_width: the
    mass variant (MASS, KX; see the glossary). sel_probe: a benchmark-only timing probe of the selection's stages
    (SEL_PROBE in the combine: 1 stops after the ticket, 2 after reloading the keys; index rows are then WRONG);
    the library never sets it. defer: the combine leaves the top-k to lychee_select_rows (DEFER; the same
    selection constexprs serve both kernels)."""
    bs = int(block_size)
    block_n = max(int(block_n), bs)
    sbn = block_n if sparse_bn is None else max(int(sparse_bn), bs)
    assert block_n % bs == 0 and sbn % bs == 0, (block_n, sbn, bs)
    g2 = _next_pow2(G)
    common = dict(
        G=G, GP=max(16, g2), G2=g2, HKV=Hkv, HKV_P=_next_pow2(Hkv), D=D, BS=bs, BLOCK_N=block_n, SBN=sbn,
        KSEL=K_sel, KP=_next_pow2(max(K_sel, 1)), SINK=sink_tokens, LOCAL=local_tokens,
        S_MAX=(-(-sink_tokens // bs) + 1) if sink_tokens > 0 else 0,
        L_MAX=(-(-local_tokens // bs) + 1) if local_tokens > 0 else 0,
        NUM_SPLITS=num_splits, SPARSE_COST=int(sparse_cost), MASS=int(bool(mass)), KX=int(extra_width),
        PDL=0,      # the lowering sets 1 where the launch uses PDL (compat.pdl_templates)
    )
    assert mass or not extra_width, "extra blocks come with the mass variant"
    common.update(NVB=common["S_MAX"] + common["L_MAX"] + K_sel + common["KX"])
    common.update(NVBP=_next_pow2(common["NVB"]))
    split = dict(common, QK_SCALE_LOG2=float(scale) * 1.4426950408889634, DOT_UPCAST=interpreting(),
                 BLSE_SUMS=int(blse_sums), SPARSE_STAGES=int(sparse_stages))
    nbr = max(16, min(nbr_max, _next_pow2(nb_hint)))
    nr2 = min(_next_pow2(select_tiers[1]), nbr)
    nrt = max(1, nr2 // 8)
    if nb_hint <= nr2 + nrt:
        # no row of this cache can outgrow NR2 + its tail: leave the NBR register tier (2x NR2 keys per thread) out
        # of the kernel; compiled in, it alone set the 16-warp combine's registers (128, the cap) and an 88-byte
        # stack frame for a 128K + 256 cache (cuobjdump, sm_90)
        nbr = nr2
    combine = dict(common, SC=int(slot_chunk), NSP=_next_pow2(num_splits),
                   KC=max(16, min(1024, _next_pow2(nb_hint))), NBR=nbr,
                   NR1=min(_next_pow2(select_tiers[0]), nbr), NR2=nr2, NRT=nrt,
                   LOWB=RANK_DROP_BITS if int(policy) == 0 else 0,      # top-k ranks 12 significant bits
                   POLICY=int(policy), PARAM=float(policy_param) if policy else 0.0,   # topk ignores the param
                   SEL_PROBE=int(sel_probe), DEFER=int(bool(defer)))
    return split, combine


# ---------------------------------------------------------------------------------------------------------------
# Standalone rendering: the same Jinja text as a plain @triton.jit kernel with explicit size / stride arguments.
# ---------------------------------------------------------------------------------------------------------------

RANKS = {"Q": 4, "K": 4, "V": 4, "ROWLO": 1, "ROWHI": 1, "TVP": 1, "RETR": 1, "IDX": 3, "PM": 3, "PL": 3, "BLSE": 4,
         "CNT": 1, "PACC": 4, "VALID": 2, "SEL": 1, "IDXO": 3, "KEYS": 3, "EXTRA": 3, "VBLSE": 3, "MASSO": 3,
         "OUT": 4}
SPLIT_OUT = ("PACC", 4)
COMBINE_OUT = ("OUT", 4)


def kernel_tensors(kind: str, mass: bool) -> dict:
    """{name: rank} of a kernel's tensor arguments, in def_kernel order."""
    names = (SPLIT_NAMES if kind == "split" else COMBINE_NAMES) + (MASS_NAMES if mass else ())
    return {n: RANKS[n] for n in names}


class _StandaloneRenderer:
    def __init__(self, name, tensors, out, constexprs):
        self.name, self.tensors, self.out, self.constexprs = name, tensors, out, constexprs
        self.scalars: list[str] = []

    def def_kernel(self, *names):
        assert tuple(names) == tuple(self.tensors), names
        return "<DEF_KERNEL>"

    def _scalar(self, s):
        if s not in self.scalars:
            self.scalars.append(s)
        return s

    def size(self, name, index):
        return self._scalar(f"size_{name}_{index}")

    def stride(self, name, index=None):
        if index is not None:
            return self._scalar(f"stride_{name}_{index}")
        return ", ".join(self._scalar(f"stride_{name}_{i}") for i in range(self.tensors[name]))

    def store_output(self, indices, val, mask=None, indent_width=4, **_):
        oname, rank = self.out
        offs = " + ".join(f"({ix}) * {self._scalar(f'stride_{oname}_{i}')}" for i, ix in enumerate(indices))
        m = f", mask={mask}" if mask else ""
        return f"tl.store({oname} + {offs}, ({val}).to({oname}.dtype.element_ty){m})"

    def render(self, source):
        body = jinja2.Template(source).render(def_kernel=self.def_kernel, size=self.size, stride=self.stride,
                                              store_output=self.store_output)
        args = list(self.tensors) + [self.out[0]] + self.scalars
        defines = "".join(f"    {k}: tl.constexpr = {v!r}\n" for k, v in sorted(self.constexprs.items()))
        header = f"@triton.jit\ndef {self.name}({', '.join(args)}):\n" + defines
        return body.replace("<DEF_KERNEL>", header.rstrip("\n"), 1), args


_MODULE_DIR = os.path.join(tempfile.gettempdir(), f"lychee_kernels_{os.getuid() if hasattr(os, 'getuid') else 0}")


@functools.lru_cache(maxsize=None)
def _standalone(kind: str, constexpr_items: tuple):
    constexprs = dict(constexpr_items)
    mass = bool(constexprs.get("MASS", 0))
    if kind == "split":
        r = _StandaloneRenderer("lychee_hybrid_split", kernel_tensors(kind, mass), SPLIT_OUT, constexprs)
        src, args = r.render(SPLIT_MASS_SOURCE if mass else SPLIT_SOURCE)
    else:
        r = _StandaloneRenderer("lychee_hybrid_combine", kernel_tensors(kind, mass), COMBINE_OUT, constexprs)
        src, args = r.render(COMBINE_MASS_SOURCE if mass else COMBINE_SOURCE)
    text = "import triton\nimport triton.language as tl\n\n" + src
    return getattr(_load_module(kind, text), r.name), args, text


def _load_module(kind: str, text: str):
    """Python module from kernel source text, written once to a content-addressed file."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    os.makedirs(_MODULE_DIR, exist_ok=True)
    path = os.path.join(_MODULE_DIR, f"lychee_{kind}_{digest}.py")
    if not os.path.exists(path):
        tmp = path + f".{os.getpid()}.tmp"
        with open(path + f".{os.getpid()}.tmp", "w") as f:
            f.write(text)
        os.replace(tmp, path)
    modname = f"_lychee_kernels_{kind}_{digest}"
    if modname in sys.modules:
        mod = sys.modules[modname]
    else:
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
    return mod


def combine_num_warps(defer: bool) -> int:
    """Warps of the combine launch. 16 when it selects: the top-k's register row (8K keys) wants many threads.
    4 when it does not (DEFER): its merge and key programs are latency chains that more, smaller programs serve
    better (H100, 128K: combine 8.0-10.8 -> 4.4-5.4 us; BENCHMARKS.md, session 11)."""
    return 4 if defer else 16


@functools.lru_cache(maxsize=None)
def select_kernel():
    """The deferred selection's @triton.jit kernel lychee_select_rows (SELECT_KERNEL_SOURCE plus the selection
    helpers), loaded from a file like the standalone kernels (Triton's JIT needs the source on disk)."""
    text = "import triton\nimport triton.language as tl\n\n" + SELECT_KERNEL_SOURCE + SELECTION_HELPERS_SOURCE
    return _load_module("select", text).lychee_select_rows


@functools.lru_cache(maxsize=None)
def selection_constexprs(*, G: int, Hkv: int, K_sel: int, block_size: int, nb_hint: int, policy: int,
                         policy_param: float) -> dict:
    """The combine's selection constexprs (SELECT_CONSTEXPRS) for these shapes: what lychee_select_rows takes.
    The attention-only parameters of kernel_params do not change them (neutral values below). Cached: without
    CUDA graphs every decode step and layer asks (the returned dict is shared: read it only)."""
    _, cp = kernel_params(G=G, Hkv=Hkv, D=16, K_sel=K_sel, block_size=block_size, sink_tokens=0, local_tokens=0,
                          scale=1.0, num_splits=1, nb_hint=nb_hint, policy=policy, policy_param=policy_param)
    return {c: cp[c] for c in SELECT_CONSTEXPRS}


def launch_select(keys, rowlo, rowhi, tvp, retr8, sel8, idx_out, cp: dict, num_warps: int = 16):
    """lychee_select_rows over grid (B * Hkv,) with the combine's constexprs `cp` (kernel_params).
    keys int32 [B, Hkv, NB] contiguous; idx_out int32 [B, Hkv, K] (any strides)."""
    B, Hkv, nb = keys.shape
    select_kernel()[(B * Hkv,)](keys, rowlo, rowhi, tvp, retr8, sel8, idx_out, nb, *idx_out.stride(),
                                **{c: cp[c] for c in SELECT_CONSTEXPRS}, num_warps=num_warps, num_stages=1)


def render_standalone(kind: str, constexprs: dict):
    """(jit function, argument names, module text) of one kernel configuration."""
    return _standalone(kind, tuple(sorted(constexprs.items())))


def _default_num_splits(device) -> int:
    import torch
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def workspace(B, Hkv, G, D, T, block_size, num_splits, device):
    import torch
    nb = -(-T // block_size)
    f32 = torch.float32
    return dict(
        PM=torch.empty(B * Hkv, num_splits, G, dtype=f32, device=device),
        PL=torch.empty(B * Hkv, num_splits, G, dtype=f32, device=device),
        BLSE=torch.empty(B, Hkv, G, nb, dtype=f32, device=device),
        PACC=torch.empty(B * Hkv, num_splits, G, D, dtype=f32, device=device),
        KEYS=torch.empty(B, Hkv, nb, dtype=torch.int32, device=device),
        CNT=torch.empty(B * Hkv, dtype=torch.int32, device=device),
    )


def _arg_values(args, tensors):
    vals = []
    for a in args:
        if a in tensors:
            vals.append(tensors[a])
        elif a.startswith("size_"):
            name, i = a[5:].rsplit("_", 1)
            vals.append(tensors[name].shape[int(i)])
        elif a.startswith("stride_"):
            name, i = a[7:].rsplit("_", 1)
            vals.append(tensors[name].stride(int(i)))
        else:
            raise KeyError(a)
    return vals


def make_launchers(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens, out=None,
                   idx_out=None, num_splits=None, block_n=64, nbr_max=16384, ws=None, split_warps=4,
                   split_stages=3, combine_warps=None, blse_sums=0, sparse_cost=3, sparse_bn=128, sparse_stages=2,
                   select=None,
                   policy=0, policy_param=0.0, select_tiers=(1024, 8192), extra=None, with_mass=False,
                   sel_probe=0, defer=False, defer_launch=True, slot_chunk=64, pdl=0):
    """Bind both kernels to fixed buffers: returns (split(), combine(), out, idx_out, mass or None). Nothing is
    allocated per call, so the pair can be captured in a CUDA graph. extra / with_mass: the mass variant
    (lychee::hybrid_decode_mass). defer: the combine leaves the top-k to lychee_select_rows, which combine() then
    launches right after it on the same stream (the lowering puts it on a side stream); defer_launch=False
    (benchmarks only: the combine's critical path alone) leaves it out, and the selecting heads' index rows
    unwritten. pdl=1 launches both with programmatic dependent launch (CUDA sm_90+), as the lowering does there."""
    import torch
    B, Hq, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    G = Hq // Hkv
    K_sel = idx_in.shape[-1]
    if num_splits is None:
        num_splits = _default_num_splits(q.device)
    nb = -(-T // block_size)
    sp, cp = kernel_params(G=G, Hkv=Hkv, D=D, K_sel=K_sel, block_size=block_size, sink_tokens=sink_tokens,
                           local_tokens=local_tokens, scale=float(scale), num_splits=num_splits, nb_hint=nb,
                           block_n=block_n, nbr_max=nbr_max, blse_sums=blse_sums, sparse_cost=sparse_cost,
                           sparse_bn=sparse_bn, sparse_stages=sparse_stages,
                           policy=policy, policy_param=policy_param, select_tiers=tuple(select_tiers),
                           mass=with_mass or extra is not None, extra_width=0 if extra is None else extra.shape[-1],
                           sel_probe=sel_probe, defer=defer, slot_chunk=slot_chunk)
    if ws is None:
        ws = workspace(B, Hkv, G, D, T, block_size, num_splits, q.device)
    mass_ws = {}
    if sp["MASS"]:
        extra = torch.full((B, Hkv, 0), -1, dtype=torch.int32, device=q.device) if extra is None else extra
        mass_ws = dict(EXTRA=extra, VBLSE=torch.empty(B * Hkv, G, sp["NVB"], dtype=torch.float32, device=q.device),
                       MASSO=torch.empty(B, Hkv, nb, dtype=torch.float32, device=q.device))
        mass_ws.update({n: ws[n] for n in ("VBLSE", "MASSO") if n in ws})     # tests poison them
    ws = {n: t for n, t in ws.items() if n not in mass_ws}
    out = torch.empty_like(q) if out is None else out
    idx_out = torch.empty_like(idx_in) if idx_out is None else idx_out
    valid8 = valid.to(torch.int8)
    ext = row_extent(valid)
    retr8 = retrieval.to(torch.int8)
    sel8 = retr8 if select is None else select.to(torch.int8)
    sp, cp = dict(sp, PDL=int(pdl)), dict(cp, PDL=int(pdl))
    launch = dict(launch_pdl=True) if pdl else {}     # pdl=1: as the lowering launches them on sm_90+
    ks, kargs, _ = render_standalone("split", sp)
    kc, cargs, _ = render_standalone("combine", cp)
    v1 = _arg_values(kargs, dict(Q=q, K=k, V=v, **ext, RETR=retr8, IDX=idx_in, **ws, **mass_ws))
    v2 = _arg_values(cargs, dict(PACC=ws["PACC"], PM=ws["PM"], PL=ws["PL"], BLSE=ws["BLSE"], VALID=valid8,
                                 **ext, RETR=retr8, SEL=sel8, IDX=idx_in, IDXO=idx_out, KEYS=ws["KEYS"], CNT=ws["CNT"],
                                 OUT=out, **mass_ws))
    combine_grid = (B * Hkv, G + -(-nb // cp["KC"]))

    def split():
        ks[(num_splits,)](*v1, num_warps=split_warps, num_stages=split_stages, **launch)

    warps = combine_warps or combine_num_warps(defer)

    def combine():
        kc[combine_grid](*v2, num_warps=warps, num_stages=1, **launch)
        if defer and defer_launch:
            launch_select(ws["KEYS"], ext["ROWLO"], ext["ROWHI"], ext["TVP"], retr8, sel8, idx_out, cp)

    return split, combine, out, idx_out, mass_ws.get("MASSO")


def row_extent(valid):
    """{ROWLO, ROWHI: int32 [B], TVP: int32 [1]} from valid bool [B, T]: each row's first valid position and one
    past its last ((0, 0) for an empty row), and the longest row end.
    The standalone launcher's twin of lower.py's `_row_extent` (Inductor IR); the kernel tests compare both paths
    with the reference."""
    import torch
    T = valid.shape[1]
    pos = torch.arange(T, dtype=torch.int32, device=valid.device)
    hi = torch.where(valid, pos + 1, 0).amax(1).to(torch.int32)
    lo = torch.minimum(torch.where(valid, pos, T).amin(1).to(torch.int32), hi)
    return dict(ROWLO=lo.contiguous(), ROWHI=hi.contiguous(), TVP=hi.amax().reshape(1))


def hybrid_decode_triton(q, k, v, valid, retrieval, idx_in, scale, block_size, sink_tokens, local_tokens, **kw):
    """Standalone launcher of the two kernels (same source as the Inductor lowering). Returns (out, idx_out), or
    (out, idx_out, mass) with extra= / with_mass=True (lychee::hybrid_decode_mass)."""
    split, combine, out, idx_out, mass = make_launchers(q, k, v, valid, retrieval, idx_in, scale, block_size,
                                                        sink_tokens, local_tokens, **kw)
    split()
    combine()
    return (out, idx_out) if mass is None else (out, idx_out, mass)


def cross_compile(kind: str, constexprs: dict, dtype: str = "bf16", num_warps: int = 4, num_stages: int = 3,
                  arch: int = 90):
    """Compile one kernel configuration for CUDA sm_`arch` without a GPU (triton's bundled ptxas); kind "split",
    "combine" or "select" (the deferred top-k, lychee_select_rows, from the combine's constexprs). Returns the
    CompiledKernel (asm["ptx"], asm["cubin"], n_regs, n_spills). Must run without TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if kind == "select":     # lychee_select_rows: explicit arguments, the selection constexprs by name
        names = ("KEYS", "ROWLO", "ROWHI", "TVP", "RETR", "SEL", "IDXO")
        types = ("*i32", "*i32", "*i32", "*i32", "*i8", "*i8", "*i32")
        signature = dict(zip(names, types), NB="i32", stride_ob="i32", stride_oh="i32", stride_ok="constexpr",
                         **{c: "constexpr" for c in SELECT_CONSTEXPRS})
        consts = dict({c: constexprs[c] for c in SELECT_CONSTEXPRS}, stride_ok=1)
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(names))}
        src = ASTSource(select_kernel(), signature, constexprs=consts, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    fn, args, _ = render_standalone(kind, dict(constexprs, DOT_UPCAST=False) if kind == "split" else constexprs)
    ptr_types = {"Q": dtype, "K": dtype, "V": dtype, "VALID": "i8", "ROWLO": "i32", "ROWHI": "i32", "TVP": "i32",
                 "RETR": "i8", "SEL": "i8", "IDX": "i32", "IDXO": "i32", "KEYS": "i32", "CNT": "i32", "PM": "fp32",
                 "PL": "fp32", "BLSE": "fp32", "PACC": "fp32", "OUT": dtype, "EXTRA": "i32", "VBLSE": "fp32",
                 "MASSO": "fp32"}
    signature, consts, attrs = {}, {}, {}
    rank = RANKS
    for i, a in enumerate(args):
        if a in ptr_types:
            signature[a] = "*" + ptr_types[a]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a.startswith("stride_") and a.endswith(f"_{rank[a[7:].rsplit('_', 1)[0]] - 1}"):
            signature[a] = "constexpr"   # innermost stride 1, as the runtime specialises it
            consts[a] = 1
        else:
            signature[a] = "i32"
            if a.startswith("stride_"):   # outer strides: multiples of 16 elements for D in (64, 128, 256)
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
