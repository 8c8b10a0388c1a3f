"""Pass `rewrite`: replace every global decode site by one `lychee::hybrid_decode` op (or, for the dense speed
baseline attention="flash_dense", one `lychee::dense_decode` op, which has no index state). In a graph of
rectification's re-encode (PassContext.reencode: a prefill of the R newest tokens over the cache, rectify.py) every
site becomes `lychee::dense_decode` with R queries instead: dense, what the model's masked attention computes, but
over the valid keys only and with no repeat_kv copy of the cache (HF's masked SDPA over the whole capacity, after
repeat_kv, read and wrote G + 1 times the cache's bytes per layer). Other prefill graphs are never rewritten. A
re-encode's dense_decode sites also share one `lychee::segment_plan(ranges, ...)` node: the FlashAttention-2 varlen
metadata of their key segments, the same for every layer.

Per site, inserted right before the original attention output (so after the KV-cache write of that layer):
    valid = valid_from_<mask kind>(mask, q)                  # bool [B, T]; ONE node shared by every site with
                                                             # the same mask (the lowering then computes each row's
                                                             # valid range once per step, not once per layer)
    kinds = kinds_slot(state.kinds, slot)                    # bool [Hkv], runtime data (ops/state.py)
    res   = lychee.hybrid_decode.default(q, K, V, valid, retrieval=kinds, idx_in=<by thread_state>, scale,
                                         block_size, sink_tokens, local_tokens, policy, policy_param, quest_mode,
                                         quest_blocks)       # built by argument name (ops/op_arguments.py)
    out   = res[0]                                           # replaces the attention output
    idx   = res[1]                                           # wired to the next layer by `thread_state`
With heat or Quest bounds on, the node is a composite instead, heat_decode_step (ops/heat.py) / quest_decode_step
(ops/quest_decode.py): a plain function equal to the eager op lychee.hybrid_decode_heat / hybrid_decode_quest, that
Inductor's AOTAutograd traces into aten ops around one lychee.hybrid_decode_mass / hybrid_decode call, so the
attention gets the Triton lowering. It also carries its layer's slot of its cross-step state: heat reads
layer_slot(state.heat, slot) and returns the updated slice as res[2], which `thread_slots` writes back; Quest takes
the whole descriptor buffer and the slot index (where the op takes one slot) and writes the one block per row that
changed into the buffer in place.
Then only the nodes this site matched are erased, and only once they have no users: never a global dead-code
elimination, which would delete the in-place KV-cache writes (index_copy_/add_ look pure to FX).
"""
from __future__ import annotations

import operator

import torch

from ..errors import LycheeCompileError
from ..ops.dense_decode import KEY_SEGMENTS
from ..ops.heat import heat_decode_step
from ..ops.hybrid_decode import IDX_OUT, OUT, SLOT_OUT, hybrid_decode_op
from ..ops.op_arguments import positional
from ..ops.quest_decode import quest_decode_step
from .canonicalize import VALID_FROM, valid_everywhere
from .context import PassContext, Site, log
from .graph_query import shape
from .thread_slots import layer_slot


def kinds_slot(kinds: torch.Tensor, slot: int) -> torch.Tensor:
    """kinds bool [Lg, Hkv] -> the slot's row [Hkv] (True = retrieval head). A view of the state buffer, so a head
    map written into the buffer by set_head_map() reaches the op at the next call with no recompile."""
    return kinds[slot]


def rewrite_sites(ctx: PassContext) -> None:
    if ctx.reencode:
        _rewrite_reencode(ctx)
        return
    global_sites = [s for s in ctx.sites if s.kind == "global"]
    if global_sites and ctx.config.attention == "hybrid" and not _buffers_fit(ctx, len(global_sites)):
        return
    shared_valid: dict = {}
    for slot, site in enumerate(global_sites):
        _rewrite(ctx, site, slot, shared_valid)
        ctx.counters.sites_rewritten += 1


def _rewrite_reencode(ctx: PassContext) -> None:
    """Every site of a re-encode graph -> dense_decode (all or none: a layer without a recognized site, or a site
    without a mask, whose valid keys and query positions the graph does not say, leaves the graph as the model
    computes it, which strict mode refuses)."""
    if ctx.is_decode:
        raise LycheeCompileError("the rectification re-encode compiled as a decode graph (query length 1), which "
                                 "would be rewritten to sparse attention; it must stay dense.")
    ctx.counters.reencode_graphs += 1
    sites = [s for s in ctx.sites if s.kind == "prefill"]
    n_layers = ctx.model.config.num_hidden_layers
    message = None
    if len(sites) != n_layers:      # a layer whose attention was not recognized would stay HF's masked attention
        message = (f"the rectification re-encode has attention sites in {len(sites)} layers "
                   f"({sorted(s.layer_idx for s in sites)}) but the model has {n_layers}: the re-encode keeps the "
                   "model's own attention (masked over the whole cache)")
    elif any(s.mask_kind == "none" for s in sites):
        message = ("an attention site of the rectification re-encode has no mask, so its valid keys are unknown: "
                   "the re-encode keeps the model's own attention (masked over the whole cache)")
    if message is not None:
        if ctx.strict:
            raise LycheeCompileError(message)
        log.warning("lychee_compile: %s.", message)
        ctx.counters.reencode_sites_unchanged += len(sites)
        return
    shared_valid: dict = {}
    for site in sites:
        _rewrite(ctx, site, None, shared_valid)
        ctx.counters.reencode_sites_dense += 1


def _buffers_fit(ctx: PassContext, n_global: int) -> bool:
    """The bound state buffers exist and have one slot per global layer of this graph (else the graph is refused)."""
    wanted = {"kinds": 0}                                                    # name -> slot dimension
    if ctx.config.heat_blocks > 0:
        wanted["heat"] = 1
    if ctx.config.quest != "off":
        wanted["quest"] = 1
    for name, dim in wanted.items():
        node = ctx.bound_buffers.get(name)
        if node is None:
            hint = (" The Quest descriptors are built from the cache by the model's eager forward (the prefill) or "
                    "just before a decode step made through model.get_compiled_call(); this decode step came "
                    "another way before any of those." if name == "quest" else "")
            ctx.refuse_graph(f"the graph carries no {name} state buffer (the model's forward was not wrapped by "
                             f"lychee_compile?).{hint}")
            return False
        slots = node.meta["example_value"].shape[dim]
        if slots != n_global:
            ctx.refuse_graph(f"the {name} state has {slots} layer slots but the graph has {n_global} global layers")
            return False
    return True


def _op_call(ctx: PassContext, site: Site, valid, kinds, slot: int, ranges=None, plan=None):
    """(the lychee node for one site, the name of the cross-step state whose slot it returns as res[2] or None):
    hybrid_decode,
    or the composite heat_decode_step (reads its heat slot, returns the new one) / quest_decode_step (updates its
    Quest descriptor slot in place, returns none) (the config allows at most one of them)."""
    graph, cfg = ctx.gm.graph, ctx.config
    def call(target, **named):
        return graph.call_function(target, positional(target, named))

    attention = dict(q=site.q, k=site.kv_k, v=site.kv_v, valid=valid, scale=site.scale)
    if _dense(ctx):
        return call(torch.ops.lychee.dense_decode.default, **attention, ranges=ranges, plan=plan), None
    hybrid = dict(attention, retrieval=kinds, idx_in=None,        # idx_in: wired by thread_state
                  block_size=cfg.block_size, sink_tokens=cfg.sink_tokens, local_tokens=cfg.local_tokens,
                  policy=cfg.policy_code, policy_param=float(cfg.selection_param))
    quest = dict(quest_mode=cfg.quest_code, quest_blocks=cfg.quest_blocks)
    if ctx.heat_input is not None:
        heat = graph.call_function(layer_slot, (ctx.heat_input, slot))
        return call(heat_decode_step, **hybrid, heat=heat, heat_decay=float(cfg.heat_decay),
                    heat_blocks=cfg.heat_blocks, ranges=ranges), "heat"
    if cfg.quest != "off":      # the whole buffer and the slot: the op writes one block per row into it
        return call(quest_decode_step, **hybrid, **quest, desc=ctx.quest_input, slot=slot, ranges=ranges), None
    return call(hybrid_decode_op(), **hybrid, **quest), None


def _shared_plan(graph, site: Site, ranges, shared: dict, key):
    """dense_decode's L > 1 metadata (lychee::segment_plan), once per graph for the sites of one shape; None for one
    query or symbolic shapes (the op then computes it itself)."""
    q, k = shape(site.q), shape(site.kv_k)                               # [B, Hq, L, D], [B, Hkv, T, D]
    if ranges is None or q is None or k is None:
        return None
    dims = (k[1], q[1] // k[1], k[2], q[2])                              # kv_heads, group, capacity, queries
    if not all(isinstance(x, int) for x in dims) or dims[3] == 1:
        return None
    node = shared.get((key, "plan", dims))
    if node is None:
        node = graph.call_function(torch.ops.lychee.segment_plan.default, (ranges, *dims, KEY_SEGMENTS))
        node.meta["nn_module_stack"] = ranges.meta["nn_module_stack"]
        shared[(key, "plan", dims)] = node
    return node


def _dense(ctx: PassContext) -> bool:
    """The sites become lychee::dense_decode (the flash_dense baseline, or a re-encode graph)."""
    return ctx.config.attention == "flash_dense" or ctx.reencode


def _composite(ctx: PassContext) -> bool:
    """The sites become heat_decode_step / quest_decode_step (plain tensor ops around one attention op)."""
    return ctx.heat_input is not None or ctx.config.quest != "off"


def _valid_key(site: Site) -> tuple:
    """Sites whose valid [B, T] is provably the same value: the same mask node and kind (B is the graph's batch),
    or, with no mask, the same cache length."""
    if site.mask_kind == "none":
        return ("none", str(site.kv_k.meta["example_value"].shape[2]))
    return (site.mask_kind, site.mask)


def _rewrite(ctx: PassContext, site: Site, slot: int, shared_valid: dict) -> None:
    graph = ctx.gm.graph
    dense = _dense(ctx)                                  # one output, no head kinds, no index state
    with graph.inserting_before(site.output):
        key = _valid_key(site)
        valid = shared_valid.get(key)
        if valid is None:
            if site.mask_kind == "none":
                valid = graph.call_function(valid_everywhere, (site.q, site.kv_k))
            else:
                valid = graph.call_function(VALID_FROM[site.mask_kind], (site.mask, site.q))
            valid.meta["nn_module_stack"] = site.output.meta.get("nn_module_stack", {})
            shared_valid[key] = valid
            if dense or _composite(ctx):   # the valid ranges once for every layer's op (dense_decode's `ranges`)
                ranges = graph.call_function(torch.ops.lychee.valid_ranges.default, (valid,))
                ranges.meta["nn_module_stack"] = valid.meta["nn_module_stack"]
                shared_valid[(key, "ranges")] = ranges
        kinds = None if dense else graph.call_function(kinds_slot, (ctx.kinds_input, slot))
        ranges = shared_valid.get((key, "ranges"))
        plan = _shared_plan(graph, site, ranges, shared_valid, key) if dense else None
        op, slot_name = _op_call(ctx, site, valid, kinds, slot, ranges, plan)
        out = op if dense else graph.call_function(operator.getitem, (op, OUT))
        if not dense:
            graph.call_function(operator.getitem, (op, IDX_OUT))
        if slot_name is not None:
            site.slot_out[slot_name] = graph.call_function(operator.getitem, (op, SLOT_OUT))
    for node in (kinds, op, out):
        if node is not None:
            node.meta["nn_module_stack"] = site.output.meta.get("nn_module_stack", {})
    op.meta["lychee_layer"] = site.layer_idx
    site.output.replace_all_uses_with(out)
    site.op_node = None if dense else op
    _erase_matched(ctx, site)


def _erase_matched(ctx: PassContext, site: Site) -> None:
    pending = list(site.matched)
    progress = True
    while pending and progress:
        progress = False
        for node in list(pending):
            if not node.users:
                ctx.gm.graph.erase_node(node)
                pending.remove(node)
                progress = True
