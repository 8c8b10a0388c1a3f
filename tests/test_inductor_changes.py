"""What lychee_compile changes in Inductor (lowering/inductor_changes.py, compile.py, codegen_key.py) holds inside
our compiles and compiled calls only: after a lychee compile and generate() Inductor's class attributes are the
originals and Dynamo's and Inductor's configs are unchanged; inside, each replacement acts as documented and hands
everything else to what was there before."""
import types

import pytest
import torch

from lychee_compile import KernelOptions, LycheeConfig
from lychee_compile.config import LycheeConfigError
from lychee_compile.lowering import codegen_key, compat, inductor_changes
from lychee_compile.lowering.compile import compile_graph, inductor_patches, sparse_tile
from lychee_compile.lowering.inductor_changes import Scope, compiling, running

# every class attribute inductor_changes may replace
REPLACED = [(compat.TritonKernel, "_filter_pdl"),
            (compat.ForeachKernelSchedulerNode, "group_algorithm_for_combo_kernels"),
            (compat.CachingAutotuner, "coordinate_descent_tuning"), (compat.CachingAutotuner, "bench"),
            (compat.CUDAGraphNode, "_record")]


def _class_entries():
    return {(owner.__name__, attr): owner.__dict__.get(attr) for owner, attr in REPLACED}


def _configs():
    return (torch._dynamo.config.get_config_copy(), torch._inductor.config.get_config_copy())


def _compile_and_generate(device, dtype, **config):
    from lychee_compile import HeadMap, lychee_compile
    from tests.harness import generate_logits
    from tests.models import make, make_batch
    from tests.test_sparse_semantics import mixed_map
    model = make("llama", "sdpa").to(device, dtype)
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model),
                   LycheeConfig(backend="inductor", budget=32, block_size=16, sink_tokens=16, local_tokens=16,
                                **config))
    ids, mask = (x.to(device) for x in make_batch(lengths=(40, 33)))
    generate_logits(model, ids, mask, 4)
    return model


def _seen_inside(monkeypatch) -> dict:
    """Record, from inside Inductor's compile and inside the compiled call, which attributes were in place."""
    seen = {"compiling": [], "running": []}
    real = compat.compile_fx

    def spy(gm, example_inputs, **kw):
        seen["compiling"].append(compat.TritonKernel.__dict__["_filter_pdl"])
        inner = real(gm, example_inputs, **kw)

        def call(*args):
            seen["running"].append(compat.CachingAutotuner.__dict__["coordinate_descent_tuning"])
            return inner(*args)
        return call
    monkeypatch.setattr(compat, "compile_fx", spy)
    return seen


def _assert_scoped(run, monkeypatch):
    before, configs = _class_entries(), _configs()
    seen = _seen_inside(monkeypatch)
    model = run()
    assert model._lychee_state.counters.decode_calls >= 3
    assert seen["compiling"] and all(f is inductor_changes._pdl_waits for f in seen["compiling"])
    assert seen["running"] and all(f is inductor_changes._tune for f in seen["running"])
    assert _class_entries() == before, "an Inductor class attribute was left replaced"
    assert _configs() == configs, "Dynamo's or Inductor's config changed"
    assert not inductor_changes._ACTIVE and not any(inductor_changes._DEPTH.values())


def test_a_lychee_compile_leaves_inductor_as_it_was_cpu(monkeypatch):
    _assert_scoped(lambda: _compile_and_generate("cpu", torch.float32), monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_lychee_compile_leaves_inductor_as_it_was_gpu(monkeypatch):
    torch._dynamo.reset()
    _assert_scoped(lambda: _compile_and_generate("cuda", torch.bfloat16, cuda_graphs=True), monkeypatch)


def test_scopes_nest_and_restore_on_error():
    before = _class_entries()
    with pytest.raises(RuntimeError, match="boom"):
        with running(Scope()):
            with running(Scope(options=KernelOptions(tune_pointwise=True))):
                assert inductor_changes.active().options.tune_pointwise
            assert compat.CachingAutotuner.__dict__["bench"] is inductor_changes._bench
            assert not inductor_changes.active().options.tune_pointwise
            raise RuntimeError("boom")
    assert _class_entries() == before and inductor_changes.active() is None


def test_inductor_patches_follow_the_config():
    # On CUDA: combo kernels, PDL and coordinate-descent tuning (with it Inductor decomposes a one-row mm -- the
    # batch-1 decode linears -- into a multiply-reduce it generates, fuses and tunes); none on CPU; each off by its
    # field
    import inspect

    import torch._inductor.decomposition as decomp
    got = inductor_patches(True, LycheeConfig(cuda_graphs=True))
    key = got.pop("post_grad_custom_post_pass")
    assert isinstance(key, codegen_key.CodegenKey)
    assert got == {"triton.cudagraphs": True, "combo_kernels": True, "coordinate_descent_tuning": True,
                   "triton.enable_pdl": True}
    assert set(inductor_patches(False, LycheeConfig())) == {"triton.cudagraphs", "post_grad_custom_post_pass"}
    off = KernelOptions.parse("pdl=false,combo_kernels=0")
    assert not {"triton.enable_pdl", "combo_kernels"} & set(inductor_patches(True, LycheeConfig(kernels=off)))
    assert "coordinate_descent_tuning" not in inductor_patches(True, LycheeConfig(tune_kernels=False))
    # the decomposition that makes the products reductions is keyed on this very flag in this torch
    src = inspect.getsource(decomp)
    assert "config.coordinate_descent_tuning" in src and "(self.unsqueeze(2) * input2.unsqueeze(0)).sum(dim=1)" in src


def test_kernel_options_parse_and_validate():
    assert KernelOptions.parse("") == KernelOptions()
    assert KernelOptions.parse("sparse_tile=64:3:2,tune_timing=inductor") == KernelOptions(
        sparse_tile=(64, 3, 2), tune_timing="inductor")
    for bad, match in (("sparse_tile=128:2", "three positive ints"), ("pdl=maybe", "true/false"),
                       ("nope=1", "no field 'nope'"), ("tune_timing=host", "'alone' or 'inductor'")):
        with pytest.raises(LycheeConfigError, match=match):
            KernelOptions.parse(bad)
    with pytest.raises(LycheeConfigError, match="must be a KernelOptions"):
        LycheeConfig(kernels={"pdl": False})
    assert LycheeConfig().cache_key() != LycheeConfig(kernels=KernelOptions(pdl=False)).cache_key()


def test_sparse_tile_reaches_the_lowering_from_the_compile_scope():
    from lychee_compile.lowering.constexprs import kernel_params
    assert sparse_tile() == {}
    with compiling(Scope(options=KernelOptions(sparse_tile=(64, 3, 2)))):
        tile = sparse_tile()
    assert tile == dict(sparse_bn=64, sparse_stages=3, sparse_cost=2)
    common = dict(G=4, Hkv=8, D=128, K_sel=256, block_size=16, sink_tokens=16, local_tokens=64, scale=0.1,
                  num_splits=264, nb_hint=8192)
    sp, cp = kernel_params(**common, **tile)
    assert (sp["SBN"], sp["SPARSE_STAGES"], sp["SPARSE_COST"], cp["SBN"]) == (64, 3, 2, 64)
    sp, _ = kernel_params(**common)
    assert (sp["SBN"], sp["SPARSE_STAGES"], sp["SPARSE_COST"]) == (128, 2, 3)


def test_codegen_key_follows_sources_and_options_and_spares_a_users_pass(monkeypatch, tmp_path):
    # Inductor's FX graph cache keys a graph on its config, not on our templates: the no-op post-grad pass's uuid is
    # a digest of the lowering package's sources and the KernelOptions, so an entry written by other kernel text
    # or other options is never served
    from torch._inductor import config as icfg
    base, real = codegen_key.CodegenKey(KernelOptions()).uuid(), codegen_key.codegen_digest()
    assert base.startswith(real) and len(real) == 64
    assert codegen_key.CodegenKey(KernelOptions(pdl_templates=False)).uuid() != base
    lowering = tmp_path / "lowering"                  # a package tree: lowering/ and the ops/ module it reads
    (lowering / "kernels").mkdir(parents=True)
    (tmp_path / "ops").mkdir()
    for name in ("lowering/lower.py", "lowering/codegen_key.py", "lowering/kernels/split.py.jinja", "ops/policies.py"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(codegen_key, "__file__", str(lowering / "codegen_key.py"))
    codegen_key.codegen_digest.cache_clear()
    try:
        digests = [codegen_key.codegen_digest()]
        for name in ("lowering/lower.py", "lowering/kernels/split.py.jinja", "ops/policies.py"):
            (tmp_path / name).write_text("x = 2\n")
            codegen_key.codegen_digest.cache_clear()
            digests.append(codegen_key.codegen_digest())
    finally:
        codegen_key.codegen_digest.cache_clear()
    assert len(set(digests + [real])) == 5
    with icfg.patch(post_grad_custom_post_pass=lambda graph: None):
        assert "post_grad_custom_post_pass" not in inductor_patches(True, LycheeConfig())


def _backend(config=LycheeConfig(tune_kernels=False, cuda_graphs=False), decode=False):
    def backend(gm, example_inputs):
        return compile_graph(gm, example_inputs, config, decode)
    return backend


def test_fx_graph_cache_misses_when_our_codegen_changes(monkeypatch):
    # end to end through Inductor's FX graph cache: the same graph compiled again hits the cache; once the digest of
    # our lowering sources differs (another lychee_compile version), the entry is not served
    import uuid

    from torch._dynamo.utils import counters
    from torch._inductor import config as icfg

    def compile_once():
        torch._dynamo.reset()
        x = torch.randn(8)
        torch.testing.assert_close(torch.compile(lambda t: (t.cos() * 3).sum(), backend=_backend())(x),
                                   (x.cos() * 3).sum())
        return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]

    with icfg.patch(fx_graph_cache=True, force_disable_caches=False):
        compile_once()
        before = counters["inductor"]["fxgraph_cache_hit"]
        hit0, miss0 = compile_once()
        assert hit0 == before + 1, "the same graph and codegen must hit Inductor's cache (else this proves nothing)"
        other = f"another lychee_compile {uuid.uuid4().hex}"      # never in the on-disk cache of an earlier run
        monkeypatch.setattr(codegen_key, "codegen_digest", lambda: other)
        hit1, miss1 = compile_once()
        assert (hit1, miss1) == (hit0, miss0 + 1)


def test_every_pdl_kernel_of_our_compiles_waits():
    # inside our compiles, a PDL kernel body that Inductor left without griddepcontrol.wait (no load) gets one first;
    # a body with loads keeps Inductor's placement (its first wait after the first load, its last
    # launch_dependents); outside, Inductor's filter is as it was
    from torch._inductor.utils import IndentedBuffer
    W, L = compat.TritonKernel.GDC_WAIT, compat.TritonKernel.GDC_LAUNCH

    class Kernel:
        GDC_WAIT, GDC_LAUNCH = W, L
        _enable_pdl_codegen = staticmethod(lambda: True)

    def filtered(lines, ours):
        buf = IndentedBuffer()
        for line in lines:
            buf.writeline(line)
        if ours:
            with compiling(Scope()):
                assert compat.TritonKernel._filter_pdl is inductor_changes._pdl_waits
                compat.TritonKernel._filter_pdl(Kernel(), buf)
        else:
            compat.TritonKernel._filter_pdl(Kernel(), buf)
        return [str(x) for x in buf._lines]

    loads = ["x0 = tl.load(a)", W, L, "x1 = tl.load(b)", W, L, "tl.store(c, x0 + x1)"]
    inductor = ["x0 = tl.load(a)", W, "x1 = tl.load(b)", L, "tl.store(c, x0 + x1)"]
    assert filtered(loads, True) == inductor and filtered(loads, False) == inductor
    store_only = ["xindex = tl.arange(0, XBLOCK)", "tl.store(c, xindex)"]
    assert filtered(store_only, True) == [W] + store_only
    assert filtered(store_only, False) == store_only


class _Kernel:
    def __init__(self, kind, outputs=4096, name="k", device="cuda"):
        self.heuristic_type, self.size_hints, self.name = kind, {"x": outputs, "r0_": 4096}, name
        self.device_props = types.SimpleNamespace(type=device)


def test_tuning_skips_pointwise_kernels_and_norms_of_our_compiled_calls_only(monkeypatch):
    # inside our compiled calls the tuning entry point returns the launcher untouched for a POINTWISE kernel and a
    # reduction of < TUNE_MIN_OUTPUTS outputs, and hands the rest (and everything outside) to what was there
    handed = []
    monkeypatch.setattr(compat.CachingAutotuner, "coordinate_descent_tuning",
                        lambda self, launcher: (handed.append(self), "tuned")[1])
    H = compat.HeuristicType
    cases = {"pointwise": _Kernel(H.POINTWISE), "reduction": _Kernel(H.REDUCTION),
             "norm (4 outputs)": _Kernel(H.REDUCTION, outputs=4),
             "persistent norm (1 output)": _Kernel(H.PERSISTENT_REDUCTION, outputs=1)}

    def tune(options=None):
        launchers = {name: types.SimpleNamespace(config=types.SimpleNamespace()) for name in cases}
        call = compat.CachingAutotuner.coordinate_descent_tuning
        if options is None:
            got = {name: call(k, launchers[name]) for name, k in cases.items()}
        else:
            with running(Scope(options=options)):
                call = compat.CachingAutotuner.coordinate_descent_tuning
                got = {name: call(k, launchers[name]) for name, k in cases.items()}
        untouched = sorted(n for n in got if got[n] is launchers[n])
        # the skipped launchers' configs are marked as Inductor marks a tuned one, so it stops asking each launch
        assert untouched == sorted(n for n, lc in launchers.items() if getattr(lc.config, "found_by_coordesc", 0))
        return untouched
    assert tune(KernelOptions()) == ["norm (4 outputs)", "persistent norm (1 output)", "pointwise"]
    assert handed == [cases["reduction"]]
    assert tune(KernelOptions(tune_small_reductions=True)) == ["pointwise"]
    assert tune(KernelOptions(tune_pointwise=True, tune_small_reductions=True)) == []
    assert tune() == []         # outside our calls: all handed on


def test_tuning_times_variants_of_our_cuda_kernels_alone(monkeypatch):
    # inside our compiled calls Inductor's bench hands a CUDA variant to time_kernel_alone, and the rest (a CPU
    # kernel; a variant spilling more than Inductor's own bench allows; a launch that raises; tune_timing=
    # "inductor"; everything outside our calls) to what was there
    monkeypatch.setattr(compat.CachingAutotuner, "bench", lambda self, launcher: ("inductor", self.name))

    def alone(tuner, launcher):
        if launcher.n_spills == -1:
            raise RuntimeError("invalid configuration argument")
        return ("alone", tuner.name)
    monkeypatch.setattr(inductor_changes, "time_kernel_alone", alone)
    monkeypatch.delitem(inductor_changes._WARNED, "bench", raising=False)
    H = compat.HeuristicType
    ok, spills, bad = (types.SimpleNamespace(n_spills=n) for n in (0, 17, -1))
    with running(Scope()):
        bench = compat.CachingAutotuner.bench
        got = [bench(_Kernel(H.REDUCTION, name="cuda"), ok), bench(_Kernel(H.REDUCTION, name="cpu", device="cpu"), ok),
               bench(_Kernel(H.REDUCTION, name="spills"), spills)]
        with pytest.warns(RuntimeWarning, match="could not be timed alone"):      # said once, not swallowed
            got.append(bench(_Kernel(H.REDUCTION, name="raises"), bad))
    with running(Scope(options=KernelOptions(tune_timing="inductor"))):
        got.append(compat.CachingAutotuner.bench(_Kernel(H.REDUCTION, name="asked"), ok))
    got.append(compat.CachingAutotuner.bench(_Kernel(H.REDUCTION, name="outside"), ok))
    assert got == [("alone", "cuda"), ("inductor", "cpu"), ("inductor", "spills"), ("inductor", "raises"),
                   ("inductor", "asked"), ("inductor", "outside")]


def test_no_blas_workspace_around_capture_or_each_step_of_a_cuda_decode_graph(monkeypatch):
    # without CUDA graphs the decode step's cuBLAS calls run on every step: the whole call is without a workspace;
    # with them only the capture needs it (CUDAGraphNode._record), the replays call no cuBLAS
    import os

    from lychee_compile import blas
    monkeypatch.delenv(blas.WORKSPACE_ENV, raising=False)
    monkeypatch.setattr(compat.CUDAGraphNode, "_record",
                        lambda self, model, inputs: os.environ.get(blas.WORKSPACE_ENV))
    with running(Scope(no_blas_workspace=True, cuda_graphs=False)):
        assert os.environ[blas.WORKSPACE_ENV] == blas.NO_WORKSPACE
    with running(Scope(no_blas_workspace=True, cuda_graphs=True)):
        assert blas.WORKSPACE_ENV not in os.environ
        assert compat.CUDAGraphNode._record(None, None, []) == blas.NO_WORKSPACE
    with running(Scope(no_blas_workspace=False, cuda_graphs=True)):
        assert compat.CUDAGraphNode._record(None, None, []) is None
    assert blas.WORKSPACE_ENV not in os.environ


def test_compile_graph_compiles_and_runs_inside_our_scopes(monkeypatch):
    seen = _seen_inside(monkeypatch)
    before = _class_entries()
    for decode, graphs in ((False, False), (True, True)):
        torch._dynamo.reset()
        x = torch.randn(8)
        config = LycheeConfig(tune_kernels=False, cuda_graphs=False, kernels=KernelOptions(tune_pointwise=True))
        torch.testing.assert_close(torch.compile(lambda t: t.sin().sum(), backend=_backend(config, decode))(x),
                                   x.sin().sum())
    assert seen["compiling"] == [inductor_changes._pdl_waits] * 2
    assert seen["running"] == [inductor_changes._tune] * 2
    assert _class_entries() == before


def test_tune_kernels_reaches_inductor(monkeypatch):
    # LycheeConfig.tune_kernels is what compile_fx is told (Inductor's coordinate-descent tuning on CUDA); the
    # config rejects a non-bool. Inductor itself is stubbed out here.
    from lychee_compile.lowering import compile as compile_module
    from tests.harness import compiled, generate_logits
    from tests.models import make_batch
    seen = []
    monkeypatch.setattr(compat, "compile_fx", lambda gm, ex, config_patches: (seen.append(config_patches),
                                                                              gm.forward)[1])
    monkeypatch.setattr(compile_module, "inductor_patches",
                        lambda on_cuda, config: {"triton.cudagraphs": False, "tune": config.tune_kernels})
    ids, mask = make_batch(lengths=(9,))
    for tune in (True, False):
        model, state = compiled("llama", "sdpa", backend="inductor", tune_kernels=tune, budget=8, block_size=4,
                                sink_tokens=4, local_tokens=4)
        generate_logits(model, ids, mask, steps=2)
        assert state.counters.decode_graphs == 1 and seen[-1]["tune"] is tune
    with pytest.raises(LycheeConfigError, match="tune_kernels must be a bool"):
        LycheeConfig(tune_kernels=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tuning_times_reductions_not_pointwise_gpu():
    # on the GPU, compile_graph with tuning on: a pointwise-only function has no kernel variant timed, nor has a
    # reduction with 4 outputs (a norm's shape); a reduction with 4096 outputs (a product's) has some; all are right
    from torch._dynamo.utils import counters
    backend = _backend(LycheeConfig(tune_kernels=True, cuda_graphs=False))

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
def test_time_kernel_alone_measures_the_device_not_the_host_gpu(monkeypatch):
    # time_kernel_alone on a real tuning variant: a launcher whose host side is slow (0.1 ms more per call, as a
    # slow Python launch path would be, 3-4x the kernel) is timed at its device time all the same, and the real
    # inputs are left as they were (the variant runs on clones of what it mutates)
    import time as _time
    captured = {}
    orig = compat.CachingAutotuner.coordinate_descent_tuning

    def grab(self, launcher, *args, **kwargs):
        captured.setdefault("k", (self, launcher, args, kwargs))
        return orig(self, launcher, *args, **kwargs)
    monkeypatch.setattr(compat.CachingAutotuner, "coordinate_descent_tuning", grab)   # what our _tune hands on to
    x = torch.randn(2048, 4096, device="cuda")
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lambda t: (t.sin() * 2).sum(-1),
                                             backend=_backend(LycheeConfig(tune_kernels=True, cuda_graphs=False)))(x),
                               (x.sin() * 2).sum(-1), rtol=1e-4, atol=1e-3)
    tuner, launcher, args, kwargs = captured["k"]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    def slow_host(*a, **k):
        _time.sleep(0.0001)
        return launcher(*a, **k)
    slow_host.config, slow_host.n_spills = launcher.config, launcher.n_spills
    fast = inductor_changes.time_kernel_alone(tuner, launcher, *args, **kwargs)
    slow = inductor_changes.time_kernel_alone(tuner, slow_host, *args, **kwargs)
    bytes_ms = x.numel() * 4 / 3.5e12 * 1e3          # the input read once at a rate above any H100 / H200
    assert bytes_ms <= fast < 0.1 and bytes_ms <= slow < 0.1 and abs(slow - fast) < 0.5 * fast, (fast, slow)
    # inputs and in-place arguments untouched (the variant ran on clones); output buffers are written, as
    # Inductor's own bench writes them, and the real launch overwrites them after the tuning
    names = tuner.fn.arg_names[:len(args)]
    checked = [n for n, a, b in zip(names, args, before)
               if isinstance(a, torch.Tensor) and not n.startswith("out_ptr") and torch.equal(a, b)]
    assert checked == [n for n, a in zip(names, args) if isinstance(a, torch.Tensor) and not n.startswith("out_ptr")]
    assert checked, names
