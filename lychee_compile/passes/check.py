"""Pass `check`: decide, before anything is changed, whether this graph is rewritten as a whole.

A decode graph is rewritten only if every layer of the model has exactly one supported attention site and at least
one layer is global. Otherwise the graph is refused: strict mode raises LycheeCompileError, non-strict mode logs
once, counts, and leaves the whole graph dense -- never a half-rewrite.
"""
from __future__ import annotations

from .context import PassContext


def check_coverage(ctx: PassContext) -> None:
    c = ctx.counters
    c.graphs += 1
    if not ctx.sites:
        ctx.refuse_graph("no attention found in the captured graph (neither an F.scaled_dot_product_attention call "
                         "nor a matmul-softmax-matmul chain); is this a transformers decoder with attention "
                         "implementation 'sdpa' or 'eager'?")
        return
    refused = [s for s in ctx.sites if s.refusal is not None]
    if refused:
        c.sites_refused += len(refused)
        first = refused[0]
        ctx.refuse_graph(f"unsupported attention form: {first.refusal} ({first.describe()}; "
                         f"{len(refused)} of {len(ctx.sites)} sites)")
        return
    if not ctx.is_decode:
        c.prefill_graphs += 1      # prefill stays dense by design
        return
    c.decode_graphs += 1
    n_layers = ctx.model.config.num_hidden_layers
    layers = [s.layer_idx for s in ctx.sites]
    if len(layers) != n_layers:
        ctx.refuse_graph(f"found attention in {len(layers)} layers ({layers}) but the model has {n_layers}; "
                         "some layers' attention was not recognized")
        return
    global_sites = [s for s in ctx.sites if s.kind == "global"]
    if not global_sites:
        window = getattr(ctx.model.config, "sliding_window", None)
        ctx.refuse_graph(f"nothing to rewrite: every attention layer uses a sliding window ({window} tokens) and "
                         "lychee rewrites only global layers. If your contexts never exceed the window, set "
                         "model.config.sliding_window = None first.")
        return
    if ctx.retrieval is not None:
        # ctx.retrieval has this rank's columns under tensor parallelism (tensor_parallel.py): compared as such
        hkv = {s.kv_heads() for s in global_sites}
        if hkv != {ctx.retrieval.shape[1]}:
            ctx.refuse_graph(f"the graph's global layers have {sorted(hkv)} KV heads but the head map (this "
                             f"process's KV heads of it) has {ctx.retrieval.shape[1]}")
            return
    c.sites_sliding += sum(s.kind == "sliding" for s in ctx.sites)
