"""`lychee eval`: quality of methods x budgets on a real model (default SmolLM2-135M-Instruct) through the compiled
decode path.

    lychee eval --task passkey --method dense,lychee,streamingllm,duo,random --budget 256,512 --lengths 2048 --trials 2
    lychee eval --task repeat --method dense,lychee --budget 512 --length 2048 --prompts 4 --score-tokens 32
    lychee eval --model gemma3-270m --task passkey --method dense,lychee --budget 256 --trials 2
    lychee eval --task passkey --method dense,lychee,lychee-topp,lychee-ratio --policy-param topp=0.9,ratio=0.25
    lychee eval --task passkey --method dense,lychee --budget 512 --numerics both        # on a CUDA machine

Each prompt is prefilled once, densely; every method scores a copy of that cache with teacher-forced decode steps
through the callable generate() compiles (see lychee_compile/eval/scoring.py). --numerics (eval/numerics.py):
reference (default) = fp32 on the CPU, --backend (default eager: the op's eager reference, the definition of
correctness); kernels = a bf16 cast of the same weights on the GPU, Inductor, CUDA graphs: the Triton kernels users
run (refused without CUDA, checked to have run on every rewritten site); both = every variant under each, paired
(each its own dense prefill; the fp32 model then runs on the GPU too), labels `lychee@512[kernels]`, and a table of
kernels minus reference per variant. Sparsity is measured on the reference rows only. Writes TASK.json (every record,
settings, compile counters, what each variant attended) and TASK.md (table with 95% intervals, and a sparsity table:
attended % of the context per non-retrieval head, blocks kept per retrieval selection) to --out, and passkey heatmaps
per method. Methods: dense, lychee (top-k), lychee-topp, lychee-threshold, lychee-ratio (selection policies,
parameters from --policy-param), tidal, streamingllm, duo, random, quest (see eval/methods.py for each one's mapping).
"""
from __future__ import annotations

import sys
import time


def add_parser(sub) -> None:
    from .methods import METHODS, POLICY_DEFAULTS, UNAVAILABLE
    from .numerics import CHOICES
    from .tasks import DEPTHS, NOT_DONE_TASKS, TASKS
    import argparse
    p = sub.add_parser("eval", formatter_class=argparse.RawDescriptionHelpFormatter, help="quality of methods x budgets on the real model (passkey, repeat, ppl, RULER-style)",
                       description=__doc__.split("\n\n", 1)[1].strip(),
                       epilog="not available: " + "; ".join(f"{k}: {v}" for k, v in {**UNAVAILABLE,
                                                                                      **NOT_DONE_TASKS}.items()))
    from .ruler import RULER_TASKS
    from .models import EVAL_MODELS
    p.add_argument("--task", choices=sorted(TASKS) + sorted(RULER_TASKS), required=True)
    p.add_argument("--model", default="smollm2",
                   help=f"{', '.join(EVAL_MODELS)} (default smollm2), or the path of a .gguf file; the other models "
                        "are evaluation data, read from $LYCHEE_<NAME>_GGUF or ~/.cache/lychee_compile/other-models "
                        "and sha256-checked (see eval/models.py for how to obtain them)")
    p.add_argument("--sha256", default=None, help="expected sha256 of a --model given as a .gguf path (refused if "
                                                  "it differs)")
    p.add_argument("--tokenizer", default=None, metavar="FOLDER", help="a folder with a saved tokenizer to use "
                   "instead of the GGUF's, for a transformers whose GGUF conversion is refused as broken")
    p.add_argument("--no-chat-template", action="store_true",
                   help="passkey: raw prompts even if the tokenizer has a chat template (base models are raw "
                        "anyway)")
    p.add_argument("--method", default="dense,lychee",
                   help=f"comma-separated, from {','.join(METHODS)} (default dense,lychee)")
    p.add_argument("--budget", default=None, help="comma-separated token budgets (default: the head map's "
                                                  "recommended budget, else 512); for the policy methods the "
                                                  "capacity: at most ceil(budget / 16) blocks kept")
    p.add_argument("--policy-param", default="",
                   help="parameters of lychee-topp / lychee-threshold / lychee-ratio, e.g. topp=0.9,threshold=0.005,"
                        f"ratio=0.25 (each in (0, 1]; defaults {','.join(f'{k}={v:g}' for k, v in POLICY_DEFAULTS.items())})")
    p.add_argument("--head-map", help="HeadMap file for lychee/duo/random (default: the shipped calibrated map, "
                                      "else the placeholder layers 0,1,15)")
    p.add_argument("--lengths", default="2048", help="passkey: comma-separated context lengths (default 2048)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEPTHS), help="passkey: comma-separated depths")
    p.add_argument("--trials", type=int, default=1, help="passkey: prompts per (length, depth) cell (default 1)")
    p.add_argument("--length", type=int, default=2048, help="repeat/ppl/RULER: context tokens (default 2048)")
    p.add_argument("--prompts", type=int, default=4, help="repeat/ppl/RULER: number of prompts (default 4)")
    p.add_argument("--score-tokens", type=int, default=32, help="repeat/ppl: tokens scored by decode steps")
    p.add_argument("--score-offset", type=int, default=None,
                   help="repeat: second-copy tokens prefilled before the scored ones (default length // 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-seed", type=int, default=0, help="seed of the random head map")
    p.add_argument("--backend", choices=("eager", "inductor"), default="eager",
                   help="LycheeConfig.backend of the reference numerics (default eager: same numbers, much faster "
                        "to build on CPU); the kernels numerics always runs Inductor")
    p.add_argument("--numerics", choices=CHOICES, default="reference",
                   help="reference (default: fp32, CPU, the op's eager reference), kernels (bf16 on CUDA through "
                        "Inductor: the Triton kernels, CUDA graphs) or both (paired rows and their difference; the "
                        "fp32 model runs on the GPU too)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="eval_out", help="output folder (default eval_out)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--verbose", action="store_true",
                   help="log lychee_compile's per-graph lines (which layers were rewritten, which sliding-window "
                        "layers were left as they are) to stderr")
    p.set_defaults(func=run)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def run(args) -> int:
    import torch

    from ..head_map import HeadMap
    from ..errors import MethodError, NumericsUnavailable, RealModelUnavailable
    from .models import load_eval_model
    from .methods import default_head_map, method_spec, parse_policy_params
    from .numerics import parse_numerics, require_all
    from .runner import markdown_table, run_eval, summarize, write_outputs
    from .tasks import passkey_items, repeat_items, text_items

    try:     # before loading the model: a typo in the option fails in a second, not after the load
        policy_params = parse_policy_params(args.policy_param)
        numerics = parse_numerics(args.numerics)
        require_all(numerics)
    except (MethodError, NumericsUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.verbose:
        import logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger("lychee_compile")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        model, tok, entry = load_eval_model(args.model, progress=not args.no_progress, sha256=args.sha256,
                                            tokenizer=args.tokenizer)
    except RealModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(numerics) > 1:      # both: the reference rows run on the GPU too (the kernels copy it there themselves)
        model.to("cuda")
    if args.head_map:
        hm, where = HeadMap.load(args.head_map), f"loaded from {args.head_map}"
    else:
        hm, where = default_head_map(model)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    budgets = _ints(args.budget) if args.budget else [hm.recommended_budget or 512]
    try:
        specs = []
        for m in methods:
            if m == "dense":
                specs.append(method_spec("dense", model, budgets[0]))
                continue
            for b in budgets:
                specs.append(method_spec(m, model, b, hm, backend=args.backend, seed=args.random_seed,
                                         policy_params=policy_params))
    except MethodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.task == "passkey":
        items = passkey_items(tok, _ints(args.lengths), [float(d) for d in args.depths.split(",")], args.trials,
                              args.seed, chat_template=entry.chat_template and not args.no_chat_template)
    elif args.task == "repeat":
        items = repeat_items(tok, args.length, args.prompts, args.score_tokens, args.seed,
                             score_offset=args.score_offset)
    elif args.task == "ppl":
        items = text_items(tok, args.length, args.prompts, args.score_tokens, args.seed)
    else:
        from .ruler import RULER_TASKS
        items = RULER_TASKS[args.task](tok, args.length, args.prompts, seed=args.seed)
    print(f"lychee eval: model {entry.title}, task {args.task}, {len(items)} prompts x {len(specs)} variants x "
          f"numerics {', '.join(n.name for n in numerics)} (on {model.device}); head map: {where}", flush=True)
    for s in specs:
        print(f"  {s.label}: {s.description}")
    t0 = time.perf_counter()
    settings = dict(vars(args), func=None, head_map_source=where, model_title=entry.title, model_gguf_sha256=entry.sha256 or args.sha256,
                    threads=args.threads, torch=torch.__version__,
                    items=len(items))

    def checkpoint(partial):      # partial outputs after every prompt, so a long run killed early still reports
        partial["settings"] = settings
        write_outputs(partial, summarize(partial), args.out, heatmaps=False)

    results = run_eval(model, tok, items, specs, progress=not args.no_progress, task=args.task, on_item=checkpoint,
                       numerics=numerics)
    results["settings"] = settings
    summary = summarize(results)
    paths = write_outputs(results, summary, args.out)
    print(markdown_table(summary, args.task))
    print(f"wrote {paths['json']} and {paths['md']}" + (f" and {len(paths['png'])} heatmaps" if "png" in paths else "")
          + f" ({time.perf_counter() - t0:.0f} s)")
    return 0
