"""Pass `classify`: which layer each site belongs to, and whether that layer is global, sliding, or a prefill.

Layer: the innermost module on the node's nn_module_stack that has a `layer_idx` (HF attention modules do); its path
is resolved against the model. Graph order must agree with layer order.

Global vs sliding (the spine's definition): a layer is *global* when its attention sees the whole cache:
config.layer_types says full attention, or the layer has no sliding window, or the window is at least the cache
length T at the site. Sliding layers keep their own attention (their cache is a ring buffer: slot != position).
When T is unknown (the probe, or a symbolic length) a windowed layer counts as sliding.

Prefill: query length > 1 -- dense by design, never rewritten. A symbolic query length is a prefill too: Dynamo
specializes sizes 0 and 1, so a graph whose query length is a symbol never serves a one-token step (chunked prefill
compiles its chunks through generate()'s compiled call, one graph for every chunk length >= 2).
"""
from __future__ import annotations

import re

from .context import PassContext, Site
from .graph_query import module_path, shape


def classify_sites(ctx: PassContext, cache_len_known: bool = True) -> None:
    names = _module_names(ctx.model)
    one_token = []
    for site in ctx.sites:
        _resolve_layer(site, names)
        q_len = (shape(site.q) or (None,) * 4)[2]
        one_token.append(isinstance(q_len, int) and q_len == 1)     # a symbolic length is >= 2 (module docstring)
        if site.refusal is not None:
            continue
        if site.layer_idx is None:
            site.refusal = f"cannot tell which layer the attention at {site.module_path!r} belongs to"
        elif not one_token[-1]:
            site.kind = "prefill"
        else:
            site.kind = "sliding" if _is_sliding(ctx, site, cache_len_known) else "global"
    ctx.is_decode = bool(one_token) and all(one_token)
    _check_order(ctx)


def classify_for_probe(ctx: PassContext) -> None:
    """The probe runs on a tiny cache, so a window always looks longer than T; judge windows as sliding."""
    classify_sites(ctx, cache_len_known=False)


def _module_names(model) -> dict[str, object]:
    return {name: module for name, module in model.named_modules()}


def _normalize(path: str) -> str:
    path = re.sub(r"\[['\"]?([\w]+)['\"]?\]", r".\1", path)     # L['self'].layers[0] -> L.self.layers.0
    path = path.replace("._modules.", ".")
    return path.strip(".")


def _resolve_layer(site: Site, names: dict[str, object]) -> None:
    stack = site.output.meta.get("nn_module_stack") or {}
    for path, _type in reversed(list(stack.values())):
        parts = _normalize(path).split(".")
        # Dynamo prefixes the compiled root (L.self, L.self.model, ...): take the longest suffix that names a module.
        for start in range(len(parts)):
            module = names.get(".".join(parts[start:]))
            if module is not None and getattr(module, "layer_idx", None) is not None:
                site.module, site.module_path = module, ".".join(parts[start:])
                site.layer_idx = int(module.layer_idx)
                return
    site.module_path = module_path(site.output)


def _is_sliding(ctx: PassContext, site: Site, cache_len_known: bool) -> bool:
    config = getattr(ctx.model, "config", None)
    layer_types = getattr(config, "layer_types", None)
    window = getattr(site.module, "sliding_window", None)
    if layer_types is not None and site.layer_idx < len(layer_types):
        if "sliding" not in str(layer_types[site.layer_idx]):
            return False
        window = window or getattr(config, "sliding_window", None)
    else:
        window = window if window is not None else getattr(config, "sliding_window", None)
    if window is None:
        return False
    cache_len = (shape(site.kv_k) or (None,) * 4)[2]
    if cache_len_known and isinstance(cache_len, int) and cache_len < window:
        return False   # the whole cache fits in the window: slot == position, the layer sees everything
    return True


def _check_order(ctx: PassContext) -> None:
    seen = [s.layer_idx for s in ctx.sites if s.layer_idx is not None]
    if seen != sorted(seen) or len(seen) != len(set(seen)):
        for site in ctx.sites:
            site.refusal = site.refusal or (f"attention sites appear in graph order {seen}, not one per layer in "
                                            "layer order; the index state cannot be threaded")
