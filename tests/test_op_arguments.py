"""Op arguments by name (lychee_compile/ops/op_arguments.py): read and replace an FX call node's argument by the name
the op's schema (or a composite's signature) gives it, whether the node states it positionally, as a keyword or not
at all (its default)."""
from __future__ import annotations

import pytest
import torch
import torch.fx

from lychee_compile.ops.heat import heat_decode_step
from lychee_compile.ops.hybrid_decode import hybrid_decode_op
from lychee_compile.ops.op_arguments import arg_names, bind, get_arg, given, positional, set_arg

SCHEMA = ("q", "k", "v", "valid", "retrieval", "idx_in", "scale", "block_size", "sink_tokens", "local_tokens",
          "policy", "policy_param", "quest_mode", "quest_blocks", "select", "defer_select")


def _call(target, n_inputs: int, scalars: tuple = (), kwargs: dict | None = None):
    """A graph with one call of `target` on n_inputs placeholders followed by `scalars`; (graph, node, inputs)."""
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(n_inputs)]
    node = graph.call_function(target, tuple(inputs) + scalars, kwargs or {})
    graph.output(node)
    return graph, node, inputs


def test_names_come_from_the_schema_and_the_signature():
    assert arg_names(hybrid_decode_op()) == SCHEMA
    assert arg_names(torch.ops.lychee.hybrid_decode) == SCHEMA          # the packet: its default overload
    assert arg_names(heat_decode_step)[4:8] == ("retrieval", "idx_in", "heat", "scale")


def test_read_positional_keyword_and_default():
    _, node, x = _call(hybrid_decode_op(), 6, (0.5, 4, 4, 8), {"policy_param": 0.25})
    assert get_arg(node, "q") is x[0] and get_arg(node, "idx_in") is x[5]
    assert get_arg(node, "local_tokens") == 8
    assert get_arg(node, "policy_param") == 0.25                   # stated as a keyword
    assert get_arg(node, "policy") == 0 and get_arg(node, "select") is None   # unstated: the schema's defaults
    assert get_arg(node, "defer_select") is False
    assert list(given(node)) == list(SCHEMA[:10]) + ["policy_param"]
    with pytest.raises(KeyError, match="no argument 'kinds'"):
        get_arg(node, "kinds")


def test_replace_keeps_the_positional_form_and_fills_defaults_between():
    graph, node, x = _call(hybrid_decode_op(), 6, (0.5, 4, 4, 8, 0, 0.0))
    set_arg(node, "idx_in", x[1])                                  # stated: replaced in place
    assert node.args[5] is x[1] and x[1] in node.all_input_nodes and x[5] not in node.all_input_nodes
    set_arg(node, "defer_select", True)                            # not stated: appended after the defaults
    assert node.args[12:] == (0, 0, None, True) and not node.kwargs
    set_arg(node, "select", x[2])
    assert get_arg(node, "select") is x[2] and node.args[15] is True
    graph.lint()


def test_replace_a_keyword_stays_a_keyword():
    _, node, x = _call(hybrid_decode_op(), 6, (0.5, 4, 4, 8), {"quest_blocks": 2})
    set_arg(node, "quest_blocks", 3)
    assert node.kwargs == {"quest_blocks": 3} and len(node.args) == 10
    set_arg(node, "defer_select", True)        # quest_blocks sits between, as a keyword: no positional gap fill
    assert node.kwargs == {"quest_blocks": 3, "defer_select": True} and len(node.args) == 10


def test_plain_function_by_signature():
    _, node, x = _call(heat_decode_step, 7, (0.5, 4, 4, 8, 0, 0.0, 0.9, 2))
    assert get_arg(node, "heat") is x[6] and get_arg(node, "heat_decay") == 0.9
    set_arg(node, "heat", x[0])
    assert node.args[6] is x[0]


def test_bind_fills_defaults_and_refuses_what_the_call_would():
    bound = bind(hybrid_decode_op(), ("q", "k", "v", "valid", "r", "idx", 0.5, 4, 4, 8), {"select": "s"})
    assert list(bound) == list(SCHEMA)
    assert bound["select"] == "s" and bound["policy"] == 0 and bound["defer_select"] is False
    with pytest.raises(TypeError, match="'local_tokens' missing"):
        bind(hybrid_decode_op(), ("q", "k", "v", "valid", "r", "idx", 0.5, 4, 4))
    with pytest.raises(TypeError, match="unknown arguments"):
        bind(hybrid_decode_op(), ("q", "k", "v", "valid", "r", "idx", 0.5, 4, 4, 8), {"defer": True})
    with pytest.raises(TypeError, match="positional"):
        bind(hybrid_decode_op(), tuple(range(17)))


def test_positional_orders_named_arguments_and_fills_gaps_with_defaults():
    named = dict(zip(SCHEMA[:10], range(10)), quest_blocks=3)
    assert positional(hybrid_decode_op(), named) == tuple(range(10)) + (0, 0.0, 0, 3)
    assert positional(heat_decode_step, {"q": 1}) == (1,)
    with pytest.raises(TypeError, match="'k' missing"):
        positional(hybrid_decode_op(), {"q": 1, "v": 2})
    with pytest.raises(TypeError, match="unknown arguments"):
        positional(hybrid_decode_op(), {"kinds": 1})
