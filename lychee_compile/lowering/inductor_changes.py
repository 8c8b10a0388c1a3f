"""Every change lychee_compile makes to Inductor's behaviour, and the scopes in which it holds.

Inductor's configuration for our compiles goes through compile_fx(config_patches=...) (lowering/compile.py), which
Inductor restores itself. Five class attributes have no configuration; they are replaced here, only while one of our
graphs is compiled (`compiling`) or one of our compiled graphs runs (`running`), and put back on leaving. Other
torch.compile calls in the process see Inductor as it is; so does everything outside these scopes.

  attribute (torch 2.11, 2.13)                     replaced by       scope      why
  TritonKernel._filter_pdl                         _pdl_waits        compiling  every PDL kernel waits (below)
  ForeachKernelSchedulerNode                       _combo_groups     compiling  our launch groups (combo_groups.py)
    .group_algorithm_for_combo_kernels
  CachingAutotuner.coordinate_descent_tuning       _tune             running    what is tuned (KernelOptions.tune_*)
  CachingAutotuner.bench                           _bench            running    variants timed alone on the device
  CUDAGraphNode._record                            _record           running    the decode step captured without a
                                                                                cuBLAS workspace (blas.py)
Inductor tunes a kernel at its first launch and captures CUDA graphs during the first calls, so those changes must
hold while our compiled graphs run, not only while they compile. Scopes nest: an attribute is replaced when the
outermost scope opens -- the replacement delegates to what was there (Inductor's method, or someone's wrapper of
it) -- and restored when that scope closes. The replacements are looked up here by name at that moment, so a
benchmark can wrap one of them (benchmarks/e2e.py CompilePhases). One thread at a time: Dynamo and Inductor compile
under a process-wide lock, and a compiled call replaces attributes for its duration.

Why PDL kernels must wait: with programmatic dependent launch (KernelOptions.pdl) a kernel may start while the one
before it drains; its accesses that touch nothing that kernel wrote or read run before its griddepcontrol.wait.
Inductor checks a kernel's early accesses against the kernel just before it only, which is safe as long as every
PDL kernel waits before it completes (the wait returns once the grids it depends on have completed, and they
completed only after their own waits). A kernel with no load gets no wait from Inductor and would break that chain;
_pdl_waits gives such a body a wait as its first statement. Bodies with a wait keep Inductor's placement.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch

from . import combo_groups, compat
from .. import blas
from ..config import KernelOptions

TUNE_MIN_OUTPUTS = 256      # Inductor's size hint "x" (outputs, a power of two): a norm has 1-4, a product 2048+


@dataclasses.dataclass(frozen=True)
class Scope:
    """What the replacements need to know about the compile / compiled graph they act for."""
    options: KernelOptions = KernelOptions()
    no_blas_workspace: bool = False     # the graph's cuBLAS products run (and are captured) without a workspace
    cuda_graphs: bool = False


_ACTIVE: list = []          # Scope stack: the innermost compile or compiled call of ours
_DEPTH: dict = {}           # (owner, attr) -> open scopes that replaced it
_SAVED: dict = {}           # (owner, attr) -> (raw class-dict entry or _MISSING, the callable it resolved to)
_MISSING = object()


def active() -> Scope | None:
    """The scope of the compile or compiled call of ours that is running, or None outside them."""
    return _ACTIVE[-1] if _ACTIVE else None


def _compiling_table():
    """(owner, attribute, name of its replacement in this module)."""
    return [(compat.TritonKernel, "_filter_pdl", "_pdl_waits"),
            (compat.ForeachKernelSchedulerNode, "group_algorithm_for_combo_kernels", "_combo_groups")]


def _running_table(scope: Scope):
    table = [(compat.CachingAutotuner, "coordinate_descent_tuning", "_tune"),
             (compat.CachingAutotuner, "bench", "_bench")]
    if scope.cuda_graphs and scope.no_blas_workspace:
        table.append((compat.CUDAGraphNode, "_record", "_record"))
    return table


@contextlib.contextmanager
def compiling(scope: Scope):
    """Inside: Inductor compiles one of our graphs (codegen: PDL waits, launch groups)."""
    with _replaced(_compiling_table(), scope):
        yield


@contextlib.contextmanager
def running(scope: Scope):
    """Inside: one of our compiled graphs runs (first launches: tuning; first calls: CUDA graph capture)."""
    with _replaced(_running_table(scope), scope):
        if scope.no_blas_workspace and not scope.cuda_graphs:
            with blas.no_workspace():     # eager cuBLAS calls on every step
                yield
        else:
            yield


@contextlib.contextmanager
def _replaced(table, scope: Scope):
    for owner, attr, new in table:
        key = (owner, attr)
        if not _DEPTH.get(key):
            _SAVED[key] = (owner.__dict__.get(attr, _MISSING), getattr(owner, attr))
            setattr(owner, attr, globals()[new])      # looked up now: a benchmark may have wrapped it
        _DEPTH[key] = _DEPTH.get(key, 0) + 1
    _ACTIVE.append(scope)
    try:
        yield
    finally:
        _ACTIVE.pop()
        for owner, attr, _ in reversed(table):
            key = (owner, attr)
            _DEPTH[key] -= 1
            if not _DEPTH[key]:
                raw, _fn = _SAVED.pop(key)
                if raw is _MISSING:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, raw)


def _before(owner, attr):
    """What was in place of owner.attr when our outermost scope replaced it."""
    return _SAVED[(owner, attr)][1]


def _pdl_waits(self, code):
    out = _before(compat.TritonKernel, "_filter_pdl")(self, code)
    if self._enable_pdl_codegen() and not any(isinstance(line, str) and self.GDC_WAIT in line
                                              for line in code._lines):
        code._lines.insert(0, self.GDC_WAIT)
    return out


def _combo_groups(scheduler):
    groups = _before(compat.ForeachKernelSchedulerNode, "group_algorithm_for_combo_kernels")(scheduler)
    options = active().options
    return combo_groups.step_end_groups(groups, scheduler.nodes, options.combo_input_reads,
                                        options.combo_tail_writes)


def _tune(self, launcher, *args, **kwargs):
    """Inductor's coordinate-descent tuning, kept to the reductions of >= TUNE_MIN_OUTPUTS outputs (the decomposed
    products, thousands of outputs each) unless KernelOptions says otherwise. The pointwise kernels of a decode
    step are a few thousand elements each, launch-bound; tuning them took 14 of the 39 s the tuning added to a cold
    compile (Llama-3-8B shapes, H200); the norms' reductions, ~8 of ~30 s (H100); neither got faster."""
    options = active().options
    pointwise = self.heuristic_type == compat.HeuristicType.POINTWISE
    small = (not pointwise and not options.tune_small_reductions
             and (getattr(self, "size_hints", None) or {}).get("x", TUNE_MIN_OUTPUTS) < TUNE_MIN_OUTPUTS)
    if small or (pointwise and not options.tune_pointwise):
        # Inductor asks again at every launch until the config says it was tuned (CachingAutotuner.run); marking
        # it, as Inductor marks the configs its own descent picks, keeps launches without CUDA graphs from paying
        # this call each time
        launcher.config.found_by_coordesc = True
        return launcher
    return _before(compat.CachingAutotuner, "coordinate_descent_tuning")(self, launcher, *args, **kwargs)


_WARNED: dict = {}


def _bench(self, launcher, *args, **kwargs):
    """Each tuning variant of a CUDA kernel timed by time_kernel_alone (KernelOptions.tune_timing="alone"). Why:
    Inductor's bench times each call of a Python closure (argument clones, the launcher) between two events; for a
    decode-step product of ~40 us the host work between the events is as long as the kernel, so the figure is the
    host's and wanders with it: the same variant timed 52, 67 and 82 us in three processes while it ran 43 us in
    the step, and the variant kept, so the step time, changed from one compile to the next (7.20-7.61 ms, H100)."""
    inductor = _before(compat.CachingAutotuner, "bench")
    spills = getattr(launcher, "n_spills", None)
    if (active().options.tune_timing != "alone" or self.device_props.type != "cuda"
            or (spills is not None and spills > 16)):    # Inductor's own bench skips (and records) spilling variants
        return inductor(self, launcher, *args, **kwargs)
    try:
        return time_kernel_alone(self, launcher, *args, **kwargs)
    except Exception as e:  # an invalid launch config: Inductor's bench knows how to record it (inf)
        if not _WARNED.get("bench"):    # anything else (a torch that moved the API) must not pass unseen
            _WARNED["bench"] = True
            warnings.warn(f"lychee_compile: a tuning variant could not be timed alone ({type(e).__name__}: {e}); "
                          "Inductor's own timing takes over for such variants.", RuntimeWarning, stacklevel=2)
        return inductor(self, launcher, *args, **kwargs)


def _record(self, model, inputs):
    """A CUDA graph of our decode step captured with its cuBLAS products run without a workspace (blas.py):
    the capture decides the kernels every replay runs, so this is the one place the choice is needed."""
    with blas.no_workspace():
        return _before(compat.CUDAGraphNode, "_record")(self, model, inputs)


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
