"""benchmarks/quality_probe.py: its variant and prompt grammar (no model; the runs themselves are benchmarks)."""
from __future__ import annotations

import pytest

from tests.harness import import_benchmarks

pytestmark = pytest.mark.single_stack   # no torch / transformers / triton version changes it: stack A only in CI


@pytest.fixture(scope="module")
def probe():
    return import_benchmarks("quality_probe")[0]


def test_variants_and_prompts_parse(probe):
    assert probe.parse_variant("lychee@768") == (None, 0, 768, None)
    assert probe.parse_variant(" lychee+qs24@384") == ("qs", 24, 384, None)
    assert probe.parse_variant("lychee+heat8@256") == ("heat", 8, 256, None)
    assert probe.parse_variant("lychee@768:rs32") == (None, 0, 768, "rs32")
    assert probe.parse_maps("a=x.safetensors,b_2=y") == {"a": "x.safetensors", "b_2": "y"}
    assert probe.parse_maps(None) == {}
    assert probe.parse_prompts("5,120") == [5, 120]
    assert probe.parse_prompts("0-3,9") == [0, 1, 2, 3, 9]


@pytest.mark.parametrize("bad", ["quest@768", "lychee+qs@384", "lychee+topp8@256", "lychee@", "lychee+qs8",
                                 "lychee@768:", "lychee@768:a.b"])
def test_bad_variants_are_refused_with_the_grammar(probe, bad):
    with pytest.raises(ValueError, match="use lychee@B"):
        probe.parse_variant(bad)
    with pytest.raises(SystemExit):       # the CLI turns it into a usage error before loading anything
        probe.main(["--task", "repeat", "--prompts", "0", "--variants", bad, "--out", "x.json"])


def test_bad_maps_are_refused(probe):
    with pytest.raises(ValueError, match="NAME=PATH"):
        probe.parse_maps("rs32")
    with pytest.raises(SystemExit):
        probe.main(["--task", "repeat", "--prompts", "0", "--variants", "lychee@768:x", "--maps", "x", "--out", "x.json"])


def test_a_named_map_replaces_the_shipped_one_in_its_variant_only(probe, tmp_path):
    import torch

    from lychee_compile import HeadMap
    from tests.models import make_llama
    model = make_llama()
    layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    shipped = HeadMap(torch.zeros(layers, kv, dtype=torch.bool)).with_model_metadata(model)
    other = HeadMap(torch.ones(layers, kv, dtype=torch.bool)).with_model_metadata(model)
    other.save(tmp_path / "all.safetensors")
    specs = probe._specs(model, shipped, ["lychee@256", "lychee@256:all"], {"all": str(tmp_path / "all.safetensors")})
    assert [s.label for s in specs] == ["dense", "lychee@256", "lychee[all]@256"]
    assert specs[1].head_map is shipped and bool(specs[2].head_map.retrieval.all())
    assert specs[1].config == specs[2].config
    with pytest.raises(ValueError, match="does not define"):
        probe._specs(model, shipped, ["lychee@256:nope"], {})
