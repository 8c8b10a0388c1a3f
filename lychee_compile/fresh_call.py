"""A callable on a code object of its own, so Dynamo keeps separate compiled entries for each model and each use.

    call = fresh_call(model, "lychee_decode_step")     # then torch.compile(call, ...)
"""
from __future__ import annotations

import itertools
import types


def fresh_call(fn, name: str):
    """A function calling fn, on a code object of its own: Dynamo keys its cache (and recompile limit) by code
    object, so each model (and each use: the probe, the decode steps) gets its own entries instead of sharing one
    with every other model."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    # Named after its use and numbered: Dynamo also keys per-frame state (automatic dynamic shapes) by (file, line,
    # name). One name for every model would let a second model's constants (attention scale, head counts), which
    # differ from the first's, look like values that change between calls, and Dynamo would make them symbolic; and
    # the probe's 2-token static-cache run must not shape the decode step's compile.
    name = f"{name}_{next(_CALL_NUMBERS)}"
    code = call.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)


_CALL_NUMBERS = itertools.count()
