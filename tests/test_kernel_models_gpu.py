"""The kernel path beyond Llama (GPU): tiny bf16 decoders of several architectures compiled with Inductor and CUDA
graphs, against the same model and head map on the op's eager reference (Inductor with every hybrid_decode site
lowered to the reference extern).

Per model (`compare_kernels_with_reference`):
  * kernel run: LycheeConfig(backend="inductor", cuda_graphs=True), greedy. Every lychee::hybrid_decode site is
    lowered to our two templates, none to the reference extern (the lowering's choices are logged, Inductor's FX
    graph cache off so that it runs), and the op's reference is never called while the model decodes (an extern
    would call it).
  * reference run: Inductor, each site on the op's reference (an extern), teacher-forced to the kernel run's tokens (a logits processor), so every step's
    logits come from the same inputs; the op's reference records each decode site's inputs and outputs.
  * logits: within bf16 tolerance at every step (greedy-token agreement is reported).
  * selection: inside a CUDA graph the kernels' index state cannot be observed, so every recorded site that selects
    (a deferred selection: every global layer but the last) is replayed through the lowering -- the one op compiled
    with Inductor, defer_select and index_ready as in the model -- on the recorded inputs. The block sets selected
    by the read retrieval heads, one per (step, layer, row, KV head), equal the reference's on >= 90% of them; every
    other row exactly (a sparse head passes its inherited row on, an unread retrieval head writes EMPTY).
  * sparsity: the reference's collector shows the sparse heads attended less than half of their row's context.
The selection policies topp / threshold / ratio get the same comparison on one model.
Run with `-rP` (or `-s`) to see each model's numbers.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from lychee_compile import HeadMap, LycheeConfig, lychee_compile
from lychee_compile.api import state_of
from lychee_compile.ops.op_arguments import arg_names
from lychee_compile.ops.sparsity import collect_sparsity
from tests.harness import generate_logits
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

# K = 4 blocks; a sparse head attends at most 1-2 sink + 1-2 local + 4 inherited blocks of 8 tokens
CFG = dict(budget=32, block_size=8, sink_tokens=8, local_tokens=8)
LENGTHS = (200, 160)     # well above budget + sink + local, and within the tiny models' 256 positions
STEPS = 12               # new tokens: 11 decode steps
LOGIT_TOL = 5e-2         # bf16 logits, as the other GPU tests (test_cuda_graphs, test_several_models)
OUT_REL_TOL = 1.5e-2     # one op's bf16 output against its reference (tests/test_lowering.py)
MIN_SAME_SELECTION = 0.9
MAX_ATTENDED = 0.5
ARCHS = ["qwen2_gqa7", "qwen3", "gemma3", "phi3_d96", "phi_d80", "gpt_neox", "mistral", "granite"]
# each keeps fewer than K blocks on some rows of this data (measured on the eager reference), so none is top-K
POLICY_PARAMS = {"topp": 0.2, "threshold": 0.04, "ratio": 0.12}
OP = torch.ops.lychee.hybrid_decode.default
TENSOR_ARGS = ("q", "k", "v", "valid", "retrieval", "idx_in", "select")
# the module whose op implementation calls the reference by its global name (the package exports the op function
# under the same name, hence import_module)
REFERENCE_MODULE = importlib.import_module("lychee_compile.ops.hybrid_decode")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class ReferenceCalls:
    """Counts calls of the op's eager reference and, while `recording`, keeps each call's arguments by name (tensors
    cloned: the static cache changes in place at the next step) with its (out, idx_out)."""

    def __init__(self, monkeypatch):
        self.count, self.recording, self.sites = 0, False, []
        original = REFERENCE_MODULE.hybrid_decode_reference
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            self.count += 1
            result = original(*args, **kwargs)
            if self.recording:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                self.sites.append((_cloned(bound.arguments), _cloned(result)))
            return result

        monkeypatch.setattr(REFERENCE_MODULE, "hybrid_decode_reference", counted)


def _cloned(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_cloned(v) for v in x)
    return x


class LoweringLog:
    """What the hybrid_decode lowering chose while Inductor compiled: template names and reference fallbacks."""

    def __init__(self, monkeypatch):
        from lychee_compile.lowering import compat, lower
        self.names = []
        fallback, select_one = lower._fallback, compat.select_one
        monkeypatch.setattr(lower, "_fallback", lambda *a: (self.names.append("fallback"), fallback(*a))[1])
        monkeypatch.setattr(compat, "select_one", lambda name, *a: (self.names.append(name), select_one(name, *a))[1])

    def assert_kernels_only(self, what: str, sites: int) -> None:
        """Every one of `sites` lowered hybrid_decode sites became the two templates, none the reference extern."""
        fallbacks, combines = self.names.count("fallback"), self.names.count("lychee_hybrid_combine")
        assert fallbacks == 0, (f"{what}: {fallbacks} of {sites} hybrid_decode sites lowered to the eager reference "
                                f"(extern), not the Triton templates; lowering log {self.names}")
        assert combines == self.names.count("lychee_hybrid_split") == sites >= 1, (what, sites, self.names)


class ForcedTokens(LogitsProcessor):
    """Teacher forcing inside generate(): each step's scores become 0 at the given token and -inf elsewhere, so the
    greedy choice is that token (generate's output_logits stay the model's raw logits)."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        pos = input_ids.shape[1]
        assert torch.equal(input_ids, self.sequences[:, :pos]), "the forced prefix was left"
        forced = torch.full_like(scores, -math.inf)
        return forced.scatter_(1, self.sequences[:, pos:pos + 1], 0.0)


@dataclasses.dataclass
class Report:
    what: str
    max_logit_diff: float = math.nan
    tokens_agree: tuple = (0, 0)        # steps x rows where the reference's greedy token is the kernel run's
    same_selection: tuple = (0, 0)      # (row, KV head) selections of read retrieval heads: equal sets, compared
    max_out_err: float = math.nan       # replayed sites: the op output's relative error
    attended_max: float = math.nan      # sparse heads: attended / valid tokens, the largest
    kept: tuple = (0, 0, 0)             # blocks kept by read retrieval heads: min, max, capacity K

    def __str__(self):
        eq, n = self.same_selection
        return (f"{self.what}: selections equal on {eq}/{n} = {eq / max(n, 1):.3f} of (step, layer, row, KV head) "
                f"read retrieval heads; max logit diff {self.max_logit_diff:.4f}; greedy tokens agree "
                f"{self.tokens_agree[0]}/{self.tokens_agree[1]}; replayed op output rel. err <= "
                f"{self.max_out_err:.4f}; sparse heads attended <= {self.attended_max:.3f} of the context; kept "
                f"blocks {self.kept[0]}..{self.kept[1]} of K={self.kept[2]}")


def _model(arch: str, device: str, config: LycheeConfig):
    model = make(arch, "sdpa").to(device, torch.bfloat16)
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model), config)
    return model


def kernel_run(arch, config, ids, mask, steps, refs: ReferenceCalls, log: LoweringLog):
    """The model on the kernels, greedy: (sequences, logits). Checks that the kernels ran, and nothing else. CUDA
    graphs on a CUDA device (elsewhere: the Triton interpreter, a CPU check of this file)."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    on_cuda = ids.is_cuda
    model = _model(arch, ids.device.type, dataclasses.replace(config, backend="inductor", cuda_graphs=on_cuda))
    skips = counters["inductor"]["cudagraph_skips"]
    with inductor_config.patch(fx_graph_cache=False):    # a graph from the cache would skip the lowering
        seq, logits = generate_logits(model, ids, mask, steps)
    state = state_of(model)
    log.assert_kernels_only(arch, state.counters.sites_rewritten)
    assert refs.count == 0, f"{arch}: the op's eager reference ran {refs.count} times during the compiled decode"
    assert state.config.cuda_graphs == on_cuda, state.config
    assert counters["inductor"]["cudagraph_skips"] == skips, "Inductor skipped CUDA graphs (see its log for why)"
    assert state.counters.decode_calls == steps - 1, state.counters
    return seq, logits


def reference_run(arch, config, ids, mask, steps, tokens, refs: ReferenceCalls, device: str, monkeypatch,
                  backend: str = "inductor"):
    """The model on the op's eager reference, teacher-forced to `tokens` (the kernel run's sequences): (logits,
    the recorded sites, the sparsity summary, the number of global layers). Compiled by Inductor like the kernel run,
    with every hybrid_decode site lowered to the reference (an extern call): the rest of the step is fused and
    rounded as in the kernel run, so the logits differ by the attention op alone (an eager bf16 model rounds every
    op's output and drifts by more than the op's own error). backend="eager": the op's reference in an eager model
    (the CPU check of this machinery)."""
    from torch._inductor import config as inductor_config
    from lychee_compile.lowering import lower
    model = _model(arch, device, dataclasses.replace(config, backend=backend, cuda_graphs=False))
    forced = LogitsProcessorList([ForcedTokens(tokens)])
    refs.recording, refs.sites = True, []
    with monkeypatch.context() as m, inductor_config.patch(fx_graph_cache=False), collect_sparsity() as sparsity:
        m.setattr(lower, "supported", lambda *args, **kwargs: "forced to the reference for the comparison")
        seq, logits = generate_logits(model, ids, mask, steps, logits_processor=forced)
    refs.recording = False
    n_global = len(state_of(model).global_layers)
    assert torch.equal(seq, tokens)
    assert sparsity.calls == len(refs.sites) == (steps - 1) * n_global, (sparsity.calls, len(refs.sites), n_global)
    return logits, refs.sites, sparsity.summary(), n_global


def selecting_sites(sites: list, n_global: int) -> list:
    """The sites whose selection a later layer reads: every global layer but the last of each step (sites come in
    layer order). The last selects for no one (its `select` is all False): checked, it confirms the slots."""
    for i, (args, _) in enumerate(sites):
        assert args["select"] is not None, "thread_state gives every hybrid_decode its readers"
        assert i % n_global < n_global - 1 or not args["select"].any(), (i, args["select"])
    return [site for i, site in enumerate(sites) if i % n_global < n_global - 1]


def site_function(scalars: dict):
    """One decode site as the model's graph has it when the next layer reads the selection: the op deferred, its
    index state joined by index_ready before it is returned."""
    def site(q, k, v, valid, retrieval, idx_in, select):
        out, idx = OP(q, k, v, valid, retrieval, idx_in, select=select, defer_select=True, **scalars)
        torch.ops.lychee.index_ready.default(idx, [])
        return out, idx
    return site


def replay(sites: list, compile_site) -> tuple[int, int, float]:
    """Each site's recorded inputs through compile_site(site_function(scalars)); its outputs against the recorded
    reference outputs: (equal selections, compared selections, the largest relative output error)."""
    scalar_names = [n for n in arg_names(OP) if n not in TENSOR_ARGS and n != "defer_select"]
    scalars = {n: sites[0][0][n] for n in scalar_names}
    assert all({n: a[n] for n in scalar_names} == scalars for a, _ in sites), "a model's sites share their scalars"
    fn = compile_site(site_function(scalars))
    equal = compared = 0
    max_err = 0.0
    for args, (ref_out, ref_idx) in sites:
        out, idx = fn(*(args[n] for n in TENSOR_ARGS))
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp_min(1e-12)).item()
        max_err = max(max_err, err)
        e, c = selection_agreement(idx, ref_idx, args["retrieval"], args["select"])
        equal, compared = equal + e, compared + c
    return equal, compared, max_err


def selection_agreement(got, want, retrieval, select) -> tuple[int, int]:
    """got, want int32 [B, Hkv, K] (idx_out of one site); retrieval, select bool [Hkv]. -> (equal, compared) over the
    (row, KV head) pairs of retrieval heads whose selection is read: how many selected the same block set. Every
    other row must be equal exactly."""
    selecting = (retrieval & select).expand(got.shape[0], -1)                        # [B, Hkv]
    same_set = (got.sort(-1).values == want.sort(-1).values).all(-1)               # [B, Hkv]
    assert torch.equal(got[~selecting], want[~selecting]), ("rows that select nothing must be equal", got, want)
    return int(same_set[selecting].sum()), int(selecting.sum())


def assert_logits_close(report: Report, logits, ref_logits) -> None:
    diff = (logits.float() - ref_logits.float()).abs().amax(-1)                     # [steps, B]
    report.max_logit_diff = diff.max().item()
    agree = logits.argmax(-1) == ref_logits.argmax(-1)
    report.tokens_agree = (int(agree.sum()), agree.numel())
    assert report.max_logit_diff < LOGIT_TOL, f"{report}; per step: {diff.amax(-1).tolist()}"


def compare_kernels_with_reference(arch: str, monkeypatch, device="cuda", lengths=LENGTHS, steps=STEPS,
                                   **config) -> Report:
    """The whole comparison (module docstring) for one model; returns its numbers."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from lychee_compile.lowering import register
    config = LycheeConfig(**CFG, **config)
    report = Report(arch if config.selection == "topk" else f"{arch}, {config.selection} {config.selection_param}")
    ids, mask = (x.to(device) for x in make_batch(lengths=lengths))
    refs, log = ReferenceCalls(monkeypatch), LoweringLog(monkeypatch)
    seq, logits = kernel_run(arch, config, ids, mask, steps, refs, log)
    ref_logits, sites, sparsity, n_global = reference_run(arch, config, ids, mask, steps, seq, refs, device,
                                                          monkeypatch)
    assert_logits_close(report, logits, ref_logits)
    assert sparsity["attended"] and sparsity["kept_blocks"], f"no sparse head or no read selection: {sparsity}"
    report.attended_max = sparsity["attended"]["max"]
    kept = sparsity["kept_blocks"]
    report.kept = (int(kept["min"]), int(kept["max"]), sparsity["capacity"])
    assert report.attended_max < MAX_ATTENDED, str(report)
    assert report.kept[1] > 0, f"no block was ever selected: {report}"
    register()              # the backend registered the lowering for the model; the replay needs it too
    log.names.clear()
    graphs = counters["stats"]["unique_graphs"]
    with inductor_config.patch(fx_graph_cache=False):
        equal, compared, report.max_out_err = replay(
            selecting_sites(sites, n_global), lambda fn: torch.compile(fn, backend="inductor", fullgraph=True))
    report.same_selection = (equal, compared)
    log.assert_kernels_only(f"{arch}, replayed sites", counters["stats"]["unique_graphs"] - graphs)
    assert report.max_out_err < OUT_REL_TOL, str(report)
    assert compared > 0 and equal / compared >= MIN_SAME_SELECTION, str(report)
    print(report)
    return report


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_kernels_match_reference_gpu(arch, monkeypatch):
    compare_kernels_with_reference(arch, monkeypatch)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("selection", sorted(POLICY_PARAMS))
def test_policy_kernels_match_reference_gpu(selection, monkeypatch):
    report = compare_kernels_with_reference("llama", monkeypatch, selection=selection,
                                            selection_param=POLICY_PARAMS[selection])
    assert report.kept[0] < report.kept[2], f"the policy kept K blocks everywhere, as top-K would: {report}"


def test_comparison_logic_on_cpu(monkeypatch):
    # the GPU tests' machinery on the reference alone (CPU, bf16): teacher forcing to the model's own tokens gives
    # its logits again, the recorded sites replayed through the (uncompiled) op select exactly what was recorded,
    # and a changed selection is counted, a changed row that selects nothing refused
    ids, mask = make_batch(lengths=(60, 45))
    refs = ReferenceCalls(monkeypatch)
    config = LycheeConfig(**CFG)
    model = _model("qwen2_gqa7", "cpu", dataclasses.replace(config, backend="eager"))
    seq, logits = generate_logits(model, ids, mask, 4)
    ref_logits, sites, sparsity, n_global = reference_run("qwen2_gqa7", config, ids, mask, 4, seq, refs, "cpu",
                                                          monkeypatch, backend="eager")
    report = Report("cpu")
    assert_logits_close(report, logits, ref_logits)
    assert report.max_logit_diff == 0.0 and report.tokens_agree == (8, 8)
    chosen = selecting_sites(sites, n_global)
    assert len(chosen) == 3 * (n_global - 1) and n_global == 3
    equal, compared, err = replay(chosen, lambda fn: fn)
    assert (equal, compared, err) == (compared, 3 * 2 * 2, 0.0)     # 3 steps x 2 selecting layers x 2 rows
    args, (out, idx) = chosen[0]
    h = int(torch.nonzero(args["retrieval"] & args["select"])[0])
    assert int(idx[0, h, 0]) >= 0
    idx[0, h, 0] = idx[0, h, 0] + 1000                              # a block no head selects
    assert replay(chosen, lambda fn: fn)[:2] == (compared - 1, compared)
    other = int(torch.nonzero(~(args["retrieval"] & args["select"]))[0])
    idx[1, other, 0] = idx[1, other, 0] + 1000
    with pytest.raises(AssertionError, match="rows that select nothing"):
        replay(chosen, lambda fn: fn)
