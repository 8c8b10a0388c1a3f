"""Stage `eval`: the quality harness (lychee_compile/eval) on the GPU with many prompts.

Parts (--eval-parts): passkey2k (>= 100 prompts), passkey4k (as many as fit), repeat2k, ppl2k; methods x budgets from
--methods / --budgets (passkey4k adds --budgets-4k); the policy methods (lychee-topp, lychee-threshold, lychee-ratio)
take --policy-param. Each part's table includes what every compiled variant attended (ops/sparsity.py; measured by
the eager reference op, hence --eval-backend eager or fp32). --eval-numerics reference|kernels|both scores the fp32
model's variants on those numerics (lychee_compile/eval/numerics.py; kernels: a bf16 copy through Inductor, the
Triton kernels, no sparsity measured; both: each variant twice, paired, with kernels minus reference). Every part runs
dense too, so each part's paired differences are against its own dense row (of the same numerics). Accuracy: Wilson
95%; differences and perplexity: bootstrap over prompts
(lychee_compile/eval/stats.py via runner.summarize). A part stopped by the time box keeps the prompts it finished
(every variant scored on each; marked partial).
"""
from __future__ import annotations

import dataclasses

from .common import Deadline, TimeUp, load, log, shipped_map


def specs_for(model, methods, budgets, head_map, backend, policy_params=None):
    from lychee_compile.eval.methods import method_spec
    out = [method_spec("dense", model, budgets[0])] if "dense" in methods else []
    for m in methods:
        if m != "dense":
            out += [method_spec(m, model, b, head_map, backend=backend, policy_params=policy_params)
                    for b in budgets]
    return out


def renamed(spec, name: str, **config):
    """The same method with another label (and config fields changed): variants of one method side by side."""
    cfg = dataclasses.replace(spec.config, **config) if config else spec.config
    return dataclasses.replace(spec, name=name, config=cfg)


def run_part(model, tok, items, specs, task, res, report, dl, key, numerics=None) -> None:
    """run_eval with the stage's deadline; res[key] holds summary + records, rewritten after every prompt.
    `numerics`: run_eval's (None: the model and specs as given)."""
    from lychee_compile.eval.runner import markdown_table, run_eval, summarize

    def store(results):
        results = dict(results)
        summary = summarize(results)
        res[key] = dict(task=task, prompts=len({r["item"] for r in results["records"]}), of=len(items),
                        partial=results.get("partial", False), summary=summary, table=markdown_table(summary, task),
                        counters=results["counters"], first_item_s=results["first_item_s"],
                        wall_s=results["wall_s"], variants=results["variants"], records=results["records"])
        report.save()

    def checkpoint(partial):
        store(partial)
        log(f"{key}: {res[key]['prompts']}/{len(items)} prompts, {dl.left():.0f} s left")
        dl.check(f"in {key}")

    log(f"{key}: {len(items)} prompts x {len(specs)} variants")
    try:
        store(run_eval(model, tok, items, specs, progress=True, task=task, on_item=checkpoint, numerics=numerics))
    except TimeUp as exc:
        res[key]["stopped"] = str(exc)
        report.save()
        raise
    log(f"{key} done:\n{res[key]['table']}")


def _items(part, tok, args):
    from lychee_compile.eval.tasks import DEPTHS, passkey_items, repeat_items, text_items
    if part in ("passkey2k", "passkey4k"):
        n = args.prompts if part == "passkey2k" else args.prompts_4k      # depths cycle: prompt i at DEPTHS[i % 5]
        trials = -(-n // len(DEPTHS))
        items = passkey_items(tok, [2048 if part == "passkey2k" else 4096], DEPTHS, trials)[:n]
        # --first-prompt: continue an earlier run (prompts are deterministic: prompt i is the same in every run)
        return "passkey", items[args.first_prompt:]
    if part == "repeat2k":
        return "repeat", repeat_items(tok, 2048, args.repeat_prompts, args.score_tokens)
    if part == "ppl2k":
        return "ppl", text_items(tok, 2048, args.ppl_prompts, args.score_tokens)
    raise ValueError(f"unknown eval part {part!r}")


def run(args, report, device: str) -> None:
    from lychee_compile.eval.numerics import parse_numerics, require_all
    res = report.stage("eval")
    numerics = None if args.eval_numerics is None else parse_numerics(args.eval_numerics)
    if numerics is not None:
        require_all(numerics)               # before the model loads
    dl = Deadline(args.max_seconds)
    dtype = args.eval_dtype if numerics is None else "float32"     # the numerics cast their own copies
    model, tok = load(device, dtype)
    hm, where = shipped_map()
    res.update(dtype=dtype, backend=args.eval_backend, head_map=where, numerics=args.eval_numerics)
    for part in args.eval_parts.split(","):
        dl.check(f"before {part}")
        task, items = _items(part, tok, args)
        budgets = args.budgets + (args.budgets_4k if part == "passkey4k" else [])
        specs = specs_for(model, args.methods, budgets, hm, args.eval_backend, args.policy_params)
        run_part(model, tok, items, specs, task, res, report, dl, part, numerics)
