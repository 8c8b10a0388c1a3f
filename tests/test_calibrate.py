"""`lychee calibrate` (lychee_compile/calibrate/) on a tiny random model: search, certification, outputs, resume.

Passkey means nothing on random weights, so the target is KL(dense || lychee) per token on real-text prompts (a
character tokenizer over the shipped haystack). The test asserts what a run must do, not the numbers it finds: at
least one visited point misses, the chosen point reads fewer KV bytes than dense and meets the target on its
held-out prompts, every evaluation went through the rewritten decode graph, and a rerun reuses every finished piece.
The escalation test pins a target between two measured numbers of the tiny model (asserted on the way, so a drift
shows as such): a point that passes the search and fails certification, and the next one that certifies.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from lychee_compile.calibrate import calibrate
from lychee_compile.calibrate.batch_scoring import batch_prefill, batch_steps
from lychee_compile.calibrate.head_scores import top_heads
from lychee_compile.calibrate.kv_bytes import bytes_per_step
from lychee_compile.calibrate.search import cheapest, next_candidate, walk
from lychee_compile.calibrate.target import QualityTarget
from lychee_compile.config import LycheeConfig
from lychee_compile.eval.methods import method_spec
from lychee_compile.eval.scoring import Variant, dense_prefill
from lychee_compile.head_map import HeadMap
from tests.models import make
from tests.test_eval_harness import CFG, CharTokenizer, _given

TINY = dict(lengths=[320], block_size=4, sink_tokens=4, local_tokens=8, budgets=[16, 64], head_counts=[0, 2, 4],
            search_prompts=3, search_margin=0.5, certify_prompts=4, min_prompts=300, score_tokens=6, score_samples=2,
            progress=False, log=lambda s: None)
TARGET = "kl=0.0004nat"     # searched at 2e-4 (margin 0.5): between what 2 and 0 heads beyond layer 0 lose at budget 64


class Tok(CharTokenizer):
    """CharTokenizer that also answers return_tensors="pt" (training/data.py asks for it)."""
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [ord(c) for c in text]
        return type("Enc", (), {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids})()


def test_calibrate_end_to_end_and_resume(tmp_path):
    out = str(tmp_path / "calib")
    model = make("llama")
    r = calibrate(model, Tok(), TARGET, out, **TINY)
    assert r.points_evaluated == len(r.points) >= 2 and r.scorings > 0
    assert any(not p["passes"] for p in r.points), "the frontier should show a failing point"
    best = r.chosen
    assert best is not None and best["passes"] and best["bytes_ratio"] < 1.0
    assert best == cheapest(r.points)
    for p in r.points:     # every searched number came from rewritten decode graphs, one call per decode step
        c = p["counters"]["ppl"]
        assert c["decode_calls"] == TINY["search_prompts"] * (TINY["score_tokens"] - 1)
        assert c["sites_rewritten"] > 0 and c["graphs_left_dense"] == 0
    cert = r.certification
    q = cert["quality"]["kl"]
    assert q["n"] == TINY["certify_prompts"] and q["decode_calls"] == q["n"] * (TINY["score_tokens"] - 1)
    assert q["counters"]["sites_rewritten"] > 0 and q["counters"]["graphs_left_dense"] == 0
    assert q["value"] <= 0.0004, "the chosen point meets the target on its held-out prompts"
    assert r.status == cert["status"] == "unconfirmed"           # 4 held-out prompts < 300
    assert any("< 300" in reason for reason in cert["reasons"])

    hm = HeadMap.load(r.paths["head_map"])                         # the record survives save / load
    assert hm.recommended_budget == best["budget"] and torch.equal(hm.retrieval, r.head_map.retrieval)
    rec = hm.calibration
    assert rec["status"] == "unconfirmed" and rec["target"] == TARGET and rec["context_range"] == [320, 320]
    assert rec["quality"]["kl"]["n"] == 4 and len(rec["quality"]["kl"]["interval"]) == 2
    assert rec["bytes_per_step_vs_dense"] == best["bytes_ratio"] and len(rec["data_digest"]) == 16
    from lychee_compile.calibrate.record import _commit
    assert rec["tool_version"].startswith("lychee_compile")
    assert (", commit " in rec["tool_version"]) == (_commit() is not None)
    import os
    import re
    if os.path.exists(os.path.join(os.path.dirname(os.path.dirname(__file__)), ".git")):   # tests run in a checkout
        assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?", _commit()), _commit()
    assert int(hm.retrieval[1:].sum()) == best["heads"] and hm.retrieval[0].all()
    report = open(r.paths["report"]).read()
    assert "unconfirmed" in report and f"**{best['budget']} tokens**" in report
    assert open(r.paths["frontier"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    again = calibrate(make("llama"), Tok(), TARGET, out, **TINY)   # same folder: everything reused
    assert again.points_evaluated == 0 and again.scorings == 0 and again.certify_scorings == 0
    assert again.points == r.points and again.chosen == best
    assert HeadMap.load(again.paths["head_map"]).calibration["quality"] == rec["quality"]
    log = [json.loads(line) for line in open(r.paths["certify_log"])]
    assert len(log) == 2 and log[1]["quality"]["kl"]["resumed_prompts"] == 4
    assert len(r.attempts) == 1, "too few prompts is no miss: no second attempt"

    with pytest.raises(ValueError, match="other settings"):
        calibrate(make("llama"), Tok(), "kl=0.001nat", out, **TINY)


# 0 heads / budget 64 scores KL 2.39e-4 on the search prompts and 2.63e-4 on held-out seed 66; 2 heads / budget 64
# 1.05e-4 and 1.16e-4 [0.99e-4, 1.26e-4] (measured on the tiny llama): 2.5e-4 lies between.
ESCALATE = dict(TINY, search_margin=0.0, min_prompts=4, certify_seed=66)


def test_failed_certification_escalates_logs_and_resumes(tmp_path, monkeypatch):
    import lychee_compile.calibrate.certify as certify_mod
    batches = []                          # variants decoded per held-out batch: dense + lychee, or lychee alone
    real = certify_mod.score_batches
    monkeypatch.setattr(certify_mod, "score_batches", lambda base, variants, *a, **k:
                        batches.append(len(variants)) or real(base, variants, *a, **k))
    out, target = str(tmp_path / "calib"), "kl=0.00025nat,repeat=1000%"
    capped = calibrate(make("llama"), Tok(), target, out, **dict(ESCALATE, certify_attempts=1))
    (first, c1), = capped.attempts
    assert (first["heads"], first["budget"]) == (0, 64) and first["passes"]
    assert first["quality"]["kl"]["value"] <= 0.00025 < c1["quality"]["kl"]["value"], "numbers drifted"
    assert capped.status == c1["status"] == "failed" and capped.chosen == first
    assert HeadMap.load(capped.paths["head_map"]).calibration["status"] == "failed"
    assert batches == [2] * 8, "the first attempt decodes dense and lychee (4 kl prompts, then 4 repeat, batch 1)"

    batches.clear()
    r = calibrate(make("llama"), Tok(), target, out, **ESCALATE)      # same folder, the cap raised: attempt 2
    assert [(p["heads"], p["budget"], c["status"]) for p, c in r.attempts] == [(0, 64, "failed"), (2, 64, "certified")]
    assert r.attempts[0][1]["scored_now"] == 0 and r.attempts[1][1]["scored_now"] == 8     # attempt 1 resumed
    assert batches == [2] * 4 + [1] * 4, "kl needs the dense distributions again; repeat reuses the dense records"
    assert r.status == "certified" and r.chosen == r.attempts[1][0] and r.certification is r.attempts[1][1]
    rec = HeadMap.load(r.paths["head_map"]).calibration
    assert rec["recommended_budget"] == 64 and rec["retrieval_heads"] == 2
    assert [a["status"] for a in rec["certify_attempts"]] == ["failed", "certified"]
    log = [json.loads(line) for line in open(r.paths["certify_log"])]
    assert [(e["point"]["heads"], e["status"]) for e in log] == [(0, "failed"), (0, "failed"), (2, "certified")]
    report = open(r.paths["report"]).read()
    assert "| 1 | 0 | 64 |" in report and "| 2 | 2 | 64 |" in report and "written for attempt 2" in report

    batches.clear()
    again = calibrate(make("llama"), Tok(), target, out, **ESCALATE)  # everything reused
    assert again.certify_scorings == 0 and batches == [] and again.chosen == r.chosen


def test_next_candidate_skips_points_below_a_rejected_one():
    pts = [dict(heads=n, budget=b, bytes=10 * n + b, passes=ok)
           for n, b, ok in ((4, 1, True), (2, 1, False), (2, 2, True), (1, 2, True), (0, 2, False))]

    def cost(n, b):
        return 10 * n + b
    args = ([0, 1, 2, 4], [1, 2, 3], cost)
    assert next_candidate(pts, [], *args) == (1, 2)                    # = cheapest()
    assert next_candidate(pts, [pts[3]], *args) == (1, 3)              # unsearched, budget up: 13 < 22
    assert next_candidate(pts, [pts[3], dict(heads=1, budget=3)], *args) == (2, 2)
    # (2, 2) rejected too: (4, 1) is not below it; (2, 3) is a neighbour at 23 < 41
    assert next_candidate(pts, [pts[3], dict(heads=1, budget=3), pts[2]], *args) == (2, 3)
    assert next_candidate(pts, [dict(heads=4, budget=3)], *args) is None


def test_walk_follows_the_staircase_and_picks_the_cheapest():
    seen = []

    def evaluate(n, b):               # passes iff n + b >= 4: monotone in both
        seen.append((n, b))
        return dict(heads=n, budget=b, bytes=10 * n + b, passes=n + b >= 4)

    pts = walk([0, 1, 2, 3], [1, 2, 3], evaluate)
    assert seen == [(3, 1), (2, 1), (2, 2), (1, 2), (1, 3), (0, 3)]
    assert (cheapest(pts)["heads"], cheapest(pts)["budget"]) == (1, 3)     # bytes 13 < 22 < 31
    assert cheapest([dict(passes=False)]) is None


def test_a_point_reading_as_many_bytes_as_dense_is_never_chosen():
    # every head retrieval reads dense's bytes: it may pass, but it is no map to certify or write
    from lychee_compile.calibrate.report import render
    from lychee_compile.calibrate.target import QualityTarget
    quality = {"ppl": dict(value=0.5, interval=[0.1, 0.9], n=4)}
    pts = [dict(heads=2, budget=1, bytes=30, bytes_ratio=1.0, passes=True, quality=quality),
           dict(heads=1, budget=1, bytes=20, bytes_ratio=0.67, passes=False, quality=quality),
           dict(heads=1, budget=2, bytes=21, bytes_ratio=0.7, passes=False, quality=quality)]

    def cost(n, b):
        return 10 * n + b
    assert cheapest(pts)["heads"] == 2 and cheapest(pts, dense=30) is None
    assert next_candidate(pts, [], [1, 2], [1, 2], cost) == (2, 1)
    assert next_candidate(pts, [], [1, 2], [1, 2], cost, dense=30) is None
    kw = dict(lengths=[64], search_prompts=2, search_seed=5, scorer="retrieval-score", block_size=16, sink_tokens=4,
              local_tokens=8, search_margin=0.5)
    text = render(None, pts, [], kw, QualityTarget.parse("ppl=2%"), "no point met the target")
    assert "Only points that read as many KV bytes per step as dense" in text and "No visited point" not in text
    assert "No visited point met" in render(None, pts[1:], [], kw, QualityTarget.parse("ppl=2%"), "none")


def test_store_resumes_a_folder_made_under_an_alias_of_a_setting(tmp_path):
    from lychee_compile.calibrate.store import Store
    Store(str(tmp_path), dict(model="legacy", lengths=[8])).put("point/h0-b64", {"passes": True})
    with pytest.raises(ValueError, match="model differ"):
        Store(str(tmp_path), dict(model="current", lengths=[8]))
    store = Store(str(tmp_path), dict(model="current", lengths=[8]), aliases={"model": {"legacy"}})
    assert store.get("point/h0-b64") == {"passes": True}
    with pytest.raises(ValueError, match="lengths differ"):
        Store(str(tmp_path), dict(model="current", lengths=[16]), aliases={"model": {"legacy"}})


def test_default_head_counts_cover_every_count_of_a_small_model():
    from lychee_compile.calibrate.calibration import default_heads
    assert default_heads(2) == [0, 1, 2]                  # Gemma-3-270M: 2 KV heads beyond its first global layer
    assert default_heads(4) == [0, 1, 2, 3, 4]
    assert default_heads(46) == [0, 2, 4, 8, 16, 24, 32, 46]
    assert default_heads(87) == [0, 2, 4, 8, 16, 24, 32, 48]


def test_targets_parse_and_bound():
    t = QualityTarget.parse("passkey=1pt,ppl=2%,kl=0.01nat")
    assert [str(m) for m in t.metrics] == ["passkey=1pt", "ppl=2%", "kl=0.01nat"]
    assert t.tasks == ["passkey", "ppl"] and t.needs_kl("ppl") and not t.needs_kl("passkey")
    pk, ppl = t.metrics[0], t.metrics[1]
    row = dict(acc_diff_vs_ref=-0.005, acc_diff_ci=(-0.02, 0.0))
    assert pk.meets(row) and not pk.meets(row, interval=True) and not pk.meets(row, margin=0.6)
    assert ppl.meets(dict(ppl_ratio_vs_ref=1.009), margin=0.5)
    assert not ppl.meets(dict(ppl_ratio_vs_ref=1.011), margin=0.5)
    for bad in ("passkey=1%", "ppl=2", "foo=1pt", "ppl=2%,ppl=3%", "", "kl=-1nat"):
        with pytest.raises(ValueError):
            QualityTarget.parse(bad)


def test_kv_bytes_model():
    model = make("llama")       # 3 layers x 2 KV heads, head_dim 16, fp32
    cfg = LycheeConfig(budget=16, block_size=4, sink_tokens=4, local_tokens=8)
    per_pos = 2 * 16 * 4
    dense = bytes_per_step(model.config, None, [0, 1, 2], cfg, 320, 4)
    assert dense == 3 * 2 * 320 * per_pos
    eff = torch.zeros(3, 2, dtype=torch.bool)
    eff[0] = True
    assert bytes_per_step(model.config, eff, [0, 1, 2], cfg, 320, 4) == per_pos * (2 * 320 + 4 * (4 + 8 + 16))
    assert bytes_per_step(model.config, eff, [0, 1, 2], cfg, 20, 4) == dense * 20 / 320   # capped at T: dense
    quest = LycheeConfig(budget=16, block_size=4, sink_tokens=4, local_tokens=8, quest="all")
    desc = 6 * (320 // 4) * 2 * 16 * 4                     # every head reads every block's min / max
    assert bytes_per_step(model.config, eff, [0, 1, 2], quest, 320, 4) == per_pos * 6 * 28 + desc
    # streaming heads (Duo / StreamingLLM baselines): sink + local only, nothing selected
    assert bytes_per_step(model.config, eff, [0, 1, 2], cfg, 320, 4, streaming=~eff) == per_pos * (2 * 320 + 4 * 12)
    scores = torch.tensor([[0.0, 0.0], [0.9, 0.1], [0.2, 0.8]])
    assert top_heads(scores, 2, [0, 1, 2]).tolist() == [[True, True], [True, False], [False, True]]
    assert top_heads(scores, 1, [1, 2]).tolist() == [[False, False], [True, True], [False, True]]


def test_batched_scoring_equals_the_harness_on_equal_lengths():
    """batch_steps on a batch of equal-length prompts = eval's Variant.score prompt by prompt (dense and lychee)."""
    base = make("llama")
    torch.manual_seed(0)
    from lychee_compile.eval.tasks import Item
    items = [Item(torch.randint(3, 128, (1, 26)), torch.randint(3, 128, (3,)).tolist(), 40, {}) for _ in range(2)]
    for name in ("dense", "lychee"):
        v = Variant.build(base, method_spec(name, base, 8, _given(base), **CFG))
        one = [v.score(dense_prefill(base, it.input_ids, it.max_cache_len), it.targets) for it in items]
        many = batch_steps(v.sequence_call(), batch_prefill(base, items), [it.targets for it in items])
        for a, b in zip(one, many):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
            assert a.hits == b.hits


def test_cli_registers_calibrate():
    from lychee_compile.cli import build_parser
    args = build_parser().parse_args(["calibrate", "--target", "kl=0.01nat", "--context", "1024,2048",
                                      "--batch-size", "8", "--device", "cuda"])
    assert args.func.__module__ == "lychee_compile.calibrate.cli" and args.batch_size == 8
    default = build_parser().parse_args(["calibrate"])
    assert default.target == "passkey=1pt,ppl=2%" and default.search_margin == 0.5 and default.certify_attempts == 4


def test_sensitivity_scorer_orders_heads_by_what_each_loses_alone_sparse(tmp_path):
    # each later global head's score is the search prompts' mean NLL increase over dense with that head alone sparse
    # at the smallest budget; checked against the eval harness scoring the same prompts with that map, independently,
    # and so is a searched point's perplexity with the map the scores chose (the probes' map must not linger)
    import math

    from lychee_compile.calibrate.prompts import SEARCH_SEED, prompt_set
    out = str(tmp_path / "calib")
    kw = dict(TINY, scorer="sensitivity", certify=False, head_counts=[0, 1, 2])
    r = calibrate(make("llama"), Tok(), "ppl=50%", out, **kw)
    state = json.load(open(tmp_path / "calib" / "state.json"))["pieces"]
    scores = torch.tensor(state["head_scores"]["scores"])                          # [3 layers, 2 KV heads]
    assert scores.shape == (3, 2) and (scores[0] == 0).all() and (scores[1:] != 0).all()
    assert sorted(k for k in state if k.startswith("sensitivity/")) == \
        [f"sensitivity/b16/ppl/{lay}-{h}" for lay in (1, 2) for h in (0, 1)]

    model = make("llama")
    items = prompt_set(Tok(), "ppl", kw["lengths"], kw["search_prompts"], SEARCH_SEED, "persuasion",
                       kw["score_tokens"], True)
    prefills = [dense_prefill(model, it.input_ids, it.max_cache_len) for it in items]
    dense = Variant.build(model, method_spec("dense", model, 1))
    dense_nll = [dense.score(pre, it.targets).nll for pre, it in zip(prefills, items)]

    def mean_loss(retrieval, budget):
        cfg = dict(block_size=4, sink_tokens=4, local_tokens=8, backend="eager")
        v = Variant.build(model, method_spec("lychee", model, budget, HeadMap(retrieval), **cfg))
        return sum(v.score(pre, it.targets).nll - d for pre, it, d in zip(prefills, items, dense_nll)) / len(items)

    layer, head = divmod(int(scores[1:].flatten().argmax()), 2)
    alone = torch.ones(3, 2, dtype=torch.bool)
    alone[layer + 1, head] = False
    assert state[f"sensitivity/b16/ppl/{layer + 1}-{head}"] == pytest.approx(mean_loss(alone, 16), rel=1e-4,
                                                                              abs=1e-7)
    one = top_heads(scores, 1, [0, 1, 2])                 # layer 0 + the head that loses the most alone sparse
    assert int(one[1:].sum()) == 1 and bool(one[layer + 1, head])
    point = next(p for p in r.points if (p["heads"], p["budget"]) == (1, 16))
    want = 100.0 * (math.exp(mean_loss(one, 16)) - 1.0)
    assert point["quality"]["ppl"]["value"] == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert torch.equal(r.head_map.retrieval, top_heads(scores, r.chosen["heads"], [0, 1, 2]))

    again = calibrate(make("llama"), Tok(), "ppl=50%", out, **kw)               # resumed: nothing scored
    assert again.scorings == 0 and again.points == r.points
    del state["head_scores"], state[f"sensitivity/b16/ppl/{layer + 1}-{head}"]  # cut short within the probes
    full = json.load(open(tmp_path / "calib" / "state.json"))
    full["pieces"] = state
    json.dump(full, open(tmp_path / "calib" / "state.json", "w"))
    resumed = calibrate(make("llama"), Tok(), "ppl=50%", out, **kw)
    assert resumed.scorings == kw["search_prompts"], "only the missing probe is scored again (dense is stored)"
    assert torch.equal(torch.tensor(json.load(open(tmp_path / "calib" / "state.json"))["pieces"]["head_scores"]
                                    ["scores"]), scores)


def test_a_requested_point_is_certified_whatever_its_search_verdict(tmp_path):
    out = str(tmp_path / "calib")

    def pieces():
        return json.load(open(tmp_path / "calib" / "state.json"))["pieces"]
    with pytest.raises(ValueError, match="leave at least one sparse"):       # refused before any scoring
        calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify_point=(4, 64)))
    with pytest.raises(ValueError, match="as many KV bytes per step as dense"):   # budget 320 = the whole context
        calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify_point=(1, 320)))
    assert "head_scores" not in pieces() and not any(k.startswith("point/") for k in pieces())
    with pytest.raises(ValueError, match="certification on"):
        calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify_point=(1, 64), certify=False))
    r = calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify_point=(1, 16)))
    point, cert = r.attempts[0]
    assert len(r.attempts) == 1 and (point["heads"], point["budget"]) == (1, 16) and not point["passes"]
    assert [(p["heads"], p["budget"]) for p in r.points].count((1, 16)) == 1 and r.points[-1] is point, \
        "an unvisited requested point is searched once, after the walk (its search numbers are reported)"
    assert cert["requested"] and r.chosen == point and r.status == cert["status"] in ("failed", "unconfirmed")
    rec = HeadMap.load(r.paths["head_map"]).calibration
    assert rec["recommended_budget"] == 16 and rec["retrieval_heads"] == 1 and rec["certify_attempts"][0]["requested"]
    assert rec["requested"] and rec["search_passes"] is False
    assert "Requested by --certify-point" in open(r.paths["report"]).read()
    assert r.certify_scorings == TINY["certify_prompts"], "each held-out prompt scored once (dense and lychee)"

    again = calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify_point=(1, 16)))   # resumed
    assert again.points_evaluated == 0 and again.certify_scorings == 0 and again.points == r.points
    visited = next(p for p in r.points if p["heads"] < 4 and p is not point)      # a point the walk visited
    other = calibrate(make("llama"), Tok(), TARGET, out,
                      **dict(TINY, certify_point=(visited["heads"], visited["budget"])))
    assert other.points_evaluated == 0 and other.points == r.points[:-1] and other.chosen == visited, \
        "a visited requested point is certified as visited: nothing searched again, nothing appended"
    assert HeadMap.load(other.paths["head_map"]).calibration["requested"]


def test_certify_point_argument_parses_heads_at_budget():
    from lychee_compile.calibrate.cli import _point
    assert _point(None) is None and _point("1@2048") == (1, 2048) and _point(" 1 @ 2048") == (1, 2048)
    for bad in ("@", "1@", "@64", "a@b", "1@-5", "\u00b2@2048", "1,2048"):
        with pytest.raises(ValueError, match="HEADS@BUDGET"):
            _point(bad)


def test_a_folder_is_resumed_only_with_the_tokenizer_it_was_made_with(tmp_path):
    """state.json records the tokenizer's fingerprint: prompts made by another splitting of the text are not the
    same prompts. A folder made before the fingerprint was recorded is refused too (its tokenizer is unknown)."""
    class Other(Tok):        # splits alike, another vocabulary: another fingerprint
        def __len__(self):
            return 1000
    out = str(tmp_path / "calib")
    calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify=False))
    with pytest.raises(ValueError, match="tokenizer differ"):
        calibrate(make("llama"), Other(), TARGET, out, **dict(TINY, certify=False))
    with open(os.path.join(out, "state.json")) as f:
        state = json.load(f)
    del state["settings"]["tokenizer"]
    with open(os.path.join(out, "state.json"), "w") as f:
        json.dump(state, f)
    with pytest.raises(ValueError, match="tokenizer differ"):
        calibrate(make("llama"), Tok(), TARGET, out, **dict(TINY, certify=False))
