"""The Inductor lowering of lychee::hybrid_decode (lychee_compile/lowering), end to end.

CPU: Inductor emits Triton for CPU tensors (config.cpu_backend = "triton") and the Triton interpreter runs it;
all workarounds that needs live in the ONE fixture `inductor_triton_on_cpu` below, gated on the versions it was
checked with. GPU (@pytest.mark.gpu): the same on CUDA, no workarounds.
"""
import os
import types

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from lychee_compile.lowering import is_registered, register, unregister  # noqa: E402
from lychee_compile.ops.reference import hybrid_decode_reference  # noqa: E402

CHECKED = {("2.13", "3.9"), ("2.11", "3.6")}


def _short(v):
    return ".".join(v.split("+")[0].split(".")[:2])


@pytest.fixture
def inductor_triton_on_cpu():
    """Inductor -> Triton for CPU tensors, run by the interpreter. Workarounds (all here, nowhere else):
    cpu_backend="triton"; a stub active driver that reports an sm_90 target; triton_helpers.libdevice -> tl.math;
    caches off (stale FX-graph cache hits while editing lowerings)."""
    if (_short(torch.__version__), _short(triton.__version__)) not in CHECKED:
        pytest.skip(f"CPU Inductor->Triton workaround checked only on {sorted(CHECKED)}")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 set before triton is imported (CPU machines)")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    import torch._inductor.config as cfg
    import torch._inductor.runtime.triton_helpers as th

    class StubDriver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def is_active(self):
            return True

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            return triton.testing.do_bench

        def get_empty_cache_for_benchmark(self):
            return torch.empty(1)

        def clear_cache(self, cache):
            pass

    drv = triton.runtime.driver
    prev_driver = getattr(drv, "_active", None)  # reset_active() would build the real (absent) GPU driver
    prev_libdevice = th.libdevice
    th.libdevice = tl.math
    drv.set_active(StubDriver())
    torch._dynamo.reset()
    with cfg.patch(cpu_backend="triton", force_disable_caches=True):
        yield
    torch._dynamo.reset()
    th.libdevice = prev_libdevice
    drv._active = prev_driver


def _case(B=2, Hkv=2, G=2, D=64, T=160, K=3, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, 1, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    valid = torch.ones(B, T, dtype=torch.bool, device=device)
    valid[-1, :21] = False
    retr = torch.tensor([i % 2 == 0 for i in range(Hkv)], device=device)
    idx = torch.full((B, Hkv, K), -1, dtype=torch.int32, device=device)
    idx[..., 0], idx[..., 1] = 3, 6
    return q, k, v, valid, retr, idx


def _layer(q, k, v, valid, retr, idx):
    o, i = torch.ops.lychee.hybrid_decode(q, k, v, valid, retr, idx, 0.125, 16, 16, 32)
    return o * 2, i


def _check(out, idx, args, layer=_layer):
    ro, ri = layer(*[a.cpu() for a in args])
    err = ((out.float().cpu() - ro.float()).norm() / ro.float().norm()).item()
    assert err < 1.5e-2, err
    assert torch.equal(idx.cpu(), ri)


def test_inductor_patches_tune_one_row_products_on_cuda_only():
    # On CUDA, coordinate-descent tuning is on: with it Inductor decomposes a one-row mm (batch-1 decode linears)
    # into a multiply-reduce it generates, fuses and tunes (compat.compile_fx says why; BENCHMARKS.md session 12).
    # Off on CPU, with LycheeConfig(tune_kernels=False), and with LYCHEE_TUNE=0 (a benchmark knob).
    import inspect

    import torch._inductor.decomposition as decomp
    from lychee_compile.lowering.compat import CODEGEN_KEY, inductor_patches
    assert inductor_patches(True, True, env={}) == {"triton.cudagraphs": True, "combo_kernels": True,
                                                     "coordinate_descent_tuning": True, "triton.enable_pdl": True,
                                                     "post_grad_custom_post_pass": CODEGEN_KEY}
    assert inductor_patches(False, False, env={}) == {"triton.cudagraphs": False,
                                                       "post_grad_custom_post_pass": CODEGEN_KEY}
    assert "triton.enable_pdl" not in inductor_patches(True, False, env={"LYCHEE_PDL": "0"})
    assert "coordinate_descent_tuning" not in inductor_patches(True, False, env={"LYCHEE_TUNE": "0"})
    assert "coordinate_descent_tuning" not in inductor_patches(True, False, tune=False, env={})
    # the decomposition that makes the products reductions is keyed on this very flag in this torch
    src = inspect.getsource(decomp)
    assert "config.coordinate_descent_tuning" in src and "(self.unsqueeze(2) * input2.unsqueeze(0)).sum(dim=1)" in src


def test_codegen_key_follows_the_lowering_sources_and_spares_a_users_pass(monkeypatch, tmp_path):
    # Inductor's FX graph cache keys a graph on its config, not on our templates: the no-op post-grad pass's uuid is
    # a digest of the lowering package's sources, so an entry written by other kernel text is never served
    from torch._inductor import config as icfg
    from lychee_compile.lowering import compat
    digest = compat.CODEGEN_KEY.uuid()
    assert len(digest) == 64 and digest == compat.codegen_digest()
    (tmp_path / "kernels").mkdir()
    for name in ("lower.py", "compat.py", "kernels/split.py.jinja"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(compat, "__file__", str(tmp_path / "compat.py"))
    compat.codegen_digest.cache_clear()
    try:
        seen = {digest, compat.codegen_digest()}
        for name in ("lower.py", "kernels/split.py.jinja"):     # a Python source, a kernel template
            (tmp_path / name).write_text("x = 2\n")
            compat.codegen_digest.cache_clear()
            seen.add(compat.codegen_digest())
        assert len(seen) == 4
    finally:
        compat.codegen_digest.cache_clear()
    with icfg.patch(post_grad_custom_post_pass=lambda graph: None):
        assert "post_grad_custom_post_pass" not in compat.inductor_patches(True, True, env={})


def test_fx_graph_cache_misses_when_our_codegen_changes(monkeypatch):
    # end to end through Inductor's FX graph cache: the same graph compiled again hits the cache; once the digest of
    # our lowering sources differs (another lychee_compile version), the entry is not served
    import uuid

    from torch._dynamo.utils import counters
    from torch._inductor import config as icfg
    from lychee_compile.lowering import compat

    def backend(gm, example_inputs):
        return compat.compile_fx(gm, example_inputs, cuda_graphs=False, tune=False)

    def compile_once():
        torch._dynamo.reset()
        x = torch.randn(8)
        torch.testing.assert_close(torch.compile(lambda t: (t.cos() * 3).sum(), backend=backend)(x),
                                   (x.cos() * 3).sum())
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    with icfg.patch(fx_graph_cache=True, force_disable_caches=False):
        compile_once()
        before = counters["inductor"]["fxgraph_cache_hit"]
        hit0, miss0 = compile_once()
        assert hit0 == before + 1, "the same graph and codegen must hit Inductor's cache (else this proves nothing)"
        other = f"another lychee_compile {uuid.uuid4().hex}"      # never in the on-disk cache of an earlier run
        monkeypatch.setattr(compat, "codegen_digest", lambda: other)
        hit1, miss1 = compile_once()
        assert (hit1, miss1) == (hit0, miss0 + 1)


def test_sparse_tile_knob_reads_three_integers_or_keeps_the_defaults():
    # LYCHEE_SPARSE_TILE (a benchmark knob) sets the gathered tile of the split launch; malformed, it says what it
    # wants instead of compiling something else
    from lychee_compile.lowering.lower import sparse_tile
    from lychee_compile.lowering.constexprs import kernel_params
    assert sparse_tile({}) == {}
    assert sparse_tile({"LYCHEE_SPARSE_TILE": "64,3,2"}) == dict(sparse_bn=64, sparse_stages=3, sparse_cost=2)
    with pytest.raises(ValueError, match="three integers"):
        sparse_tile({"LYCHEE_SPARSE_TILE": "128,2"})
    sp, cp = kernel_params(G=4, Hkv=8, D=128, K_sel=256, block_size=16, sink_tokens=16, local_tokens=64, scale=0.1,
                           num_splits=264, nb_hint=8192, **sparse_tile({"LYCHEE_SPARSE_TILE": "64,3,2"}))
    assert (sp["SBN"], sp["SPARSE_STAGES"], sp["SPARSE_COST"], cp["SBN"]) == (64, 3, 2, 64)
    sp, _ = kernel_params(G=4, Hkv=8, D=128, K_sel=256, block_size=16, sink_tokens=16, local_tokens=64, scale=0.1,
                          num_splits=264, nb_hint=8192)
    assert (sp["SBN"], sp["SPARSE_STAGES"], sp["SPARSE_COST"]) == (128, 2, 3)


def test_every_pdl_kernel_of_our_compiles_waits():
    # compat.pdl_always_waits: while one of our graphs compiles, a PDL kernel body that Inductor left without
    # griddepcontrol.wait (no load) gets one first; a body with loads keeps Inductor's placement (its first wait
    # after the first load, its last launch_dependents); other compiles keep Inductor's filter as is
    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.utils import IndentedBuffer
    from lychee_compile.lowering import compat
    W, L = TritonKernel.GDC_WAIT, TritonKernel.GDC_LAUNCH

    class Kernel:
        GDC_WAIT, GDC_LAUNCH = W, L
        _enable_pdl_codegen = staticmethod(lambda: True)

    def filtered(lines, ours):
        buf = IndentedBuffer()
        for line in lines:
            buf.writeline(line)
        compat.pdl_always_waits()
        assert TritonKernel._filter_pdl is compat._filter_pdl_always_waits
        if ours:
            compat._OURS_COMPILING.append(True)
        try:
            TritonKernel._filter_pdl(Kernel(), buf)
        finally:
            if ours:
                compat._OURS_COMPILING.pop()
        return [str(x) for x in buf._lines]

    loads = ["x0 = tl.load(a)", W, L, "x1 = tl.load(b)", W, L, "tl.store(c, x0 + x1)"]
    inductor = ["x0 = tl.load(a)", W, "x1 = tl.load(b)", L, "tl.store(c, x0 + x1)"]
    assert filtered(loads, True) == inductor and filtered(loads, False) == inductor
    store_only = ["xindex = tl.arange(0, XBLOCK)", "tl.store(c, xindex)"]
    assert filtered(store_only, True) == [W] + store_only
    assert filtered(store_only, False) == store_only
    assert not compat._OURS_COMPILING


def test_tuning_skips_pointwise_kernels_of_our_compiles_only(monkeypatch):
    # compat.tune_reductions_only: Inductor's per-kernel tuning entry point returns the launcher untouched for a
    # POINTWISE kernel of a registered compile, and hands every other kernel (a reduction; a pointwise kernel of
    # someone else's compile) to Inductor's own method
    from torch._guards import CompileId
    from torch._inductor.runtime.hints import HeuristicType
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from lychee_compile.lowering import compat
    ours, theirs = CompileId(frame_id=9001, frame_compile_id=0), CompileId(frame_id=9002, frame_compile_id=0)
    assert compat.tune_reductions_only(None) is False and None not in compat._POINTWISE_UNTUNED
    assert compat.tune_reductions_only(ours) is True
    assert CachingAutotuner.coordinate_descent_tuning is compat._coordesc_reductions_only
    handed = []
    monkeypatch.setitem(compat._INDUCTOR_COORDESC, "method", lambda self, launcher: (handed.append(self), "tuned")[1])

    class Kernel:
        def __init__(self, kind, compile_id, outputs=4096):
            self.heuristic_type, self.compile_id, self.size_hints = kind, compile_id, {"x": outputs, "r0_": 4096}
    cases = {"pointwise, ours": Kernel(HeuristicType.POINTWISE, ours),
             "reduction, ours": Kernel(HeuristicType.REDUCTION, ours),
             "norm (4 outputs), ours": Kernel(HeuristicType.REDUCTION, ours, outputs=4),
             "persistent norm (1 output), ours": Kernel(HeuristicType.PERSISTENT_REDUCTION, ours, outputs=1),
             "pointwise, theirs": Kernel(HeuristicType.POINTWISE, theirs),
             "norm (4 outputs), theirs": Kernel(HeuristicType.REDUCTION, theirs, outputs=4)}
    launchers = {name: types.SimpleNamespace(config=types.SimpleNamespace()) for name in cases}
    got = {name: CachingAutotuner.coordinate_descent_tuning(k, launchers[name]) for name, k in cases.items()}
    untouched = ["pointwise, ours", "norm (4 outputs), ours", "persistent norm (1 output), ours"]
    assert got == dict({n: launchers[n] for n in untouched}, **{"reduction, ours": "tuned",
                       "pointwise, theirs": "tuned", "norm (4 outputs), theirs": "tuned"})
    assert handed == [cases["reduction, ours"], cases["pointwise, theirs"], cases["norm (4 outputs), theirs"]]
    # the skipped launchers' configs are marked as Inductor marks a tuned one, so Inductor stops asking at each launch
    assert [n for n, lc in launchers.items() if getattr(lc.config, "found_by_coordesc", False)] == untouched
    # products_only=False (LYCHEE_TUNE_SMALL_REDUCTIONS=1): the small reductions of such a compile are tuned
    third = CompileId(frame_id=9003, frame_compile_id=0)
    assert compat.tune_reductions_only(third, products_only=False) is True
    small = Kernel(HeuristicType.REDUCTION, third, outputs=4)
    assert CachingAutotuner.coordinate_descent_tuning(small, types.SimpleNamespace(config=None)) == "tuned"


def test_tuning_times_variants_of_our_cuda_compiles_alone(monkeypatch):
    # compat.time_kernels_alone: Inductor's CachingAutotuner.bench hands a variant of a registered compile on CUDA
    # to time_kernel_alone, and everything else (another compile; a CPU kernel; a variant spilling more than
    # Inductor's own bench allows; a launch that raises) to Inductor's bench
    from torch._guards import CompileId
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from lychee_compile.lowering import compat
    ours, theirs = CompileId(frame_id=9101, frame_compile_id=0), CompileId(frame_id=9102, frame_compile_id=0)
    assert compat.time_kernels_alone(None) is False and None not in compat._TIMED_ALONE
    assert compat.time_kernels_alone(ours) is True
    assert CachingAutotuner.bench is compat._bench_alone_for_ours
    monkeypatch.setitem(compat._INDUCTOR_BENCH, "method", lambda self, launcher: ("inductor", self.name))

    def alone(tuner, launcher):
        if launcher.n_spills == -1:
            raise RuntimeError("invalid configuration argument")
        return ("alone", tuner.name)
    monkeypatch.setattr(compat, "time_kernel_alone", alone)

    def kernel(name, compile_id, device="cuda"):
        return types.SimpleNamespace(name=name, compile_id=compile_id, device_props=types.SimpleNamespace(type=device))
    ok, spills, bad = (types.SimpleNamespace(n_spills=n) for n in (0, 17, -1))
    monkeypatch.delitem(compat._INDUCTOR_BENCH, "warned", raising=False)
    got = [CachingAutotuner.bench(kernel("ours", ours), ok), CachingAutotuner.bench(kernel("theirs", theirs), ok),
           CachingAutotuner.bench(kernel("cpu", ours, "cpu"), ok), CachingAutotuner.bench(kernel("spills", ours), spills)]
    with pytest.warns(RuntimeWarning, match="could not be timed alone"):      # said once, not swallowed
        got.append(CachingAutotuner.bench(kernel("raises", ours), bad))
    assert got == [("alone", "ours"), ("inductor", "theirs"), ("inductor", "cpu"), ("inductor", "spills"),
                   ("inductor", "raises")]


def test_compile_fx_registers_its_compile_for_reduction_only_tuning(monkeypatch):
    # compat.compile_fx, called from a torch.compile backend, registers the compile Dynamo is running when the
    # tuning is on (forced here: on the CPU it is off), and not with LYCHEE_TUNE_POINTWISE=1
    from torch._guards import CompileContext
    from lychee_compile.lowering import compat
    monkeypatch.setattr(compat, "inductor_patches", lambda *a, **k: {"coordinate_descent_tuning": True})
    seen = []

    def backend(gm, example_inputs):
        seen.append(CompileContext.current_compile_id())
        return compat.compile_fx(gm, example_inputs, cuda_graphs=False, tune=True)
    registered, small, alone = [], [], []
    for pointwise, small_red, bench in (("0", "0", "gpu"), ("0", "1", "gpu"), ("1", "0", "inductor")):
        monkeypatch.setenv("LYCHEE_TUNE_POINTWISE", pointwise)
        monkeypatch.setenv("LYCHEE_TUNE_SMALL_REDUCTIONS", small_red)
        monkeypatch.setenv("LYCHEE_TUNE_BENCH", bench)
        monkeypatch.setattr(compat, "_POINTWISE_UNTUNED", set())   # Dynamo numbers compiles afresh after a reset
        monkeypatch.setattr(compat, "_SMALL_REDUCTIONS_UNTUNED", set())
        monkeypatch.setattr(compat, "_TIMED_ALONE", set())
        torch._dynamo.reset()
        x = torch.randn(8)
        torch.testing.assert_close(torch.compile(lambda t: t.sin().sum(), backend=backend)(x), x.sin().sum())
        registered.append(set(compat._POINTWISE_UNTUNED))
        small.append(set(compat._SMALL_REDUCTIONS_UNTUNED))
        alone.append(set(compat._TIMED_ALONE))
    assert None not in seen and len(set(seen)) == 1
    assert registered == [set(seen), set(seen), set()] and small == [set(seen), set(), set()]
    assert alone == [set(seen), set(seen), set()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tuning_times_reductions_not_pointwise_gpu():
    # on the GPU, our compile_fx with tuning on: a pointwise-only function has no kernel variant timed, nor has a
    # reduction with 4 outputs (a norm's shape); a reduction with 4096 outputs (a product's) has some; all are right
    from torch._dynamo.utils import counters
    from lychee_compile.lowering import compat

    def backend(gm, example_inputs):
        return compat.compile_fx(gm, example_inputs, cuda_graphs=False, tune=True)

    def timed_configs(fn, x):
        torch._dynamo.reset()
        before = counters["inductor"]["coordesc_tuning_bench"]
        torch.testing.assert_close(torch.compile(fn, backend=backend)(x), fn(x), rtol=1e-4, atol=1e-4)
        return counters["inductor"]["coordesc_tuning_bench"] - before
    x = torch.randn(4096, 1024, device="cuda")
    assert timed_configs(lambda t: t.sin() * 2 + 1, x) == 0
    # 4 rows of 4096 (one kernel: Inductor splits a longer row into a first reduction with many outputs)
    assert timed_configs(lambda t: (t.sin() * 2).sum(-1), torch.randn(4, 4096, device="cuda")) == 0
    assert timed_configs(lambda t: (t.sin() * 2).sum(-1), x) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_kernel_alone_measures_the_device_not_the_host_gpu():
    # compat.time_kernel_alone on a real tuning variant: a launcher whose host side is slow (0.1 ms more per call,
    # as a slow Python launch path would be, 3-4x the kernel) is timed at its device time all the same, and the
    # real inputs are left as they were (the variant runs on clones of what it mutates)
    import time as _time
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from lychee_compile.lowering import compat
    captured = {}
    orig = CachingAutotuner.coordinate_descent_tuning

    def grab(self, launcher, *args, **kwargs):
        captured.setdefault("k", (self, launcher, args, kwargs))
        return orig(self, launcher, *args, **kwargs)

    def backend(gm, example_inputs):
        return compat.compile_fx(gm, example_inputs, cuda_graphs=False, tune=True)
    x = torch.randn(2048, 4096, device="cuda")
    CachingAutotuner.coordinate_descent_tuning = grab
    try:
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(lambda t: (t.sin() * 2).sum(-1), backend=backend)(x),
                                   (x.sin() * 2).sum(-1), rtol=1e-4, atol=1e-3)
    finally:
        CachingAutotuner.coordinate_descent_tuning = orig
    tuner, launcher, args, kwargs = captured["k"]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    def slow_host(*a, **k):
        _time.sleep(0.0001)
        return launcher(*a, **k)
    slow_host.config, slow_host.n_spills = launcher.config, launcher.n_spills
    fast = compat.time_kernel_alone(tuner, launcher, *args, **kwargs)
    slow = compat.time_kernel_alone(tuner, slow_host, *args, **kwargs)
    bytes_ms = x.numel() * 4 / 3.5e12 * 1e3          # the input read once at a rate above any H100 / H200
    assert bytes_ms <= fast < 0.1 and bytes_ms <= slow < 0.1 and abs(slow - fast) < 0.5 * fast, (fast, slow)
    # inputs and in-place arguments untouched (the variant ran on clones); output buffers are written, as
    # Inductor's own bench writes them, and the real launch overwrites them after the tuning
    names = tuner.fn.arg_names[:len(args)]
    checked = [n for n, a, b in zip(names, args, before)
               if isinstance(a, torch.Tensor) and not n.startswith("out_ptr") and torch.equal(a, b)]
    assert checked == [n for n, a in zip(names, args) if isinstance(a, torch.Tensor) and not n.startswith("out_ptr")]
    assert checked, names


def test_register_is_idempotent():
    register()
    register()
    assert is_registered()
    unregister()
    assert not is_registered()
    register()
    assert is_registered()


def test_lowering_end_to_end_cpu(inductor_triton_on_cpu):
    from torch._inductor.utils import run_and_get_code
    register()
    args = _case()
    (out, idx), codes = run_and_get_code(torch.compile(_layer, backend="inductor", fullgraph=True), *args)
    _check(out, idx, args)
    code = "\n".join(codes)
    # token checks on the generated code (never whole files)
    for token in ["def triton_tem_fused_hybrid_decode", "# ---- glossary (names and shapes)",
                  "tl.dot(", "for bit in range(31 - LOWB):", "LOWB : tl.constexpr = 11", "tl.atomic_add(CNT + seg, 1)",
                  "def _lychee_select(",
                  "NUM_SPLITS : tl.constexpr", "HKV : tl.constexpr = 2", "G : tl.constexpr = 2"]:
        assert token in code, token
    # the `* 2` epilogue is fused into the combine template's store
    assert "triton_tem_fused_hybrid_decode_mul" in code
    # no eager fallback for the op
    assert "torch.ops.lychee.hybrid_decode" not in code.split("def call(")[-1]


def test_lowering_head_map_is_runtime_data_and_sizes_symbolic(inductor_triton_on_cpu):
    from torch._inductor.utils import run_and_get_code
    register()
    compiled = torch.compile(_layer, backend="inductor", fullgraph=True, dynamic=True)
    args = _case(T=160)
    (out, idx), codes = run_and_get_code(compiled, *args)
    _check(out, idx, args)
    code = "\n".join(codes)
    assert "T = ks" in code or "T = s" in code, "cache length must stay a runtime size"
    # another head map and another cache length: same compiled graph (no recompilation)
    from torch._dynamo.utils import counters
    counters.clear()
    args2 = list(_case(T=208, seed=1))
    args2[4] = ~args2[4]
    out2, idx2 = compiled(*args2)
    _check(out2, idx2, args2)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])


def _policy_layer(policy, param, quest_mode=0):
    def layer(q, k, v, valid, retr, idx):
        o, i = torch.ops.lychee.hybrid_decode(q, k, v, valid, retr, idx, 0.3, 16, 16, 32, policy, param, quest_mode, 2)
        return o * 2, i
    return layer


@pytest.mark.parametrize("policy,param", [(1, 0.6), (2, 0.05), (3, 0.3)], ids=["topp", "threshold", "ratio"])
def test_lowering_selection_policy_emits_kernels(inductor_triton_on_cpu, policy, param):
    # issue 7: a policy other than top-K is a constexpr of the combine template, no longer an extern fallback
    from torch._inductor.utils import run_and_get_code
    register()
    layer = _policy_layer(policy, param)
    args = _case(K=6, seed=policy)
    (out, idx), codes = run_and_get_code(torch.compile(layer, backend="inductor", fullgraph=True), *args)
    _check(out, idx, args, layer)
    assert (idx[0, 0] == -1).any(), "on this case every policy keeps fewer than K (top-K keeps all 6)"
    code = "\n".join(codes)
    for token in [f"POLICY : tl.constexpr = {policy}", f"PARAM : tl.constexpr = {param!r}",
                  "def _lychee_keep_count(", "def _lychee_topp_count(", "triton_tem_fused_hybrid_decode_mul"]:
        assert token in code, token
    assert "torch.ops.lychee.hybrid_decode" not in code.split("def call(")[-1]


def test_lowering_quest_still_falls_back_with_its_policy(inductor_triton_on_cpu):
    # Quest has no template yet: the extern gets every argument (policy included), not the top-K defaults
    from torch._inductor.utils import run_and_get_code
    register()
    layer = _policy_layer(3, 0.3, quest_mode=1)
    args = _case(K=6)
    (out, idx), codes = run_and_get_code(torch.compile(layer, backend="inductor", fullgraph=True), *args)
    _check(out, idx, args, layer)
    assert "triton_tem_fused_hybrid_decode" not in "\n".join(codes)


def _mass_layer(q, k, v, valid, retr, idx, extra, heat):
    # the heat step's shape: extra blocks in, the mass folded into a decayed state (plain tensor ops around the op)
    o, i, m = torch.ops.lychee.hybrid_decode_mass(q, k, v, valid, retr, idx, extra, 0.125, 16, 16, 32)
    return o, i, 0.5 * heat + m


def test_lowering_mass_variant_emits_kernels(inductor_triton_on_cpu):
    from torch._inductor.utils import run_and_get_code
    register()
    q, k, v, valid, retr, idx = _case()
    extra = torch.full((2, 2, 2), -1, dtype=torch.int32)
    extra[:, :, 0] = 8                                              # a block nothing else reads
    heat = torch.rand(2, 2, 10)
    args = (q, k, v, valid, retr, idx, extra, heat)
    (out, i, h), codes = run_and_get_code(torch.compile(_mass_layer, backend="inductor", fullgraph=True), *args)
    ro, ri, rh = _mass_layer(*args)
    assert ((out.float() - ro.float()).norm() / ro.float().norm()).item() < 1.5e-2
    assert torch.equal(i, ri)
    assert (h - rh).abs().max().item() < 1e-2 and (h - 0.5 * heat)[:, 1, 8].min() > 0   # the extra block was read
    code = "\n".join(codes)
    for token in ["def triton_tem_fused_hybrid_decode_mass", "MASS : tl.constexpr = 1", "KX : tl.constexpr = 2",
                  "_lychee_virtual_blocks(", "tl.store(MASSO + seg.to(tl.int64) * NB + vblk"]:
        assert token in code, token
    assert "torch.ops.lychee.hybrid_decode_mass" not in code.split("def call(")[-1]     # no extern fallback


def test_lowering_plain_kernels_carry_no_mass_code(inductor_triton_on_cpu):
    from torch._inductor.utils import run_and_get_code
    register()
    args = _case()
    _, codes = run_and_get_code(torch.compile(_layer, backend="inductor", fullgraph=True), *args)
    code = "\n".join(codes)
    assert "MASS : tl.constexpr = 0" in code and "MASSO" not in code.split("@triton.jit")[0]


def test_lowering_fp32_falls_back_to_reference(inductor_triton_on_cpu):
    from torch._inductor.utils import run_and_get_code
    register()
    args = _case(dtype=torch.float32)
    (out, idx), codes = run_and_get_code(torch.compile(_layer, backend="inductor", fullgraph=True), *args)
    _check(out, idx, args)
    assert "triton_tem_fused_hybrid_decode" not in "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("G,D", [(4, 128), (7, 64)])
def test_lowering_end_to_end_gpu(G, D):
    register()
    torch._dynamo.reset()
    args = _case(B=2, Hkv=4, G=G, D=D, T=5000, K=64, device="cuda")
    out, idx = torch.compile(_layer, backend="inductor", fullgraph=True)(*args)
    _check(out, idx, args)


def _two_layers(q, k, v, valid, retr, idx):
    o, i = torch.ops.lychee.hybrid_decode(q, k, v, valid, retr, idx, 0.125, 16, 16, 32)
    o2, i2 = torch.ops.lychee.hybrid_decode(q, v, k, valid, retr, i, 0.125, 16, 16, 32)
    return o + o2, i2


def test_lowering_row_extent_once_per_mask(inductor_triton_on_cpu):
    # layers that share one valid mask (the rewrite pass gives them one node) reduce it to row extents once per
    # step: two layers launch exactly as many reduction kernels as one layer
    from torch._inductor.utils import run_and_get_code
    register()
    args = _case()

    def reductions(fn):
        torch._dynamo.reset()
        (out, idx), codes = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), *args)
        call = "\n".join(codes).split("def call(")[-1]
        return out, idx, [ln for ln in call.splitlines() if ".run(" in ln and ("triton_per_" in ln or "triton_red_" in ln)]

    _, _, one = reductions(_layer)
    out, idx, two = reductions(_two_layers)
    assert len(one) >= 1 and len(two) == len(one), (one, two)
    o1, i1 = torch.ops.lychee.hybrid_decode(*[a.cpu() for a in args], 0.125, 16, 16, 32)
    a = [x.cpu() for x in args]
    o2, i2 = torch.ops.lychee.hybrid_decode(a[0], a[2], a[1], a[3], a[4], i1, 0.125, 16, 16, 32)
    ref = (o1 + o2).float()
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < 1.5e-2
    assert torch.equal(idx.cpu(), i2)


@pytest.mark.slow
def test_lowering_compiled_model_with_policy(inductor_triton_on_cpu, monkeypatch):
    # the whole pipeline (lychee_compile, backend="inductor") on a bf16 model with selection="topp": every
    # lychee::hybrid_decode node becomes our two templates (counted at the lowering), none the extern fallback
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from lychee_compile.lowering import compat, lower
    from tests.harness import generate_logits
    from tests.models import make, make_batch
    from tests.test_sparse_semantics import mixed_map
    calls = []
    fallback, select_one = lower._fallback, compat.select_one
    monkeypatch.setattr(lower, "_fallback", lambda *a: (calls.append("fallback"), fallback(*a))[1])
    monkeypatch.setattr(compat, "select_one", lambda name, *a: (calls.append(name), select_one(name, *a))[1])
    cfg = dict(budget=16, block_size=2, sink_tokens=2, local_tokens=2, selection_param=0.6)
    ids, mask = make_batch(lengths=(26, 17))
    runs = {}
    for backend, selection in (("eager", "topk"), ("eager", "topp"), ("inductor", "topp")):
        model = make("llama", "sdpa").to(torch.bfloat16)
        config = LycheeConfig(backend=backend, selection=selection, **cfg)
        lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model), config)
        runs[backend if selection == "topp" else selection] = generate_logits(model, ids, mask, 3)
    n_layers = model.config.num_hidden_layers
    assert calls.count("lychee_hybrid_combine") == n_layers and "fallback" not in calls, calls
    assert torch.equal(runs["inductor"][0], runs["eager"][0])
    assert (runs["inductor"][1].float() - runs["eager"][1].float()).abs().max().item() < 5e-2
    assert not torch.equal(runs["topk"][1], runs["eager"][1]), "topp must select differently from top-K here"


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["heat", "quest_sparse", "quest_all"])
def test_lowering_compiled_model_with_state(inductor_triton_on_cpu, monkeypatch, feature):
    # issue 7 on the kernel path: with heat or Quest on, every global layer's attention is our templates (the mass
    # variant where sparse heads read extra blocks), the picks and state updates are Inductor kernels around them,
    # and nothing falls back to the eager reference; the compiled model equals the eager (reference-op) one
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from lychee_compile.lowering import compat, lower
    from tests.harness import generate_logits
    from tests.models import make, make_batch
    from tests.test_sparse_semantics import mixed_map
    calls = []
    fallback, select_one = lower._fallback, compat.select_one
    monkeypatch.setattr(lower, "_fallback", lambda *a: (calls.append("fallback"), fallback(*a))[1])
    monkeypatch.setattr(compat, "select_one", lambda name, *a: (calls.append(name), select_one(name, *a))[1])
    extra = {"heat": dict(heat_blocks=2, heat_decay=0.8), "quest_sparse": dict(quest="sparse", quest_blocks=2),
             "quest_all": dict(quest="all")}[feature]
    cfg = dict(budget=8, block_size=2, sink_tokens=2, local_tokens=2, **extra)
    ids, mask = make_batch(lengths=(26, 17))
    runs = {}
    for backend in ("eager", "inductor"):
        model = make("llama", "sdpa").to(torch.bfloat16)
        lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model),
                       LycheeConfig(backend=backend, **cfg))
        runs[backend] = generate_logits(model, ids, mask, 4)
    n_layers = model.config.num_hidden_layers
    want = "lychee_hybrid_combine" if feature == "quest_all" else "lychee_hybrid_combine_mass"
    assert calls.count(want) == n_layers and "fallback" not in calls, calls
    assert torch.equal(runs["inductor"][0], runs["eager"][0])
    assert (runs["inductor"][1].float() - runs["eager"][1].float()).abs().max().item() < 5e-2


@pytest.mark.parametrize("dynamic", [False, True])
def test_small_top_k_picks_are_one_fused_reduction(inductor_triton_on_cpu, dynamic):
    # heat / Quest picks (select_top_blocks, k <= CHAINED_TOPK_MAX): k chained max-reductions that Inductor fuses
    # into one reduction kernel, with no extern topk / sort over the blocks (an int64 radix select cost ~36 us per
    # layer on the H100); equal to the eager picks, also at a symbolic block count
    from torch._inductor.utils import run_and_get_code
    from lychee_compile.ops.policies import CHAINED_TOPK_MAX, select_top_blocks
    k = 8
    assert k <= CHAINED_TOPK_MAX
    g = torch.Generator().manual_seed(0)
    score = torch.randint(-4, 5, (2, 3, 200), generator=g).float() * 0.5        # ties: to the lower block
    cand = torch.rand(2, 3, 200, generator=g) > 0.2
    cand[1, 2, 5:] = False                                                     # a row with fewer than k candidates
    fn = torch.compile(lambda s, c: select_top_blocks(s, c, k), backend="inductor", fullgraph=True, dynamic=dynamic)
    picks, codes = run_and_get_code(fn, score, cand)
    assert torch.equal(picks, select_top_blocks(score, cand, k))
    code = "\n".join(codes)
    assert "topk" not in code
    reducing = [kern for kern in code.split("@triton.jit")[1:] if "max2(" in kern]
    assert len(reducing) == 1 and reducing[0].count("max2(") == k, [kern.count("max2(") for kern in reducing]


def _state_launches(code: str, shape: tuple) -> list[list[int]]:
    """Inductor's call() in `code`: the trailing integer arguments (xnumel first) of every kernel launch that takes
    the graph input of shape `shape`. Fails if that input appears anywhere else than in its size assert, a launch or
    a `del` (an extern copy_, a write_state call, a reinterpret_tensor alias: anything that is not a kernel we
    counted)."""
    import re
    call = code.split("def call(")[-1].split("\ndef get_args(")[0]          # not the benchmark harness after it
    found = re.search(r"assert_size_stride\((\w+), \(" + ", ".join(map(str, shape)) + r"\)", call)
    assert found, f"no graph input of shape {shape}"
    name = found.group(1)
    launches = []
    for line in call.splitlines():
        text = line.strip()
        if (not re.search(rf"\b{name}\b", text) or text.startswith(("#", "assert_size_stride", "del "))
                or text.endswith("= args")):                          # the arguments' unpacking
            continue
        launch = re.search(r"\.run\(.*?((?:, \d+)+), stream=", line)
        assert launch, f"the state is used outside a kernel launch: {line.strip()}"
        launches.append([int(n) for n in launch.group(1).split(", ")[1:]])
    return launches


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sparse", "all"])
def test_quest_state_is_updated_in_place_without_a_copy(inductor_triton_on_cpu, mode):
    # The composite writes one block per (row, KV head) into `_lychee_quest` in place (ops/quest_decode.py); after
    # AOTAutograd's functionalization, Inductor's reinplace pass must turn that back into an in-place scatter.
    # Evidence in the generated code: the state is touched only by kernels, per layer one write of B * Hkv * 2 * D
    # values and reads; no kernel or launch spans the whole state or one slot (a clone, a view-scatter, a copy_
    # back); and the state after the steps is the fresh min / max of the cache.
    from torch._inductor.utils import run_and_get_code
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from lychee_compile.api import state_of
    from tests.models import make, make_batch
    from tests.test_quest_state import assert_state_is_fresh, cache_valid, run
    from tests.test_sparse_semantics import mixed_map
    # block 4: a slot's numel (B * Hkv * NB * 2 * D) is then about half the KV cache's, so no cache-sized kernel
    # can be mistaken for a slot copy
    bs, steps = 4, 4
    quest = dict(quest="sparse", quest_blocks=1) if mode == "sparse" else dict(quest="all")
    ids, mask = make_batch(lengths=(26, 17))
    model = make("llama", "sdpa").to(torch.bfloat16)
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model),
                   LycheeConfig(backend="inductor", budget=8, block_size=bs, sink_tokens=2, local_tokens=2, **quest))
    (_, cache), codes = run_and_get_code(run, model, ids, mask, steps)
    state = state_of(model)
    assert state.counters.decode_calls == steps - 1 and "quest_decode_step" in state.snapshots[0]
    buf = model._lychee_quest
    B, Lg, Hkv, NB, _, D = buf.shape
    whole, slot, block = buf.numel(), buf[:, 0].numel(), B * Hkv * 2 * D
    codes = [c for c in codes if "def call(" in c and "assert_size_stride" in c]
    assert codes
    for code in codes:
        launches = _state_launches(code, tuple(buf.shape))
        assert [n[0] for n in launches].count(block) == Lg, launches          # one block write per layer
        assert not {whole, slot} & {n for args in launches for n in args}, launches
        assert f"xnumel = {whole}\n" not in code and f"xnumel = {slot}\n" not in code
        assert "write_state" not in code
    assert_state_is_fresh(model, state, cache, cache_valid(cache, mask, ids.shape[1] + steps - 1), block_size=bs)


def test_tune_kernels_reaches_inductor(monkeypatch):
    # LycheeConfig.tune_kernels is what compile_fx is told (compat.inductor_patches turns it into Inductor's
    # coordinate-descent tuning on CUDA); the config rejects a non-bool. Inductor itself is stubbed out here.
    from lychee_compile import LycheeConfig
    from lychee_compile.config import LycheeConfigError
    from lychee_compile.lowering import compat
    from tests.harness import compiled, generate_logits
    from tests.models import make_batch
    seen = []
    monkeypatch.setattr(compat, "compile_fx", lambda gm, ex, cuda_graphs, tune: (seen.append(tune), gm.forward)[1])
    ids, mask = make_batch(lengths=(9,))
    for tune in (True, False):
        model, state = compiled("llama", "sdpa", backend="inductor", tune_kernels=tune, budget=8, block_size=4,
                                sink_tokens=4, local_tokens=4)
        generate_logits(model, ids, mask, steps=2)
        assert state.counters.decode_graphs == 1 and seen[-1] is tune
    with pytest.raises(LycheeConfigError, match="tune_kernels must be a bool"):
        LycheeConfig(tune_kernels=1)
