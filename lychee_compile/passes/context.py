"""What the passes share: the attention sites found in a graph, the counters, and the error type.

A pass reads and writes one PassContext; nothing flows between passes through globals.
"""
from __future__ import annotations

import dataclasses
import logging

import torch.fx

from ..errors import LycheeCompileError

log = logging.getLogger("lychee_compile")


@dataclasses.dataclass
class Site:
    """One attention computation found in the graph.

    form: "sdpa" (one F.scaled_dot_product_attention call) or "eager" (matmul -> softmax -> matmul chain).
    q: [B, Hq, L, D]; k, v: as the attention consumed them (possibly repeat_kv-expanded to Hq heads);
    mask: the mask node or None; output: the node whose value is the attention output [B, Hq, L, D];
    matched: every node of the matched form (removed after rewriting when it has no users left).
    Filled by later passes: kv_k / kv_v ([B, Hkv, T, D] after peeling repeat_kv), scale, layer_idx, module,
    kind ("global" | "sliding" | "prefill"), refusal (why it cannot be rewritten).
    """
    form: str
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    mask: torch.fx.Node | None
    output: torch.fx.Node
    matched: list[torch.fx.Node]
    scale: float | None = None
    enable_gqa: bool = False
    kv_k: torch.fx.Node | None = None
    kv_v: torch.fx.Node | None = None
    mask_kind: str | None = None           # "none" | "bool" | "additive"
    module_path: str | None = None
    module: object | None = None
    layer_idx: int | None = None
    kind: str | None = None
    refusal: str | None = None
    op_node: torch.fx.Node | None = None   # the lychee op that replaced it (rewrite pass)
    # the op's updated layer slot of a cross-step state, by buffer name ("heat"), written back by `thread_slots`
    # (Quest's op writes its slot in place and returns none)
    slot_out: dict[str, torch.fx.Node] = dataclasses.field(default_factory=dict)

    def kv_heads(self) -> int:
        """Hkv of the K the attention reads (after canonicalize): this process's KV heads at the site."""
        return int(self.kv_k.meta["example_value"].shape[1])

    def describe(self) -> str:
        where = f"layer {self.layer_idx}" if self.layer_idx is not None else (self.module_path or "?")
        return f"{self.form} attention at {where} (node {self.output.name})"


@dataclasses.dataclass
class Counters:
    """Per compiled model; accumulated over every graph our backend sees."""
    graphs: int = 0
    decode_graphs: int = 0
    prefill_graphs: int = 0
    sites_found: int = 0
    sites_rewritten: int = 0
    sites_sliding: int = 0
    sites_refused: int = 0
    graphs_left_dense: int = 0
    linear_groups_fused: int = 0     # pass fuse_linears: groups of sibling linears made one product, over all graphs
    linears_fused: int = 0           # ... and the linear calls they replaced
    selections_deferred: int = 0     # pass defer_selection: ops whose top-k the lowering may finish on a side stream
    # per rewritten site of each decode graph compiled: its lychee decode call runs the Triton kernels, or the op's
    # eager reference (fp32, no Triton device, backend='eager', ...: lowering/kernel_path.py), each site's reason
    # once in reference_reasons
    sites_on_kernel: int = 0
    sites_on_reference: int = 0
    # decode graphs' inputs that are DTensors (tensor parallel: nn.Linear weights enter as their local shards,
    # tensor_parallel.LocalLinearShards, so this counts what is left, e.g. an embedding)
    dtensor_inputs: int = 0
    # pass one_shot_all_reduce (tensor parallel on CUDA): all-reduces made lychee::one_shot_all_reduce, and those left
    # to the process group (a shape or dtype the buffer cannot take), over all graphs
    all_reduces_one_shot: int = 0
    all_reduces_kept: int = 0
    decode_calls: int = 0            # runtime: calls of a rewritten decode graph (generate() checks it moved)
    generate_calls_dense: int = 0    # runtime: generate() calls whose decode steps never reached the rewrite
    # rectification (rectify.py): graphs compiled for its re-encode (each a prefill graph, also in prefill_graphs)
    # and their attention sites made lychee::dense_decode (pass rewrite), or left as the model computes them (no
    # mask: non-strict only, logged); re-encodes run through that compiled call, or through the uncompiled model
    # (compile_reencode=False, or rectify_every=1 outside strict mode: the reason in reencode_eager_reason)
    reencode_graphs: int = 0
    reencode_sites_dense: int = 0
    reencode_sites_unchanged: int = 0
    reencodes_compiled: int = 0
    reencodes_eager: int = 0
    reencode_eager_reason: str | None = None
    reasons: list[str] = dataclasses.field(default_factory=list)
    reference_reasons: list[str] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PassContext:
    gm: torch.fx.GraphModule
    model: object
    config: object                   # LycheeConfig
    retrieval: object                # bool [num_layers, num_kv_heads], the effective head map (or None: probe)
    counters: Counters
    streaming: object = None         # bool [num_layers, num_kv_heads] or None: heads that inherit nothing
    # name -> placeholder of each buffer the wrapped forward announced with lychee::bind_state (pass bind_state):
    # the state buffers (ops/state.py STATE_NAMES) and the fused linear groups (fuse_linears)
    bound_buffers: dict = dataclasses.field(default_factory=dict)
    sites: list[Site] = dataclasses.field(default_factory=list)
    is_decode: bool | None = None
    rewrite: bool = True             # False: detect and check only (the probe in lychee_compile)
    reencode: bool = False           # a graph of rectification's re-encode (rectify.py; pass rewrite)
    aborted: str | None = None       # set when the graph is left dense as a whole (non-strict)
    example_inputs: list | None = None   # the tensors Dynamo bound to the placeholders, in order (fuse_linears)

    @property
    def heat_input(self) -> torch.fx.Node | None:
        return self.bound_buffers.get("heat")

    @property
    def quest_input(self) -> torch.fx.Node | None:
        return self.bound_buffers.get("quest")

    @property
    def kinds_input(self) -> torch.fx.Node | None:
        return self.bound_buffers.get("kinds")

    @property
    def strict(self) -> bool:
        return self.config.strict

    def refuse_graph(self, message: str) -> None:
        """Strict: raise. Otherwise log once, count, and leave the whole graph dense (no half-rewrites)."""
        if self.strict:
            raise LycheeCompileError(message)
        if message not in self.counters.reasons:
            log.warning("lychee_compile: %s -- this graph is left dense.", message)
            self.counters.reasons.append(message)
        self.counters.graphs_left_dense += 1
        self.aborted = message
