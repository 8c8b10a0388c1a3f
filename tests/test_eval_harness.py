"""Evaluation harness (lychee_compile/eval/): method -> (HeadMap, LycheeConfig) mapping, task builders, statistics,
and teacher-forced scoring through the compiled decode path on tiny models (fast). The real-model end-to-end check
is tests/test_eval_real.py (slow)."""
from __future__ import annotations

import math

import pytest
import torch

from lychee_compile.eval import methods, ruler, stats, tasks
from lychee_compile.eval.methods import MethodError, method_spec
from lychee_compile.eval.runner import markdown_table, passkey_grid, run_eval, summarize, write_outputs
from lychee_compile.eval.scoring import DenseFallback, Variant, dense_prefill, shared_weight_copy
from lychee_compile.head_map import HeadMap
from tests.harness import generate_logits
from tests.models import make

CFG = dict(block_size=4, sink_tokens=3, local_tokens=5)


def _given(model):
    r = torch.zeros(3, 2, dtype=torch.bool)
    r[0] = True
    r[2, 1] = True
    return HeadMap(r, {"method": "given"}).with_model_metadata(model)


def test_method_mapping_tiny():
    model = make("llama")
    given = _given(model)
    dense = method_spec("dense", model, 8)
    assert dense.head_map is None and dense.config is None

    ly = method_spec("lychee", model, 8, given, **CFG)
    assert torch.equal(ly.head_map.retrieval, given.retrieval) and not ly.head_map.streaming.any()
    assert ly.config.first_layer_retrieval and ly.config.budget == 8 and ly.config.local_tokens == 5

    st = method_spec("streamingllm", model, 8, given, **CFG)
    assert not st.head_map.retrieval.any() and st.head_map.streaming.all()
    assert not st.config.first_layer_retrieval
    # equal budget: a streaming head attends sink + (budget + local) = what a lychee sparse head attends
    assert st.config.local_tokens == 8 + 5 and st.config.sink_tokens == 3 and st.budget == 8 and st.label == "streamingllm@8"

    duo = method_spec("duo", model, 8, given, **CFG)
    assert torch.equal(duo.head_map.retrieval, given.retrieval)
    assert torch.equal(duo.head_map.streaming, ~given.retrieval) and not duo.config.first_layer_retrieval

    rnd = method_spec("random", model, 8, given, seed=3, **CFG)
    assert rnd.head_map.retrieval[0].all()
    assert int(rnd.head_map.retrieval[1:].sum()) == int(given.retrieval[1:].sum()) == 1
    assert rnd.config.first_layer_retrieval
    assert torch.equal(method_spec("random", model, 8, given, seed=3, **CFG).head_map.retrieval,
                       rnd.head_map.retrieval)   # seeded

    td = method_spec("tidal", model, 8, layers=[0, 2], **CFG)
    assert td.head_map.retrieval[[0, 2]].all() and not td.head_map.retrieval[1].any()


def test_tidal_default_layers_and_random_counts():
    assert methods.tidal_layers(32) == [0, 1, 2, 13]
    assert methods.tidal_layers(30) == [0, 1, 2, 12]
    model = make("qwen2_gqa7")
    for count in (0, 1, 3):
        hm = methods.random_map(model, count, seed=1)
        assert int(hm.retrieval[1:].sum()) == count and hm.retrieval[0].all()
    with pytest.raises(MethodError, match="do not fit"):
        methods.random_map(model, 10**6)


def test_unavailable_and_unknown_methods():
    model = make("llama")
    q = method_spec("quest", model, 8, **CFG)
    assert q.config.quest == "all" and q.config.budget == 8 and q.config.local_tokens == 5
    with pytest.raises(MethodError, match="unknown method"):
        method_spec("h2o", model, 8)


def test_default_head_map_is_placeholder_or_learned():
    model = make("llama")   # 3 layers: placeholder layers {0, 1} | {1} (the shipped learned map is SmolLM2-shaped)
    hm, where = methods.default_head_map(model)
    assert hm.shape == (3, 2) and "PLACEHOLDER" in where and hm.retrieval[[0, 1]].all()


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"])
def test_default_head_map_is_the_certified_shipped_map_made_for_the_models_config(name, monkeypatch):
    from lychee_compile import head_map as head_map_module
    from lychee_compile.training import load_shipped_map
    shipped = load_shipped_map(name)
    assert shipped.metadata["calibration_status"] == "certified" and shipped.recommended_budget
    model = make("llama")                       # stands in for the model: only its config's fingerprint is read
    monkeypatch.setattr(head_map_module, "config_fingerprint",
                        lambda config: shipped.metadata["config_fingerprint"])
    hm, where = methods.default_head_map(model)
    assert f"shipped map {name}.safetensors" in where
    assert torch.equal(hm.retrieval, shipped.retrieval) and hm.recommended_budget == shipped.recommended_budget
    monkeypatch.setattr(head_map_module, "config_fingerprint", lambda config: "another model")
    _, where = methods.default_head_map(model)
    assert "PLACEHOLDER" in where and "another config fingerprint" not in where    # no shipped map is 3 x 2
    monkeypatch.setattr(methods, "model_geometry", lambda config: shipped.shape)
    _, where = methods.default_head_map(model)
    assert f"{name}.safetensors has this shape but another config fingerprint" in where


def test_shared_weight_copy_shares_tensors():
    model = make("llama")
    copy_ = shared_weight_copy(model)
    assert copy_ is not model
    for a, b in zip(model.parameters(), copy_.parameters()):
        assert a is b


@pytest.mark.parametrize("name", ["dense", "lychee", "streamingllm", "duo", "quest"])
def test_teacher_forced_scores_equal_generate(name):
    """Variant.score through the compiled callable = the logits of model.generate on the same compiled model."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 26))
    ids[0, 0] = 1
    steps = 5
    # Reference: a separately built model of the same method, through plain generate().
    ref_model = make("llama")
    spec_ref = method_spec(name, ref_model, 8, _given(ref_model), **CFG)
    if spec_ref.config is not None:
        from lychee_compile import lychee_compile
        lychee_compile(ref_model, spec_ref.head_map, spec_ref.config)
    seq, logits = generate_logits(ref_model, ids, torch.ones_like(ids), steps)
    targets = seq[0, ids.shape[1]:].tolist()

    base = make("llama")
    v = Variant.build(base, method_spec(name, base, 8, _given(base), **CFG))
    pre = dense_prefill(base, ids, max_cache_len=ids.shape[1] + steps + 3)
    s = v.score(pre, targets)
    assert s.all_hit
    want = torch.log_softmax(logits[:, 0].float(), -1)[torch.arange(steps), torch.tensor(targets)]
    assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4), (s.logprobs, want)
    if name != "dense":
        c = v.counters()
        assert c.sites_rewritten > 0 and c.graphs_left_dense == 0
    # The prefill cache is not modified by scoring (each variant scores a copy).
    again = v.score(pre, targets)
    assert again.logprobs == s.logprobs


def test_check_sparse_refuses_unused_variant():
    base = make("llama")
    v = Variant.build(base, method_spec("lychee", base, 8, _given(base), **CFG))
    with pytest.raises(DenseFallback, match="did not run"):
        v.check_sparse()   # nothing compiled yet: no number may be reported from it


class CharTokenizer:
    """Tokenizer stand-in for the task builders: one token per character."""
    chat_template = None

    def __len__(self):       # every code point is an id
        return 0x110000

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [ord(c) for c in text]})()

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def test_passkey_items():
    tok = CharTokenizer()
    items = tasks.passkey_items(tok, lengths=(1500,), depths=(0.2, 0.8), trials=2)
    assert len(items) == 4
    seeds = {it.meta["seed"] for it in items}
    assert len(seeds) == 4 and max(seeds) < 10000
    for it in items:
        text = tok.decode(it.input_ids[0].tolist())
        assert text.endswith(tasks.ANSWER_PREFIX)
        assert tok.decode(it.targets) == " " + it.meta["passkey"]
        assert f"The pass key is {it.meta['passkey']}." in text
        assert abs(it.input_ids.shape[1] - 1500) < 40
        assert it.max_cache_len >= it.input_ids.shape[1] + len(it.targets) and it.max_cache_len % 64 == 0
    again = tasks.passkey_items(tok, lengths=(1500,), depths=(0.2, 0.8), trials=2)
    assert [a.meta for a in again] == [a.meta for a in items]


def test_repeat_and_text_items():
    tok = CharTokenizer()
    rep = tasks.repeat_items(tok, length=300, n=3, score_tokens=20, seed=1)
    for it in rep:
        ids = it.input_ids[0].tolist()
        seg = ids[:300]
        assert len(ids) == 450 and ids[300:] == seg[:150] and it.targets == seg[150:170]
    first = tasks.repeat_items(tok, length=300, n=1, score_tokens=20, score_offset=0)[0]
    assert first.input_ids.shape[1] == 300 and first.targets == first.input_ids[0, :20].tolist()
    txt = tasks.text_items(tok, length=300, n=2, score_tokens=20)
    for it in txt:
        assert len(it.targets) == 20 and it.input_ids.shape[1] == 300
    with pytest.raises(ValueError):
        tasks.repeat_items(tok, length=10, score_tokens=6)


def test_stats():
    lo, hi = stats.wilson(10, 10)
    assert hi == 1.0 and 0.69 < lo < 0.73           # Wilson 95% for 10/10: [0.722, 1]
    lo, hi = stats.wilson(50, 100)
    assert 0.40 < lo < 0.41 and 0.59 < hi < 0.60
    lo, hi = stats.bootstrap([1.0] * 10, stats.mean)
    assert lo == hi == 1.0
    assert math.isclose(stats.ppl_of([0.0, 2 * math.log(2)]), 2.0)


def test_run_eval_summary_and_outputs_tiny(tmp_path):
    """run_eval end to end on a tiny model with passkey-shaped items; summary, Markdown and heatmap written."""
    base = make("llama")
    torch.manual_seed(1)
    items = []
    for i, depth in enumerate((0.1, 0.9)):
        ids = torch.randint(3, 128, (1, 30))
        items.append(tasks.Item(ids, [5, 6, 7], 40, dict(length=30, depth=depth, trial=0, seed=i)))
    specs = [method_spec("dense", base, 8), method_spec("lychee", base, 8, _given(base), **CFG),
             method_spec("streamingllm", base, 8, **CFG)]
    res = run_eval(base, None, items, specs, progress=False, task="passkey")
    assert len(res["records"]) == 6 and set(res["counters"]) == {"lychee@8", "streamingllm@8"}
    assert all(c["sites_rewritten"] > 0 for c in res["counters"].values())
    summ = summarize(res)
    assert [r["label"] for r in summ] == ["dense", "lychee@8", "streamingllm@8"]
    assert "acc_diff_vs_ref" in summ[1] and "acc_diff_vs_ref" not in summ[0]
    lengths, depths, acc, cnt = passkey_grid(res, "dense")
    assert lengths == [30] and depths == [0.1, 0.9] and cnt == [[1, 1]]
    paths = write_outputs(res, summ, str(tmp_path))
    assert len(paths["png"]) == 3 and "| lychee | 8 | 2 |" in open(paths["md"]).read()
    assert "perplexity" in markdown_table(summ, "repeat")


@pytest.mark.parametrize("name", sorted(ruler.RULER_TASKS))
def test_ruler_items(name):
    tok = CharTokenizer()
    small = dict(common=3, common_freq=6) if name == "cwe" else {}     # 1200 characters hold few list lines
    items = ruler.RULER_TASKS[name](tok, 1200, n=2, **small)
    assert len(items) == 2
    for it in items:
        text = tok.decode(it.input_ids[0].tolist())
        answer = tok.decode(it.targets)
        short = 30 if name == "cwe" else 12      # cwe grows its list by whole entries: it may stop short of 1200
        assert -short <= it.input_ids.shape[1] - 1200 <= 12
        assert text.endswith(" are:") or text.endswith(" is:")
        assert it.max_cache_len >= it.input_ids.shape[1] + len(it.targets)
        if name == "multikey":
            assert answer == " " + it.meta["answer"]
            assert f"for {it.meta['key']} is: {it.meta['answer']}." in text and text.count("special magic number") >= 4
        elif name == "cwe":
            words = it.meta["answer"]
            assert answer == " " + ", ".join(words) and "most common words" in text
            listed = [line.split(". ", 1)[1] for line in text.split("\n") if line[:1].isdigit() and ". " in line]
            counts = {w: listed.count(w) for w in set(listed)}
            assert all(counts[w] == it.meta["common_freq"] for w in words)
            assert max(c for w, c in counts.items() if w not in words) == it.meta["rare_freq"]
            assert [listed.index(w) for w in words] == sorted(listed.index(w) for w in words)
        elif name == "multivalue":
            assert answer == " " + ", ".join(it.meta["answer"])
            positions = [text.index(f"is: {v}.") for v in it.meta["answer"]]
            assert positions == sorted(positions)          # target order = document order
        else:
            names = it.meta["answer"]
            assert answer == " " + ", ".join(names) and f"VAR {names[0]} = {it.meta['value']}." in text
            chain = [text.index(f"VAR {names[j + 1]} = VAR {names[j]}.") for j in range(len(names) - 1)]
            assert chain == sorted(chain) and text.index(f"VAR {names[0]} =") < chain[0]
    assert [i.meta for i in ruler.RULER_TASKS[name](tok, 1200, n=2, **small)] == [i.meta for i in items]  # seeded


def test_plot_budget_sweep(tmp_path):
    from lychee_compile.eval.runner import plot_budget_sweep
    rows = [dict(method="dense", budget=None, n=4, accuracy=1.0, accuracy_ci=(0.5, 1.0), ppl=1.2, ppl_ci=(1.1, 1.3))]
    for m in ("lychee", "duo"):
        for b in (256, 512):
            rows.append(dict(method=m, budget=b, n=4, accuracy=0.5, accuracy_ci=(0.1, 0.9), ppl=2.0, ppl_ci=(1.5, 3.0)))
    for task in ("passkey", "repeat"):
        plot_budget_sweep([rows], str(tmp_path / f"{task}.png"), task)
        assert (tmp_path / f"{task}.png").stat().st_size > 1000


@pytest.mark.parametrize("extra", [dict(heat_blocks=2, heat_decay=0.5), dict(rectify_every=3)])
def test_per_sequence_state_is_reset_between_scores(extra):
    """Heat and rectification keep state across decode steps; generate() resets it at each prefill, which the
    harness runs on the base model, so Variant must reset it itself: scoring the same prompt twice (with another
    prompt in between) gives the same numbers, and they equal generate() on a model with the same config."""
    import dataclasses
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 40))
    other = torch.randint(3, 128, (1, 40))
    steps = 8            # 7 decode steps: rectify_every=3 leaves one token pending at the end
    ref_model = make("llama")
    spec_ref = method_spec("lychee", ref_model, 8, _given(ref_model), **CFG)
    from lychee_compile import lychee_compile
    lychee_compile(ref_model, spec_ref.head_map, dataclasses.replace(spec_ref.config, **extra))
    seq, logits = generate_logits(ref_model, ids, torch.ones_like(ids), steps)
    targets = seq[0, ids.shape[1]:].tolist()
    want = torch.log_softmax(logits[:, 0].float(), -1)[torch.arange(steps), torch.tensor(targets)]

    base = make("llama")
    spec = method_spec("lychee", base, 8, _given(base), **CFG)
    v = Variant.build(base, dataclasses.replace(spec, config=dataclasses.replace(spec.config, **extra)))
    first = v.score(dense_prefill(base, ids, max_cache_len=64), targets)
    v.score(dense_prefill(base, other, max_cache_len=64), targets)
    again = v.score(dense_prefill(base, ids, max_cache_len=64), targets)
    assert again.logprobs == first.logprobs
    assert torch.allclose(torch.tensor(first.logprobs), want, atol=1e-4), (first.logprobs, want)
