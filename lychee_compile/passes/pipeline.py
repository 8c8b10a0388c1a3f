"""The pass pipeline: a declarative list of named passes over one PassContext.

    bind_state    find the cross-step state buffers (kinds, heat, quest) announced by the wrapped forward; drop the
                  markers
    detect        find attention sites (sdpa call / eager matmul-softmax-matmul chain)
    canonicalize  peel repeat_kv to [B, Hkv, T, D], mask kind, explicit scale
    classify      layer of each site; global / sliding / prefill
    check         all-or-nothing decision for the graph (strict raises, non-strict leaves it dense)
    rewrite       global decode sites -> lychee::hybrid_decode (heat / Quest: the composites heat_decode_step /
                  quest_decode_step around lychee::hybrid_decode_mass)
    thread_state  index state from each op to the next
    defer_selection  each read index state waits (lychee::index_ready) just before its first reader; the op's
                  top-k may then run on a side stream meanwhile (ops/deferred_select.py)
    thread_slots  stack the ops' heat slices and write them back in place (heat on; Quest's ops write their
                  descriptor slots in place themselves)
    fuse_linears  sibling linears whose weights lychee_compile fused into one buffer -> one product + narrows
    one_shot_all_reduce  tensor parallel on CUDA: small all-reduces -> lychee::one_shot_all_reduce over the
                  symmetric buffer lychee_compile rendezvoused (symm_mem_all_reduce)
The probe in api.py runs the same list up to `check` (with window-aware classification off).
"""
from __future__ import annotations

from .bind_state import bind_buffers
from .canonicalize import canonicalize_sites
from .check import check_coverage
from .classify import classify_for_probe, classify_sites
from .context import PassContext
from .defer_selection import defer_selections
from .detect import find_sites
from .fuse_linears import fuse_sibling_linears
from .one_shot_all_reduce import one_shot_all_reduces
from .rewrite import rewrite_sites
from .thread_slots import thread_slots
from .thread_state import thread_index_state

PASSES = [
    ("bind_state", bind_buffers),
    ("detect", find_sites),
    ("canonicalize", canonicalize_sites),
    ("classify", classify_sites),
    ("check", check_coverage),
    ("rewrite", rewrite_sites),
    ("thread_state", thread_index_state),
    ("defer_selection", defer_selections),
    ("thread_slots", thread_slots),
    ("fuse_linears", fuse_sibling_linears),
    ("one_shot_all_reduce", one_shot_all_reduces),
]
PROBE_PASSES = [(name, classify_for_probe if name == "classify" else fn)
                for name, fn in PASSES[:[n for n, _ in PASSES].index("check") + 1]]


def run_passes(ctx: PassContext) -> PassContext:
    passes = PASSES if ctx.rewrite else PROBE_PASSES
    for _name, fn in passes:
        fn(ctx)
        if ctx.aborted:
            return ctx
    if ctx.rewrite:     # a prefill graph may have changed too (bind_state markers, fused linears)
        ctx.gm.graph.lint()
        ctx.gm.recompile()
    return ctx
