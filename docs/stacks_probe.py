"""Probe how every tiny test model's decode step looks to a torch.compile backend (source of docs/STACKS.md).

    python docs/stacks_probe.py [--arch llama] [--impl sdpa] [--json out.json]

For each arch x attn_impl: model.generate(max_new_tokens=4, static cache, CompileConfig(backend=<recording backend>,
fullgraph=True, mode=None), _compile_all_devices=True), then reports per captured graph: attention call form, mask,
kv-cache placeholder shapes, notable ops; and whether the compiled tokens equal eager generate's.
"""
from __future__ import annotations

import argparse
import json
import operator
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import CompileConfig  # noqa: E402

from tests.models import ARCHS, ATTN_IMPLS, make, make_batch  # noqa: E402

SDPA_TARGETS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
MATMUL_TARGETS = {torch.matmul, operator.matmul, "matmul", torch.bmm, "bmm"}


def _val(n):
    return n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None


def _desc(x):
    if isinstance(x, torch.fx.Node):
        v = _val(x)
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        return f"<{x.op}:{x.name}>"
    return repr(x)


def _tname(n):
    t = n.target
    if isinstance(t, str):
        return t if n.op == "call_method" else f"{n.op}:{t}"
    return getattr(t, "__name__", str(t))


def _is_matmul(n):
    return n.op in ("call_function", "call_method") and n.target in MATMUL_TARGETS


def _module_path(n):
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def _ancestors(n, limit=10_000):
    seen, todo = set(), [n]
    while todo and len(seen) < limit:
        x = todo.pop()
        for a in x.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _descendants(n):
    seen, todo = set(), [n]
    while todo:
        x = todo.pop()
        for u in x.users:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


def _has_repeat_kv(kv_node):
    """True if kv_node comes from x[:, :, None].expand(...).reshape(...) (repeat_kv) within a few hops."""
    x, hops = kv_node, 0
    while isinstance(x, torch.fx.Node) and hops < 4:
        if x.op == "call_method" and x.target == "expand":
            return True
        if x.op == "call_function" and x.target in (torch.repeat_interleave,):
            return True
        if x.op == "call_method" and x.target == "repeat_interleave":
            return True
        if not x.all_input_nodes:
            return False
        x, hops = x.all_input_nodes[0], hops + 1
    return False


def _mask_origin(mask_node, placeholders):
    """Where the mask comes from: 'graph input <name>' or 'computed in graph from [inputs]'."""
    if mask_node is None:
        return None
    if mask_node.op == "placeholder":
        return f"graph input {mask_node.name}"
    anc = _ancestors(mask_node)
    srcs = sorted(a.name for a in anc if a.op == "placeholder")
    return f"computed in graph (from {', '.join(srcs) or 'constants'})"


def analyse(gm, example_inputs):
    g = gm.graph
    nodes = list(g.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    info = {"n_nodes": len(nodes), "placeholders": [], "attention": [], "notable_ops": {}}
    for p in placeholders:
        v = _val(p)
        if isinstance(v, torch.Tensor) and "_parameters_" not in p.name:
            info["placeholders"].append((p.name, _desc(p)))
    # notable ops
    for n in nodes:
        if n.op in ("call_function", "call_method"):
            name = _tname(n)
            if name in ("tanh", "index_copy_", "add_", "copy_", "index_put_", "scatter_", "roll", "cat",
                        "repeat_interleave", "softmax", "expand", "where", "masked_fill"):
                info["notable_ops"][name] = info["notable_ops"].get(name, 0) + 1
    # attention sites
    for n in nodes:
        if n.op == "call_function" and n.target in SDPA_TARGETS:
            q, k, v = n.args[:3]
            mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            site = {
                "form": "sdpa", "module": _module_path(n),
                "q": _desc(q), "k": _desc(k), "v": _desc(v),
                "attn_mask": _desc(mask) if mask is not None else None,
                "mask_origin": _mask_origin(mask, placeholders) if isinstance(mask, torch.fx.Node) else None,
                "is_causal": n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False),
                "scale": n.kwargs.get("scale"),
                "enable_gqa": n.kwargs.get("enable_gqa", False),
                "dropout_p": n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0),
                "repeat_kv_expand": _has_repeat_kv(k),
                "other_kwargs": sorted(set(n.kwargs) - {"attn_mask", "is_causal", "scale", "enable_gqa",
                                                          "dropout_p"}),
            }
            info["attention"].append(site)
    # eager: QK matmul -> ... -> PV matmul, per attention module
    mms = [n for n in nodes if _is_matmul(n)]
    used = set()
    for qk in mms:
        if qk in used:
            continue
        desc = _descendants(qk)
        pvs = [m for m in mms if m in desc and m is not qk]
        if not pvs:
            continue
        pv = min(pvs, key=nodes.index)
        # skip matmuls that are not attention (e.g. rotary inv_freq @ position): require softmax between them
        between = [x for x in nodes if x in desc and x in _ancestors(pv)]
        if not any(_tname(x) == "softmax" for x in between):
            continue
        used.update((qk, pv))
        chain, extra = [], []
        for x in between:
            args = [a for a in x.args if not isinstance(a, torch.fx.Node)]
            kw = {k_: v_ for k_, v_ in x.kwargs.items() if not isinstance(v_, torch.fx.Node)}
            side = [a for a in x.all_input_nodes if a not in desc and a is not qk]
            s = _tname(x)
            if args or kw:
                s += "(" + ", ".join([repr(a) for a in args] + [f"{k_}={v_!r}" for k_, v_ in kw.items()]) + ")"
            if side:
                s += " with " + ", ".join(_desc(a) for a in side)
                extra.extend(side)
            chain.append(s)
        mask_nodes = [a for a in extra if isinstance(_val(a), torch.Tensor) and _val(a).dim() == 4]
        site = {
            "form": "eager", "module": _module_path(qk),
            "qk": f"{_tname(qk)}({', '.join(_desc(a) for a in qk.args)})",
            "chain": chain,
            "pv": f"{_tname(pv)}({', '.join(_desc(a) for a in pv.args)})",
            "mask": [_desc(m) for m in mask_nodes],
            "mask_origin": [_mask_origin(m, placeholders) for m in mask_nodes],
            "k_repeat_kv_expand": _has_repeat_kv(qk.args[1].all_input_nodes[0] if isinstance(qk.args[1], torch.fx.Node)
                                                 and qk.args[1].all_input_nodes else qk.args[1]),
            "attn_weights_users": len([u for u in pv.args[0].users]) if isinstance(pv.args[0], torch.fx.Node) else None,
        }
        info["attention"].append(site)
    return info


def summarize(res):
    """Compact text lines for one run."""
    out = [f"== {res['arch']} {res['impl']} torch {res['torch']} transformers {res['transformers']} "
           f"lengths {res['lengths']}: graphs={res['n_graphs']} breaks={res['graph_breaks']} "
           f"tokens==eager:{res['tokens_equal_eager']} ==static-uncompiled:{res['tokens_equal_static_uncompiled']}"
           + (f" ERROR {res['error']}" if res["error"] else "")]
    for gi, g in enumerate(res["graphs"]):
        out.append(f"  graph {gi}: {g['n_nodes']} nodes; notable ops {g['notable_ops']}")
        out.append("   inputs: " + "; ".join(f"{n.replace('l_kwargs_', '')}={d}" for n, d in g["placeholders"]))
        seen = {}
        for site in g["attention"]:
            key = json.dumps({k: v for k, v in site.items() if k != "module"}, sort_keys=True, default=str)
            seen.setdefault(key, []).append(site["module"].split(".")[-2] if "." in site["module"] else site["module"])
        for key, mods in seen.items():
            out.append(f"   layers {mods}: {key}")
    return "\n".join(out)


def run_one(arch, impl, lengths=(12, 7), max_new_tokens=4):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append((gm, example_inputs, kwargs, analyse(gm, example_inputs), gm.code))
        return gm.forward

    ids, am = make_batch(lengths)
    model = make(arch, impl)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False)
        ref_static = model.generate(ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False,
                                    cache_implementation="static", disable_compile=True)
    model.generation_config.cache_implementation = "static"
    cc = CompileConfig(backend=backend, fullgraph=True, mode=None)
    cc._compile_all_devices = True
    model.generation_config.compile_config = cc
    err = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:300]}"
        out = None
    res = {
        "arch": arch, "impl": impl, "lengths": list(lengths), "torch": torch.__version__, "transformers": transformers.__version__,
        "error": err,
        "n_graphs": len(graphs),
        "graph_breaks": sum(counters["graph_break"].values()),
        "backend_kwargs": [sorted(g[2].keys()) for g in graphs],
        "tokens_equal_eager": None if out is None else bool(torch.equal(out, ref)),
        "tokens_equal_static_uncompiled": None if out is None else bool(torch.equal(out, ref_static)),
        "static_vs_dynamic_equal": bool(torch.equal(ref, ref_static)),
        "graphs": [g[3] for g in graphs],
    }
    cfg = model.config
    res["config"] = {k: getattr(cfg, k, None) for k in ("layer_types", "sliding_window", "attn_logit_softcapping",
                                                         "final_logit_softcapping", "query_pre_attn_scalar")}
    return res, graphs


def run_direct(arch, impl, lengths=(12, 7), max_new_tokens=4, pass_mask=True):
    """torch.compile(model) called by hand (no generate): StaticCache, prefill + decode steps, greedy."""
    from transformers import StaticCache
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append((gm, example_inputs, kwargs, analyse(gm, example_inputs), gm.code))
        return gm.forward

    ids, am = make_batch(lengths)
    model = make(arch, impl)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=am, max_new_tokens=max_new_tokens, do_sample=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    err, out = None, None
    try:
        with torch.no_grad():
            cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + max_new_tokens)
            mask = am.clone()
            pos = (am.cumsum(-1) - 1).clamp(min=0)
            kw = dict(attention_mask=mask) if pass_mask else {}
            logits = compiled(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, **kw).logits
            toks = [logits[:, -1].argmax(-1, keepdim=True)]
            for _ in range(max_new_tokens - 1):
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                pos = pos[:, -1:] + 1
                kw = dict(attention_mask=mask) if pass_mask else {}
                logits = compiled(input_ids=toks[-1], position_ids=pos, past_key_values=cache, use_cache=True,
                                  **kw).logits
                toks.append(logits[:, -1].argmax(-1, keepdim=True))
            out = torch.cat([ids] + toks, dim=1)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:300]}"
    res = {
        "arch": arch, "impl": impl, "lengths": list(lengths), "torch": torch.__version__,
        "transformers": transformers.__version__, "error": err, "n_graphs": len(graphs),
        "graph_breaks": sum(counters["graph_break"].values()),
        "backend_kwargs": [sorted(g[2].keys()) for g in graphs],
        "tokens_equal_eager": None if out is None else bool(torch.equal(out, ref)),
        "tokens_equal_static_uncompiled": "direct" + ("" if pass_mask else ", no mask passed"),
        "graphs": [g[3] for g in graphs],
    }
    return res, graphs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", action="append")
    ap.add_argument("--impl", action="append")
    ap.add_argument("--json")
    ap.add_argument("--lengths", default="12,7", help="prompt lengths, e.g. 12,7 (left-padded) or 12,12 or 9")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--new", type=int, default=4, help="max_new_tokens")
    ap.add_argument("--direct", action="store_true", help="torch.compile(model) + StaticCache by hand, no generate")
    ap.add_argument("--no-mask", action="store_true", help="with --direct: pass no attention_mask")
    ap.add_argument("--dump-graph", action="store_true")
    a = ap.parse_args()
    results = []
    for arch in a.arch or list(ARCHS):
        for impl in a.impl or list(ATTN_IMPLS):
            lengths = tuple(int(x) for x in a.lengths.split(","))
            if a.direct:
                res, graphs = run_direct(arch, impl, lengths, a.new, pass_mask=not a.no_mask)
            else:
                res, graphs = run_one(arch, impl, lengths, a.new)
            results.append(res)
            print(json.dumps(res, indent=1, default=str) if a.verbose else summarize(res))
            if a.dump_graph:
                for g in graphs:
                    print(g[4])
            sys.stdout.flush()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
