"""Stage `evolve` (cache evolution): with/without comparisons of the cache-evolution features on the real model.

Parts (--evolve-parts; default both; one part per call when a device time box cannot hold both):

1. `heat`: the harness's repeat test and perplexity-by-decode (paired, same prompts; dense row included) for lychee
   at each --evolve-budgets budget without and with each feature:
   - heat (`lychee+heat<N>`: LycheeConfig.heat_blocks / heat_decay);
   - Quest bounds on the sparse heads (`lychee+qs<N>`: LycheeConfig(quest="sparse", quest_blocks=N), each sparse
     head adds its own top N blocks by the min/max key bound to the inherited ones; --quest-blocks 0 leaves it out).
   Besides each part's table against dense, `vs_lychee` holds every feature row against plain lychee at the same
   budget: perplexity ratio with a bootstrap 95% interval over the prompts (eval/runner.summarize). A feature row
   attends up to N blocks more than its budget, so a better perplexity at the same budget can be the extra tokens
   alone: --evolve-controls adds plain lychee rows at other budgets, and a feature row at budget b is also paired
   with lychee at b + N * block_size where that row ran (`comparison` = "equal attended"; the feature's N blocks
   may overlap the inherited ones, so the control attends at least as much as the feature row).
2. `rectify`: dense rectification (rectify_every) on vs off, on greedy generations of --evolve-new tokens after
   --rectify-prompts different --evolve-context-token windows of Persuasion (prompt 0 is the window of the
   single-prompt runs). Per prompt (`records`):
   - the dense model's own greedy generation is the reference;
   - teacher-forced on the DENSE greedy tokens (the fair per-token measure: every step sees the same prefix):
     agreement = argmax equals the dense token; NLL of the dense tokens;
   - free-running greedy generation: tokens equal to dense (prefix and total) and the dense model's perplexity of
     the generated text;
   - prompt 0 only (GPU time): amortized time per token, a warm generate() call's wall time minus a 1-token
     generate() (≈ the prefill), divided by the new tokens (rectification passes included). The other prompts
     generate once.
   `aggregate` (rewritten after every prompt, over the prompts both variants finished): per variant the mean
   agreement and the pooled teacher-forced perplexity, and the paired rect - no-rect differences (same prompt) with
   bootstrap 95% intervals: agreement in points, teacher-forced perplexity ratio. The time box is checked between
   prompts, so a stopped run keeps every prompt it finished.
   With --rectify-batch N > 1 the prompts go N at a time (equal-length windows: one generate() call per variant and
   one teacher-forced batch, calibrate/batch_scoring.batch_steps) and nothing is timed; make --rectify-prompts a
   multiple of N (a smaller last batch compiles every variant again). --rectify-resume OUT.json keeps an earlier
   run's records (same settings and windows) and goes on from the first prompt it lacks, so the prompts can span
   several device calls.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch

from lychee_compile.eval import stats

from .common import Deadline, TimeUp, load, log, shipped_map, sync
from .quality import renamed, run_part, specs_for

PARTS = ("heat", "rectify")


def run(args, report, device: str) -> None:
    res = report.stage("evolve")
    dl = Deadline(args.max_seconds)
    hm, where = shipped_map()
    res.update(head_map=where)
    parts = args.evolve_parts.split(",")
    if "heat" in parts:
        model, tok = load(device, args.eval_dtype)
        _heat(args, model, tok, hm, res, report, dl)
        del model
    if "rectify" in parts:
        dl.check("before rectification")
        _rectify(args, hm, res, report, dl, device)


def _heat(args, model, tok, hm, res, report, dl) -> None:
    from lychee_compile.eval.tasks import repeat_items, text_items
    specs = _heat_specs(args, model, hm)
    res["heat"] = dict(heat_blocks=args.heat_blocks, heat_decay=args.heat_decay, quest_blocks=args.quest_blocks,
                       dtype=args.eval_dtype, backend=args.eval_backend)
    for key, task, items in (("heat_repeat2k", "repeat", repeat_items(tok, 2048, args.repeat_prompts,
                                                                         args.score_tokens)),
                             ("heat_ppl2k", "ppl", text_items(tok, 2048, args.ppl_prompts, args.score_tokens))):
        dl.check(f"before {key}")
        res.pop(key, None)                     # a report filled by an earlier call: no stale rows in vs_lychee
        try:
            run_part(model, tok, items, specs, task, res, report, dl, key)
        finally:                               # also after a time box: the prompts that finished
            if key in res:
                res[key]["vs_lychee"] = vs_lychee(res[key], _extra_tokens(args, specs))
                report.save()
                log(f"{key} vs lychee at the same budget: {res[key]['vs_lychee']}")
    png = os.path.join(os.path.dirname(os.path.abspath(report.path)), "evolve_vs_lychee.png")
    plot_vs_lychee({k: res[k]["vs_lychee"] for k in ("heat_repeat2k", "heat_ppl2k") if k in res}, png)
    res["heat"]["png"] = png
    report.save()
    log(f"plot: {png}")


def _heat_specs(args, model, hm) -> list:
    """dense, lychee at each budget, lychee with each feature on at the same budgets, then the plain lychee
    controls (--evolve-controls)."""
    base = specs_for(model, ["dense", "lychee"], args.evolve_budgets, hm, args.eval_backend)
    lychee = [s for s in base if s.config is not None]
    controls = specs_for(model, ["lychee"], args.evolve_controls, hm, args.eval_backend) if args.evolve_controls else []
    out = base + controls + [renamed(s, f"lychee+heat{args.heat_blocks}", heat_blocks=args.heat_blocks,
                          heat_decay=args.heat_decay) for s in lychee]
    if args.quest_blocks:
        out += [renamed(s, f"lychee+qs{args.quest_blocks}", quest="sparse", quest_blocks=args.quest_blocks)
                for s in lychee]
    return out


def _extra_tokens(args, specs) -> dict[str, int]:
    """Feature method -> the most tokens it attends beyond its budget (N blocks of the specs' block size)."""
    block = next(s.config.block_size for s in specs if s.config is not None)
    return {f"lychee+heat{args.heat_blocks}": args.heat_blocks * block,
            f"lychee+qs{args.quest_blocks}": args.quest_blocks * block}


def vs_lychee(part: dict, extra_tokens: dict[str, int] | None = None) -> list[dict]:
    """Each feature row of a run_part result against plain lychee (paired over the same prompts): at its budget
    ("same budget"), and at its budget + extra_tokens[method] where such a lychee row ran ("equal attended")."""
    from lychee_compile.eval.runner import summarize
    ran = {v["label"] for v in part["variants"]}
    rows = []
    for v in part["variants"]:
        if v["method"] in ("dense", "lychee"):
            continue
        refs = [("same budget", f"lychee@{v['budget']}")]
        extra = (extra_tokens or {}).get(v["method"])
        if extra and f"lychee@{v['budget'] + extra}" in ran:
            refs.append(("equal attended", f"lychee@{v['budget'] + extra}"))
        for comparison, ref in refs:
            records = [r for r in part["records"] if r["label"] in (ref, v["label"])]
            row = summarize(dict(records=records, variants=[v]), reference=ref)[0]
            rows.append(dict(label=v["label"], reference=ref, comparison=comparison, n=row["n"], ppl=row["ppl"],
                             ppl_ratio=row.get("ppl_ratio_vs_ref"), ppl_ratio_ci=row.get("ppl_ratio_ci"),
                             token_hit_rate=row["token_hit_rate"]))
    return rows


def plot_vs_lychee(parts: dict[str, list[dict]], path: str) -> None:
    """Forest plot of vs_lychee rows: one panel per part, one line per (feature row, reference) with its paired 95%
    interval; left of 1 = the feature row's perplexity is lower than plain lychee's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(parts), 1), figsize=(5.2 * max(len(parts), 1), 1.0 + 0.45 * max(
        (len(rows) for rows in parts.values()), default=1)), squeeze=False)
    for ax, (name, rows) in zip(axes[0], parts.items()):
        rows = [r for r in rows if r["ppl_ratio"] is not None and r["ppl_ratio_ci"] is not None]   # n = 0: none
        for y, r in enumerate(rows):
            lo, hi = r["ppl_ratio_ci"]
            ax.errorbar([r["ppl_ratio"]], [y], xerr=[[r["ppl_ratio"] - lo], [hi - r["ppl_ratio"]]], fmt="o",
                        capsize=3, color="C0" if r.get("comparison", "same budget") == "same budget" else "C1")
        ax.set_yticks(range(len(rows)), [f"{r['label']} vs {r['reference']}" for r in rows], fontsize=7)
        ax.axvline(1.0, color="k", lw=1)
        ax.invert_yaxis()
        ax.set_xlabel("perplexity ratio (paired 95% CI)", fontsize=8)
        ax.set_title(f"{name} (n = {rows[0]['n'] if rows else 0})", fontsize=9)
    fig.suptitle("feature rows vs plain lychee; blue: at the same budget, orange: at equal attended tokens",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rectify(args, hm, res, report, dl, device) -> None:
    """`dense` generates the references (HF's own generate(), whatever it compiles) and scores perplexity; `base`
    (never generated with, so never compiled) is what the lychee variants copy and what prefills for scoring. Each
    variant is built once and serves every prompt (same prompt length: no recompiles)."""
    from lychee_compile.eval.methods import method_spec
    from lychee_compile.eval.scoring import Variant
    from lychee_compile.eval.tasks import text_items
    dense, tok = load(device, args.long_dtype)
    base, _ = load(device, args.long_dtype)
    items = text_items(tok, args.evolve_context, args.rectify_prompts, 1)
    spec = method_spec("lychee", base, args.evolve_rect_budget, hm, backend=args.backend)
    variants = {f"rectify_every_{every}": Variant.build(base, renamed(spec, f"lychee-rect{every}",
                                                                      rectify_every=every))
                for every in (0, args.rectify_every)}
    starts = [it.meta["start"] for it in items]
    out = res["rectify"] = dict(dtype=args.long_dtype, backend=args.backend, prompt_tokens=items[0].input_ids.shape[1],
                                new_tokens=args.evolve_new, budget=args.evolve_rect_budget, every=args.rectify_every,
                                prompts_asked=len(items), prompt_starts=starts,
                                overlapping_windows=_overlaps(starts, args.evolve_context), timed_prompt=0,
                                records=[])
    out["batch"] = args.rectify_batch
    if args.rectify_batch > 1:
        out["timed_prompt"] = None
    if args.rectify_resume:
        out["records"] = resumed_records(args.rectify_resume, out, res.get("head_map"))
        out["resumed_from"] = args.rectify_resume
        if out["records"]:
            out["aggregate"] = rectify_aggregate(out["records"], *variants)
    try:
        for i in range(len(out["records"]), len(items), args.rectify_batch):
            dl.check(f"before rectify prompt {i}")
            t0 = time.perf_counter()
            chunk = items[i:i + args.rectify_batch]
            if args.rectify_batch == 1:
                out["records"].append(_rect_prompt(i, chunk[0], dense, base, variants, tok, args.evolve_new, device))
            else:
                out["records"] += _rect_batch(i, chunk, dense, base, variants, tok, args.evolve_new, device)
            out["aggregate"] = rectify_aggregate(out["records"], *variants)
            report.save()
            log(f"rectify prompts {i + 1}-{i + len(chunk)}/{len(items)} ({time.perf_counter() - t0:.0f} s, "
                f"{dl.left():.0f} s left): {_brief(out['records'][-1], variants)}; aggregate {out['aggregate']}")
    except TimeUp as exc:
        out["stopped"] = str(exc)
        report.save()
        raise


RESUME_KEYS = ("dtype", "backend", "prompt_tokens", "new_tokens", "budget", "every", "prompt_starts", "batch")


def resumed_records(path: str, out: dict, head_map: str | None = None) -> list[dict]:
    """The finished records of an earlier report (--rectify-resume) whose rectify part was made with `out`'s
    settings, prompt windows and head map (by file name); the run goes on from the first prompt it lacks."""
    with open(path) as f:
        stage = json.load(f)["stages"]["evolve"]
    old = stage["rectify"]
    diff = [k for k in RESUME_KEYS if old.get(k) != out.get(k)]
    if os.path.basename(stage.get("head_map") or "") != os.path.basename(head_map or ""):
        diff.append("head_map")
    if diff:
        raise SystemExit(f"--rectify-resume {path}: made with other settings ({', '.join(diff)} differ)")
    records = list(old["records"])
    if [r["index"] for r in records] != list(range(len(records))) or \
            [r["start"] for r in records] != out["prompt_starts"][:len(records)]:
        raise SystemExit(f"--rectify-resume {path}: its records are not the first prompts of these windows")
    return records


def _overlaps(starts: list[int], length: int) -> int:
    """Pairs of prompt windows that share text (random starts may overlap; overlapping prompts are not independent)."""
    return sum(abs(a - b) < length for i, a in enumerate(starts) for b in starts[i + 1:])


def _brief(record: dict, keys) -> str:
    return ", ".join(f"{k}: agreement {record[k]['teacher_forced_agreement']:.4f} tf-ppl "
                     f"{record[k]['teacher_forced_ppl']:.4f} passes {record[k]['rectify_passes_teacher_forced']}"
                     for k in keys)


def _rect_prompt(i, item, dense, base, variants, tok, n_new, device) -> dict:
    """One prompt: the dense reference generation, then every variant on it. Prompt 0 is also timed."""
    ids = item.input_ids.to(device)
    timed = i == 0
    dense_new, dense_t = _greedy(dense, ids, n_new) if timed else (_generate(dense, ids, n_new)[0][0], None)
    rec = dict(index=i, start=item.meta["start"], timed=timed,
               dense=dict(ms_per_token_amortized=dense_t, text_first_200_chars=tok.decode(dense_new[:200])[:200],
                          dense_ppl_of_generated=_dense_ppl(dense, ids, dense_new),
                          note="HF generate() as-is (static cache; HF's own compile choice)"))
    for key, v in variants.items():
        rec[key] = _one_variant(base, dense, v, ids, dense_new, n_new, timed)
    return rec


def _rect_batch(first, chunk, dense, base, variants, tok, n_new, device) -> list[dict]:
    """_rect_prompt for len(chunk) equal-length prompts at once: each generate() call and the teacher-forced scoring
    (calibrate/batch_scoring.batch_steps, through the variant's decode call and so its rectification) take the
    whole batch; nothing is timed (the cost per token is benchmarks/e2e.py's)."""
    from lychee_compile.calibrate.batch_scoring import batch_prefill, batch_steps
    from lychee_compile.eval.tasks import Item
    ids = torch.cat([it.input_ids for it in chunk]).to(device)                    # [B, P]: equal-length windows
    dense_new, _ = _generate(dense, ids, n_new)
    recs = [dict(index=first + b, start=it.meta["start"], timed=False, batch=len(chunk),
                 dense=dict(ms_per_token_amortized=None, text_first_200_chars=tok.decode(new[:200])[:200],
                            dense_ppl_of_generated=_dense_ppl(dense, ids[b:b + 1], new),
                            note="HF generate() as-is on the batch (static cache; HF's own compile choice)"))
            for b, (it, new) in enumerate(zip(chunk, dense_new))]
    scored = [Item(it.input_ids, new, it.input_ids.shape[1] + n_new, it.meta) for it, new in zip(chunk, dense_new)]
    for key, v in variants.items():
        with _CountReencodes() as gen_passes:
            free, _ = _generate(v.model, ids, n_new)
        gen_graphs = _graphs(v)
        pre = batch_prefill(base, scored)
        with _CountReencodes() as tf_passes:
            tf = batch_steps(v.sequence_call(), pre, dense_new, scratch=v.scratch)
        del pre
        graphs = _graphs(v)
        for b, rec in enumerate(recs):
            rec[key] = _variant_record(dense, ids[b:b + 1], dense_new[b], free[b], tf[b], None, graphs, gen_graphs,
                                       gen_passes.n, tf_passes.n, [n_new])
    return recs


def rectify_aggregate(records: list[dict], off: str, on: str) -> dict:
    """Over the prompts where both variants finished: per variant the mean teacher-forced agreement, the pooled
    teacher-forced perplexity (exp of the mean per-token NLL: every prompt scores the same number of tokens) and the
    mean free-run equal tokens; paired `on` - `off` (same prompt) with bootstrap 95% intervals over prompts:
    agreement difference in points and teacher-forced perplexity ratio."""
    done = [r for r in records if off in r and on in r]
    per = {k: dict(teacher_forced_agreement=stats.mean(r[k]["teacher_forced_agreement"] for r in done),
                   teacher_forced_ppl=stats.ppl_of([r[k]["teacher_forced_nll"] for r in done]),
                   free_run_equal_prefix=stats.mean(r[k]["free_run_equal_prefix"] for r in done),
                   free_run_equal_total=stats.mean(r[k]["free_run_equal_total"] for r in done))
           for k in (off, on)}
    pairs = [(r[on], r[off]) for r in done]

    def agreement_points(ps):
        return 100 * stats.mean(a["teacher_forced_agreement"] - b["teacher_forced_agreement"] for a, b in ps)

    def nll_diff(ps):
        return stats.mean(a["teacher_forced_nll"] - b["teacher_forced_nll"] for a, b in ps)

    paired = dict(of=f"{on} vs {off}", agreement_diff_points=agreement_points(pairs),
                  agreement_diff_ci=stats.bootstrap(pairs, agreement_points),
                  teacher_forced_ppl_ratio=math.exp(nll_diff(pairs)),
                  teacher_forced_ppl_ratio_ci=tuple(math.exp(x) for x in stats.bootstrap(pairs, nll_diff)))
    return dict(prompts=len(done), variants=per, paired=paired)


class _CountReencodes:
    """Counts Rectifier._reencode calls (the dense re-encoding passes), so a run shows that rectification fired.
    Measurement only: wraps the method for the duration of the with-block, behaviour unchanged."""

    def __enter__(self):
        from lychee_compile.rectify import Rectifier
        self.n, self._orig, counter = 0, Rectifier._reencode, self

        def counted(rect, *a, **kw):
            counter.n += 1
            return counter._orig(rect, *a, **kw)
        Rectifier._reencode = counted
        return self

    def __exit__(self, *exc):
        from lychee_compile.rectify import Rectifier
        Rectifier._reencode = self._orig


def _one_variant(base, dense, v, ids, dense_new, n_new, timed) -> dict:
    """`v`'s free run and teacher-forced scores on one prompt. Graph counters are the variant's, cumulative over the
    prompts so far (equal-length prompts: they should not grow after prompt 0)."""
    from lychee_compile.eval.scoring import dense_prefill, score_steps
    with _CountReencodes() as gen_passes:
        new, ms = _greedy(v.model, ids, n_new) if timed else (_generate(v.model, ids, n_new)[0][0], None)
    gen_graphs = _graphs(v)
    pre = dense_prefill(base, ids, ids.shape[1] + n_new)        # the cache size generate() uses
    with _CountReencodes() as tf_passes:
        tf = score_steps(v.sequence_call(), pre, dense_new)
    # generate() (transformers 5.x) calls the decode step with a bool attention mask and no cache_position;
    # score_steps (lychee_compile/eval/scoring.py) passes a long mask and cache_position, so Dynamo guards fail
    # and the teacher-forced part compiles a second decode graph: "after_generate" is generate()'s own count.
    return _variant_record(dense, ids, dense_new, new, tf, ms, _graphs(v), gen_graphs, gen_passes.n, tf_passes.n,
                           [n_new, 1, n_new] if timed else [n_new])


def _graphs(v) -> dict:
    c = v.counters()
    return dict(decode_graphs=c.decode_graphs, graphs=c.graphs, graphs_left_dense=c.graphs_left_dense)


def _variant_record(dense, ids, dense_new, new, tf, ms, graphs, gen_graphs, gen_passes, tf_passes, calls) -> dict:
    """One prompt's record of one variant: teacher-forced scores `tf` (TokenScores) on the dense tokens, its free
    run `new` against them; ids [1, P] the prompt."""
    same = (torch.tensor(new) == torch.tensor(dense_new)).long()
    return dict(teacher_forced_agreement=sum(tf.hits) / len(tf.hits), teacher_forced_nll=tf.nll,
                teacher_forced_ppl=math.exp(tf.nll), free_run_equal_prefix=int(same.cumprod(0).sum()),
                free_run_equal_total=int(same.sum()), dense_ppl_of_generated=_dense_ppl(dense, ids, new),
                ms_per_token_amortized=ms, **graphs, after_generate=gen_graphs,
                rectify_passes_generate=gen_passes, rectify_passes_teacher_forced=tf_passes,
                generate_calls_new_tokens=calls)


def _generate(model, ids, n):
    """(each row's greedy new token ids, wall seconds) of one generate() call of exactly n new tokens; ids [B, P]."""
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, cache_implementation="static")
    sync()
    return seq[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def _greedy(model, ids, n_new):
    """(new token ids, amortized ms per new token of a warm call, prefill subtracted)."""
    new = _generate(model, ids, n_new)[0][0]                    # compiles
    _, t_prefill = _generate(model, ids, 1)
    again, t_all = _generate(model, ids, n_new)
    if again[0] != new:
        raise AssertionError("two identical greedy generate() calls gave different tokens")
    return new, (t_all - t_prefill) / (n_new - 1) * 1e3


@torch.no_grad()
def _dense_ppl(dense, ids, new) -> float:
    from lychee_compile.eval.scoring import forward_logprobs
    full = torch.cat([ids, torch.tensor([new], device=ids.device)], 1)
    lp = forward_logprobs(dense, full)
    return math.exp(-lp[ids.shape[1] - 1:].float().mean().item())
