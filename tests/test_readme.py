"""README.md's LycheeConfig table lists every field of the dataclass with its default, in the dataclass's order."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from lychee_compile.config import LycheeConfig

pytestmark = pytest.mark.single_stack   # text against our own dataclass: no torch / transformers version changes it

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_config_table_lists_every_field_with_its_default():
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", README.read_text(), flags=re.M)
    fields = dataclasses.fields(LycheeConfig)
    assert [name for name, _ in rows] == [f.name for f in fields]
    for (name, shown), field in zip(rows, fields):
        default = field.default
        expected = f'"{default}"' if isinstance(default, str) else f"{type(default).__name__}()" \
            if dataclasses.is_dataclass(default) else repr(default)
        assert shown.strip() == expected, name
