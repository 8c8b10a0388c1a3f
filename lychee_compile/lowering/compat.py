"""The ONE module of lychee_compile that imports private torch._inductor APIs.

Checked on:
  * torch 2.13 (+ triton 3.9, CPU machine: Inductor emitting Triton for CPU tensors under TRITON_INTERPRET=1)
  * torch 2.11 (+ triton 3.6, the H100 machine)
Known differences handled here:
  * `autotune_select_algorithm` returns the output node on 2.11 but a tuple (node, ...) on 2.13 -> `select_one`.
  * `SizeVarAllocator.optimization_hint` (2.13) vs `size_hint` (2.11) -> `size_hint`.
Everything else used (compile_fx(config_patches=...), CachingAutotuner.coordinate_descent_tuning and its
heuristic_type / compile_id / bench / clone_args / reset_to_zero_args / device_props, HeuristicType,
TritonKernel._filter_pdl / _enable_pdl_codegen / GDC_WAIT, ForeachKernelSchedulerNode
.group_algorithm_for_combo_kernels / set_group_algorithm_for_combo_kernels, SchedulerBuffer.users, OutputNode,
BaseSchedulerNode.get_outputs / ancestors / get_name / get_device, CustomGraphPass (uuid), the config key
post_grad_custom_post_pass, CompileContext.current_compile_id, register_lowering, lowerings, empty_strided,
fallback_handler, TritonTemplate, SymbolicGridFn, ir.FixedLayout, ir.ExternKernel.realize_input,
V.graph.sizevars.guard_int) has the same shape on both. Any other torch version is used at your own risk:
`CHECKED_VERSIONS` says what was checked.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

CHECKED_VERSIONS = ((2, 11), (2, 13))
TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor import ir  # noqa: E402
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
from torch._inductor.lowering import (empty_strided, fallback_handler, lowerings,  # noqa: E402
                                      register_lowering)
from torch._inductor.select_algorithm import (SymbolicGridFn, TritonTemplate,  # noqa: E402
                                              autotune_select_algorithm)
from torch._inductor.virtualized import V  # noqa: E402
from torch.utils._sympy.functions import CeilDiv  # noqa: E402

__all__ = ["CHECKED_VERSIONS", "TORCH_VERSION", "inductor_config", "ir", "empty_strided", "fallback_handler",
           "lowerings", "register_lowering", "SymbolicGridFn", "TritonTemplate", "select_one", "V", "CeilDiv",
           "size_hint", "static_int", "compile_fx", "tune_reductions_only", "time_kernels_alone",
           "time_kernel_alone", "install_tuning_filter", "pdl_always_waits", "realize",
           "to_dtype", "fixed_layout", "triton_device_ok", "sm_count", "graph_memo", "combo_step_ends",
           "combo_knobs", "codegen_knobs", "tail_writes", "input_reads", "pdl_templates"]


def compile_fx(gm, example_inputs, cuda_graphs: bool, tune: bool = True):
    """Inductor on a Dynamo graph, optionally with CUDA graphs (cudagraph trees, as mode="reduce-overhead" does).
    Called inside Dynamo's backend call, so Dynamo's record of static inputs (parameters, the static cache, our
    state buffers marked static) reaches the cudagraph wrapper.

    On CUDA, Inductor's combo kernels are on: a decode step is ~8 tiny independent pointwise / norm kernels per
    layer (rotary, the K and V cache writes, ...), each a launch and a latency; combined into fewer launches they
    saved 0.19-0.21 ms of a 12.4 ms step (Llama-3-8B shapes, 128K, H100, interleaved twice: BENCHMARKS.md).
    LYCHEE_COMBO_KERNELS=0 turns them off (a benchmark knob, read at compile time). With them, the small kernels
    that read graph inputs only, and the write-backs nothing reads, each run as one combo kernel (combo_step_ends).
    On CUDA (compute capability 9+), programmatic dependent launch (PDL) for Inductor's own Triton kernels
    (`triton.enable_pdl`, present on 2.11 and 2.13): a kernel may be launched while the one before it drains, and
    its accesses that do not touch what that kernel wrote or read run before its griddepcontrol.wait. Measured:
    -0.06 to -0.10 ms of a 7.6 ms hybrid step (Llama-3-8B shapes, 128K b1, H100, session 11) and -0.114 ms at 128K
    b4 on the H200 (7.904 -> 7.790 ms, session 15). Why that is safe: Inductor checks a kernel's early accesses
    against the kernel just before it only (scheduler.previous_node; none after a template or extern call, so
    the kernel then waits before its first access), and emits gdc_launch_dependents only after a wait. So when a
    kernel starts early, its predecessor has passed a wait, and every older kernel has completed (the wait returns
    once the grids it depends on have completed, and they completed only after their own waits) -- provided every
    PDL kernel waits before it completes. A kernel with no load gets no wait from Inductor and would break that
    chain (it could complete, and release its successor, while an older kernel still runs); pdl_always_waits
    gives each such body a wait as its first statement. Our templates launch with PDL too and wait before their
    first access (pdl_templates); extern calls (cuBLAS) launch without PDL, fully ordered. LYCHEE_PDL=0 turns PDL
    off (a benchmark knob, read at compile time).

    On CUDA with `tune` (LycheeConfig.tune_kernels, default True), Inductor's coordinate-descent tuning is on
    (`coordinate_descent_tuning`, on 2.11 and 2.13). With it, Inductor's own decomposition turns a one-row matrix
    product (batch-1 decode: every linear) into a multiply-reduce that it generates in Triton, fuses with its
    neighbours (the RMSNorm scale into q/k/v and gate/up, SiLU * up into down_proj, the residual add) and tunes by
    timing; no cuBLAS call and no split-K reduce kernel is left in the step. Measured (Llama-3-8B shapes, 128K, H100,
    side by side in one call: BENCHMARKS.md, session 12): hybrid 12.5%/4096 7.60 -> 7.16 ms, dense mode
    12.14 -> 11.69 ms; the first compile of the 32-layer step 41-43 -> 73-92 s, cold caches (the tuning compiles and
    times kernel variants; Inductor caches what it found), 62-84 s once pointwise kernels were left out (below). A
    tuned reduction may sum in a different order from one compile to the next: values agree to rounding, not bit for
    bit. The variants are timed by time_kernel_alone (time_kernels_alone says why): with Inductor's own timing the
    configurations the descent kept, and the step time with them, moved from one compile to the next (7.14-7.97 ms
    over eleven processes of the hybrid step above, session 13); timed alone, 7.07-7.10 ms in four (session 14).
    LYCHEE_TUNE=0 also turns the tuning off, LYCHEE_TUNE_BENCH=inductor keeps Inductor's timing (benchmark knobs,
    read at compile time).

    The tuning is kept to reductions (tune_reductions_only): the pointwise kernels of a decode step are a few
    thousand elements each, launch-bound, and tuning them took 14 of the 39 s the tuning added to a cold compile
    (34 kernels; Llama-3-8B shapes, H200, session 13). LYCHEE_TUNE_POINTWISE=1 tunes them too (a benchmark knob).
    So are reductions with fewer than TUNE_MIN_OUTPUTS outputs (norms, the row extents: a few us each, tuned for
    ~8 of the ~30 s the tuning added to a cold b1 compile, H100, session 17); the decomposed products, thousands
    of outputs each, are what the tuning is for. LYCHEE_TUNE_SMALL_REDUCTIONS=1 tunes them too (a benchmark knob)."""
    from torch._guards import CompileContext
    from torch._inductor.compile_fx import compile_fx as _compile_fx
    on_cuda = any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs)
    patches = inductor_patches(on_cuda, cuda_graphs, tune)
    if patches.get("triton.enable_pdl"):
        pdl_always_waits()
    if patches.get("combo_kernels"):
        combo_step_ends()
    if patches.get("coordinate_descent_tuning"):
        compile_id = CompileContext.current_compile_id()
        if os.environ.get("LYCHEE_TUNE_POINTWISE", "0") != "1":
            tune_reductions_only(compile_id, products_only=os.environ.get("LYCHEE_TUNE_SMALL_REDUCTIONS", "0") != "1")
        if os.environ.get("LYCHEE_TUNE_BENCH", "gpu") != "inductor":
            time_kernels_alone(compile_id)
    _OURS_COMPILING.append(True)     # codegen runs inside this call: pdl_always_waits acts on our kernels only
    try:
        return _compile_fx(gm, example_inputs, config_patches=patches)
    finally:
        _OURS_COMPILING.pop()


def pdl_templates(device) -> bool:
    """Launch our two templates with programmatic dependent launch: where Inductor generates PDL kernels for this
    compile (config.triton.enable_pdl, set by inductor_patches) on a CUDA device of compute capability 9+, unless
    LYCHEE_PDL_TEMPLATES=0 (a benchmark knob, read at compile time; CodegenKey covers it). Inductor never gives a
    template PDL (TritonKernel._enable_pdl_codegen); ours make it safe themselves: each program waits
    (griddepcontrol.wait) before its first memory access, so it never overlaps what came before, and the split
    releases the combine only once its own work is done; the chain argument of compile_fx holds unchanged (a
    template waits before it completes). What it buys: each launch's latency overlaps the kernel before it.
    The combine does not release its dependents early: a kernel after it checks its early loads against the
    template's write set, which holds only the template's output, not the inputs it mutates (IDXO, KEYS, CNT,
    MASSO; TemplateBuffer.extract_read_writes, 2.11 and 2.13), so it could read those before they are written."""
    if not getattr(inductor_config.triton, "enable_pdl", False) or torch.version.hip:
        return False
    if "no-pdl-templates" in codegen_knobs():
        return False
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


_OURS_COMPILING: list = []          # non-empty while compile_fx runs Inductor for one of our graphs
_INDUCTOR_FILTER_PDL: dict = {}     # "method": Inductor's own TritonKernel._filter_pdl, once wrapped


def pdl_always_waits() -> None:
    """Wrap TritonKernel._filter_pdl once, process-wide (idempotent; the same method on 2.11 and 2.13): while one of
    our graphs is compiled, a kernel body generated with PDL that Inductor left without griddepcontrol.wait (it
    loads nothing) gets one as its first statement; bodies with a wait keep Inductor's placement (compile_fx says
    why that is enough). Combo kernels filter each part's body, so every part waits. Kernels of other
    torch.compile calls are left as Inductor makes them."""
    from torch._inductor.codegen.triton import TritonKernel
    if not _INDUCTOR_FILTER_PDL:
        _INDUCTOR_FILTER_PDL["method"] = TritonKernel._filter_pdl
        TritonKernel._filter_pdl = _filter_pdl_always_waits


def _filter_pdl_always_waits(self, code):
    out = _INDUCTOR_FILTER_PDL["method"](self, code)
    if (_OURS_COMPILING and self._enable_pdl_codegen()
            and not any(isinstance(line, str) and self.GDC_WAIT in line for line in code._lines)):
        code._lines.insert(0, self.GDC_WAIT)
    return out


_INDUCTOR_COMBO_GROUPS: dict = {}   # "algorithm": Inductor's own combo-kernel grouping, once wrapped


def combo_step_ends() -> None:
    """Wrap Inductor's combo-kernel grouping once, process-wide (idempotent; the class attribute
    ForeachKernelSchedulerNode.group_algorithm_for_combo_kernels on 2.11 and 2.13): while one of our graphs is
    compiled, two more groups are taken out of the groups Inductor made, each run as one combo kernel:
      * the input reads (`input_reads`): small kernels that read graph inputs only, e.g. each layer's head kinds
        (RETR, SEL) cast from the head-kinds state, which Inductor places right before each layer's attention;
      * the tail writes (`tail_writes`): the write-backs of mutated graph inputs that nothing in the graph reads,
        e.g. the static cache's per-layer length counters (`cumulative_length.add_(1)`, transformers 5.17-5.24).
    Why: Inductor groups nodes of one topological level only (and at most 8), so these stayed kernels of their own:
    ~31 + 32 launches of ~1 us each in a Llama-3-8B step, plus a launch gap each (H200 profiles, sessions 13, 16).
    Safe: an input read depends on no other kernel, so the group depends on none and runs first; nothing in the graph
    reads what a tail write writes, so none depends on another (checked from the scheduler's ancestors) and delaying
    them changes no value. Other compiles keep Inductor's grouping; LYCHEE_COMBO_HEAD=0 / LYCHEE_COMBO_TAIL=0 keep it
    for ours too (benchmark knobs, read at compile time; CodegenKey covers them)."""
    from torch._inductor.scheduler import ForeachKernelSchedulerNode
    if not _INDUCTOR_COMBO_GROUPS:
        _INDUCTOR_COMBO_GROUPS["algorithm"] = ForeachKernelSchedulerNode.group_algorithm_for_combo_kernels
        ForeachKernelSchedulerNode.set_group_algorithm_for_combo_kernels(_our_combo_groups)


def combo_knobs(env=os.environ) -> str:
    """The step-end groups turned off by benchmark knobs, as text for CodegenKey ("" by default)."""
    return "".join(f"no-{k}" for k in ("head", "tail") if env.get(f"LYCHEE_COMBO_{k.upper()}", "1") == "0")


def codegen_knobs(env=os.environ) -> str:
    """Every benchmark knob read at compile time that changes our generated code, as text ("" by default): the
    combo groups (combo_knobs) and LYCHEE_PDL_TEMPLATES=0. The one reading of them; CodegenKey keys on it."""
    return combo_knobs(env) + ("no-pdl-templates" if env.get("LYCHEE_PDL_TEMPLATES", "1") == "0" else "")


def _our_combo_groups(scheduler):
    groups = _INDUCTOR_COMBO_GROUPS["algorithm"](scheduler)
    if not _OURS_COMPILING:
        return groups
    off = combo_knobs()
    ours = [[n for n in find(scheduler.nodes) if _gpu_node(n)]      # Inductor's grouping leaves CPU nodes out
            for key, find in (("head", input_reads), ("tail", tail_writes)) if f"no-{key}" not in off]
    ours = [g for g in ours if len(g) > 1]
    taken = {n for g in ours for n in g}
    rest = [[n for n in g if n not in taken] for g in groups]
    return [g for g in rest if g] + ours


INPUT_READ_MAX_NUMEL = 1 << 16      # elements: what is hoisted to the start of the step stays small


def input_reads(nodes) -> list:
    """The scheduler nodes among `nodes` (in order) that depend on no other node (they read graph inputs only, no
    ordering constraint either) and are small pointwise Inductor kernels (<= INPUT_READ_MAX_NUMEL elements, known
    at compile time; not a no-op node, not a template or extern call), writing no graph input."""
    from torch._inductor.scheduler import FusedSchedulerNode, ForeachKernelSchedulerNode, SchedulerNode
    out = []
    for node in nodes:
        if (not isinstance(node, (SchedulerNode, FusedSchedulerNode)) or isinstance(node, ForeachKernelSchedulerNode)
                or node.unmet_dependencies
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
    from torch._inductor.scheduler import OutputNode
    inputs = set(V.graph.graph_inputs)
    found = [n for n in nodes if not (n.is_template() or n.is_extern()) and _writes_back_only(n, inputs, OutputNode)]
    names = {x.get_name() for n in found for x in n.get_nodes()}
    return [n for n in found
            if not ((set(getattr(n, "ancestors", ())) - {x.get_name() for x in n.get_nodes()}) & names)]


def _writes_back_only(node, inputs: set, output_node) -> bool:
    own = {x.get_name() for x in node.get_nodes()}
    writes = False
    for buf in node.get_outputs():
        mutated = set(buf.node.get_mutation_names())
        back = bool(mutated) and mutated <= inputs
        for user in buf.users:
            if not (user.get_name() in own or (back and isinstance(user.node, output_node))):
                return False
        writes |= back
    return writes


_POINTWISE_UNTUNED: set = set()      # Dynamo compile ids (torch._guards.CompileId) of our tuned compiles
_SMALL_REDUCTIONS_UNTUNED: set = set()   # ... whose reductions of < TUNE_MIN_OUTPUTS outputs stay untuned too
TUNE_MIN_OUTPUTS = 256      # Inductor's size hint "x" (outputs, a power of two): a norm has 1-4, a product 2048+
_TIMED_ALONE: set = set()           # compile ids whose tuning times each variant with time_kernel_alone
_INDUCTOR_COORDESC: dict = {}       # "method": Inductor's own CachingAutotuner.coordinate_descent_tuning, once wrapped
_INDUCTOR_BENCH: dict = {}          # "method": Inductor's own CachingAutotuner.bench, once wrapped


def tune_reductions_only(compile_id, products_only: bool = True) -> bool:
    """Skip Inductor's coordinate-descent tuning for the POINTWISE kernels of the compile `compile_id`, and with
    products_only for its reductions of fewer than TUNE_MIN_OUTPUTS outputs too (the other reductions -- a
    decomposed product has one output per weight row -- and everything else keep it). Inductor decides per kernel
    at its first run (CachingAutotuner
    .coordinate_descent_tuning, 2.11 and 2.13; every kernel is stamped with its compile's id by
    set_compile_info), so this wraps that method once, process-wide, and the wrapper acts only on kernels whose
    compile id was registered here: other torch.compile calls in the process keep Inductor's behaviour (Dynamo
    numbers compiles afresh after torch._dynamo.reset(), so a later compile may share a registered id; the only
    effect is that its pointwise kernels go untuned: speed, never values). Returns False (nothing changed) outside
    a Dynamo compile (no compile id)."""
    if compile_id is None:
        return False
    _POINTWISE_UNTUNED.add(compile_id)
    if products_only:
        _SMALL_REDUCTIONS_UNTUNED.add(compile_id)
    install_tuning_filter()
    return True


def install_tuning_filter() -> None:
    """Wrap CachingAutotuner.coordinate_descent_tuning and CachingAutotuner.bench once (idempotent); the wrappers
    change nothing for a kernel whose compile was not registered by tune_reductions_only / time_kernels_alone."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    if not _INDUCTOR_COORDESC:
        _INDUCTOR_COORDESC["method"] = CachingAutotuner.coordinate_descent_tuning
        CachingAutotuner.coordinate_descent_tuning = _coordesc_reductions_only
    if not _INDUCTOR_BENCH:
        _INDUCTOR_BENCH["method"] = CachingAutotuner.bench
        CachingAutotuner.bench = _bench_alone_for_ours


def time_kernels_alone(compile_id) -> bool:
    """Time the tuning's kernel variants of the compile `compile_id` with time_kernel_alone instead of Inductor's
    CachingAutotuner.bench (CUDA only; other compiles keep Inductor's). Why: Inductor's bench times each call of
    a Python closure (argument clones, the launcher) between two events; for a decode-step product of ~40 us the
    host work between the events is as long as the kernel, so the figure is the host's and wanders with it. The
    same variant (Llama-3-8B down_proj, H100) timed 52, 67 and 82 us in three processes while it ran 43 us in the
    step; which variant the descent kept, and so the step time, changed from one compile to the next (7.20-7.61
    ms, session 14). Returns False outside a Dynamo compile."""
    if compile_id is None:
        return False
    _TIMED_ALONE.add(compile_id)
    install_tuning_filter()
    return True


def _bench_alone_for_ours(self, launcher, *args, **kwargs):
    spills = getattr(launcher, "n_spills", None)
    if (self.compile_id not in _TIMED_ALONE or self.device_props.type != "cuda"
            or (spills is not None and spills > 16)):    # Inductor's own bench skips (and records) spilling variants
        return _INDUCTOR_BENCH["method"](self, launcher, *args, **kwargs)
    try:
        return time_kernel_alone(self, launcher, *args, **kwargs)
    except Exception as e:  # an invalid launch config: Inductor's bench knows how to record it (inf)
        if not _INDUCTOR_BENCH.get("warned"):    # anything else (a torch that moved the API) must not pass unseen
            _INDUCTOR_BENCH["warned"] = True
            warnings.warn(f"lychee_compile: a tuning variant could not be timed alone ({type(e).__name__}: {e}); "
                          "Inductor's own timing takes over for such variants.", RuntimeWarning, stacklevel=2)
        return _INDUCTOR_BENCH["method"](self, launcher, *args, **kwargs)


TIME_ALONE_REPS = 25
TIME_ALONE_HOLD_CYCLES = 10_000_000   # ~5 ms at H100 / H200 clocks: the host queues every repetition meanwhile
TIME_ALONE_SLEEP_CYCLES = 100_000     # ~50 us: each repetition's own margin, should the queue have run dry


def time_kernel_alone(tuner, launcher, *args, **kwargs) -> float:
    """Milliseconds of one launch of a tuning variant, the device's time alone: median of TIME_ALONE_REPS launches,
    each after an L2 flush (a write over twice the L2). A device-side sleep ahead of them all (and a short one
    before each) holds the device while the host queues every repetition, so each launch is already queued when
    its start event fires: the interval holds the kernel, not the host's launch overhead (as long as the host
    queues the lot within the hold: ~5 ms). The arguments the kernel mutates in place are cloned once (Inductor's
    clone_args: the real ones stay untouched); output buffers are written, as by Inductor's own bench, and the
    real launch after the tuning overwrites them. The arguments Inductor zeroes before each call are zeroed before
    each launch, outside the interval."""
    device = torch.cuda.current_device()
    cargs, ckwargs = tuner.clone_args(*args, **kwargs)
    stream = torch.cuda.current_stream()
    raw = stream.cuda_stream
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flush = torch.empty(max(2 * l2, 64 << 20), dtype=torch.int8, device=device)

    def launch():
        launcher(*cargs, **ckwargs, stream=raw)

    tuner.reset_to_zero_args(*cargs, **ckwargs)
    launch()                        # first launch: module load, outside the timing
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(TIME_ALONE_REPS)]
    torch.cuda._sleep(TIME_ALONE_HOLD_CYCLES)
    for start, end in events:
        flush.zero_()
        tuner.reset_to_zero_args(*cargs, **ckwargs)
        torch.cuda._sleep(TIME_ALONE_SLEEP_CYCLES)
        start.record(stream)
        launch()
        end.record(stream)
    end.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def _coordesc_reductions_only(self, launcher, *args, **kwargs):
    from torch._inductor.runtime.hints import HeuristicType
    small = (self.heuristic_type != HeuristicType.POINTWISE and self.compile_id in _SMALL_REDUCTIONS_UNTUNED
             and (getattr(self, "size_hints", None) or {}).get("x", TUNE_MIN_OUTPUTS) < TUNE_MIN_OUTPUTS)
    if small or (self.heuristic_type == HeuristicType.POINTWISE and self.compile_id in _POINTWISE_UNTUNED):
        # Inductor asks again at every launch until the config says it was tuned (CachingAutotuner.run); marking
        # it, as Inductor marks the configs its own descent picks, keeps launches without CUDA graphs from paying
        # this call each time
        launcher.config.found_by_coordesc = True
        return launcher
    return _INDUCTOR_COORDESC["method"](self, launcher, *args, **kwargs)


class CodegenKey(CustomGraphPass):
    """A post-grad pass that changes nothing; its uuid() is a digest of our code generation (the source of the
    lowering package: templates, lowerings, this module's codegen wrappers). Inductor's FX graph cache keys a
    compiled graph on Inductor's config and the graph, not on our templates or on pdl_always_waits, so without it a
    cache entry written by another version of lychee_compile (other kernel text, PDL kernels without a wait) would
    be served as is. Installed only where the user set no post-grad pass of their own."""

    def __call__(self, graph) -> None:
        return None

    def uuid(self) -> str:
        from .lower import sparse_tile      # the benchmark knobs that change our code: the kernels' constexprs,
        tile = sparse_tile()
        return codegen_digest() + (repr(sorted(tile.items())) if tile else "") + codegen_knobs()  # grouping, PDL


@functools.lru_cache(maxsize=1)
def codegen_digest() -> str:
    """sha256 of the lowering package's Python sources and kernel templates (lychee_compile/lowering/*.py,
    kernels/*.py.jinja), in path order."""
    import hashlib
    folder = os.path.dirname(os.path.abspath(__file__))
    kernels = os.path.join(folder, "kernels")
    names = [n for n in os.listdir(folder) if n.endswith(".py")]
    if os.path.isdir(kernels):
        names += [os.path.join("kernels", n) for n in os.listdir(kernels) if n.endswith(".py.jinja")]
    h = hashlib.sha256()
    for name in sorted(names):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


CODEGEN_KEY = CodegenKey()


def inductor_patches(on_cuda: bool, cuda_graphs: bool, tune: bool = True, env=os.environ) -> dict:
    """The Inductor config patches of compile_fx (its docstring says why each; CodegenKey says why the last)."""
    patches = {"triton.cudagraphs": bool(cuda_graphs)}
    if on_cuda and env.get("LYCHEE_COMBO_KERNELS", "1") != "0":
        patches["combo_kernels"] = True
    if on_cuda and tune and env.get("LYCHEE_TUNE", "1") != "0":
        patches["coordinate_descent_tuning"] = True
    if on_cuda and env.get("LYCHEE_PDL", "1") != "0" and hasattr(inductor_config.triton, "enable_pdl"):
        patches["triton.enable_pdl"] = True
    if inductor_config.post_grad_custom_post_pass is None:
        patches["post_grad_custom_post_pass"] = CODEGEN_KEY
    return patches


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
