"""A calibrated head map's recommended budget (metadata written by `lychee calibrate`) is the budget lychee_compile
uses unless the config sets one; set_head_map refuses (strict) a map calibrated for another budget than the one
compiled in."""
import json

import pytest

from lychee_compile import HeadMap, HeadMapError, LycheeConfig, lychee_compile, set_head_map
from lychee_compile.api import state_of
from lychee_compile.config import DEFAULT_BUDGET
from tests.models import make
from tests.test_sparse_semantics import mixed_map

CFG = dict(block_size=4, sink_tokens=2, local_tokens=2, backend="eager")


def _calibrated(model, budget):
    record = json.dumps({"status": "unconfirmed"})
    return HeadMap(mixed_map(model), {"recommended_budget": str(budget), "calibration": record}
                   ).with_model_metadata(model)


@pytest.mark.parametrize("configured,expect", [(None, 24), (12, 12)], ids=["from-map", "configured"])
def test_budget_from_a_calibrated_map_unless_configured(configured, expect):
    model = make("llama", "sdpa")
    lychee_compile(model, _calibrated(model, 24), LycheeConfig(budget=configured, **CFG))
    assert state_of(model).config.budget == expect and state_of(model).config.num_select == -(-expect // 4)


def test_uncalibrated_map_and_bare_config_use_the_default():
    model = make("llama", "sdpa")
    lychee_compile(model, HeadMap(mixed_map(model)).with_model_metadata(model), LycheeConfig(**CFG))
    assert state_of(model).config.budget == DEFAULT_BUDGET == LycheeConfig().resolved_budget


def test_set_head_map_refuses_a_map_calibrated_for_another_budget():
    model = make("llama", "sdpa")
    lychee_compile(model, _calibrated(model, 24), LycheeConfig(**CFG))
    with pytest.raises(HeadMapError, match="calibrated for budget 32"):
        set_head_map(model, _calibrated(model, 32))
    set_head_map(model, _calibrated(model, 24))          # the same budget: fine
    chosen = make("llama", "sdpa")
    lychee_compile(chosen, _calibrated(chosen, 24), LycheeConfig(budget=16, **CFG))
    set_head_map(chosen, _calibrated(chosen, 32))        # the user chose the budget: the map's is advice
