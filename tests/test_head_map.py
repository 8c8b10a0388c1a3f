"""HeadMap: save/load round trip with metadata, validation, the first-global-layer and sliding-row warnings."""
from __future__ import annotations

import pytest
import torch

from lychee_compile import HeadMap, HeadMapError
from lychee_compile.head_map import HeadMapWarning
from tests.models import make


def test_save_load_round_trip(tmp_path):
    model = make("llama")
    hm = HeadMap.for_model(model, layers=[0, 2], method="test", budget="1024")
    hm.save(tmp_path / "m.safetensors")
    back = HeadMap.load(tmp_path / "m.safetensors")
    assert torch.equal(back.retrieval, hm.retrieval) and back.metadata == hm.metadata
    assert back.metadata["architecture"] == "LlamaForCausalLM" and back.metadata["method"] == "test"
    back.validate_for(model, strict=True)
    assert back.digest() == hm.digest()


def test_truncated_and_foreign_files(tmp_path):
    model = make("llama")
    HeadMap.for_model(model).save(tmp_path / "m.safetensors")
    blob = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(blob[: len(blob) // 2])
    (tmp_path / "text.safetensors").write_text("not a tensor file")
    for name in ("cut", "text"):
        with pytest.raises(HeadMapError, match="not a readable safetensors head map"):
            HeadMap.load(tmp_path / f"{name}.safetensors")


def test_non_bool_values_are_rejected():
    with pytest.raises(HeadMapError, match="0 and 1"):
        HeadMap(torch.tensor([[0.5, 1.0]]))
    with pytest.raises(HeadMapError, match="2-D"):
        HeadMap(torch.ones(3, dtype=torch.bool))


def test_effective_map_forces_first_global_layer_and_warns_on_sliding_rows():
    hm = HeadMap(torch.tensor([[True], [False], [True], [False]]))
    with pytest.warns(HeadMapWarning) as record:
        eff = hm.effective(global_layers=[1, 3])
    messages = " ".join(str(w.message) for w in record)
    assert "sliding-window layers [0, 2]" in messages and "first global layer (1)" in messages
    assert eff[:, 0].tolist() == [True, True, True, False]


def test_config_fingerprint_ignores_dict_key_order(tmp_path):
    # A config built in memory (e.g. from a GGUF) and the same config read back from its saved JSON (sorted keys)
    # hold nested dicts such as rope_parameters in different key orders; a calibration resumed after the model cache
    # was written, or a shipped map's lookup, must see one model.
    from transformers import AutoConfig, Gemma3TextConfig
    from lychee_compile.head_map import config_fingerprint, fingerprint_matches, legacy_config_fingerprint
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
    cfg = Gemma3TextConfig(num_hidden_layers=6, rope_parameters=rope)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert list(back.rope_parameters) != list(cfg.rope_parameters)      # the saved JSON did reorder the keys
    assert config_fingerprint(back) == config_fingerprint(cfg)
    other = Gemma3TextConfig(num_hidden_layers=6, rope_parameters={**rope, "full_attention": {
        "rope_type": "default", "rope_theta": 500000.0}})
    assert config_fingerprint(other) != config_fingerprint(cfg)
    # maps made before (their fingerprint repr'd the dicts as they came) still match their model
    legacy = legacy_config_fingerprint(cfg)
    assert legacy != config_fingerprint(cfg) and fingerprint_matches(legacy, cfg)
    assert not fingerprint_matches(legacy_config_fingerprint(other), cfg)
