"""The ONE module of lychee_compile that imports private torch._inductor APIs.

Checked on:
  * torch 2.13 (+ triton 3.9, CPU machine: Inductor emitting Triton for CPU tensors under TRITON_INTERPRET=1)
  * torch 2.11 (+ triton 3.6, the H100 machine)
Known differences handled here:
  * `autotune_select_algorithm` returns the output node on 2.11 but a tuple (node, ...) on 2.13 -> `select_one`.
  * `SizeVarAllocator.optimization_hint` (2.13) vs `size_hint` (2.11) -> `size_hint`.
Everything else used (compile_fx(config_patches=...), CachingAutotuner.coordinate_descent_tuning and its
heuristic_type / size_hints / bench / clone_args / reset_to_zero_args / device_props, HeuristicType,
TritonKernel._filter_pdl / _enable_pdl_codegen / GDC_WAIT, ForeachKernelSchedulerNode
.group_algorithm_for_combo_kernels, CUDAGraphNode._record, SchedulerBuffer.users, OutputNode, SchedulerNode,
FusedSchedulerNode, BaseSchedulerNode.get_outputs / ancestors / get_name / get_device, CustomGraphPass (uuid), the
config keys post_grad_custom_post_pass and triton.enable_pdl, register_lowering, lowerings, empty_strided,
fallback_handler, TritonTemplate, SymbolicGridFn, ir.FixedLayout, ir.ExternKernel.realize_input,
V.graph.sizevars.guard_int) has the same shape on both. Any other torch version is used at your own risk:
`CHECKED_VERSIONS` says what was checked.

This module only imports and adapts; it changes nothing in Inductor. What lychee_compile changes in Inductor's
behaviour, and where, is in inductor_changes.py; how our graphs are compiled, in compile.py.
"""
from __future__ import annotations

import torch

CHECKED_VERSIONS = ((2, 11), (2, 13))
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor import ir  # noqa: E402
from torch._inductor.codegen.triton import TritonKernel  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402
from torch._inductor.cudagraph_trees import CUDAGraphNode  # noqa: E402
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
from torch._inductor.lowering import (empty_strided, fallback_handler, lowerings,  # noqa: E402
                                      register_lowering)
from torch._inductor.runtime.hints import HeuristicType  # noqa: E402
from torch._inductor.runtime.triton_heuristics import CachingAutotuner  # noqa: E402
from torch._inductor.scheduler import (ForeachKernelSchedulerNode, FusedSchedulerNode, OutputNode,  # noqa: E402
                                       SchedulerNode)
from torch._inductor.select_algorithm import (SymbolicGridFn, TritonTemplate,  # noqa: E402
                                              autotune_select_algorithm)
from torch._inductor.virtualized import V  # noqa: E402
from torch.utils._sympy.functions import CeilDiv  # noqa: E402

__all__ = ["CHECKED_VERSIONS", "TORCH_VERSION", "inductor_config", "ir", "empty_strided", "fallback_handler",
           "lowerings", "register_lowering", "SymbolicGridFn", "TritonTemplate", "select_one", "V", "CeilDiv",
           "size_hint", "static_int", "compile_fx", "has_inductor_pdl", "realize", "to_dtype", "fixed_layout",
           "triton_device_ok", "sm_count", "graph_memo", "TritonKernel", "CUDAGraphNode", "CustomGraphPass",
           "HeuristicType", "CachingAutotuner", "ForeachKernelSchedulerNode", "FusedSchedulerNode", "OutputNode",
           "SchedulerNode"]


def has_inductor_pdl() -> bool:
    """Inductor can generate its Triton kernels with programmatic dependent launch (config triton.enable_pdl)."""
    return hasattr(inductor_config.triton, "enable_pdl")


def select_one(name, choices, input_nodes, layout):
    """autotune_select_algorithm over our (single) choice; returns the output TensorBox on every checked version."""
    res = autotune_select_algorithm(name, choices, input_nodes, layout)
    if isinstance(res, tuple):  # torch 2.13
        res = res[0]
    return res


def size_hint(expr) -> int:
    """A tuning hint for a (possibly symbolic) size; never a guard."""
    sv = V.graph.sizevars
    if hasattr(sv, "optimization_hint"):
        return int(sv.optimization_hint(expr, fallback=8192))
    return int(sv.size_hint(expr, fallback=8192))


def static_int(expr) -> int:
    """Head counts / head dim / index width become kernel constexprs: guard them static (they are model
    constants). Batch and cache length are never passed through here."""
    return int(V.graph.sizevars.guard_int(expr))


def realize(x):
    return ir.ExternKernel.realize_input(x)


def to_dtype(x, dtype):
    return lowerings[torch.ops.prims.convert_element_type.default](x, dtype)


def fixed_layout(device, dtype, size):
    return ir.FixedLayout(device, dtype, list(size), ir.FlexibleLayout.contiguous_strides(list(size)))


def triton_device_ok(device) -> bool:
    if device.type == "cuda":
        return True
    return device.type == "cpu" and inductor_config.cpu_backend == "triton"


def sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def graph_memo() -> dict:
    """A dict that lives as long as the graph being lowered (V.graph): lets lowerings of one graph share IR they
    would otherwise each rebuild (e.g. the row extents every layer computes from the same valid mask)."""
    graph = V.graph
    memo = getattr(graph, "_lychee_memo", None)
    if memo is None:
        memo = {}
        graph._lychee_memo = memo
    return memo
