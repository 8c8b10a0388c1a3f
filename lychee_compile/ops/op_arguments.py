"""Op arguments by name: read and replace an argument of an op call by the name its op gives it.

A lychee op (an OpOverload such as lychee::hybrid_decode.default) names its arguments in its schema
(`op._schema.arguments`); a composite the rewrite emits (a plain function such as heat_decode_step) and the small
graph helpers around it (kinds_slot, drop_inherited, ...) name them in their Python signature. An FX call node may
hold an argument positionally, as a keyword, or not at all (then it is the default). These functions hide which,
so passes, the snapshot and the lowering address arguments by name, never by position:

    arg_names(op)                         names in schema order
    bind(op, args, kwargs)                name -> value for a call, defaults filled (what the op will see)
    positional(op, named)                 the args tuple of a call given by name (for graph.call_function)
    given(node)                           name -> value of the arguments a call node states, in schema order
    get_arg(node, name)                   one argument (its default if the node does not state it)
    set_arg(node, name, value)            replace it in place (positionally where the schema allows)
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.fx

_NO_DEFAULT = inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kwarg_only: bool
    default: object = _NO_DEFAULT     # _NO_DEFAULT: the caller must give it


@functools.lru_cache(maxsize=None)
def params(target) -> tuple[Param, ...]:
    """The parameters of an op (OpOverload, or OpOverloadPacket: its default overload) or of a plain function."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return tuple(Param(a.name, a.kwarg_only, a.default_value if a.has_default_value() else _NO_DEFAULT)
                     for a in schema.arguments)
    return tuple(Param(p.name, p.kind is inspect.Parameter.KEYWORD_ONLY, p.default)
                 for p in inspect.signature(target).parameters.values())


def arg_names(target) -> tuple[str, ...]:
    return tuple(p.name for p in params(target))


def _param(target, name: str) -> tuple[int, Param]:
    for i, p in enumerate(params(target)):
        if p.name == name:
            return i, p
    raise KeyError(f"{getattr(target, '__name__', target)} has no argument {name!r}; it has {arg_names(target)}")


def _refuse_unknown(target, names) -> None:
    unknown = set(names) - set(arg_names(target))
    if unknown:
        raise TypeError(f"{target}: unknown arguments {sorted(unknown)}; its schema takes {arg_names(target)}")


def bind(target, args: tuple, kwargs: dict | None = None) -> dict:
    """name -> value of a call `target(*args, **kwargs)`, in schema order, defaults filled; a missing or unknown
    argument raises TypeError (as the call would)."""
    kwargs = dict(kwargs or {})
    ps = params(target)
    if len(args) > sum(not p.kwarg_only for p in ps):
        raise TypeError(f"{target}: {len(args)} positional arguments, its schema takes {arg_names(target)}")
    _refuse_unknown(target, kwargs)
    bound = {}
    for i, p in enumerate(ps):
        if i < len(args):
            bound[p.name] = args[i]
        elif p.name in kwargs:
            bound[p.name] = kwargs[p.name]
        elif p.default is not _NO_DEFAULT:
            bound[p.name] = p.default
        else:
            raise TypeError(f"{target}: argument {p.name!r} missing")
    return bound


def positional(target, named: dict) -> tuple:
    """The positional args of a call of `target` with the arguments `named` (name -> value): schema order up to the
    last one named, the defaults of the unnamed ones between (a name the schema lacks, or a gap without a default,
    raises)."""
    _refuse_unknown(target, named)
    ps = [p for p in params(target) if not p.kwarg_only]
    last = max((i for i, p in enumerate(ps) if p.name in named), default=-1)
    args = []
    for p in ps[:last + 1]:
        if p.name not in named and p.default is _NO_DEFAULT:
            raise TypeError(f"{target}: argument {p.name!r} missing")
        args.append(named.get(p.name, p.default))
    return tuple(args)


def given(node: torch.fx.Node) -> dict:
    """name -> value of the arguments the call node states (positionally or as keywords), in schema order."""
    names = arg_names(node.target)
    stated = dict(zip(names, node.args))
    return {n: stated[n] if n in stated else node.kwargs[n] for n in names if n in stated or n in node.kwargs}


def get_arg(node: torch.fx.Node, name: str):
    i, p = _param(node.target, name)
    if i < len(node.args) and not p.kwarg_only:
        return node.args[i]
    if name in node.kwargs:
        return node.kwargs[name]
    if p.default is _NO_DEFAULT:
        raise KeyError(f"node {node.name} does not state argument {name!r}, which has no default")
    return p.default


def set_arg(node: torch.fx.Node, name: str, value) -> None:
    """Replace the argument in place. A positional argument the node does not state yet is appended positionally,
    with the defaults of the ones between, so the call keeps its positional form (as a keyword where a gap
    cannot be filled so)."""
    i, p = _param(node.target, name)
    if p.kwarg_only or name in node.kwargs:
        node.update_kwarg(name, value)
        return
    if i < len(node.args):
        node.update_arg(i, value)
        return
    between = params(node.target)[len(node.args):i]
    if any(q.default is _NO_DEFAULT or q.name in node.kwargs for q in between):
        node.update_kwarg(name, value)      # the gap cannot be filled positionally
        return
    node.args = tuple(node.args) + tuple(q.default for q in between) + (value,)
