"""Evaluation numerics (lychee_compile/eval/numerics.py) on the CPU: the kernels numerics is refused without CUDA before
any work, `both`'s paired rows and summary (emulated by two fp32 eager numerics, whose difference must be exactly 0),
the kernel-path check refusing a number whose sites ran the reference, and the kept cache tensors the variants decode
in. The real `both` run on the GPU is tests/test_eval_numerics_gpu.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lychee_compile.errors import KernelsNotRun, NumericsUnavailable
from lychee_compile.eval import numerics as nm
from lychee_compile.eval.methods import method_spec
from lychee_compile.eval.runner import SPARSITY_NOTE, markdown_table, run_eval, summarize
from lychee_compile.eval.scoring import Variant, dense_prefill
from lychee_compile.eval.scratch_cache import CacheScratch, working_copy
from lychee_compile.eval.tasks import Item
from lychee_compile.passes.context import Counters
from tests.harness import import_benchmarks
from tests.models import make
from tests.test_eval_harness import CFG, _given

# Test-only: a second numerics that is the reference again (fp32, the specs' eager backend), under the kernels name,
# so a CPU run has the shape of `both` and every kernels-minus-reference difference must be exactly 0.
TWIN = nm.Numerics("kernels", torch.float32, None, None, False, False)


def _items(n=3, length=30, targets=(5, 6, 7, 9)):
    torch.manual_seed(1)
    return [Item(torch.randint(3, 128, (1, length)), list(targets), 40, dict(length=length, depth=0.5, trial=0, seed=i))
            for i in range(n)]


def _specs(base):
    return [method_spec("dense", base, 8), method_spec("lychee", base, 8, _given(base), **CFG)]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_kernels_refused_without_cuda_before_any_work(no_cuda, monkeypatch, capsys, tmp_path):
    with pytest.raises(NumericsUnavailable, match="CUDA GPU"):
        nm.KERNELS.require()
    nm.REFERENCE.require()                                       # the reference runs anywhere
    assert nm.parse_numerics("both") == (nm.REFERENCE, nm.KERNELS)
    # run_eval refuses before it builds, prefills or reads anything (no model, no items needed)
    with pytest.raises(NumericsUnavailable):
        run_eval(None, None, [object()], [object()], progress=False, numerics=nm.parse_numerics("both"))

    def never(*a, **k):
        raise AssertionError("the model was loaded before the refusal")
    import lychee_compile.calibrate.cli as calibrate_cli
    import lychee_compile.eval.models as models
    monkeypatch.setattr(models, "load_eval_model", never)
    monkeypatch.setattr(calibrate_cli, "load_model", never)
    from lychee_compile.cli import build_parser
    for argv in (["eval", "--task", "passkey", "--numerics", "kernels", "--out", str(tmp_path)],
                 ["eval", "--task", "repeat", "--numerics", "both", "--out", str(tmp_path)],
                 ["calibrate", "--numerics", "kernels", "--out", str(tmp_path)]):
        args = build_parser().parse_args(argv)
        assert args.func(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: numerics 'kernels'") and "\n" not in err
    from lychee_compile.calibrate import calibrate
    with pytest.raises(NumericsUnavailable):
        calibrate(None, None, "kl=0.01nat", str(tmp_path / "c"), numerics="kernels")
    assert not (tmp_path / "c").exists()
    (real_gpu,) = import_benchmarks("real_gpu")                  # the GPU quality stage's option, refused at parse
    with pytest.raises(SystemExit):
        real_gpu.parse(["--stages", "eval", "--out", "x.json", "--eval-numerics", "both"])
    assert "numerics 'kernels'" in capsys.readouterr().err
    assert real_gpu.parse(["--stages", "eval", "--out", "x.json", "--eval-numerics", "reference"]).eval_numerics \
        == "reference"


def test_both_pairs_every_variant_and_differences_within_numerics():
    """Two numerics (the reference and its fp32 twin): each variant twice, labels tagged, each numerics' paired
    difference to its own dense row, and the twin minus the reference exactly 0 on every row."""
    base = make("llama")
    items = _items()
    res = run_eval(base, None, items, _specs(base), progress=False, task="passkey",
                   numerics=(nm.REFERENCE, TWIN))
    labels = ["dense[reference]", "lychee@8[reference]", "dense[kernels]", "lychee@8[kernels]"]
    assert [v["label"] for v in res["variants"]] == labels
    assert [r["label"] for r in res["records"][:4]] == labels      # prompt-major: every variant of prompt 0 first
    assert [r["numerics"] for r in res["records"][:4]] == ["reference", "reference", "kernels", "kernels"]
    rows = {r["label"]: r for r in summarize(res)}
    ref, twin = rows["lychee@8[reference]"], rows["lychee@8[kernels]"]
    assert ref["n"] == twin["n"] == 3 and ref["sparsity"] is not None
    # within one numerics: lychee vs that numerics' dense (same numbers under both, as the twin is the reference)
    for key in ("acc_diff_vs_ref", "ppl_ratio_vs_ref"):
        assert twin[key] == ref[key]
    assert ref["ppl_ratio_vs_ref"] != 1.0, "lychee@8 differs from dense on these prompts (a real comparison)"
    assert "vs_numerics" not in ref and "acc_diff_vs_ref" not in rows["dense[kernels]"]
    for label in ("dense[kernels]", "lychee@8[kernels]"):
        r = rows[label]
        assert r["vs_numerics"] == "reference"
        assert r["acc_diff_vs_numerics"] == 0.0 and tuple(r["acc_diff_vs_numerics_ci"]) == (0.0, 0.0)
        assert r["ppl_ratio_vs_numerics"] == 1.0 and tuple(r["ppl_ratio_vs_numerics_ci"]) == (1.0, 1.0)
    per_item = {(r["label"], r["item"]): r["nll"] for r in res["records"]}
    assert all(per_item[("lychee@8[kernels]", i)] == per_item[("lychee@8[reference]", i)] for i in range(3))
    assert res["counters"]["lychee@8[kernels]"]["decode_graphs"] == 1   # one decode shape for every step and prompt

    md = markdown_table(summarize(res), "passkey")
    assert "| lychee[kernels] | 8 | 3 |" in md and "| lychee[reference] | 8 | 3 |" in md
    assert "| method | budget | n | reference accuracy % | kernels accuracy % | Δ kernels − reference" in md
    assert f"| lychee | 8 | 3 | {100 * ref['accuracy']:.1f} | {100 * twin['accuracy']:.1f} | +0.0 [+0.0, +0.0] |" in md
    assert SPARSITY_NOTE in md
    ppl_md = markdown_table(summarize(res), "ppl")
    assert f"| lychee | 8 | 3 | {ref['ppl']:.3f} | {twin['ppl']:.3f} | 1.000 [1.000, 1.000] |" in ppl_md

    # One numerics: labels as before numerics existed (dense only: nothing to compile), the reference rows' numbers.
    one = run_eval(base, None, items, _specs(base)[:1], progress=False, task="passkey", numerics=(nm.REFERENCE,))
    assert [v["label"] for v in one["variants"]] == ["dense"] and one["variants"][0]["numerics_tag"] == ""
    plain = summarize(one)[0]
    assert plain["ppl"] == rows["dense[reference]"]["ppl"] and "vs_numerics" not in plain
    assert SPARSITY_NOTE not in markdown_table(summarize(one), "passkey")


def test_kernel_path_check_refuses_reference_sites():
    """A variant promised on the kernels whose sites ran the op's reference (here: the eager backend on the CPU) is
    refused, by check_sparse and through the harness; counters with every site on the kernels pass."""
    base = make("llama")
    items = _items(n=1)
    fake = dataclasses.replace(TWIN, kernels=True)          # checks like the kernels, runs the reference
    with pytest.raises(KernelsNotRun, match=r"lychee@8: numerics 'kernels', but 0 rewritten sites ran the Triton "
                                            r"kernels and 3 the op's eager reference \(.*backend='eager'"):
        run_eval(base, None, items, _specs(base), progress=False, task="passkey", numerics=(fake,))
    nm.KERNELS.check_ran(Counters(sites_on_kernel=3), "x")
    for bad in (Counters(), Counters(sites_on_kernel=2, sites_on_reference=1)):
        with pytest.raises(KernelsNotRun):
            nm.KERNELS.check_ran(bad, "x")


def test_working_copies_keep_their_tensors():
    """Each prompt's copy is a new cache object in the same tensors (a CUDA graph's addresses), holding that prompt's
    K/V; another cache length gets new tensors; the prefill itself is never written."""
    base = make("llama")
    a, b = _items(n=2)
    scratch = CacheScratch()
    pre_a = dense_prefill(base, a.input_ids, 40)
    first = working_copy(pre_a.cache, scratch)
    keys = [layer.keys for layer in first.layers]
    pre_b = dense_prefill(base, b.input_ids, 40)
    second = working_copy(pre_b.cache, scratch)
    assert second is not first and all(l.keys is k for l, k in zip(second.layers, keys))
    assert all(torch.equal(l.keys, p.keys) for l, p in zip(second.layers, pre_b.cache.layers))
    assert getattr(keys[0], "_dynamo_static_input_type", None) == "unguarded"     # still a static address
    other = working_copy(dense_prefill(base, a.input_ids, 48).cache, scratch)
    assert other.layers[0].keys is not keys[0] and other.layers[0].keys.shape[2] == 48
    v = Variant.build(base, method_spec("lychee", base, 8, _given(base), **CFG))
    before = [layer.keys.clone() for layer in pre_a.cache.layers]
    assert v.scratch is Variant.build(base, method_spec("dense", base, 8)).scratch
    v.score(pre_a, a.targets)
    assert all(torch.equal(layer.keys, k) for layer, k in zip(pre_a.cache.layers, before))
