"""Pass `rewrite`: replace every global decode site by one `lychee::hybrid_decode` op.

Per site, inserted right before the original attention output (so after the KV-cache write of that layer):
    valid = valid_from_<mask kind>(mask, q)                  # bool [B, T]
    kinds = head_kinds(q, retrieval row of the layer)        # bool [Hkv], runtime data of the op
    res   = lychee.hybrid_decode.default(q, K, V, valid, kinds, <idx_in>, scale, block, sink, local,
                                         policy, policy_param)
    out   = res[0]                                           # replaces the attention output
    idx   = res[1]                                           # wired to the next layer by `thread_state`
Then only the nodes this site matched are erased, and only once they have no users: never a global dead-code
elimination, which would delete the in-place KV-cache writes (index_copy_/add_ look pure to FX).
"""
from __future__ import annotations

import operator

import torch

from ..ops.hybrid_decode import hybrid_decode_op
from .canonicalize import VALID_FROM, valid_everywhere
from .context import PassContext, Site
from .thread_heat import heat_slot


def head_kinds(q: torch.Tensor, row: tuple) -> torch.Tensor:
    """The layer's head kinds as a tensor on q's device: bool [Hkv], True = retrieval head."""
    return torch.tensor(row, dtype=torch.bool, device=q.device)


def rewrite_sites(ctx: PassContext) -> None:
    global_sites = [s for s in ctx.sites if s.kind == "global"]
    if ctx.heat_input is not None and ctx.heat_input.meta["example_value"].shape[1] != len(global_sites):
        ctx.refuse_graph(f"the heat state has {ctx.heat_input.meta['example_value'].shape[1]} layer slots but the "
                         f"graph has {len(global_sites)} global layers")
        return
    for slot, site in enumerate(global_sites):
        _rewrite(ctx, site, slot)
        ctx.counters.sites_rewritten += 1


def _op_call(ctx: PassContext, site: Site, valid, kinds, slot: int):
    """The lychee op for one site: hybrid_decode, or hybrid_decode_heat reading its heat slot (heat enabled)."""
    graph, cfg = ctx.gm.graph, ctx.config
    args = (site.q, site.kv_k, site.kv_v, valid, kinds, None)
    tail = (site.scale, cfg.block_size, cfg.sink_tokens, cfg.local_tokens, cfg.policy_code,
            float(cfg.selection_param))
    if ctx.heat_input is None:
        return graph.call_function(hybrid_decode_op(), args + tail + (cfg.quest_code, cfg.quest_blocks))
    heat = graph.call_function(heat_slot, (ctx.heat_input, slot))
    return graph.call_function(torch.ops.lychee.hybrid_decode_heat.default,
                               args + (heat,) + tail + (float(cfg.heat_decay), cfg.heat_blocks))


def _rewrite(ctx: PassContext, site: Site, slot: int) -> None:
    graph = ctx.gm.graph
    row = tuple(bool(x) for x in ctx.retrieval[site.layer_idx].tolist())
    with graph.inserting_before(site.output):
        if site.mask_kind == "none":
            valid = graph.call_function(valid_everywhere, (site.q, site.kv_k))
        else:
            valid = graph.call_function(VALID_FROM[site.mask_kind], (site.mask, site.q))
        kinds = graph.call_function(head_kinds, (site.q, row))
        op = _op_call(ctx, site, valid, kinds, slot)
        out = graph.call_function(operator.getitem, (op, 0))
        graph.call_function(operator.getitem, (op, 1))
        if ctx.heat_input is not None:
            site.heat_out = graph.call_function(operator.getitem, (op, 2))
    for node in (valid, kinds, op, out):
        node.meta["nn_module_stack"] = site.output.meta.get("nn_module_stack", {})
    op.meta["lychee_layer"] = site.layer_idx
    site.output.replace_all_uses_with(out)
    site.op_node = op
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
