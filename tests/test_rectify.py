"""Dense rectification: after a rectification the rectified tokens' cache entries equal those of a dense run over
the same tokens; without rectification they differ. The re-encode runs compiled (a dense prefill graph of its own,
compiled once, the decode graph never recompiled) and writes what the uncompiled model's re-encode writes;
rectify_every=1 cannot compile (refused in strict mode, eager and counted otherwise)."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, LycheeConfig, LycheeConfigError, lychee_compile
from lychee_compile.api import state_of
from tests.harness import EXACT_TOL, compiled, generate_logits, max_logit_diff
from tests.models import make, make_batch
from tests.test_sparse_semantics import mixed_map

CFG = dict(budget=4, block_size=2, sink_tokens=2, local_tokens=2)
R = 4


def run(model, ids, mask, steps):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             return_dict_in_generate=True)
    return out.sequences, out.past_key_values


def dense_cache(arch, attn, sequences, mask_prompt, fed):
    """K/V of an uncompiled dense forward over prompt + the `fed` generated tokens that were fed back."""
    model = make(arch, attn)
    seq = sequences[:, : mask_prompt.shape[1] + fed]
    mask = torch.cat([mask_prompt, torch.ones(seq.shape[0], fed, dtype=mask_prompt.dtype)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        out = model(input_ids=seq, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.past_key_values


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen2_gqa7", "eager")])
def test_rectified_entries_equal_dense(arch, attn):
    ids, mask = make_batch(lengths=(26, 17))
    n = ids.shape[1]
    model, state = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), rectify_every=R, **CFG)
    seq, cache = run(model, ids, mask, 2 * R + 1)          # 2R decode steps -> two rectifications
    assert state.counters.decode_graphs == 1
    plain, _ = compiled(arch, attn, retrieval=mixed_map(make(arch, attn)), **CFG)
    seq_plain, cache_plain = run(plain, ids, mask, 2 * R + 1)
    ref = dense_cache(arch, attn, seq, mask, 2 * R)

    span = slice(n, n + 2 * R)
    for layer in range(1, model.config.num_hidden_layers):   # layer 0's K/V never depend on attention
        got = cache.layers[layer].keys[:, :, span]
        want = ref.layers[layer].keys[:, :, span]
        assert (got - want).abs().max() < 1e-4, f"layer {layer}: rectified keys differ from dense"
        assert torch.allclose(cache.layers[layer].values[:, :, span], ref.layers[layer].values[:, :, span],
                              atol=1e-4)
    if torch.equal(seq, seq_plain):
        deltas = [(cache_plain.layers[layer].keys[:, :, span] - ref.layers[layer].keys[:, :, span]).abs().max()
                  for layer in range(1, model.config.num_hidden_layers)]
        assert max(deltas) > 1e-4, "without rectification the sparse cache should differ from dense"


def test_rectification_refused_with_sliding_layers():
    model = make("gemma3")
    with pytest.raises(LycheeConfigError, match="every layer to be global"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager", rectify_every=8))
    assert not hasattr(model, "_lychee_state")


def test_rectified_entries_equal_dense_in_teacher_forced_scoring():
    # the evaluation harness drives the compiled decode call itself (eval/scoring.py), passing cache_position and a
    # 2-D mask: rectification must rewrite exactly the same slots there; the unrectified tail must still differ
    from lychee_compile.eval.scoring import dense_prefill, score_steps
    ids = torch.randint(3, 120, (1, 60), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(3, 120, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    dense = make("llama", "sdpa")
    dense_pre = dense_prefill(dense, ids, 96)
    score_steps(lambda **kw: dense(**kw), dense_pre, targets, copy_cache=False)
    model, _ = compiled("llama", "sdpa", retrieval=mixed_map(make("llama", "sdpa")), budget=8, block_size=4,
                        sink_tokens=4, local_tokens=4, rectify_every=4)
    pre = dense_prefill(model, ids, 96)
    score_steps(model.get_compiled_call(model.generation_config.compile_config), pre, targets, copy_cache=False)
    end = 60 + len(targets) - 1                    # positions written: prompt + every target but the last
    rectified = 60 + (len(targets) - 1) // 4 * 4
    for mine, ref in zip(pre.cache.layers, dense_pre.cache.layers):
        assert torch.allclose(mine.keys[:, :, :rectified], ref.keys[:, :, :rectified], atol=1e-5)
        assert torch.allclose(mine.values[:, :, :rectified], ref.values[:, :, :rectified], atol=1e-5)
    tail = max((m.keys[:, :, rectified:end] - r.keys[:, :, rectified:end]).abs().max().item()
               for m, r in zip(pre.cache.layers, dense_pre.cache.layers))
    assert tail > 1e-3, "the tail after the last rectification is sparse-decoded and must differ from dense"


def test_compiled_reencode_equals_eager_reencode_and_dense_with_all_retrieval_heads(caplog, monkeypatch):
    import lychee_compile.backend as backend
    from torch._dynamo.utils import counters
    plans = []                                     # lychee::segment_plan nodes of each snapshotted graph
    snapshot = backend.graph_snapshot
    monkeypatch.setattr(backend, "graph_snapshot", lambda gm: plans.append(sum(
        n.target is torch.ops.lychee.segment_plan.default for n in gm.graph.nodes)) or snapshot(gm))
    ids, mask = make_batch(lengths=(26, 17))
    steps = 3 * R + 1                                       # 3R decode steps: three re-encodes
    with caplog.at_level("INFO", logger="lychee_compile"):
        model, state = compiled("llama", "sdpa", rectify_every=R, **CFG)
    assert "re-encode runs compiled" in caplog.text
    graphs = counters["stats"]["unique_graphs"]
    seq, logits = generate_logits(model, ids, mask, steps)
    c = state.counters
    assert (c.reencodes_compiled, c.reencodes_eager, c.reencode_graphs, c.reencode_eager_reason) == (3, 0, 1, None)
    assert (c.decode_graphs, c.prefill_graphs) == (1, 1), "the re-encode graph is a prefill graph (dense)"
    assert (c.reencode_sites_dense, c.reencode_sites_unchanged) == (model.config.num_hidden_layers, 0)
    assert c.sites_rewritten == model.config.num_hidden_layers, "only the decode graph's sites go sparse"
    assert counters["stats"]["unique_graphs"] == graphs + 2, "one decode graph and one re-encode graph, no recompile"
    # the re-encode graph (compiled after the decode graph): one key-segment plan for every layer's dense_decode
    reencode_graph = state.snapshots[-1].splitlines()
    sites = [line for line in reencode_graph if " dense_decode " in line]
    assert len(sites) == model.config.num_hidden_layers and all("plan=segment_plan(" in line for line in sites)
    assert plans == [0, 1], "the decode graph has no plan, the re-encode graph one node for every layer"
    generate_logits(model, ids, mask, steps)
    assert counters["stats"]["unique_graphs"] == graphs + 2 and c.reencodes_compiled == 6

    eager, eager_state = compiled("llama", "sdpa", rectify_every=R, compile_reencode=False, **CFG)
    eager_seq, eager_logits = generate_logits(eager, ids, mask, steps)
    e = eager_state.counters
    assert (e.reencodes_compiled, e.reencodes_eager, e.reencode_graphs) == (0, 3, 0)
    assert e.reencode_eager_reason == "compile_reencode=False (as configured)"
    dense_seq, dense_logits = generate_logits(make("llama", "sdpa"), ids, mask, steps)
    assert torch.equal(seq, eager_seq) and torch.equal(seq, dense_seq)
    assert max_logit_diff(logits, eager_logits) < EXACT_TOL and max_logit_diff(logits, dense_logits) < EXACT_TOL


def test_compiled_reencode_writes_the_eager_reencodes_cache_with_a_sparse_map():
    ids, mask = make_batch(lengths=(26, 17))
    runs = {}
    for compile_reencode in (True, False):
        model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama", "sdpa")), rectify_every=R,
                                compile_reencode=compile_reencode, **CFG)
        runs[compile_reencode] = run(model, ids, mask, 2 * R + 1)
        c = state.counters
        assert (c.reencodes_compiled, c.reencodes_eager) == ((2, 0) if compile_reencode else (0, 2))
    (seq, cache), (eager_seq, eager_cache) = runs[True], runs[False]
    assert torch.equal(seq, eager_seq)
    written = ids.shape[1] + 2 * R
    for mine, ref in zip(cache.layers, eager_cache.layers):
        assert torch.allclose(mine.keys[:, :, :written], ref.keys[:, :, :written], atol=1e-5)
        assert torch.allclose(mine.values[:, :, :written], ref.values[:, :, :written], atol=1e-5)


def test_one_token_reencode_is_refused_in_strict_mode_and_runs_eagerly_otherwise(caplog):
    model = make("llama", "sdpa")
    with pytest.raises(LycheeConfigError, match="rectify_every=1"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager", rectify_every=1, **CFG))
    assert not hasattr(model, "_lychee_state")
    with caplog.at_level("WARNING", logger="lychee_compile"):
        model, state = compiled("llama", "sdpa", retrieval=mixed_map(make("llama", "sdpa")), rectify_every=1,
                                strict=False, **CFG)
    assert "the re-encode runs the uncompiled model" in caplog.text
    ids, mask = make_batch(lengths=(26, 17))
    seq, cache = run(model, ids, mask, 4)                   # 3 decode steps, each re-encoded
    c = state.counters
    assert (c.reencodes_eager, c.reencodes_compiled, c.reencode_graphs, c.decode_graphs) == (3, 0, 0, 1)
    assert c.reencode_eager_reason.startswith("rectify_every=1")
    ref = dense_cache("llama", "sdpa", seq, mask, 3)
    span = slice(ids.shape[1], ids.shape[1] + 3)
    for layer in range(1, model.config.num_hidden_layers):
        assert torch.allclose(cache.layers[layer].keys[:, :, span], ref.layers[layer].keys[:, :, span], atol=1e-4)


@pytest.mark.parametrize("strict", [True, False])
def test_reencode_graph_missing_a_layers_site_is_refused_or_left_whole(strict, caplog):
    """A re-encode graph whose attention was recognized in fewer layers than the model has is not rewritten in part:
    strict raises, non-strict logs and leaves every site as the model computes it (counted)."""
    from types import SimpleNamespace

    from lychee_compile.errors import LycheeCompileError
    from lychee_compile.passes.context import Counters
    from lychee_compile.passes.rewrite import _rewrite_reencode
    site = SimpleNamespace(kind="prefill", layer_idx=0, mask_kind="bool")
    ctx = SimpleNamespace(is_decode=False, counters=Counters(), sites=[site], strict=strict,
                          model=SimpleNamespace(config=SimpleNamespace(num_hidden_layers=2)))
    if strict:
        with pytest.raises(LycheeCompileError, match="sites in 1 layers"):
            _rewrite_reencode(ctx)
        return
    with caplog.at_level("WARNING", logger="lychee_compile"):
        _rewrite_reencode(ctx)
    assert "sites in 1 layers ([0]) but the model has 2" in caplog.text
    assert (ctx.counters.reencode_sites_unchanged, ctx.counters.reencode_sites_dense) == (1, 0)


def test_reencode_rewinds_every_layer_in_one_op():
    """The re-encode runs eagerly between decode steps: the R-step rewind of the write offsets is one foreach op,
    not one launch per layer (32 for Llama-3-8B), and the forward sees every layer rewound."""
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from lychee_compile.passes import Counters
    from lychee_compile.rectify import Rectifier

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))
    layers = [SimpleNamespace(cumulative_length=torch.tensor(9), keys=torch.zeros(1, 1, 16, 2)) for _ in range(6)]
    cache = SimpleNamespace(layers=layers)
    seen = []
    model = make("llama", "sdpa")
    rectifier = Rectifier(model, R, lambda **kw: seen.append([int(x.cumulative_length) for x in layers]), True,
                          Counters())
    rectifier.tokens = [torch.tensor([[5]])] * R
    rectifier.positions = [torch.tensor([[5 + i]]) for i in range(R)]
    with Ops() as ops:
        rectifier._reencode(cache, torch.ones(1, 9, dtype=torch.long))
    assert seen == [[9 - R] * len(layers)]
    assert ops.ops.count("aten::sub_") == 0 and ops.ops.count("aten::_foreach_sub_") == 1, ops.ops


def test_step_output_is_copied_before_a_reencode_only():
    """Under CUDA graphs the decode step's output lives in the graph pool, which the re-encode's graph may reuse:
    after_step hands back a copy of every tensor in it (ModelOutput, tuples, nested) at a re-encode, else `out`."""
    from types import SimpleNamespace

    from transformers.modeling_outputs import CausalLMOutputWithPast

    from lychee_compile.passes import Counters
    from lychee_compile.rectify import Rectifier
    layers = [SimpleNamespace(cumulative_length=torch.tensor(9), keys=torch.zeros(1, 1, 16, 2))]
    cache = SimpleNamespace(layers=layers)
    rectifier = Rectifier(make("llama", "sdpa"), 2, lambda **kw: None, True, Counters())
    kwargs = dict(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[8]]), past_key_values=cache,
                  attention_mask=torch.ones(1, 9, dtype=torch.long))
    out = CausalLMOutputWithPast(logits=torch.ones(1, 1, 3), hidden_states=(torch.ones(1, 1, 4),))
    assert rectifier.after_step(kwargs, out) is out                          # step 1 of 2: no re-encode
    copied = rectifier.after_step(kwargs, out)                               # step 2: a re-encode
    assert isinstance(copied, CausalLMOutputWithPast) and torch.equal(copied.logits, out.logits)
    assert copied.logits.data_ptr() != out.logits.data_ptr()
    assert copied.hidden_states[0].data_ptr() != out.hidden_states[0].data_ptr()
    steps = (torch.ones(1, 1, 3), (torch.ones(2),))                          # return_dict=False: tuples
    rectifier.after_step(kwargs, steps)
    assert rectifier.after_step(kwargs, steps)[1][0].data_ptr() != steps[1][0].data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_reencode_between_cuda_graph_replays_gpu():
    # the default config on a CUDA model: the decode step replays a CUDA graph, the re-encode (Inductor, a CUDA graph
    # of its own) rewrites the static cache between two replays, the step's logits copied out first; same tokens as
    # the model without CUDA graphs, no recompile and no CUDA-graph skip across generate() calls
    from torch._dynamo.utils import counters
    ids, mask = (x.cuda() for x in make_batch(lengths=(90, 71)))
    retrieval = mixed_map(make("llama", "sdpa"))
    cfg = dict(budget=32, block_size=16, sink_tokens=16, local_tokens=16, rectify_every=R)

    def build(**kw):
        model = make("llama", "sdpa").to("cuda", torch.bfloat16)
        lychee_compile(model, HeadMap(retrieval).with_model_metadata(model), LycheeConfig(**cfg, **kw))
        return model, state_of(model)
    model, state = build()
    assert state.config.cuda_graphs is True
    seq, logits = generate_logits(model, ids, mask, 3 * R + 1)
    graphs = counters["stats"]["unique_graphs"]
    again, _ = generate_logits(model, ids, mask, 3 * R + 1)
    c = state.counters
    assert counters["stats"]["unique_graphs"] == graphs and torch.equal(seq, again)
    assert (c.reencodes_compiled, c.reencode_graphs, c.decode_graphs) == (6, 1, 1)
    assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (see its log for why)"
    plain, _ = build(cuda_graphs=False, compile_reencode=False)
    plain_seq, plain_logits = generate_logits(plain, ids, mask, 3 * R + 1)
    assert torch.equal(seq, plain_seq)
    assert (logits.float() - plain_logits.float()).abs().max() < 5e-2
