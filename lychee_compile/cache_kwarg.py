"""The name of the cache argument in a Hugging Face model's forward / generate call.

transformers calls it `past_key_values` up to 5.23 and `cache` from 5.24 on (where the old name is still taken, as a
deprecated alias). Every wrapper of ours that looks for the cache in a call's kwargs reads it through `cache_of`, and
a call we make ourselves names it as the model's forward does (`cache_kwarg`): read under one name only, a decode
step on 5.24 would not be seen as one (the Quest descriptors never built, a DynamicCache step run eagerly, i.e.
dense, rectification never run)."""
from __future__ import annotations

import functools
import inspect

CACHE_KWARGS = ("cache", "past_key_values")     # the newest name first


def cache_of(kwargs: dict):
    """The cache object a forward / generate call got, under either name; None if none."""
    for name in CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


@functools.lru_cache(maxsize=None)
def _forward_takes(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return next((n for n in CACHE_KWARGS if n in params), "past_key_values")


def cache_kwarg(model) -> str:
    """The name `model`'s class forward takes its cache under ("cache" or "past_key_values")."""
    return _forward_takes(type(model))


def tokens_of(args, kwargs):
    """The token tensor of a forward call ([B, L] ids, or [B, L, H] embeddings), however it was passed; None if
    neither."""
    x = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if x is None else x
