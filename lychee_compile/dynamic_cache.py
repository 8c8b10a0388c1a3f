"""Decode steps that transformers makes without its compiled call run through the lychee backend too.

Two kinds, both recognised by the instance's forward (the outermost forward wrapper) as a call with one query token
made outside Dynamo: on a static cache during beam search (which calls `model(...)` for every step: beam_search.py),
the step goes through the model's own compiled call (model.get_compiled_call, the one generate() uses); on a
DynamicCache, as follows.

transformers' generate() compiles its decode step only for compileable caches (the static cache lychee_compile
installs). With `past_key_values=DynamicCache()` or `cache_implementation="dynamic"` every step would call the
uncompiled model and run dense. So the instance's forward is wrapped: a call with query length 1 whose cache is a
DynamicCache (the cache grows by torch.cat, so its length changes every step) goes through
`torch.compile(<fresh code object calling the inner forward>, backend=lychee_backend, fullgraph=True, dynamic=True)`.
dynamic=True makes the cache length a symbol from the first decode graph on, so one graph serves every length (a new
batch size may add a graph: Dynamo specializes 1, and duck sizing can tie B to a head count). Prefill (query length
> 1) and calls made while Dynamo is already tracing (generate()'s static-cache path) go straight to the inner forward.

Options that need a static cache are refused at the first dynamic decode step, before any sparse step runs:
rectify_every rewinds the static cache's write offsets (rectify.py). Heat works: its buffer is sized by
max_position_embeddings, not by the cache.
"""
from __future__ import annotations

import functools
import logging

import torch

from .cache_kwarg import cache_of, tokens_of
from .errors import LycheeConfigError
from .beam_search import BEAM_STEPS_ATTR
from .fresh_call import fresh_call
from .rectify import REENCODING_ATTR

log = logging.getLogger("lychee_compile")


def _eager_decode_cache(args, kwargs):
    """The cache of a decode step (one query token) called outside Dynamo, else None."""
    if torch.compiler.is_compiling():
        return None
    x = tokens_of(args, kwargs)
    return cache_of(kwargs) if x is not None and x.shape[1] == 1 else None


def _is_dynamic_decode(args, kwargs) -> bool:
    """A decode step (one query token) on a DynamicCache, called outside Dynamo."""
    cache = _eager_decode_cache(args, kwargs)     # None while Dynamo traces: no import inside a traced frame
    if cache is None:
        return False
    from transformers import DynamicCache
    return isinstance(cache, DynamicCache)


def _is_beam_decode(model, args, kwargs) -> bool:
    """A beam-search decode step (one query token) on a compileable cache, called outside Dynamo (not a
    rectification re-encode, dense on purpose: rectify.py)."""
    # the compiling check first: an attribute read while Dynamo traces the wrapped forward becomes a guard, and the
    # flag changes between generate() calls (a recompile of the decode step at every switch of mode)
    if torch.compiler.is_compiling() or not getattr(model, BEAM_STEPS_ATTR, False) or getattr(model, REENCODING_ATTR,
                                                                                              False):
        return False
    return bool(getattr(_eager_decode_cache(args, kwargs), "is_compileable", False))


def install_dynamic_cache(model, backend, config, before_decode=None) -> None:
    """Wrap the instance's forward (install it after every other forward wrapper: the compiled call must include
    them, e.g. the heat state's bind_state marker, so that the backend sees it in the graph) and its generate().
    before_decode(kwargs), if given, runs before each compiled decode step, outside the graph (state_buffers.py:
    Quest descriptors built from a cache this model did not prefill)."""
    _route_decode_steps(model, backend, config, before_decode)
    _let_cache_objects_in(model)


def _route_decode_steps(model, backend, config, before_decode) -> None:
    inner = model.forward
    logged: list = []
    compiled = torch.compile(fresh_call(inner, "lychee_dynamic_decode"), backend=backend, fullgraph=True,
                             dynamic=True)

    # wraps: generate() reads forward's signature to decide which inputs to pass (position_ids, logits_to_keep).
    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if _is_beam_decode(model, args, kwargs):
            return model.get_compiled_call(model.generation_config.compile_config)(*args, **kwargs)
        if not _is_dynamic_decode(args, kwargs):
            return inner(*args, **kwargs)
        if config.rectify_every:
            raise LycheeConfigError(
                "rectify_every needs the static cache lychee_compile installs: rectification rewinds its write "
                "offsets. Drop the DynamicCache (past_key_values / cache_implementation='dynamic') or use "
                "rectify_every=0.")
        if config.cuda_graphs and not logged:
            logged.append(True)
            log.info("lychee_compile: decode steps on a DynamicCache run without CUDA graphs (its length changes "
                     "every step); the static cache lychee_compile sets runs with them")
        if before_decode is not None:
            before_decode(kwargs)
        # dynamic=True would also turn float attributes (attention scaling, norm eps) into graph inputs; the passes
        # need the scale as a number, and they are constants of the model.
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    model.forward = forward


def _let_cache_objects_in(model) -> None:
    """lychee_compile sets generation_config.cache_implementation = "static", and transformers refuses a generate()
    that also passes a cache object (past_key_values=DynamicCache(...)). A cache the caller passes wins."""
    inner = model.generate

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        if cache_of(kwargs) is not None and "cache_implementation" not in kwargs:
            kwargs["cache_implementation"] = None
        return inner(*args, **kwargs)

    model.generate = generate
