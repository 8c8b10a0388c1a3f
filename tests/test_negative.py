"""Acceptance 4: bad input gets a clear error naming the problem, and the model is left unchanged and usable."""
from __future__ import annotations

import copy

import pytest
import torch

from lychee_compile import HeadMap, HeadMapError, LycheeConfig, LycheeConfigError, lychee_compile
from lychee_compile.passes import Counters, LycheeCompileError, PassContext, run_passes
from tests.harness import generate_logits
from tests.models import _COMMON, _finish, make, make_batch


def _snapshot(model):
    return (copy.deepcopy(model.generation_config.to_dict()), {k: v.clone() for k, v in model.state_dict().items()},
            set(model.__dict__))


def _assert_unchanged(model, before):
    gen, weights, attrs = before
    assert model.generation_config.to_dict() == gen
    assert model.generation_config.compile_config is None
    assert set(model.__dict__) == attrs and not hasattr(model, "_lychee_state")
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    ids, mask = make_batch(lengths=(6,))
    generate_logits(model, ids, mask, 2)          # still usable


def make_gemma2_softcap():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(**dict(_COMMON, tie_word_embeddings=True), num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0, sliding_window=None,
                       layer_types=["full_attention", "full_attention"])
    return _finish(Gemma2ForCausalLM, cfg, "eager", 0)


CASES = {
    "head map of wrong shape": (lambda m: HeadMap(torch.ones(5, 2, dtype=torch.bool)), LycheeConfig(backend="eager"),
                                HeadMapError, r"shape \(5, 2\) does not match.*3 layers x 2 KV heads"),
    "head map of another model": (lambda m: HeadMap.for_model(make("qwen3")), LycheeConfig(backend="eager"),
                                  HeadMapError, "made for another model"),
    "head map with NaN": (lambda m: HeadMap(torch.full((3, 2), float("nan"))), None, HeadMapError, "NaN"),
    "not a head map": (lambda m: "no-such-file.safetensors", LycheeConfig(backend="eager"), HeadMapError,
                       "does not exist"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_head_map(case):
    model = make("llama")
    before = _snapshot(model)
    make_map, config, error, message = CASES[case]
    with pytest.raises(error, match=message):
        lychee_compile(model, make_map(model), config)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("kwargs,message", [
    (dict(budget=float("nan")), "NaN"),
    (dict(budget=0), "budget must be > 0"),
    (dict(budget=-4), "budget must be > 0"),
    (dict(block_size=3), "power of two"),
    (dict(budget=8, block_size=16), "larger than the budget"),
    (dict(budget=64, sink_tokens=40, local_tokens=40), "exceeds the budget"),
    (dict(backend="tvm"), "backend"),
])
def test_nonsense_config(kwargs, message):
    with pytest.raises(LycheeConfigError, match=message):
        LycheeConfig(**kwargs)


def test_softcapped_attention_is_refused():
    model = make_gemma2_softcap()
    before = _snapshot(model)
    with pytest.raises(LycheeCompileError, match="softcap"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
    _assert_unchanged(model, before)


def test_unsupported_attention_implementation_is_refused():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    def custom_mean(module, q, k, v, mask, **kw):   # [B, Hq, L, D] -> [B, L, Hq, D]
        return v.mean(2, keepdim=True).repeat_interleave(q.shape[1] // v.shape[1], 1).expand_as(q).transpose(1, 2), None
    AttentionInterface.register("custom_mean", custom_mean)
    AttentionMaskInterface.register("custom_mean", sdpa_mask)
    model = make("llama")
    model.config._attn_implementation = "custom_mean"
    before = _snapshot(model)
    with pytest.raises(LycheeCompileError, match="attention implementation 'custom_mean'"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
    _assert_unchanged(model, before)


def test_graph_without_attention_is_refused_strict_and_left_dense_otherwise():
    model = make("llama")
    mlp = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    with pytest.raises(LycheeCompileError, match="no attention found"):
        run_passes(PassContext(mlp, model, LycheeConfig(), None, Counters()))
    counters = Counters()
    code_before = mlp.code
    ctx = run_passes(PassContext(mlp, model, LycheeConfig(strict=False), None, counters))
    assert ctx.aborted and counters.graphs_left_dense == 1 and "no attention found" in counters.reasons[0]
    assert mlp.code == code_before


def test_twice_on_one_model_is_refused():
    model = make("llama")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
    with pytest.raises(LycheeCompileError, match="already applied"):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))


def test_non_strict_fingerprint_mismatch_warns_and_compiles():
    model = make("llama")
    with pytest.warns(UserWarning, match="made for another model"):
        lychee_compile(model, HeadMap.for_model(make("qwen3")), LycheeConfig(backend="eager", strict=False))
    assert model._lychee_state.counters.graphs == 0   # compiled lazily, on the first decode step


def _bloom_alibi():
    from transformers import BloomConfig, BloomForCausalLM
    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4)).eval()


def _t5_encoder_decoder():
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=64, num_layers=2,
                                               num_heads=4)).eval()


def _llama_output_attentions():
    model = make("llama", "eager")
    model.config.output_attentions = True
    return model


def _llama_training():
    return make("llama").train()


def _llama_on_meta():
    return make("llama").to("meta")


@pytest.mark.parametrize("make_model,message", [
    (_bloom_alibi, "no attention found"),                      # ALiBi through baddbmm: not a form we reproduce
    (_t5_encoder_decoder, "encoder-decoder"),
    (_llama_output_attentions, "output_attentions=True"),
    (_llama_training, "training mode"),
    (_llama_on_meta, "device 'meta'"),
], ids=["alibi-bloom", "encoder-decoder", "output-attentions", "training", "meta-device"])
def test_unsupported_models_are_refused_and_untouched(make_model, message):
    model = make_model()
    gen_before = copy.deepcopy(model.generation_config.to_dict())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LycheeCompileError, match=message):
        lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
    assert model.generation_config.to_dict() == gen_before and not hasattr(model, "_lychee_state")
    assert all(v.is_meta or torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_generate_that_bypasses_the_rewrite_is_not_silent():
    model = make("llama")
    lychee_compile(model, HeadMap.for_model(model), LycheeConfig(backend="eager"))
    ids, mask = make_batch(lengths=(6,))
    with pytest.raises(LycheeCompileError, match="without the lychee decode step"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, disable_compile=True)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert out.shape[1] == ids.shape[1] + 3 and model._lychee_state.counters.decode_calls == 2
