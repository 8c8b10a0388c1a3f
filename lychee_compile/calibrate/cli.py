"""`lychee calibrate`: the cheapest head map x budget that keeps a model within a quality target of dense.

    lychee calibrate --target passkey=1pt,ppl=2% --context 2048 --out calib
    lychee calibrate --model gemma3-270m --target kl=0.01nat --context 1024,4096 --certify-prompts 300 --out calib
    lychee calibrate --model ./my-hf-model --text corpus.txt --target repeat=2% --no-certify --out calib

Search: heads ordered by --scorer (retrieval-score, hardkuma, or sensitivity), a staircase walk over --heads x
--budgets on --search-prompts prompts per context length and task (seed --search-seed), the point with the fewest KV
bytes per decode step whose point estimates are within the target less --search-margin. Certify: that point on
--certify-prompts held-out prompts (seed --certify-seed) with paired 95% intervals; "certified" needs every interval
within the target and >= --min-prompts prompts. While an attempt misses the target, the next candidate is certified
(the next cheapest passing point not below a rejected one, or an unsearched neighbour with one head count or one
budget more), at most --certify-attempts; if none certifies, the map is written "unconfirmed" (or "failed") with
every attempt's intervals. On a CUDA --device the certification runs the
Inductor (GPU kernel) backend, --batch-size prompts per step; load the model in --dtype bfloat16 for the Triton
kernels. --numerics kernels does all of that for both phases (eval/numerics.py: a bf16 copy on CUDA, Inductor, CUDA
graphs) and refuses any number whose rewritten sites did not all run the Triton kernels; --numerics reference: fp32
with --backend. Writes OUT/calibrated.safetensors (record in its metadata), frontier.png, report.md,
certify_log.jsonl and state.json; rerun with the same OUT and settings to resume.
Targets: passkey=Xpt (accuracy points below dense), ppl=X% / repeat=X% (perplexity above dense, real text / the
repeat test), kl=Xnat (mean KL(dense || lychee) per scored token).
"""
from __future__ import annotations

import sys


def add_parser(sub) -> None:
    import argparse
    from .head_scores import SCORERS
    from .prompts import CERTIFY_SEED, SEARCH_SEED
    p = sub.add_parser("calibrate", help="find and certify the cheapest head map x budget for a quality target",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=__doc__.split("\n\n", 1)[1].strip())
    p.add_argument("--model", default="smollm2", help="smollm2 (default), gemma3-270m, qwen2.5-coder-0.5b (the "
                   "models `lychee eval` knows), the path of a .gguf file, or a local Hugging Face model folder")
    p.add_argument("--sha256", default=None, help="expected sha256 of a --model given as a .gguf path")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER", help="a folder with a saved tokenizer to use "
                   "instead of the model's (e.g. for a transformers whose GGUF conversion is refused as broken); "
                   "state.json records the tokenizer's fingerprint, so a resume with another one is refused")
    p.add_argument("--text", default="persuasion", help="calibration text: the shipped haystack (default "
                   "'persuasion') or a UTF-8 text file")
    p.add_argument("--target", default="passkey=1pt,ppl=2%", help="quality target, comma-separated METRIC=BOUND "
                   "(default passkey=1pt,ppl=2%%)")
    p.add_argument("--context", default="2048", help="comma-separated context lengths the map must hold for "
                   "(default 2048); prompts are drawn at each, bytes averaged over them")
    p.add_argument("--scorer", choices=SCORERS, default="retrieval-score", help="head ordering (default "
                   "retrieval-score; hardkuma trains gates first; sensitivity scores the search prompts once per "
                   "later global KV head made sparse alone, at the smallest budget: for models with few global heads)")
    p.add_argument("--score-samples", type=int, default=8, help="passkey prompts the scorer uses (default 8)")
    p.add_argument("--hardkuma-steps", type=int, default=40, help="--scorer hardkuma: training steps (default 40)")
    p.add_argument("--heads", default=None, help="comma-separated retrieval-head counts beyond the first global "
                   "layer (default 0,2,4,8,16,24,32,48 up to what the model has, and every count up to 4 heads)")
    p.add_argument("--budgets", default=None, help="comma-separated budgets in tokens (default 64..4096 powers of "
                   "two, >= sink + local, below the longest context)")
    p.add_argument("--search-prompts", type=int, default=10, help="search prompts per context length and task "
                   "(default 10)")
    p.add_argument("--search-margin", type=float, default=0.5, help="a point passes the search when every point "
                   "estimate is within the bound less this fraction of it (default 0.5: ppl=2%% searches at 1%%)")
    p.add_argument("--score-tokens", type=int, default=16, help="ppl / repeat / kl: tokens scored per prompt "
                   "(default 16)")
    p.add_argument("--certify-prompts", type=int, default=300, help="held-out prompts per context length and task "
                   "(default 300)")
    p.add_argument("--min-prompts", type=int, default=300, help="held-out prompts per metric a 'certified' label "
                   "needs (default 300: a 1-point passkey claim)")
    p.add_argument("--certify-attempts", type=int, default=4, help="points certified at most: while one misses "
                   "the target, the next candidate is certified (default 4)")
    p.add_argument("--no-certify", action="store_true", help="search only; the map is written 'unconfirmed'")
    p.add_argument("--certify-point", default=None, metavar="HEADS@BUDGET", help="certify this point (retrieval "
                   "heads beyond the first global layer @ budget) whatever its search verdict: one attempt, no "
                   "escalation, marked 'requested' in the record and report")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sink-tokens", type=int, default=16)
    p.add_argument("--local-tokens", type=int, default=64)
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager", help="search backend (default "
                   "eager: the same numbers, fast to build on the CPU)")
    p.add_argument("--certify-backend", choices=("eager", "inductor"), default=None, help="default: inductor on "
                   "a CUDA device (the GPU kernels), else --backend")
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--batch-size", type=int, default=1, help="certification prompts per decode step (default 1)")
    p.add_argument("--numerics", choices=("reference", "kernels"), default=None,
                   help="score search and certification on this numerics (lychee eval --numerics): kernels = a bf16 "
                        "copy on CUDA through Inductor, the Triton kernels checked to have run (refused without "
                        "CUDA); reference = fp32, --backend. Default: --device / --dtype / --backend as given")
    p.add_argument("--search-seed", type=int, default=SEARCH_SEED)
    p.add_argument("--certify-seed", type=int, default=CERTIFY_SEED, help="must differ from --search-seed; "
                   "a failed attempt is logged: certify again with a new seed, never the same prompts")
    p.add_argument("--no-chat-template", action="store_true", help="passkey: raw prompts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="calibration", help="output folder (default calibration); resumable")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _point(text):
    """"HEADS@BUDGET" -> (heads, budget); None -> None."""
    if text is None:
        return None
    heads, sep, budget = text.partition("@")
    if not (sep and heads.strip().isdecimal() and budget.strip().isdecimal()):
        raise ValueError(f"--certify-point takes HEADS@BUDGET, e.g. 1@2048 (got {text!r})")
    return int(heads), int(budget)


def _ints(text):
    return None if text is None else [int(x) for x in text.split(",") if x.strip()]


def load_model(name: str, sha256: str | None, progress: bool, tokenizer=None):
    """(model, tokenizer, chat_template) of --model: a folder through transformers, else `lychee eval`'s loader;
    the tokenizer from the folder `tokenizer` when given."""
    import os
    if os.path.isdir(name):
        from ..training.cli import _load_model
        model, tok = _load_model(name, tokenizer=tokenizer)
        return model, tok, True
    from ..eval.models import load_eval_model
    model, tok, entry = load_eval_model(name, progress=progress, sha256=sha256, tokenizer=tokenizer)
    return model, tok, entry.chat_template


def run(args) -> int:
    import torch
    from ..errors import NumericsUnavailable, RealModelUnavailable
    from .target import QualityTarget
    from ..eval.numerics import NUMERICS
    try:
        QualityTarget.parse(args.target)        # a typo fails before the model loads
        point = _point(args.certify_point)
        if point is not None and args.no_certify:
            raise ValueError("--certify-point certifies: it cannot go with --no-certify")
        if point is not None:                   # a budget the config refuses fails before the model loads
            from ..config import LycheeConfig
            LycheeConfig(budget=point[1], block_size=args.block_size, sink_tokens=args.sink_tokens,
                         local_tokens=args.local_tokens)
        if args.numerics is not None:           # so does the kernels numerics on a machine without CUDA
            NUMERICS[args.numerics].require()
    except (ValueError, NumericsUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        model, tok, chat = load_model(args.model, args.sha256, not args.no_progress, args.tokenizer)
    except RealModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = model.to(device=args.device, dtype=getattr(torch, args.dtype))
    result = _calibrate(model, tok, chat, point, args)   # its refusals (settings, a requested point) come first
    print(f"{result.status}; wrote " + ", ".join(result.paths.values()))
    if result.status == "failed":        # the map is written (labelled failed) for inspection, not for use
        print("calibrate: the certified point missed the target on its held-out prompts (report.md says by how much)")
        return 1
    return 0 if result.head_map is not None else 1


def _calibrate(model, tok, chat, point, args):
    from .calibration import calibrate
    return calibrate(model, tok, args.target, args.out, lengths=_ints(args.context), text=args.text,
                     scorer=args.scorer, head_counts=_ints(args.heads), budgets=_ints(args.budgets),
                     search_prompts=args.search_prompts, search_margin=args.search_margin,
                     certify_prompts=args.certify_prompts, certify_attempts=args.certify_attempts,
                     min_prompts=args.min_prompts, score_tokens=args.score_tokens, block_size=args.block_size,
                     sink_tokens=args.sink_tokens, local_tokens=args.local_tokens, backend=args.backend,
                     certify=not args.no_certify, certify_backend=args.certify_backend, batch_size=args.batch_size,
                     score_samples=args.score_samples, hardkuma_steps=args.hardkuma_steps,
                     search_seed=args.search_seed, certify_seed=args.certify_seed,
                     chat_template=chat and not args.no_chat_template, progress=not args.no_progress,
                     numerics=args.numerics, certify_point=point)
