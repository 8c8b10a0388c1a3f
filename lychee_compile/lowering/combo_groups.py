"""Two launch groups of our own among a decode step's small kernels, each run as one Inductor combo kernel:
  * the input reads (`input_reads`): small kernels that read graph inputs only, e.g. each layer's head kinds
    (RETR, SEL) cast from the head-kinds buffer, which Inductor places right before each layer's attention;
  * the tail writes (`tail_writes`): the write-backs of mutated graph inputs that nothing in the graph reads,
    e.g. the static cache's per-layer length counters (`cumulative_length.add_(1)`, transformers 5.17-5.24).
Why: Inductor groups nodes of one topological level only (and at most 8), so these stayed kernels of their own:
~31 + 32 launches of ~1 us each in a Llama-3-8B step, plus a launch gap each (H200 profiles: docs/design-notes.md).
Safe: an input read depends on no other kernel, so the group depends on none and runs first; nothing in the graph
reads what a tail write writes, so none depends on another (checked from the scheduler's ancestors) and delaying
them changes no value. `step_end_groups` is what inductor_changes puts in place of Inductor's grouping, inside our
compiles only (KernelOptions.combo_input_reads / combo_tail_writes turn each group off).
"""
from __future__ import annotations

from . import compat

INPUT_READ_MAX_NUMEL = 1 << 16      # elements: what is hoisted to the start of the step stays small


def step_end_groups(groups: list, nodes, input_reads_on: bool = True, tail_writes_on: bool = True) -> list:
    """Inductor's combo groups `groups` of the scheduler nodes `nodes`, less our two groups, which come last."""
    ours = [[n for n in find(nodes) if _gpu_node(n)]      # Inductor's grouping leaves CPU nodes out
            for on, find in ((input_reads_on, input_reads), (tail_writes_on, tail_writes)) if on]
    ours = [g for g in ours if len(g) > 1]
    taken = {n for g in ours for n in g}
    rest = [[n for n in g if n not in taken] for g in groups]
    return [g for g in rest if g] + ours


def input_reads(nodes) -> list:
    """The scheduler nodes among `nodes` (in order) that depend on no other node (they read graph inputs only, no
    ordering constraint either) and are small pointwise Inductor kernels (<= INPUT_READ_MAX_NUMEL elements, known
    at compile time; not a no-op node, not a template or extern call), writing no graph input."""
    out = []
    for node in nodes:
        if (not isinstance(node, (compat.SchedulerNode, compat.FusedSchedulerNode))
                or isinstance(node, compat.ForeachKernelSchedulerNode) or node.unmet_dependencies
                or node.is_template() or node.is_extern() or node.is_reduction() or not node.get_outputs()):
            continue
        if any(buf.node.get_mutation_names() for buf in node.get_outputs()):
            continue
        numel = _numel(node)
        if numel is not None and numel <= INPUT_READ_MAX_NUMEL:
            out.append(node)
    return out


def _numel(node):
    """Elements of a pointwise node's iteration space (node.group[1][0]: a size on the Triton backend, a tuple of
    sizes on the C++ one), or None where it is not a number at compile time."""
    import sympy
    size = node.group[1][0]
    n = sympy.Mul(*size) if isinstance(size, (tuple, list)) else sympy.sympify(size)
    return int(n) if n.is_number else None


def _gpu_node(node) -> bool:
    device = node.get_device()
    return device is not None and device.type not in ("cpu", "mps")


def tail_writes(nodes) -> list:
    """The scheduler nodes among `nodes` (in order) that only write mutated graph inputs back (a static cache's
    counter, a state buffer): some output mutates a graph input, and every output is used only by the node itself
    or, if it is such a write-back, as a graph output. Inductor kernels only (no template or extern call), and none
    depending on another. Nothing in the graph waits for them."""
    inputs = set(compat.V.graph.graph_inputs)
    found = [n for n in nodes if not (n.is_template() or n.is_extern()) and _writes_back_only(n, inputs)]
    names = {x.get_name() for n in found for x in n.get_nodes()}
    return [n for n in found
            if not ((set(getattr(n, "ancestors", ())) - {x.get_name() for x in n.get_nodes()}) & names)]


def _writes_back_only(node, inputs: set) -> bool:
    own = {x.get_name() for x in node.get_nodes()}
    writes = False
    for buf in node.get_outputs():
        mutated = set(buf.node.get_mutation_names())
        back = bool(mutated) and mutated <= inputs
        for user in buf.users:
            if not (user.get_name() in own or (back and isinstance(user.node, compat.OutputNode))):
                return False
        writes |= back
    return writes
