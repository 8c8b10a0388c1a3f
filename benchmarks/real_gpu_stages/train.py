"""Stage `train` (head training): `lychee train-heads --method hardkuma` on the GPU, then the passkey comparison of the
trained map against the shipped one through the eval harness.

Training runs as repeated `lychee train-heads` invocations with a growing --steps (the CLI resumes from its
checkpoint), so the time box stops it between chunks and what is done is kept. Settings: the paper's 30% training
token budget, passkey prompts over Persuasion at --train-prompt-tokens (default 2000), lr/λ-lr from the flags.
steps/s counts whole invocations (model and data loading included): a lower bound on the training rate.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from .common import Deadline, load, log, shipped_map
from .quality import renamed, run_part, specs_for


def cli_args(args, out_map: str, plot_dir: str, steps: int, device: str) -> list[str]:
    return ["train-heads", "--method", "hardkuma", "--retrieval-heads", str(args.train_heads), "--steps", str(steps),
            "--batch", str(args.train_batch), "--lr", str(args.train_lr), "--lambda-lr", str(args.train_lambda_lr),
            "--budget-frac", "0.3", "--prompt-tokens", str(args.train_prompt_tokens),
            "--samples", str(args.train_samples), "--device", device, "--out", out_map, "--plot-dir", plot_dir,
            "--no-progress"]


def _invoke(argv: list[str]) -> int:
    from lychee_compile.training.cli import add_parser
    ap = argparse.ArgumentParser(prog="lychee")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    ns = ap.parse_args(argv)
    return ns.func(ns)


def run(args, report, device: str) -> None:
    res = report.stage("train")
    dl = Deadline(args.max_seconds)
    folder = os.path.dirname(os.path.abspath(args.out))
    out_map = os.path.join(folder, "hardkuma-gpu.safetensors")
    res.update(map=out_map, plots=folder, chunks=[])
    done, chunk = 0, args.train_chunk
    while done < args.train_steps and dl.left() > 0:
        target = min(args.train_steps, done + chunk)
        argv = cli_args(args, out_map, folder, target, device)
        res["command"] = "lychee " + " ".join(argv)
        t0 = time.perf_counter()
        rc = _invoke(argv)
        wall = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"lychee train-heads returned {rc}")
        res["chunks"].append(dict(steps_to=target, wall_s=round(wall, 1)))
        done = target
        _record_map(res, out_map, done)
        log(f"train: {done}/{args.train_steps} steps, {res['steps_per_s']:.3f} steps/s (with load overhead)")
        report.save()
    if dl.left() > 0 and args.train_compare_prompts > 0:
        _compare(args, res, report, dl, device, out_map)


def _record_map(res, out_map, done) -> None:
    from lychee_compile.head_map import HeadMap
    hm = HeadMap.load(out_map)
    r = hm.retrieval
    res.update(steps_done=done, steps_per_s=done / sum(c["wall_s"] for c in res["chunks"]),
               retrieval_heads_beyond_layer0=int(r[1:].sum()),
               heads=[(l, h) for l in range(1, r.shape[0]) for h in range(r.shape[1]) if r[l, h]],
               metadata={k: hm.metadata.get(k) for k in ("expected_l0", "final_lambda", "final_distill",
                                                          "train_config", "data", "wall_s")},
               scores=json.loads(hm.metadata.get("scores", "[]")))


def _compare(args, res, report, dl, device, out_map) -> None:
    from lychee_compile.eval.tasks import DEPTHS, passkey_items
    from lychee_compile.head_map import HeadMap
    model, tok = load(device, args.eval_dtype)
    shipped, _ = shipped_map()
    trained = HeadMap.load(out_map)
    specs = specs_for(model, ["dense", "lychee"], args.budgets, shipped, args.eval_backend)
    specs += [renamed(s, "lychee-trained") for s in specs_for(model, ["lychee"], args.budgets, trained,
                                                               args.eval_backend)]
    specs = [renamed(s, "lychee-shipped") if s.name == "lychee" else s for s in specs]
    trials = -(-args.train_compare_prompts // len(DEPTHS))
    items = passkey_items(tok, [2048], DEPTHS, trials)[:args.train_compare_prompts]
    run_part(model, tok, items, specs, "passkey", res, report, dl, "passkey2k_trained_vs_shipped")
