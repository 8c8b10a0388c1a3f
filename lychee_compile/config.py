"""LycheeConfig: the one frozen configuration that flows explicitly through api -> passes -> ops.

Every field that changes the rewritten graph is part of `cache_key()`, which the backend folds into its identity
so two configs never share a compiled artifact.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

from .errors import LycheeConfigError


DEFAULT_BUDGET = 1024      # tokens per sparse head where neither the config nor a calibrated head map sets one


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """How the rewritten decode step is generated on CUDA (no effect on values, only on speed; the defaults are the
    measured fast path: lowering/compile.py and inductor_changes.py say why each). Benchmarks turn them off one by
    one (`benchmarks/e2e.py --kernels pdl=false`); `KernelOptions.parse` reads that text."""
    # Inductor's combo kernels: the step's small independent pointwise / norm kernels share launches.
    combo_kernels: bool = True
    # ... and two groups of our own among them (lowering/combo_groups.py): the kernels that read graph inputs only
    # (each layer's head kinds), and the write-backs of mutated inputs nothing reads (cache length counters).
    combo_input_reads: bool = True
    combo_tail_writes: bool = True
    # Programmatic dependent launch for Inductor's kernels (compute capability 9+), and for our two templates.
    pdl: bool = True
    pdl_templates: bool = True
    # With LycheeConfig.tune_kernels: also tune the pointwise kernels, and the reductions of < 256 outputs (norms);
    # time each tuning variant on the device alone ("alone") or with Inductor's own timer ("inductor").
    tune_pointwise: bool = False
    tune_small_reductions: bool = False
    tune_timing: str = "alone"
    # The split launch's gathered (sparse-head) tile: (tokens per tile, pipeline stages, weight in the work pool);
    # None: the template's defaults (lowering/constexprs.kernel_params).
    sparse_tile: tuple | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise LycheeConfigError(f"KernelOptions.{f.name} must be a bool, got {value!r}.")
        if self.tune_timing not in ("alone", "inductor"):
            raise LycheeConfigError(f"KernelOptions.tune_timing must be 'alone' or 'inductor', got "
                                    f"{self.tune_timing!r}.")
        tile = self.sparse_tile
        if tile is not None and (not isinstance(tile, tuple) or len(tile) != 3
                                 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in tile)):
            raise LycheeConfigError(f"KernelOptions.sparse_tile must be None or three positive ints (tokens per "
                                    f"tile, stages, cost), got {tile!r}.")

    @classmethod
    def parse(cls, text: str) -> "KernelOptions":
        """'pdl=false,sparse_tile=64:3:2' -> KernelOptions (benchmarks' command lines); '' -> the defaults."""
        kw = {}
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, _, value = item.partition("=")
            if name not in names:
                raise LycheeConfigError(f"KernelOptions has no field {name!r}; fields: {sorted(names)}.")
            if names[name] == "bool":
                if value.lower() not in ("true", "false", "1", "0"):
                    raise LycheeConfigError(f"KernelOptions.{name}: expected true/false, got {value!r}.")
                kw[name] = value.lower() in ("true", "1")
            elif name == "sparse_tile":
                try:
                    kw[name] = tuple(int(x) for x in value.split(":"))
                except ValueError:
                    raise LycheeConfigError(f"KernelOptions.sparse_tile: expected 'tokens:stages:cost', e.g. "
                                            f"'128:2:4', got {value!r}.") from None
            else:
                kw[name] = value
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class LycheeConfig:
    # Tokens each sparse head may attend to beyond sink/local (rounded up to whole blocks). None (default): the head
    # map's recommended budget where `lychee calibrate` made it (HeadMap.recommended_budget), else DEFAULT_BUDGET;
    # lychee_compile resolves it (with_budget_for) and logs which.
    budget: int | None = None
    # Tokens per block; blocks are aligned to each row's first valid position (ops/row_alignment.py). Power of two.
    block_size: int = 16
    # First `sink_tokens` valid positions of a row are always attended (their blocks, outside the budget).
    sink_tokens: int = 16
    # Last `local_tokens` valid positions (incl. the current token) are always attended (their blocks).
    local_tokens: int = 64
    # How many ranked blocks a retrieval head keeps (ops/policies.py): "topk" (ceil(budget / block_size)),
    # "topp" (attention mass >= selection_param), "threshold" (block mass >= selection_param), "ratio"
    # (ceil(selection_param * valid blocks)); all capped at ceil(budget / block_size) slots.
    selection: str = "topk"
    selection_param: float = 0.0
    # EvoSparse heat (ops/heat.py): sparse heads also attend their `heat_blocks` hottest blocks (0 = off); heat
    # decays by `heat_decay` per step, in (0, 1).
    heat_blocks: int = 0
    heat_decay: float = 0.9
    # Quest block bounds (ops/quest.py): "off"; "all" = every head selects its own top blocks by the bound (the
    # Quest baseline); "sparse" = sparse heads add their own top `quest_blocks` blocks to the inherited ones.
    quest: str = "off"
    quest_blocks: int = 0
    # Dense rectification (rectify.py): every `rectify_every` decode steps, re-encode those tokens densely and
    # overwrite their K/V (0 = off; LycheeDecode uses 32, ReSA studies 16-64).
    rectify_every: int = 0
    # The re-encode runs the model's own compiled call (a dense prefill graph through this config's backend, fixed
    # shapes: compiled once per batch size, rectify.py). False: the uncompiled model (HF's eager forward, several
    # times slower at long context). rectify_every=1 cannot compile (a one-token forward is a decode step):
    # strict mode refuses it at lychee_compile time, otherwise it runs eagerly, logged and counted.
    compile_reencode: bool = True
    # The first global layer is all retrieval (nothing precedes it). False only for baselines whose first layer
    # must stay streaming (StreamingLLM); a sparse head there then inherits nothing.
    first_layer_retrieval: bool = True
    # strict: any attention site that cannot be rewritten, or a head map that does not match, raises.
    # Non-strict: such problems are logged once and counted; the graph is then left dense as a whole.
    strict: bool = True
    # What the rewritten global layers compute: "hybrid" (lychee), or "flash_dense" -- NOT lychee: plain dense
    # attention over exactly the valid keys with native GQA (ops/dense_decode.py), the best dense baseline that
    # speed claims are quoted against. Budget, selection, heat and Quest do not apply to it.
    attention: str = "hybrid"
    # Compile the decode step with CUDA graphs (Inductor's cudagraph trees): one replay per step instead of one
    # launch per kernel (at 128K on an H100 the default path took 13.3 ms a step without them, 6.8 ms with them).
    # CUDA models with backend="inductor" only; state buffers have static addresses for it. None (default): on
    # wherever they apply -- a CUDA model, the Inductor backend -- and off elsewhere, and lychee_compile logs which
    # and why (resolved_for); decode steps on a DynamicCache and rectification's re-encode run without them.
    cuda_graphs: bool | None = None
    # What compiles the rewritten graph: "inductor" (default), or "eager" (run the FX graph as is; fast to
    # build, used by tests that check the pass and numerics but not code generation).
    backend: str = "inductor"
    # Sibling linears (several F.linear on one input: q/k/v, gate/up) become one matrix product over a fused
    # weight (passes/fuse_linears.py): the member parameters become views of one buffer, no extra memory.
    fuse_linears: bool = True
    # Each retrieval head's top-k runs on a side stream, overlapped with the products up to the next global layer
    # (passes/defer_selection.py; Triton lowering on CUDA only, elsewhere the same values synchronously).
    defer_selection: bool = True
    # CUDA: Inductor tunes its generated reductions by timing (coordinate descent); with it every batch-1 linear
    # becomes a fused, tuned Triton reduction instead of a cuBLAS call (lowering/compat.py: -0.45 ms of a 7.6 ms step
    # at 128K on the H100). Costs 20-30 s more on the first compile of a 32-layer model (Inductor caches the results).
    tune_kernels: bool = True
    # False: a rewritten decode step's cuBLAS products run without a workspace (blas.py: no split-K reduce kernel;
    # o_proj / down_proj at 1-4 rows 2-2.5 us faster each on the H200), unless CUBLAS_WORKSPACE_CONFIG is set.
    # True keeps cuBLAS's default workspace.
    decode_blas_workspace: bool = False
    # Tensor parallel on CUDA, opt-in: the step's all-reduces of the hidden state ([B, 1, hidden], up to 128 KB) run
    # as lychee::one_shot_all_reduce -- torch's symmetric-memory one-shot kernel, which reads the peers' buffers over
    # NVLink -- instead of the process group's (NCCL) all-reduce (pass one_shot_all_reduce); lychee_compile
    # rendezvouses the buffer (tensor_parallel.resolved_all_reduce). The same all-reduces and sums. Off by default:
    # the hybrid step's gain (-0.34 ms at 128K x 4, 2 x H200, 2026-11-28) was shown on one machine, not on a second
    # (docs/tensor-parallel.md). No effect in one process or on CPU ranks.
    symm_mem_all_reduce: bool = False
    # Code-generation choices below these (KernelOptions above): benchmarks' switches, defaults are the fast path.
    kernels: KernelOptions = KernelOptions()

    def __post_init__(self) -> None:
        for name in ("budget", "block_size", "sink_tokens", "local_tokens"):
            value = self.resolved_budget if name == "budget" else getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and math.isnan(value):
                    raise LycheeConfigError(f"LycheeConfig.{name} is NaN; give a positive integer number of tokens.")
                raise LycheeConfigError(
                    f"LycheeConfig.{name} must be an int, got {type(value).__name__} {value!r}.")
        budget = self.resolved_budget
        if budget <= 0:
            raise LycheeConfigError(f"LycheeConfig.budget must be > 0 tokens, got {budget}. "
                                    "Use e.g. budget=1024; budget >= context length makes attention dense.")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise LycheeConfigError(f"LycheeConfig.block_size must be a power of two, got {self.block_size}.")
        if self.block_size > budget:
            raise LycheeConfigError(f"LycheeConfig.block_size ({self.block_size}) is larger than the budget "
                                    f"({budget}): not even one block fits. Lower block_size or raise budget.")
        if self.sink_tokens < 0 or self.local_tokens < 0:
            raise LycheeConfigError("LycheeConfig.sink_tokens and local_tokens must be >= 0, got "
                                    f"{self.sink_tokens} and {self.local_tokens}.")
        if self.sink_tokens + self.local_tokens > budget:
            raise LycheeConfigError(
                f"sink_tokens + local_tokens ({self.sink_tokens} + {self.local_tokens}) exceeds the budget "
                f"({budget}): the always-attended tokens would cost more than the whole budget. "
                "Lower them or raise the budget.")
        from .ops.policies import POLICIES
        if self.selection not in POLICIES:
            raise LycheeConfigError(f"LycheeConfig.selection must be one of {sorted(POLICIES)}, got "
                                    f"{self.selection!r}.")
        param = self.selection_param
        if not isinstance(param, (int, float)) or isinstance(param, bool) or math.isnan(param):
            raise LycheeConfigError(f"LycheeConfig.selection_param must be a number, got {param!r}.")
        if self.selection != "topk" and not 0.0 < param <= 1.0:
            raise LycheeConfigError(f"LycheeConfig.selection_param for {self.selection!r} must be in (0, 1] "
                                    f"(a probability mass, threshold or fraction), got {param}.")
        if isinstance(self.heat_blocks, bool) or not isinstance(self.heat_blocks, int) or self.heat_blocks < 0:
            raise LycheeConfigError(f"LycheeConfig.heat_blocks must be an int >= 0, got {self.heat_blocks!r}.")
        decay = self.heat_decay
        if not isinstance(decay, (int, float)) or isinstance(decay, bool) or not 0.0 < decay < 1.0:
            hint = (" decay 1 never forgets: the earliest hot blocks lock in for good (EvoSparse)."
                    if decay == 1 else "")
            raise LycheeConfigError(f"LycheeConfig.heat_decay must be in (0, 1), got {decay!r}.{hint}")
        from .ops.quest import QUEST_MODES
        if self.quest not in QUEST_MODES:
            raise LycheeConfigError(f"LycheeConfig.quest must be one of {sorted(QUEST_MODES)}, got {self.quest!r}.")
        if isinstance(self.quest_blocks, bool) or not isinstance(self.quest_blocks, int) or self.quest_blocks < 0:
            raise LycheeConfigError(f"LycheeConfig.quest_blocks must be an int >= 0, got {self.quest_blocks!r}.")
        if self.quest == "sparse" and self.quest_blocks == 0:
            raise LycheeConfigError("LycheeConfig(quest='sparse') needs quest_blocks > 0 (blocks each sparse head "
                                    "adds by its Quest bound).")
        if self.quest != "off" and self.heat_blocks > 0:
            raise LycheeConfigError("Quest bounds and heat cannot be combined yet; enable one of them.")
        if isinstance(self.rectify_every, bool) or not isinstance(self.rectify_every, int) or self.rectify_every < 0:
            raise LycheeConfigError(f"LycheeConfig.rectify_every must be an int >= 0 (0 = off), got "
                                    f"{self.rectify_every!r}.")
        if not isinstance(self.first_layer_retrieval, bool):
            raise LycheeConfigError("LycheeConfig.first_layer_retrieval must be a bool.")
        if not isinstance(self.strict, bool):
            raise LycheeConfigError(f"LycheeConfig.strict must be a bool, got {self.strict!r}.")
        if not isinstance(self.kernels, KernelOptions):
            raise LycheeConfigError(f"LycheeConfig.kernels must be a KernelOptions, got {self.kernels!r}.")
        if self.backend not in ("inductor", "eager"):
            raise LycheeConfigError(f"LycheeConfig.backend must be 'inductor' or 'eager', got {self.backend!r}.")

        self._check_modes()

    def _check_modes(self) -> None:
        if self.attention not in ("hybrid", "flash_dense"):
            raise LycheeConfigError(f"LycheeConfig.attention must be 'hybrid' or 'flash_dense', got "
                                    f"{self.attention!r}.")
        if self.attention == "flash_dense" and (self.heat_blocks or self.quest != "off" or self.rectify_every):
            raise LycheeConfigError("attention='flash_dense' is plain dense attention (the speed baseline): heat, "
                                    "Quest and rectification do not apply. Turn them off, or use attention='hybrid'.")
        for name in ("cuda_graphs", "defer_selection", "tune_kernels", "fuse_linears", "decode_blas_workspace",
                     "compile_reencode", "symm_mem_all_reduce"):
            if not isinstance(getattr(self, name), bool) and not (name == "cuda_graphs" and self.cuda_graphs is None):
                raise LycheeConfigError(f"LycheeConfig.{name} must be a bool, got {getattr(self, name)!r}.")
        if self.cuda_graphs and self.backend != "inductor":
            raise LycheeConfigError("cuda_graphs=True needs backend='inductor' (Inductor captures the graphs).")

    def resolved_for(self, device) -> tuple["LycheeConfig", str]:
        """This config with cuda_graphs decided for a model on `device` (a torch.device): True / False as given;
        None: on for a CUDA model with the Inductor backend. Also why, as a sentence for the log. (Rectification
        does not turn them off: its re-encode writes the static cache's tensors in place between two replays, as a
        prefill does.)"""
        if self.cuda_graphs is not None:
            return self, f"CUDA graphs {'on' if self.cuda_graphs else 'off'} (as configured)"
        why_not = ("the model is not on a CUDA device" if device.type != "cuda" else
                   "backend='eager'" if self.backend != "inductor" else None)
        resolved = dataclasses.replace(self, cuda_graphs=why_not is None)
        return resolved, ("CUDA graphs on (default for a CUDA model with the Inductor backend)" if why_not is None
                          else f"CUDA graphs off: {why_not}")

    @property
    def policy_code(self) -> int:
        from .ops.policies import POLICIES
        return POLICIES[self.selection]

    @property
    def quest_code(self) -> int:
        from .ops.quest import QUEST_MODES
        return QUEST_MODES[self.quest]

    @property
    def resolved_budget(self) -> int:
        """budget, or DEFAULT_BUDGET where it is None (lychee_compile resolves None from the head map first)."""
        return DEFAULT_BUDGET if self.budget is None else self.budget

    def with_budget_for(self, head_map) -> tuple["LycheeConfig", str]:
        """This config with budget=None replaced by the head map's recommended budget (a calibrated map), else
        DEFAULT_BUDGET; and where the budget came from, as a sentence for the log."""
        if self.budget is not None:
            return self, f"budget {self.budget} tokens (as configured)"
        recommended = head_map.recommended_budget
        if recommended is None:
            return dataclasses.replace(self, budget=DEFAULT_BUDGET), f"budget {DEFAULT_BUDGET} tokens (the default)"
        status = (head_map.calibration or {}).get("status", "?")
        return (dataclasses.replace(self, budget=recommended),
                f"budget {recommended} tokens (recommended by the head map's calibration, {status})")

    @property
    def num_select(self) -> int:
        """Blocks a retrieval head selects: ceil(budget / block_size). The index-state width K."""
        return -(-self.resolved_budget // self.block_size)

    def cache_key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
