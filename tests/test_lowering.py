"""The Inductor lowering of lychee::hybrid_decode (lychee_compile/lowering), end to end.

CPU: Inductor emits Triton for CPU tensors (config.cpu_backend = "triton") and the Triton interpreter runs it;
all workarounds that needs live in the ONE fixture `inductor_triton_on_cpu` (tests/conftest.py), gated on the
versions it was checked with. GPU (@pytest.mark.gpu): the same on CUDA, no workarounds.
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


def test_lowering_padded_head_dim_emits_kernels(inductor_triton_on_cpu):
    # head_dim 96 (Phi-3): the templates, their head-dim tile padded to 128 lanes inside the kernels (no copy of
    # q / k / v, no extern fallback); the `* 2` epilogue still fused into the combine's masked store
    from torch._inductor.utils import run_and_get_code
    register()
    args = _case(D=96, dtype=torch.float16)
    (out, idx), codes = run_and_get_code(torch.compile(_layer, backend="inductor", fullgraph=True), *args)
    _check(out, idx, args)
    code = "\n".join(codes)
    for token in ["D : tl.constexpr = 96", "DP : tl.constexpr = 128", "offs_d = tl.arange(0, DP)",
                  "mask=ok[:, None] & (offs_d[None, :] < D)", "triton_tem_fused_hybrid_decode_mul"]:
        assert token in code, token
    calls = code.split("def call(")[-1]
    assert "torch.ops.lychee.hybrid_decode" not in calls and "constant_pad_nd" not in calls


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
    # a policy other than top-K is a constexpr of the combine template, no longer an extern fallback
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


def test_lowering_row_extent_of_long_rows_accumulates_in_one_integer_type(inductor_triton_on_cpu):
    # rows long enough for a looped reduction (4096 positions): its accumulators start in the type its loop assigns
    # (int64); int32 ones, re-assigned int64 in the loop, made Triton refuse the kernel on the GPU at 8K+ (torch 2.11)
    import re
    from torch._inductor.utils import run_and_get_code
    register()
    args = _case(T=4096)
    (out, idx), codes = run_and_get_code(torch.compile(_layer, backend="inductor", fullgraph=True), *args)
    kernels = "\n".join(codes).split("async_compile.triton(")
    looped = [k for k in kernels if "def triton_red_" in k and "for r0_offset in" in k]
    assert looped, "expected the row extent as a looped reduction"
    for kernel in looped:
        setup = kernel.split("for r0_offset in")[0]
        assert "tl.int64)" in setup and not re.search(r"_tmp\d+ = tl\.full\(.*tl\.int32\)", setup), setup
    _check(out, idx, args)


def _record_lowering(monkeypatch) -> list:
    """The lowering's choices while Inductor compiles, in order: template names, "fallback" for the reference."""
    from lychee_compile.lowering import compat, lower
    calls = []
    fallback, select_one = lower._fallback, compat.select_one
    monkeypatch.setattr(lower, "_fallback", lambda *a: (calls.append("fallback"), fallback(*a))[1])
    monkeypatch.setattr(compat, "select_one", lambda name, *a: (calls.append(name), select_one(name, *a))[1])
    return calls


def _model_run(arch, ids, mask, **config):
    """A tiny bf16 `arch` under lychee_compile(LycheeConfig(**config)), mixed head map, 3 greedy tokens:
    (sequences, logits, counters, layers)."""
    from lychee_compile import HeadMap, LycheeConfig, lychee_compile
    from lychee_compile.api import state_of
    from tests.harness import generate_logits
    from tests.models import make
    from tests.test_sparse_semantics import mixed_map
    model = make(arch, "sdpa").to(torch.bfloat16)
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model), LycheeConfig(**config))
    seq, logits = generate_logits(model, ids, mask, 3)
    return seq, logits, state_of(model).counters, model.config.num_hidden_layers


@pytest.mark.slow
def test_lowering_compiled_model_head_dim_96(inductor_triton_on_cpu, monkeypatch):
    # a Phi-3-like bf16 model with head_dim 96 through the whole pipeline: the backend counts every rewritten site on
    # the kernels (from the graph's metadata, before Inductor runs) and the lowering agrees (two templates per site,
    # no extern fallback); logits as the op's eager reference gives them
    from tests.models import make_batch
    calls = _record_lowering(monkeypatch)
    ids, mask = make_batch(lengths=(26, 17))
    cfg = dict(strict=True, budget=16, block_size=4, sink_tokens=4, local_tokens=4)
    runs = {backend: _model_run("phi3_d96", ids, mask, backend=backend, **cfg) for backend in ("eager", "inductor")}
    seq, logits, c, n_layers = runs["inductor"]
    assert (c.sites_rewritten, c.sites_on_kernel, c.sites_on_reference, c.reference_reasons) == (n_layers, n_layers,
                                                                                                0, [])
    assert runs["eager"][2].sites_on_reference == n_layers
    assert calls.count("lychee_hybrid_combine") == n_layers and "fallback" not in calls, calls
    assert torch.equal(seq, runs["eager"][0])
    assert (logits.float() - runs["eager"][1].float()).abs().max().item() < 5e-2


@pytest.mark.slow
def test_lowering_compiled_model_with_policy(inductor_triton_on_cpu, monkeypatch):
    # the whole pipeline (lychee_compile, backend="inductor") on a bf16 model with selection="topp": every
    # lychee::hybrid_decode node becomes our two templates (counted at the lowering), none the extern fallback
    from tests.models import make_batch
    calls = _record_lowering(monkeypatch)
    cfg = dict(budget=16, block_size=2, sink_tokens=2, local_tokens=2, selection_param=0.6)
    ids, mask = make_batch(lengths=(26, 17))
    runs = {}
    for backend, selection in (("eager", "topk"), ("eager", "topp"), ("inductor", "topp")):
        seq, logits, _, n_layers = _model_run("llama", ids, mask, backend=backend, selection=selection, **cfg)
        runs[backend if selection == "topp" else selection] = seq, logits
    assert calls.count("lychee_hybrid_combine") == n_layers and "fallback" not in calls, calls
    assert torch.equal(runs["inductor"][0], runs["eager"][0])
    assert (runs["inductor"][1].float() - runs["eager"][1].float()).abs().max().item() < 5e-2
    assert not torch.equal(runs["topk"][1], runs["eager"][1]), "topp must select differently from top-K here"


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["heat", "quest_sparse", "quest_all"])
def test_lowering_compiled_model_with_state(inductor_triton_on_cpu, monkeypatch, feature):
    # heat and Quest on the kernel path: with either on, every global layer's attention is our templates (the mass
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
