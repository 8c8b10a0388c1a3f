"""benchmarks/quality_probe.py: its variant and prompt grammar (no model; the runs themselves are benchmarks)."""
from __future__ import annotations

import pytest

from tests.harness import import_benchmarks


@pytest.fixture(scope="module")
def probe():
    return import_benchmarks("quality_probe")[0]


def test_variants_and_prompts_parse(probe):
    assert probe.parse_variant("lychee@768") == (None, 0, 768)
    assert probe.parse_variant(" lychee+qs24@384") == ("qs", 24, 384)
    assert probe.parse_variant("lychee+heat8@256") == ("heat", 8, 256)
    assert probe.parse_prompts("5,120") == [5, 120]
    assert probe.parse_prompts("0-3,9") == [0, 1, 2, 3, 9]


@pytest.mark.parametrize("bad", ["quest@768", "lychee+qs@384", "lychee+topp8@256", "lychee@", "lychee+qs8"])
def test_bad_variants_are_refused_with_the_grammar(probe, bad):
    with pytest.raises(ValueError, match="use lychee@B"):
        probe.parse_variant(bad)
    with pytest.raises(SystemExit):       # the CLI turns it into a usage error before loading anything
        probe.main(["--task", "repeat", "--prompts", "0", "--variants", bad, "--out", "x.json"])
