"""Selection policies in the evaluation harness: the policy methods' configs, --policy-param, and the
sparsity collector (ops/sparsity.py) against plain recomputations on hand-made cases. Tiny models, fast."""
from __future__ import annotations

import math

import pytest
import torch

from lychee_compile.eval.methods import (POLICY_DEFAULTS, MethodError, method_spec, parse_policy_params)
from lychee_compile.eval.runner import markdown_table, run_eval, summarize, write_outputs
from lychee_compile.eval.scoring import SparsityNotMeasured, Variant, dense_prefill, score_steps
from lychee_compile.eval import tasks
from lychee_compile.ops import sparsity
from lychee_compile.ops.index_state import EMPTY
from lychee_compile.ops.reference import hybrid_decode_reference
from tests.models import make
from tests.test_eval_harness import CFG, _given   # block 4, sink 3, local 5; map: layer 0 all + (2, 1) retrieval


def test_policy_methods_build_their_config():
    model = make("llama")
    given = _given(model)
    for name, policy in (("lychee-topp", "topp"), ("lychee-threshold", "threshold"), ("lychee-ratio", "ratio")):
        spec = method_spec(name, model, 8, given, policy_params={**POLICY_DEFAULTS, policy: 0.3}, **CFG)
        assert spec.config.selection == policy and spec.config.selection_param == 0.3
        assert spec.config.budget == 8 and spec.config.num_select == 2 and spec.config.local_tokens == 5
        assert torch.equal(spec.head_map.retrieval, given.retrieval) and spec.config.first_layer_retrieval
        assert spec.label == f"{name}=0.3@8" and spec.variant == f"{name}=0.3"
        default = method_spec(name, model, 8, given, **CFG)
        assert default.config.selection_param == POLICY_DEFAULTS[policy]
    ly = method_spec("lychee", model, 8, given, policy_params={"topp": 0.5, "threshold": 0.1, "ratio": 0.5}, **CFG)
    assert ly.config.selection == "topk" and ly.label == "lychee@8" and ly.variant == "lychee"


def test_parse_policy_params():
    assert parse_policy_params("") == POLICY_DEFAULTS
    assert parse_policy_params(None) == POLICY_DEFAULTS
    got = parse_policy_params(" topp=0.8, ratio=1 ")
    assert got == {"topp": 0.8, "threshold": POLICY_DEFAULTS["threshold"], "ratio": 1.0}
    for text, message in (("topq=0.5", "unknown policy 'topq'"), ("topk=4", "set --budget"),
                          ("topp=high", "not a number"), ("topp=0", r"must be in \(0, 1\]"),
                          ("ratio=1.5", r"must be in \(0, 1\]"), ("threshold=nan", r"must be in \(0, 1\]"),
                          ("topp=0.9,topp=0.8", "given twice"), ("topp", "not POLICY=VALUE")):
        with pytest.raises(MethodError, match=message):
            parse_policy_params(text)


def test_cli_policy_param(tmp_path, capsys):
    from lychee_compile.cli import build_parser, main
    args = build_parser().parse_args(["eval", "--task", "passkey", "--method", "lychee-topp,lychee-ratio",
                                      "--policy-param", "topp=0.8,ratio=0.5"])
    assert args.policy_param == "topp=0.8,ratio=0.5" and args.method == "lychee-topp,lychee-ratio"
    # a bad value fails before the model is loaded (no output folder, clear message, exit 2)
    rc = main(["eval", "--task", "passkey", "--method", "lychee-topp", "--policy-param", "topp=2",
               "--no-progress", "--out", str(tmp_path / "out")])
    assert rc == 2 and "topp=2 must be in (0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_real_gpu_eval_stage_accepts_policy_methods():
    import sys
    sys.path.insert(0, "benchmarks")
    try:
        import real_gpu
        from real_gpu_stages.quality import specs_for
    finally:
        sys.path.remove("benchmarks")
    args = real_gpu.parse(["--stages", "eval", "--out", "x.json", "--methods", "dense,lychee-topp,lychee-ratio",
                           "--budgets", "128", "--policy-param", "ratio=0.5"])
    assert args.policy_params["ratio"] == 0.5
    model = make("llama")
    specs = specs_for(model, args.methods, args.budgets, _given(model), "eager", args.policy_params)
    assert [s.label for s in specs] == ["dense", f"lychee-topp={POLICY_DEFAULTS['topp']:g}@128",
                                        "lychee-ratio=0.5@128"]
    assert specs[2].config.selection == "ratio" and specs[2].config.selection_param == 0.5
    with pytest.raises(SystemExit):
        real_gpu.parse(["--stages", "eval", "--out", "x.json", "--policy-param", "ratio=-1"])


def _op(q, k, v, valid, retrieval, idx_in, policy, param, select=None):
    return hybrid_decode_reference(q, k, v, valid, retrieval, idx_in, 1.0, 4, 3, 5, policy, param, select=select)


def test_collector_hand_made_case():
    """Two op calls by hand (block 4, sink 3, local 5, two rows, one left-padded): layer A all retrieval selects
    with ratio 0.25, layer B all sparse reads it. Expected numbers recomputed from positions, not from the op."""
    torch.manual_seed(0)
    B, Hkv, G, T, D, K = 2, 2, 2, 40, 8, 8
    q = torch.randn(B, Hkv * G, 1, D)
    k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :6] = False                                         # row 1: left padding, valid 6..39 (34 tokens)
    empty = torch.full((B, Hkv, K), EMPTY, dtype=torch.int32)
    with sparsity.collect_sparsity() as sp:
        _, idx = _op(q, k, v, valid, torch.ones(Hkv, dtype=torch.bool), empty, 3, 0.25)
        _op(q, k, v, valid, torch.zeros(Hkv, dtype=torch.bool), idx, 3, 0.25)
    assert sparsity.ACTIVE is None and sp.calls == 2 and sp.capacity == K
    # row 0: 10 valid blocks; sink block 0, local tokens 35..39 -> blocks 8, 9; candidates 1..7; keep ceil(2.5) = 3
    # row 1: blocks count from its first valid position (6): block j holds tokens 6 + 4j .. 9 + 4j; 9 blocks (block
    #        8 holds only tokens 38, 39); sink tokens 6..8 -> block 0; local tokens 35..39 -> blocks 7, 8;
    #        candidates 1..6; keep ceil(0.25 * 9) = 3
    assert (idx >= 0).sum(-1).tolist() == [[3, 3], [3, 3]]
    s = sp.summary()
    assert s["kept_blocks"] == dict(n=4, mean=3.0, sd=0.0, min=3.0, max=3.0)
    # attended tokens of a sparse head: sink + local + kept blocks, whole blocks of valid tokens
    att0 = (4 + 8 + 3 * 4) / 40                                  # 24 / 40
    att1 = (4 + 4 + 2 + 3 * 4) / 34                              # 22 / 34
    a = s["attended"]
    assert a["n"] == 4 and math.isclose(a["min"], att0, rel_tol=1e-6) and math.isclose(a["max"], att1, rel_tol=1e-6)
    assert math.isclose(a["mean"], (att0 + att1) / 2, rel_tol=1e-6)


def test_collector_budget_covering_context_attends_everything_and_changes_nothing():
    torch.manual_seed(1)
    B, Hkv, G, T, D = 1, 2, 2, 40, 8
    q, k, v = torch.randn(B, Hkv * G, 1, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    valid = torch.ones(B, T, dtype=torch.bool)
    empty = torch.full((B, Hkv, 16), EMPTY, dtype=torch.int32)   # K = 16 >= 10 blocks: top-k keeps every candidate
    retrieval = torch.tensor([True, False])
    off = _op(q, k, v, valid, torch.ones(Hkv, dtype=torch.bool), empty, 0, 0.0)
    off2 = _op(q, k, v, valid, retrieval, off[1], 0, 0.0, select=torch.tensor([False, False]))
    with sparsity.collect_sparsity() as sp:
        on = _op(q, k, v, valid, torch.ones(Hkv, dtype=torch.bool), empty, 0, 0.0)
        on2 = _op(q, k, v, valid, retrieval, on[1], 0, 0.0, select=torch.tensor([False, False]))
    for a, b in zip(off + off2, on + on2):
        assert torch.equal(a, b)                                 # the collector only reads
    s = sp.summary()
    assert s["attended"] == dict(n=1, mean=1.0, sd=0.0, min=1.0, max=1.0)   # the one sparse head of call 2
    assert s["kept_blocks"]["n"] == 2 and s["kept_blocks"]["mean"] == 7.0   # call 1: blocks 1..7; call 2 selects
    # for nobody (select all False), so its retrieval head is not counted
    with pytest.raises(RuntimeError, match="already active"):
        with sparsity.collect_sparsity(), sparsity.collect_sparsity():
            pass
    assert sparsity.ACTIVE is None


def _items(n_items=2, length=30, targets=(5, 6, 7)):
    torch.manual_seed(1)
    return [tasks.Item(torch.randint(3, 128, (1, length)), list(targets), 40,
                       dict(length=length, depth=0.5, trial=0, seed=i)) for i in range(n_items)]


def test_run_eval_sparsity_on_the_compiled_model(tmp_path):
    """Through the compiled tiny model (eager backend): 30-token prompts, 2 decode steps (valid 31 and 32 tokens),
    block 4, sink 3, local 5. Map: layer 0 all retrieval (read by layer 1), layer 1 all sparse, layer 2 head 0
    sparse / head 1 retrieval (read by nobody). Sparse-head samples per step: 3; counted selections: 2 (layer 0)."""
    base = make("llama")
    specs = [method_spec("dense", base, 8),
             method_spec("lychee", base, 64, _given(base), **CFG),                        # K = 16: every candidate
             method_spec("lychee-ratio", base, 32, _given(base), policy_params={**POLICY_DEFAULTS, "ratio": 0.5},
                         **CFG)]                                                            # K = 8
    res = run_eval(base, None, _items(), specs, progress=False, task="passkey")
    summ = {r["label"]: r for r in summarize(res)}
    assert summ["dense"]["sparsity"] is None
    # budget covering the context: every sparse head attends every valid token; both steps: blocks 0..7, sink block
    # 0 and local blocks 6, 7 -> candidates 1..5 (all kept)
    full = summ["lychee@64"]["sparsity"]
    assert full["attended"]["mean"] == full["attended"]["min"] == 1.0 and full["kept_blocks"]["mean"] == 5.0
    assert full["attended"]["samples"] == 2 * 2 * 3 and full["kept_blocks"]["samples"] == 2 * 2 * 2
    # ratio 0.5: ceil(0.5 * 8 valid blocks) = 4 of the 5 candidates; attended = sink block (4) + local blocks 6, 7
    # (7 valid tokens at 31, 8 at 32) + 4 full blocks (16)
    r = summ["lychee-ratio=0.5@32"]["sparsity"]
    assert r["kept_blocks"] == dict(mean=4.0, sd_prompts=0.0, min=4.0, max=4.0, samples=8) and r["capacity"] == 8
    assert math.isclose(r["attended"]["mean"], (27 / 31 + 28 / 32) / 2, rel_tol=1e-6)
    assert math.isclose(r["attended"]["min"], 27 / 31, rel_tol=1e-6)
    # per-record numbers in the JSON, the variant in the tables
    rec = next(x for x in res["records"] if x["label"] == "lychee-ratio=0.5@32")
    assert rec["sparsity"]["calls"] == 2 * 3
    md = markdown_table(list(summ.values()), "passkey")
    assert "| lychee-ratio=0.5 | 32 |" in md and "| lychee-ratio=0.5 | 32 (8) | 2 |" in md and "| 4.00 (0.00) [4, 4] |" in md
    paths = write_outputs(res, list(summ.values()), str(tmp_path), heatmaps=False)   # no matplotlib needed
    assert "lychee-ratio=0.5" in open(paths["json"]).read()


def test_collector_does_not_change_scores_and_refuses_a_miscount():
    base = make("llama")
    ids = _items(1)[0].input_ids
    v = Variant.build(base, method_spec("lychee-topp", base, 8, _given(base), policy_params={**POLICY_DEFAULTS,
                                                                                             "topp": 0.6}, **CFG))
    pre = dense_prefill(base, ids, 40)
    with_collector = v.score(pre, [5, 6, 7, 8])
    assert with_collector.sparsity["calls"] == 3 * 3
    assert sparsity.ACTIVE is None
    plain = score_steps(v.sequence_call(), pre, [5, 6, 7, 8])      # the collector off
    assert plain.logprobs == with_collector.logprobs and plain.sparsity is None
    with pytest.raises(SparsityNotMeasured, match="expected 9"):
        v._check_measured(0, 3)


def test_no_report_leaves_sparsity_unmeasured(monkeypatch):
    # a lowering that never runs the reference op (Triton on bf16 CUDA) reports nothing: the variant still scores,
    # with sparsity None (the tables leave it out), instead of failing the whole evaluation
    import contextlib

    import lychee_compile.eval.scoring as scoring

    class Silent:
        calls = 0

        def summary(self):
            raise AssertionError("nothing was measured: no summary may be taken")

    monkeypatch.setattr(scoring, "collect_sparsity", lambda: contextlib.nullcontext(Silent()))
    base = make("llama")
    ids = _items(1)[0].input_ids
    v = Variant.build(base, method_spec("lychee", base, 8, _given(base), **CFG))
    scores = v.score(dense_prefill(base, ids, 40), [5, 6, 7, 8])
    assert scores.sparsity is None and len(scores.logprobs) == 4
