"""benchmarks/real_gpu.py stage `evolve` (cache evolution): its options, the heat / Quest-sparse variants it builds,
and its paired aggregations on synthetic records. No real model, fast."""
from __future__ import annotations

import math

import pytest

from tests.harness import import_benchmarks
from tests.models import make
from tests.test_eval_harness import _given

pytestmark = pytest.mark.single_stack   # no torch / transformers / triton version changes it: stack A only in CI


@pytest.fixture(scope="module")
def bench():
    """(real_gpu, real_gpu_stages.evolve), imported the way the script imports them (benchmarks/ on sys.path)."""
    return import_benchmarks("real_gpu", "real_gpu_stages.evolve")


def _parse(real_gpu, *extra):
    return real_gpu.parse(["--stages", "evolve", "--out", "x.json", *extra])


def test_new_options_parse_and_default_to_todays_run(bench):
    real_gpu, _ = bench
    args = _parse(real_gpu)
    assert (args.quest_blocks, args.rectify_prompts, args.evolve_parts) == (8, 1, "heat,rectify")
    args = _parse(real_gpu, "--quest-blocks", "4", "--rectify-prompts", "6", "--evolve-parts", "rectify")
    assert (args.quest_blocks, args.rectify_prompts, args.evolve_parts) == (4, 6, "rectify")
    for bad in (["--rectify-prompts", "0"], ["--quest-blocks", "-1"], ["--rectify-every", "0"],
                ["--evolve-parts", "heat,rectfy"]):
        with pytest.raises(SystemExit):
            _parse(real_gpu, *bad)


def test_heat_part_builds_heat_and_quest_sparse_rows(bench):
    real_gpu, evolve = bench
    model = make("llama")
    args = _parse(real_gpu, "--evolve-budgets", "128", "--heat-blocks", "2", "--quest-blocks", "3")
    specs = evolve._heat_specs(args, model, _given(model))
    assert [s.label for s in specs] == ["dense", "lychee@128", "lychee+heat2@128", "lychee+qs3@128"]
    lychee, heat, qs = (s.config for s in specs[1:])
    assert (heat.heat_blocks, heat.quest) == (2, "off") and (qs.heat_blocks, qs.quest, qs.quest_blocks) == (0, "sparse", 3)
    assert heat.budget == qs.budget == lychee.budget and specs[3].head_map is specs[1].head_map
    args = _parse(real_gpu, "--evolve-budgets", "128", "--quest-blocks", "0")
    assert [s.label for s in evolve._heat_specs(args, model, _given(model))][-1] == "lychee+heat8@128"


def test_vs_lychee_pairs_each_feature_row_with_lychee_at_its_budget(bench):
    _, evolve = bench
    variants = [dict(label=lbl, method=m, budget=b) for lbl, m, b in
                (("dense", "dense", None), ("lychee@256", "lychee", 256), ("lychee@512", "lychee", 512),
                 ("lychee+heat8@256", "lychee+heat8", 256))]
    nll = {"dense": 0.5, "lychee@256": 1.0, "lychee@512": 0.7, "lychee+heat8@256": 0.9}
    # the heat row's prompts are 0.1 nat better than lychee@256's on every prompt (prompt difficulty varies)
    records = [dict(item=i, label=lbl, nll=v + 0.05 * i, all_hit=False, hit_rate=0.5) for i in range(4)
               for lbl, v in nll.items()]
    rows = evolve.vs_lychee(dict(variants=variants, records=records))
    assert [(r["label"], r["reference"], r["n"]) for r in rows] == [("lychee+heat8@256", "lychee@256", 4)]
    assert rows[0]["ppl_ratio"] == pytest.approx(math.exp(-0.1))
    assert rows[0]["ppl_ratio_ci"] == pytest.approx((math.exp(-0.1),) * 2)


def test_controls_add_plain_lychee_rows_and_are_checked(bench):
    real_gpu, evolve = bench
    model = make("llama")
    args = _parse(real_gpu, "--evolve-budgets", "128", "--evolve-controls", "160", "--heat-blocks", "2",
                  "--quest-blocks", "2")
    specs = evolve._heat_specs(args, model, _given(model))
    assert [s.label for s in specs] == ["dense", "lychee@128", "lychee@160", "lychee+heat2@128", "lychee+qs2@128"]
    assert (specs[2].config.budget, specs[2].config.heat_blocks, specs[2].config.quest) == (160, 0, "off")
    assert evolve._extra_tokens(args, specs) == {"lychee+heat2": 32, "lychee+qs2": 32}
    for bad in (["--evolve-controls", "128"], ["--evolve-controls", "0"]):   # a budget twice, or a nonsense one
        with pytest.raises(SystemExit):
            _parse(real_gpu, "--evolve-budgets", "128", *bad)


def test_vs_lychee_adds_the_equal_attended_control_where_it_ran(bench):
    _, evolve = bench
    variants = [dict(label=lbl, method=m, budget=b) for lbl, m, b in
                (("lychee@256", "lychee", 256), ("lychee@384", "lychee", 384),
                 ("lychee+heat8@256", "lychee+heat8", 256), ("lychee+qs8@256", "lychee+qs4", 256))]
    nll = {"lychee@256": 1.0, "lychee@384": 0.8, "lychee+heat8@256": 0.9, "lychee+qs8@256": 0.95}
    records = [dict(item=i, label=lbl, nll=v + 0.05 * i, all_hit=False, hit_rate=0.5) for i in range(3)
               for lbl, v in nll.items()]
    # qs4's 64 extra tokens would need lychee@320, which did not run: only its same-budget row
    rows = evolve.vs_lychee(dict(variants=variants, records=records), {"lychee+heat8": 128, "lychee+qs4": 64})
    assert [(r["label"], r["reference"], r["comparison"]) for r in rows] == [
        ("lychee+heat8@256", "lychee@256", "same budget"), ("lychee+heat8@256", "lychee@384", "equal attended"),
        ("lychee+qs8@256", "lychee@256", "same budget")]
    assert rows[1]["ppl_ratio"] == pytest.approx(math.exp(0.1))     # heat loses to the control by 0.1 nat


def test_vs_lychee_plot_is_written(bench, tmp_path):
    _, evolve = bench
    row = dict(label="lychee+heat8@256", reference="lychee@256", comparison="same budget", n=4, ppl_ratio=0.95,
               ppl_ratio_ci=(0.9, 0.99))
    path = tmp_path / "evolve.png"
    unpaired = dict(row, n=0, ppl_ratio=None, ppl_ratio_ci=None)      # a time box before any paired prompt
    evolve.plot_vs_lychee({"heat_repeat2k": [row, dict(row, reference="lychee@384", comparison="equal attended")],
                           "heat_ppl2k": [row, unpaired]}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def _rect(agreement, nll, prefix=10):
    return dict(teacher_forced_agreement=agreement, teacher_forced_nll=nll, free_run_equal_prefix=prefix,
                free_run_equal_total=2 * prefix)


def test_rectify_aggregate_identical_variants_give_no_difference(bench):
    _, evolve = bench
    records = [dict(index=i, off=_rect(0.9 + 0.01 * i, 0.1 * i), on=_rect(0.9 + 0.01 * i, 0.1 * i)) for i in range(5)]
    agg = evolve.rectify_aggregate(records, "off", "on")
    p = agg["paired"]
    assert agg["prompts"] == 5
    assert p["agreement_diff_points"] == 0 and tuple(p["agreement_diff_ci"]) == (0, 0)
    assert p["teacher_forced_ppl_ratio"] == 1 and tuple(p["teacher_forced_ppl_ratio_ci"]) == (1, 1)
    assert agg["variants"]["on"] == agg["variants"]["off"]


def test_rectify_aggregate_finds_a_known_shift_and_skips_unfinished_prompts(bench):
    _, evolve = bench
    off = [_rect(0.99 - 0.02 * i, 0.1 + 0.05 * i) for i in range(6)]
    # rectified: NLL + 0.2 on every prompt; agreement 1.5 points lower, except on prompt 0 (1.0 lower)
    on = [_rect(a["teacher_forced_agreement"] - 0.015 + (0.005 if i == 0 else 0), a["teacher_forced_nll"] + 0.2)
          for i, a in enumerate(off)]
    records = [dict(index=i, off=o, on=n) for i, (o, n) in enumerate(zip(off, on))]
    records.append(dict(index=6, off=_rect(0.0, 9.0)))          # the time box stopped it before `on`
    agg = evolve.rectify_aggregate(records, "off", "on")
    p = agg["paired"]
    assert agg["prompts"] == 6
    assert p["agreement_diff_points"] == pytest.approx(-1.5 + 0.5 / 6)
    lo, hi = p["agreement_diff_ci"]
    assert -1.5 - 1e-9 <= lo <= p["agreement_diff_points"] <= hi <= -1.0 + 1e-9
    assert p["teacher_forced_ppl_ratio"] == pytest.approx(math.exp(0.2))
    assert p["teacher_forced_ppl_ratio_ci"] == pytest.approx((math.exp(0.2),) * 2)
    assert agg["variants"]["off"]["teacher_forced_ppl"] == pytest.approx(math.exp(0.1 + 0.05 * 2.5))
    assert agg["variants"]["off"]["teacher_forced_agreement"] == pytest.approx(0.99 - 0.02 * 2.5)


def test_rectify_batch_option_parses_and_is_checked(bench):
    real_gpu, _ = bench
    assert _parse(real_gpu).rectify_batch == 1 and _parse(real_gpu, "--rectify-batch", "8").rectify_batch == 8
    with pytest.raises(SystemExit):
        _parse(real_gpu, "--rectify-batch", "0")


class _Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_batched_rectify_prompts_equal_them_one_by_one(bench):
    """_rect_batch (prompts decoded together) gives each prompt the record _rect_prompt gives it alone, and the
    rectified variant re-encodes in both its generate() call and its teacher-forced scoring."""
    import torch

    from lychee_compile import HeadMap
    from lychee_compile.eval.methods import method_spec
    from lychee_compile.eval.scoring import Variant
    from lychee_compile.eval.tasks import Item
    from real_gpu_stages.quality import renamed
    _, evolve = bench
    torch.manual_seed(0)
    model = make("llama")
    retrieval = torch.zeros(3, 2, dtype=torch.bool)
    retrieval[0] = True
    spec = method_spec("lychee", model, 16, HeadMap(retrieval).with_model_metadata(model), block_size=4,
                       sink_tokens=4, local_tokens=4)
    variants = {f"r{e}": Variant.build(model, renamed(spec, f"lychee-rect{e}", rectify_every=e)) for e in (0, 4)}
    items = [Item(torch.randint(3, 120, (1, 40)), [], 0, dict(start=s)) for s in (0, 1)]
    n_new = 10
    batched = evolve._rect_batch(0, items, model, model, variants, _Tok(), n_new, "cpu")
    alone = [evolve._rect_prompt(i, it, model, model, variants, _Tok(), n_new, "cpu") for i, it in enumerate(items)]
    for b, a in zip(batched, alone):
        assert b["index"] == a["index"] and b["batch"] == 2
        for key in variants:
            for f in ("teacher_forced_agreement", "free_run_equal_prefix", "free_run_equal_total"):
                assert b[key][f] == a[key][f], (key, f)
            assert b[key]["teacher_forced_nll"] == pytest.approx(a[key]["teacher_forced_nll"], abs=1e-4)
        assert b["r0"]["rectify_passes_generate"] == b["r0"]["rectify_passes_teacher_forced"] == 0
        assert b["r4"]["rectify_passes_generate"] == b["r4"]["rectify_passes_teacher_forced"] == (n_new - 1) // 4


def test_rectify_resume_keeps_records_made_with_the_same_settings(bench, tmp_path):
    import json
    evolve = bench[1]
    out = dict(dtype="bfloat16", backend="inductor", prompt_tokens=2048, new_tokens=1024, budget=256, every=32,
               prompt_starts=[5, 9, 13], batch=1, records=[])
    path = tmp_path / "rect.json"
    rec = {"index": 0, "start": 5}
    path.write_text(json.dumps({"stages": {"evolve": {"head_map": "/a/m.safetensors",
                                                      "rectify": dict(out, records=[rec])}}}))
    assert evolve.resumed_records(str(path), out, "/b/m.safetensors") == [rec]
    for key, other in (("prompt_starts", [5, 9, 14]), ("every", 16), ("batch", 8)):
        with pytest.raises(SystemExit, match=f"{key} differ"):
            evolve.resumed_records(str(path), dict(out, **{key: other}), "/b/m.safetensors")
    with pytest.raises(SystemExit, match="head_map differ"):
        evolve.resumed_records(str(path), out, "/a/other.safetensors")
    path.write_text(json.dumps({"stages": {"evolve": {"head_map": "/a/m.safetensors",
                                                      "rectify": dict(out, records=[dict(rec, index=1)])}}}))
    with pytest.raises(SystemExit, match="not the first prompts"):
        evolve.resumed_records(str(path), out, "/a/m.safetensors")
