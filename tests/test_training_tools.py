"""Head-map tooling: trainer determinism and resume on a tiny model, map extraction, DuoAttention TSV import,
plots, and the `lychee train-heads` parser."""
from __future__ import annotations

import os

import pytest
import torch

from lychee_compile.head_map import HeadMap, HeadMapError
from lychee_compile.training.data import Sample
from lychee_compile.training.duo_import import duo_to_head_map, read_duo_tsv
from lychee_compile.training.trainer import Trainer, TrainConfig


def _tiny_samples(model, n=3, prompt=48, target=5):
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(3, 128, (1, prompt + target), generator=g)
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=ids[:, :prompt - 1], past_key_values=cache, use_cache=True)
            kv = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
            inputs = ids[:, prompt - 1:prompt - 1 + target]
            teacher = model(input_ids=inputs, past_key_values=DynamicCache(ddp_cache_data=kv)).logits[0]
        out.append(Sample(kv=kv, inputs=inputs, targets=ids[0, prompt:prompt + target], teacher=teacher,
                          passkey="0", depth=0.5, needle_token_pos=10, n_prompt=prompt))
    return out


@pytest.mark.parametrize("method", ["hardkuma", "hardconcrete", "duo"])
def test_trainer_is_deterministic_and_resumes_exactly(tmp_path, method):
    from tests.models import make
    model = make("llama", "sdpa")
    samples = _tiny_samples(model)
    cfg = TrainConfig(method=method, retrieval_heads=1, steps=4, batch=2, lr=0.1, lambda_lr=0.1, block_size=4,
                      sink_tokens=4, local_tokens=4, seed=3)
    full = Trainer(model, samples, cfg)
    full.train(progress=False)
    ckpt = str(tmp_path / "c.ckpt")
    half = Trainer(model, samples, TrainConfig(**{**cfg.__dict__, "steps": 2}), checkpoint=ckpt)
    half.train(progress=False)
    resumed = Trainer(model, samples, cfg, checkpoint=ckpt)
    assert resumed.step == 2
    resumed.train(progress=False)
    for k, v in full.gates.state_dict().items():
        torch.testing.assert_close(resumed.gates.state_dict()[k], v, rtol=0, atol=0)
    assert [h["distill"] for h in resumed.history] == [h["distill"] for h in full.history]
    assert any(h["distill"] > 0 for h in full.history)
    sm = full.score_matrix()
    assert sm.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads)
    assert bool((sm[0] == 1).all())


def test_checkpoint_with_other_settings_is_refused(tmp_path):
    from tests.models import make
    model = make("llama", "sdpa")
    samples = _tiny_samples(model, n=2)
    ckpt = str(tmp_path / "c.ckpt")
    Trainer(model, samples, TrainConfig(steps=1, batch=1, block_size=4, sink_tokens=4, local_tokens=4),
            checkpoint=ckpt).train(progress=False)
    with pytest.raises(ValueError, match="other settings"):
        Trainer(model, samples, TrainConfig(steps=1, batch=1, lr=0.5, block_size=4, sink_tokens=4,
                                            local_tokens=4), checkpoint=ckpt)


def test_duo_tsv_import(tmp_path):
    p = tmp_path / "full_attention_heads.tsv"
    p.write_text("1.000000000000000000e+00\t2.0e-01\t0.7\n0.1\t0.9\t0.3\n# comment\n\n-0.1\t0.6\t0.5\n")
    scores = read_duo_tsv(str(p))
    assert scores.shape == (3, 3) and float(scores.min()) == 0.0      # clipped to [0, 1] like DuoAttention
    hm = duo_to_head_map(scores, threshold=0.5, source=str(p))
    assert hm.retrieval.tolist() == [[True, False, True], [False, True, False], [False, True, True]]
    assert hm.metadata["method"] == "duo-import"
    top = duo_to_head_map(scores, retrieval_heads=2)
    assert int(top.retrieval.sum()) == 2 and top.retrieval[0, 0] and top.retrieval[1, 1]
    out = tmp_path / "m.safetensors"
    hm.save(out)
    assert HeadMap.load(out).retrieval.tolist() == hm.retrieval.tolist()
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t0\n1\n")
    with pytest.raises(HeadMapError, match="different numbers"):
        read_duo_tsv(str(bad))


def test_plots_write_pngs(tmp_path):
    from lychee_compile.training.plots import plot_history, plot_map
    hist = [{"score": torch.rand(6).tolist()} for _ in range(5)]
    plot_history(hist, 3, 3, str(tmp_path / "h.png"))
    s = torch.rand(3, 3)
    plot_map(s, s > 0.5, str(tmp_path / "m.png"))
    assert os.path.getsize(tmp_path / "h.png") > 1000 and os.path.getsize(tmp_path / "m.png") > 1000


def test_cli_registers_train_heads():
    from lychee_compile.cli import build_parser
    args = build_parser().parse_args(["train-heads", "--method", "duo", "--retrieval-heads", "8", "--out", "x"])
    assert args.method == "duo" and args.retrieval_heads == 8 and args.steps == 100 and args.target_warmup == 50
    assert args.func.__module__ == "lychee_compile.training.cli"


def test_shipped_smollm2_map_is_certified():
    """The package default: made and certified by `lychee calibrate` (passkey=1pt,ppl=2% at 2K-4K, GPU kernels)."""
    import json
    from lychee_compile.training import load_shipped_map, shipped_map_path
    assert shipped_map_path().endswith("lychee_compile/data/smollm2-135m.safetensors")
    hm = load_shipped_map()
    assert hm.shape == (30, 3) and bool(hm.retrieval[0].all()) and not bool(hm.streaming.any())
    md = hm.metadata
    assert md["calibration_status"] == "certified" and hm.recommended_budget == 512
    cal = json.loads(md["calibration"])
    assert int(md["retrieval_heads"]) == int(hm.retrieval[1:].sum()) == int(cal["retrieval_heads"])
    q = cal["quality"]
    assert q["passkey"]["n"] >= 300 and q["passkey"]["interval"][0] >= -1.0        # within 1 point of dense
    assert q["ppl"]["n"] >= 300 and q["ppl"]["interval"][1] <= 2.0                 # within 2% of dense
    assert hm.recommended_budget <= 0.25 * 2048                                      # <= 25% of the context


def test_shipped_smollm2_hardkuma_map():
    from lychee_compile.training import load_shipped_map
    hm = load_shipped_map("smollm2-135m-hardkuma")
    assert hm.shape == (30, 3)
    assert bool(hm.retrieval[0].all())                       # first global layer: all retrieval
    assert not bool(hm.streaming.any())
    md = hm.metadata
    assert md["method"] == "hardkuma" and md["selection"] == "threshold"
    for key in ("N_target", "steps", "data", "config_fingerprint", "architecture", "train_config", "scores"):
        assert md.get(key), key
    assert int(md["retrieval_heads"]) == int(hm.retrieval[1:].sum())


def test_reselect_from_scores(tmp_path):
    from lychee_compile.training import load_shipped_map
    from lychee_compile.training.reselect import reselect
    hm = load_shipped_map("smollm2-135m-hardkuma")
    n = int(hm.retrieval[1:].sum()) + 3
    top = reselect(hm, topk=n)
    assert int(top.retrieval[1:].sum()) == n and bool((top.retrieval & hm.retrieval).sum() == hm.retrieval.sum())
    same = reselect(hm, threshold=0.5)
    assert torch.equal(same.retrieval, hm.retrieval)
