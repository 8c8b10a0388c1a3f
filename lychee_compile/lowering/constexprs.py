"""Constexpr planning of the hybrid decode kernels: from the shapes and the op's scalars to the constexpr dicts of
the split and combine launches (kernel_params), the deferred selection's subset (selection_constexprs) and the
combine's warps. The names are the kernels' (kernels/glossary.py.jinja)."""
from __future__ import annotations

import functools
import os

from ..ops.policies import RANK_DROP_BITS

# lychee_select_rows' constexprs (kernels/select_rows.py.jinja), a subset of the combine's
SELECT_CONSTEXPRS = ("HKV", "G", "BS", "KSEL", "KP", "NBR", "NR1", "NR2", "NRT", "LOWB", "POLICY", "PARAM")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def head_dim_tile(D: int) -> int:
    """The kernels' tile width over the head dim: D padded to a power of two, at least 16 (tl.dot's K); lanes >= D
    load 0 and store nothing (glossary DP). Strides, masks and every buffer keep the true D: no copy pads."""
    return max(16, _next_pow2(D))


@functools.lru_cache(maxsize=None)
def kernel_params(*, G: int, Hkv: int, D: int, K_sel: int, block_size: int, sink_tokens: int, local_tokens: int,
                  scale: float, num_splits: int, nb_hint: int, block_n: int = 64, nbr_max: int = 16384,
                  blse_sums: int = 0, sparse_cost: int = 3, sparse_bn: int | None = 128, sparse_stages: int = 2,
                  policy: int = 0,
                  policy_param: float = 0.0, select_tiers: tuple = (1024, 8192), mass: bool = False,
                  extra_width: int = 0, defer: bool = False, slot_chunk: int = 64):
    """Constexpr parameters shared by both kernels (a plain dict, hashable inputs only). mass / extra_width: the
    mass variant (MASS, KX; see the glossary). defer: the combine leaves the top-k to lychee_select_rows (DEFER; the
    same selection constexprs serve both kernels). SEL_PROBE is always 0 here: its timing probes are the
    benchmark's (standalone.make_launchers(sel_probe=...))."""
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
        PDL=0,      # the lowering sets 1 where the launch uses PDL (compile.pdl_templates)
    )
    assert mass or not extra_width, "extra blocks come with the mass variant"
    if head_dim_tile(D) != D:    # a constexpr only where it pads: a power-of-two D >= 16 keeps its text unchanged
        common.update(DP=head_dim_tile(D))
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
                   SEL_PROBE=0, DEFER=int(bool(defer)))
    return split, combine


@functools.lru_cache(maxsize=None)
def selection_constexprs(*, G: int, Hkv: int, K_sel: int, block_size: int, nb_hint: int, policy: int,
                         policy_param: float) -> dict:
    """The combine's selection constexprs (SELECT_CONSTEXPRS) for these shapes: what lychee_select_rows takes.
    The attention-only parameters of kernel_params do not change them (neutral values below). Cached: without
    CUDA graphs every decode step and layer asks (the returned dict is shared: read it only)."""
    _, cp = kernel_params(G=G, Hkv=Hkv, D=16, K_sel=K_sel, block_size=block_size, sink_tokens=0, local_tokens=0,
                          scale=1.0, num_splits=1, nb_hint=nb_hint, policy=policy, policy_param=policy_param)
    return {c: cp[c] for c in SELECT_CONSTEXPRS}


def combine_num_warps(defer: bool) -> int:
    """Warps of the combine launch. 16 when it selects: the top-k's register row (8K keys) wants many threads.
    4 when it does not (DEFER): its merge and key programs are latency chains that more, smaller programs serve
    better (H100, 128K: combine 8.0-10.8 -> 4.4-5.4 us, measured side by side)."""
    return 4 if defer else 16
