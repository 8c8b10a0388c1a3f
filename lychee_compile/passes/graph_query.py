"""Small read-only questions about FX nodes of a Dynamo (torch-IR) graph.

Dynamo records the same operation in several spellings (torch.matmul vs Tensor.matmul, F.softmax vs .softmax,
operator.mul vs torch.mul); these helpers answer "is this node op X" for every spelling so matchers stay short.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

_FUNCTIONS = {
    "sdpa": {torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention},
    "matmul": {torch.matmul, torch.bmm, operator.matmul},
    "softmax": {torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax},
    "mul": {operator.mul, torch.mul},
    "truediv": {operator.truediv, torch.div, torch.true_divide},
    "add": {operator.add, torch.add},
    "tanh": {torch.tanh},
    "dropout": {torch.nn.functional.dropout},
    "transpose": {torch.transpose},
    "reshape": {torch.reshape},
    "getitem": {operator.getitem},
    "repeat_interleave": {torch.repeat_interleave},
    "linear": {torch._C._nn.linear},     # torch.nn.functional.linear is this same builtin
}
_METHODS = {
    "matmul": {"matmul", "bmm", "__matmul__"},
    "softmax": {"softmax"},
    "mul": {"mul", "__mul__"},
    "truediv": {"div", "__truediv__"},
    "add": {"add", "__add__"},
    "tanh": {"tanh"},
    "to": {"to", "type_as", "float", "half", "bfloat16"},
    "transpose": {"transpose", "mT"},
    "reshape": {"reshape", "view"},
    "expand": {"expand"},
    "contiguous": {"contiguous"},
    "repeat_interleave": {"repeat_interleave"},
}


def is_op(node, name: str) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return node.target in _FUNCTIONS.get(name, ())
    if node.op == "call_method":
        return node.target in _METHODS.get(name, ())
    return False


def value(node):
    """The example value Dynamo recorded for a node (a FakeTensor, SymInt, ...) or None."""
    if isinstance(node, torch.fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def shape(node) -> tuple | None:
    v = value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node):
    v = value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def arg(node: torch.fx.Node, index: int, name: str, default=None):
    """Positional-or-keyword argument of a call node of a torch builtin (which has no schema to read; lychee ops and
    our helpers are addressed by name alone: ops/op_arguments.py)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def output_of(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    """The getitem node that reads output `index` of a multi-output call, or None."""
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == index), None)


def module_path(node: torch.fx.Node) -> str | None:
    """Innermost module path Dynamo recorded for the node (e.g. "L['self'].model.layers.0.self_attn")."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]
