"""How many cases each fuzz test really checked, reported in pytest's terminal summary (tests/conftest.py) so the CI
log shows the counts even under `pytest -q` (which hides what passing tests print)."""
from __future__ import annotations

import collections

COUNTS: collections.Counter = collections.Counter()


def record(name: str) -> None:
    COUNTS[name] += 1
