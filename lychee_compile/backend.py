"""Our torch.compile backend: run the pass pipeline on the Dynamo graph, then hand it to Inductor (or run it as is).

The backend is a plain closure (HF deep-copies its CompileConfig; a function deep-copies to itself), named after the
config key and head-map digest so two configurations never share an identity in Dynamo's cache.
"""
from __future__ import annotations

import logging

import torch

from .lowering.kernel_path import account_sites
from .passes import Counters, PassContext, run_passes
from .passes.snapshot import graph_snapshot
from .tensor_parallel import _dtensor_type

log = logging.getLogger("lychee_compile")


def make_backend(model, config, retrieval: torch.Tensor, streaming: torch.Tensor, counters: Counters,
                 head_map_digest: str, snapshots: list[str], reencode: bool = False):
    """snapshots: receives graph_snapshot() of every decode graph rewritten and of every re-encode graph (tests and
    `lychee` debugging);
    reencode: the backend of rectification's re-encode (rectify.py), whose graphs the pass rewrite makes dense."""
    def lychee_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
        # kwargs: torch.compile / HF's CompileConfig pass mode= and options=; LycheeConfig decides instead
        # (cuda_graphs), so one config always means one compiled artifact.
        ctx = run_passes(PassContext(gm, model, config, retrieval, counters, streaming=streaming,
                                     example_inputs=list(example_inputs), reencode=reencode))
        if (ctx.is_decode or reencode) and not ctx.aborted:
            snapshots.append(graph_snapshot(gm))
        kind = "decode" if ctx.is_decode else "re-encode" if reencode else "prefill"
        log.info("lychee_compile: graph %d (%s): %d sites%s; %d rewritten in total", counters.graphs, kind,
                 len(ctx.sites), _site_kinds(ctx), counters.sites_rewritten)
        decode = ctx.is_decode and not ctx.aborted
        if decode:      # kernels or reference, per site; strict refuses a CUDA site on the reference here
            account_sites(ctx.sites, config, counters)
            dtensor = _dtensor_type()
            counters.dtensor_inputs += sum(isinstance(x, dtensor) for x in example_inputs) if dtensor else 0
        compiled = gm.forward if config.backend == "eager" else _inductor(gm, example_inputs, config, decode)
        if not decode:
            return compiled

        def rewritten_decode_step(*args):
            counters.decode_calls += 1     # lets generate() prove its decode steps ran the rewrite
            return compiled(*args)
        return rewritten_decode_step

    lychee_backend.__name__ = f"lychee_backend_{config.cache_key()}_{head_map_digest}{'_reencode' * reencode}"
    return lychee_backend


def _site_kinds(ctx) -> str:
    """', layers rewritten [..], sliding-window layers left as they are [..]' for a decode graph (the log names both,
    so a hybrid model's untouched sliding layers are visible, not silent)."""
    if not ctx.is_decode or ctx.aborted:
        return f" (left dense: {ctx.aborted})" if ctx.aborted else ""
    rewritten = [s.layer_idx for s in ctx.sites if s.kind == "global"]
    sliding = [s.layer_idx for s in ctx.sites if s.kind == "sliding"]
    return f": layers {rewritten} rewritten, sliding-window layers {sliding} left as they are"


def _inductor(gm, example_inputs, config, decode: bool):
    from . import lowering
    from .lowering.compile import compile_graph
    lowering.register()
    return compile_graph(gm, example_inputs, config, decode)
