"""calibrate(): search the cheapest head map x budget that meets a quality target, certify it on held-out prompts,
write the calibrated map, the frontier plot and a report. The `lychee calibrate` command calls it.

    result = calibrate(model, tokenizer, "passkey=1pt,ppl=2%", out_dir="calib", lengths=[2048])
    result.head_map.recommended_budget, result.status, result.paths

Output folder: calibrated.safetensors (HeadMap; its metadata["calibration"] is the record, see record.py),
frontier.png, report.md, certify_log.jsonl (every certification attempt) and state.json (resume).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

from .head_scores import beyond_first, score_heads, top_heads
from .prompts import CERTIFY_SEED, SEARCH_SEED, check_disjoint, digest, prompt_set
from .search import cheapest, walk
from .store import Store
from .target import QualityTarget

HEAD_COUNTS = (0, 2, 4, 8, 16, 24, 32, 48)
BUDGETS = (64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass
class Calibration:
    status: str                     # certified | unconfirmed | failed | no point met the target
    head_map: object | None         # the calibrated HeadMap (None if no point met the target)
    points: list[dict]              # every visited point, in walk order
    chosen: dict | None
    certification: dict | None
    paths: dict
    points_evaluated: int           # points scored in this run (the rest came from state.json)
    scorings: int                   # search: (variant, prompt) scorings this run, dense reference included
    certify_scorings: int           # held-out prompts scored this run (dense and lychee each)


def default_budgets(lengths, sink: int, local: int) -> list[int]:
    return [b for b in BUDGETS if sink + local <= b < max(lengths)] or [max(sink + local, BUDGETS[0])]


def default_heads(room: int) -> list[int]:
    """HEAD_COUNTS up to `room` (the heads of the later global layers), and `room` itself if it is below 48."""
    return sorted({c for c in HEAD_COUNTS if c <= room} | ({room} if room < HEAD_COUNTS[-1] else set()))


def _settings(model, target, kw) -> dict:
    from ..head_map import config_fingerprint
    return dict(model=config_fingerprint(model.config), dtype=str(model.dtype), target=str(target),
                **{k: v for k, v in kw.items() if k not in ("progress", "log", "certify", "certify_backend",
                                                            "batch_size", "certify_prompts", "certify_seed",
                                                            "min_prompts")})


def calibrate(model, tokenizer, target: str = "passkey=1pt,ppl=2%", out_dir: str = "calibration", *,
              lengths=(2048,), text: str = "persuasion", scorer: str = "retrieval-score", head_scores=None,
              head_counts=None, budgets=None, search_prompts: int = 5, certify_prompts: int = 300,
              min_prompts: int = 300, score_tokens: int = 16, block_size: int = 16, sink_tokens: int = 16,
              local_tokens: int = 64, backend: str = "eager", certify: bool = True, certify_backend: str | None = None,
              batch_size: int = 1, score_samples: int = 8, hardkuma_steps: int = 40, search_seed: int = SEARCH_SEED,
              certify_seed: int = CERTIFY_SEED, chat_template: bool = True, progress: bool = True,
              numerics: str | None = None, log=print) -> Calibration:
    """`head_scores`: float [L, Hkv] to order the heads instead of `scorer`. `certify_backend`: default "inductor"
    on a CUDA model (the GPU kernels), else `backend`. `numerics` ("reference" | "kernels", eval/numerics.py): search
    and certify on that numerics' copy of the model with its backend (kernels: bf16 on CUDA, Inductor, CUDA graphs,
    every rewritten site checked to have run the Triton kernels); None: `model`, `backend` and `certify_backend` as
    given. See the module docstring and docs/calibrate.md."""
    from ..eval.numerics import NUMERICS
    from ..eval.scoring import dynamo_limits
    from .session import Session
    tgt = QualityTarget.parse(target)
    budgets = sorted(budgets or default_budgets(lengths, sink_tokens, local_tokens))
    if numerics is not None:         # before any work: refused where it cannot run (the kernels without CUDA)
        NUMERICS[numerics].require()
        model = NUMERICS[numerics].base_model(model)
        backend = NUMERICS[numerics].backend or backend
        certify_backend = NUMERICS[numerics].backend or certify_backend
    kw = dict(lengths=list(lengths), text=text, scorer=scorer if head_scores is None else "given", head_counts=head_counts,
              budgets=budgets, search_prompts=search_prompts, score_tokens=score_tokens, block_size=block_size,
              sink_tokens=sink_tokens, local_tokens=local_tokens, backend=backend, score_samples=score_samples,
              hardkuma_steps=hardkuma_steps, search_seed=search_seed, chat_template=chat_template,
              **({} if numerics is None else dict(numerics=numerics)))    # absent: older state.json files resume
    if certify and certify_seed == search_seed:
        raise ValueError("certify_seed must differ from search_seed: held-out prompts come from unused seeds")
    with dynamo_limits():     # Dynamo's recompile limits raised for the run's many variants (scoped)
        store = Store(out_dir, _settings(model, tgt, kw))
        s = Session(model, tokenizer, tgt, store, kw, progress, log)
        t0 = time.perf_counter()
        scores = s.head_scores(head_scores)
        room = beyond_first(s.global_layers(), scores.shape[1])
        points = walk(head_counts or default_heads(room), budgets, lambda n, b: s.evaluate_point(scores, n, b))
        search_s = time.perf_counter() - t0
        best = cheapest(points)
        log(f"search: {len(points)} points visited ({s.points_evaluated} evaluated now, the rest resumed), "
            f"{search_s:.0f} s; chosen: {_describe(best)}")
        cert, held_out = None, {}
        if best is not None and certify:
            t1 = time.perf_counter()
            held_out = {task: prompt_set(tokenizer, task, list(lengths), certify_prompts, certify_seed, text,
                                         score_tokens, chat_template) for task in tgt.tasks}
            for task in tgt.tasks:
                check_disjoint(s.search_items(task), held_out[task])
            cert = s.certify(scores, best, held_out, min_prompts, batch_size, certify_backend, certify_seed)
            cert["wall_s"] = round(time.perf_counter() - t1, 1)
            log(f"certify: {cert['status']} ({'; '.join(cert['reasons']) or 'every interval within the target'})")
        from .outputs import write_outputs
        data = digest(text, *(s.search_items(t) for t in tgt.tasks), *held_out.values())
        status, hm, paths = write_outputs(s, scores, points, best, cert, search_s, data, out_dir)
        return Calibration(status, hm, points, best, cert, paths, s.points_evaluated, s.scorings,
                           cert["scored_now"] if cert else 0)


def _describe(p) -> str:
    if p is None:
        return "none (no visited point met the target)"
    return f"{p['heads']} retrieval heads beyond the first global layer, budget {p['budget']}, " \
           f"{100 * p['bytes_ratio']:.1f}% of dense KV bytes per step"
