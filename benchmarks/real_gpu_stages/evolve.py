"""Stage `evolve` (issue 7): with/without comparisons of the cache-evolution features on the real model.

1. heat (LycheeConfig.heat_blocks / heat_decay) on vs off: the harness's repeat test and perplexity-by-decode
   (paired, same prompts; dense row included).
2. dense rectification (rectify_every) on vs off, on a greedy generation of --evolve-new tokens after a ~2K-token
   real-text prompt (Persuasion):
   - teacher-forced on the DENSE greedy tokens (the fair per-token measure: every step sees the same prefix):
     agreement = argmax equals the dense token; NLL of the dense tokens;
   - free-running greedy generation: tokens equal to dense (prefix and total) and the dense model's perplexity of
     the generated text;
   - amortized time per token: a warm generate() call's wall time minus a 1-token generate() (≈ the prefill),
     divided by the new tokens (rectification passes included).
"""
from __future__ import annotations

import math
import time

import torch

from .common import Deadline, load, log, shipped_map, sync
from .quality import renamed, run_part, specs_for


def run(args, report, device: str) -> None:
    res = report.stage("evolve")
    dl = Deadline(args.max_seconds)
    hm, where = shipped_map()
    res.update(head_map=where)
    model, tok = load(device, args.eval_dtype)
    _heat(args, model, tok, hm, res, report, dl)
    del model
    dl.check("before rectification")
    _rectify(args, hm, res, report, dl, device)


def _heat(args, model, tok, hm, res, report, dl) -> None:
    from lychee_compile.eval.tasks import repeat_items, text_items
    base = specs_for(model, ["dense", "lychee"], args.evolve_budgets, hm, args.eval_backend)
    heat = [renamed(s, f"lychee+heat{args.heat_blocks}", heat_blocks=args.heat_blocks, heat_decay=args.heat_decay)
            for s in base if s.config is not None]
    res["heat"] = dict(heat_blocks=args.heat_blocks, heat_decay=args.heat_decay, dtype=args.eval_dtype,
                       backend=args.eval_backend)
    for key, task, items in (("heat_repeat2k", "repeat", repeat_items(tok, 2048, args.repeat_prompts,
                                                                         args.score_tokens)),
                             ("heat_ppl2k", "ppl", text_items(tok, 2048, args.ppl_prompts, args.score_tokens))):
        dl.check(f"before {key}")
        run_part(model, tok, items, base + heat, task, res, report, dl, key)


def _rectify(args, hm, res, report, dl, device) -> None:
    """`dense` generates the reference (HF's own generate(), whatever it compiles) and scores perplexity; `base`
    (never generated with, so never compiled) is what the lychee variants copy and what prefills for scoring."""
    from lychee_compile.eval.methods import method_spec
    from lychee_compile.eval.tasks import text_items
    dense, tok = load(device, args.long_dtype)
    model, _ = load(device, args.long_dtype)
    n_new = args.evolve_new
    item = text_items(tok, args.evolve_context, 1, 1)[0]
    ids = item.input_ids.to(device)
    out = res["rectify"] = dict(dtype=args.long_dtype, backend=args.backend, prompt_tokens=ids.shape[1],
                                new_tokens=n_new, budget=args.evolve_rect_budget, every=args.rectify_every,
                                prompt_start=item.meta["start"])
    dense_new, dense_t = _greedy(dense, ids, n_new)
    out["dense"] = dict(ms_per_token_amortized=dense_t, text_first_200_chars=tok.decode(dense_new[:200])[:200],
                        dense_ppl_of_generated=_dense_ppl(dense, ids, dense_new),
                        note="HF generate() as-is (static cache; HF's own compile choice)")
    report.save()
    log(f"rectify: dense {out['dense']}")
    for every in (0, args.rectify_every):
        dl.check(f"before rectify_every={every}")
        spec = method_spec("lychee", model, args.evolve_rect_budget, hm, backend=args.backend)
        spec = renamed(spec, f"lychee-rect{every}", rectify_every=every)
        out[f"rectify_every_{every}"] = _one_variant(model, dense, spec, ids, dense_new, n_new)
        log(f"rectify: every={every}: {out[f'rectify_every_{every}']}")
        report.save()


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


def _one_variant(base, dense, spec, ids, dense_new, n_new) -> dict:
    from lychee_compile.eval.scoring import Prefill, Variant, dense_prefill, score_steps
    v = Variant.build(base, spec)
    with _CountReencodes() as gen_passes:
        new, ms = _greedy(v.model, ids, n_new)
    c = v.counters()
    gen_graphs = dict(decode_graphs=c.decode_graphs, graphs=c.graphs, graphs_left_dense=c.graphs_left_dense)
    pre = dense_prefill(base, ids, ids.shape[1] + n_new)        # the cache size generate() uses
    with _CountReencodes() as tf_passes:
        tf = score_steps(v.sequence_call(), pre, dense_new)
    same = (torch.tensor(new) == torch.tensor(dense_new)).long()
    c = v.counters()
    # generate() (transformers 5.x) calls the decode step with a bool attention mask and no cache_position;
    # score_steps (lychee_compile/eval/scoring.py) passes a long mask and cache_position, so Dynamo guards fail
    # and the teacher-forced part compiles a second decode graph: "after_generate" is generate()'s own count.
    return dict(teacher_forced_agreement=sum(tf.hits) / len(tf.hits), teacher_forced_nll=tf.nll,
                teacher_forced_ppl=math.exp(tf.nll), free_run_equal_prefix=int(same.cumprod(0).sum()),
                free_run_equal_total=int(same.sum()), dense_ppl_of_generated=_dense_ppl(dense, ids, new),
                ms_per_token_amortized=ms, decode_graphs=c.decode_graphs, graphs=c.graphs,
                graphs_left_dense=c.graphs_left_dense, after_generate=gen_graphs,
                rectify_passes_generate=gen_passes.n, rectify_passes_teacher_forced=tf_passes.n,
                generate_calls_new_tokens=[n_new, 1, n_new])


def _greedy(model, ids, n_new):
    """(new token ids, amortized ms per new token of a warm call, prefill subtracted)."""
    def gen(n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, cache_implementation="static")
        sync()
        return seq[0, ids.shape[1]:].tolist(), time.perf_counter() - t0
    new, _ = gen(n_new)                       # compiles
    _, t_prefill = gen(1)
    again, t_all = gen(n_new)
    if again != new:
        raise AssertionError("two identical greedy generate() calls gave different tokens")
    return new, (t_all - t_prefill) / (n_new - 1) * 1e3


@torch.no_grad()
def _dense_ppl(dense, ids, new) -> float:
    from lychee_compile.eval.scoring import forward_logprobs
    full = torch.cat([ids, torch.tensor([new], device=ids.device)], 1)
    lp = forward_logprobs(dense, full)
    return math.exp(-lp[ids.shape[1] - 1:].float().mean().item())
