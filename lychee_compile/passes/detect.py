"""Pass `detect`: find every attention computation in the graph, in one of two named forms.

Form "sdpa":  out = F.scaled_dot_product_attention(q, k, v, attn_mask=?, dropout_p=, is_causal=, scale=?, enable_gqa=?)
Form "eager": s = matmul(q, k.transpose(-2, -1)); s = s * scale | s / c (any number); s = s + mask (at most one);
              p = softmax(s, dim=-1[, dtype]); p = p.to(dtype)?; p = dropout(p, p=0 | training=False)?;
              out = matmul(p, v)
Anything attention-like we cannot reproduce exactly (softcap tanh, a per-head bias such as ALiBi, two additive terms,
attention weights used elsewhere e.g. output_attentions=True, dropout in training) becomes a Site with `refusal` set:
later passes refuse the graph (strict) or leave it dense; nothing is approximated.
"""
from __future__ import annotations

import numbers

import torch.fx

from .context import PassContext, Site
from .graph_query import arg, is_op, shape


def find_sites(ctx: PassContext) -> None:
    for node in ctx.gm.graph.nodes:
        site = None
        if is_op(node, "sdpa"):
            site = _match_sdpa(node)
        elif is_op(node, "softmax"):
            site = _match_eager(node)
        if site is not None:
            ctx.sites.append(site)
    ctx.counters.sites_found += len(ctx.sites)


def _match_sdpa(node: torch.fx.Node) -> Site:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    mask = arg(node, 3, "attn_mask")
    site = Site("sdpa", q, k, v, mask, node, [node], scale=arg(node, 6, "scale"),
                enable_gqa=bool(arg(node, 7, "enable_gqa", False)))
    dropout_p = arg(node, 4, "dropout_p", 0.0)
    if not isinstance(dropout_p, numbers.Number) or dropout_p != 0.0:
        site.refusal = f"scaled_dot_product_attention with dropout_p={dropout_p!r} (call model.eval())"
    elif arg(node, 5, "is_causal", False) is not False and _query_len(q) == 1:
        site.refusal = "scaled_dot_product_attention(is_causal=True) on a single query attends only position 0"
    elif site.scale is not None and not isinstance(site.scale, numbers.Number):
        site.refusal = "scaled_dot_product_attention with a tensor-valued scale"
    return site


def _query_len(q):
    s = shape(q)
    return s[2] if s is not None and len(s) == 4 else None


def _match_eager(softmax: torch.fx.Node) -> Site | None:
    dim = arg(softmax, 1, "dim")
    if dim not in (-1, 3):
        return None
    scale, mask, refusal = 1.0, None, None
    matched = [softmax]
    x = softmax.args[0]
    while True:
        if not isinstance(x, torch.fx.Node):
            return None
        if is_op(x, "matmul"):
            break
        matched.append(x)
        if is_op(x, "mul") or is_op(x, "truediv"):
            a, b = x.args[0], x.args[1]
            const, chain = (b, a) if isinstance(b, numbers.Number) else (a, b)
            if not isinstance(const, numbers.Number) or is_op(x, "truediv") and const is a:
                return None
            scale = scale * const if is_op(x, "mul") else scale / const
            x = chain
        elif is_op(x, "add"):
            a, b = x.args[0], x.args[1]
            chain, term = (a, b) if _leads_to_matmul(a) else (b, a)
            if mask is not None:
                refusal = "two additive terms before softmax (a position bias such as ALiBi plus a mask)"
            term_shape = shape(term)
            if term_shape is None or len(term_shape) != 4:
                refusal = refusal or "an additive term before softmax that is not a 4-D attention mask"
            elif term_shape[1] != 1:
                refusal = refusal or "a per-head additive bias before softmax (ALiBi-like); only masks are supported"
            mask, x = term, chain
        elif is_op(x, "tanh"):
            refusal = "softcapped attention (tanh on the scores, e.g. Gemma2) cannot be reproduced by lychee ops"
            x = x.args[0]
        elif is_op(x, "to"):
            x = x.args[0]
        else:
            return None
    qk = x
    q, k_t = qk.args[0], qk.args[1]
    if not (is_op(k_t, "transpose") and _is_last_two(k_t)):
        return None
    k = k_t.args[0]
    out, tail = _follow_to_pv(softmax)
    if out is None:
        return None
    site = Site("eager", q, k, out.args[1], mask, out, [qk, k_t, *matched, *tail, out], scale=scale)
    site.refusal = refusal or _chain_escapes(site)
    return site


def _is_last_two(transpose: torch.fx.Node) -> bool:
    if transpose.target == "mT":
        return True
    dims = {d % 4 if isinstance(d, int) else d for d in transpose.args[1:3]}
    return dims == {2, 3}


def _leads_to_matmul(node, depth: int = 6) -> bool:
    while depth and isinstance(node, torch.fx.Node):
        if is_op(node, "matmul"):
            return True
        if not node.args:
            return False
        node = node.args[0]
        depth -= 1
    return False


def _follow_to_pv(softmax: torch.fx.Node):
    """softmax -> [to] -> [dropout] -> matmul(p, v); returns (pv matmul, nodes in between) or (None, [])."""
    tail, x = [], softmax
    while len(x.users) == 1:
        (user,) = x.users
        if is_op(user, "matmul") and user.args[0] is x:
            return user, tail
        if is_op(user, "to") or is_op(user, "dropout"):
            if is_op(user, "dropout") and arg(user, 1, "p", 0.5) != 0.0 and arg(user, 2, "training", True):
                return None, []
            tail.append(user)
            x = user
            continue
        return None, []
    # Several users: the weights escape (returned with output_attentions=True); find the PV matmul anyway so the
    # site is reported as refused instead of silently ignored.
    for user in x.users:
        if is_op(user, "matmul") and user.args[0] is x:
            return user, tail
    return None, []


def _chain_escapes(site: Site) -> str | None:
    inner = [n for n in site.matched if n is not site.output]
    for n in inner:
        if any(u not in site.matched for u in n.users):
            return ("attention weights are used outside the attention (output_attentions=True?); "
                    "lychee ops do not materialize them")
    return None
