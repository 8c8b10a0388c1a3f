"""calibrate(): search the cheapest head map x budget that meets a quality target, certify it on held-out prompts
(and, while an attempt misses, the next candidate: search.next_candidate, at most `certify_attempts`), write the
calibrated map, the frontier plot and a report. The `lychee calibrate` command calls it.

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

from ..head_map import model_geometry
from .head_scores import beyond_first, score_heads, top_heads
from .prompts import CERTIFY_SEED, SEARCH_SEED, check_disjoint, digest, prompt_set
from .search import cheapest, next_candidate, walk
from .store import Store
from .target import QualityTarget

HEAD_COUNTS = (0, 2, 4, 8, 16, 24, 32, 48)
BUDGETS = (64, 128, 256, 512, 1024, 2048, 4096)


@dataclasses.dataclass
class Calibration:
    status: str                     # certified | unconfirmed | failed | no point ... met the target (outputs.py)
    head_map: object | None         # the calibrated HeadMap (None if no point met the target)
    points: list[dict]              # every visited point, in walk order
    chosen: dict | None             # the point the map was written for: the first certified attempt, else see final()
    certification: dict | None      # the chosen point's certification
    attempts: list[tuple[dict, dict]]   # every certification attempt: (point, certification), in order
    paths: dict
    points_evaluated: int           # points scored in this run (the rest came from state.json)
    scorings: int                   # search: (variant, prompt) scorings this run, dense and sensitivity probes incl.
    certify_scorings: int           # held-out prompts scored this run (dense and lychee each)


def default_budgets(lengths, sink: int, local: int) -> list[int]:
    return [b for b in BUDGETS if sink + local <= b < max(lengths)] or [max(sink + local, BUDGETS[0])]


def default_heads(room: int) -> list[int]:
    """HEAD_COUNTS up to `room` (the heads of the later global layers), and `room` itself if it is below 48; every
    count when room <= 4 (Gemma-3-270M has 2 such heads: between none and all of them there is only 1)."""
    small = set(range(room + 1)) if room <= 4 else set()
    return sorted({c for c in HEAD_COUNTS if c <= room} | ({room} if room < HEAD_COUNTS[-1] else set()) | small)


def _settings(model, tokenizer, target, kw) -> dict:
    from ..head_map import config_fingerprint
    from ..real_model import tokenizer_fingerprint
    return dict(model=config_fingerprint(model.config), tokenizer=tokenizer_fingerprint(tokenizer),
                dtype=str(model.dtype), target=str(target),
                **{k: v for k, v in kw.items() if k not in ("progress", "log", "certify", "certify_backend",
                                                            "batch_size", "certify_prompts", "certify_seed",
                                                            "min_prompts", "search_margin")})


def calibrate(model, tokenizer, target: str = "passkey=1pt,ppl=2%", out_dir: str = "calibration", *,
              lengths=(2048,), text: str = "persuasion", scorer: str = "retrieval-score", head_scores=None,
              head_counts=None, budgets=None, search_prompts: int = 10, search_margin: float = 0.5,
              certify_prompts: int = 300, certify_attempts: int = 4,
              min_prompts: int = 300, score_tokens: int = 16, block_size: int = 16, sink_tokens: int = 16,
              local_tokens: int = 64, backend: str = "eager", certify: bool = True, certify_backend: str | None = None,
              batch_size: int = 1, score_samples: int = 8, hardkuma_steps: int = 40, search_seed: int = SEARCH_SEED,
              certify_seed: int = CERTIFY_SEED, chat_template: bool = True, progress: bool = True,
              numerics: str | None = None, certify_point: tuple[int, int] | None = None, log=print) -> Calibration:
    """`head_scores`: float [L, Hkv] to order the heads instead of `scorer`. `certify_backend`: default "inductor"
    on a CUDA model (the GPU kernels), else `backend`. `numerics` ("reference" | "kernels", eval/numerics.py): search
    and certify on that numerics' copy of the model with its backend (kernels: bf16 on CUDA, Inductor, CUDA graphs,
    every rewritten site checked to have run the Triton kernels); None: `model`, `backend` and `certify_backend` as
    given. `certify_point` (retrieval heads beyond the first global layer, budget): certify that point whatever its
    search verdict (searched first if the walk did not visit it), one attempt, no escalation; the record marks it
    requested. See the module docstring and docs/calibrate.md."""
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
              budgets=budgets, search_prompts=search_prompts, search_margin=search_margin, score_tokens=score_tokens,
              block_size=block_size, sink_tokens=sink_tokens, local_tokens=local_tokens, backend=backend,
              score_samples=score_samples,
              hardkuma_steps=hardkuma_steps, search_seed=search_seed, chat_template=chat_template,
              **({} if numerics is None else dict(numerics=numerics)))    # absent: older state.json files resume
    if not 0.0 <= search_margin < 1.0 or certify_attempts < 1:
        raise ValueError(f"search_margin must be in [0, 1) (got {search_margin}) and certify_attempts >= 1 (got "
                         f"{certify_attempts})")
    if certify_point is not None and (not certify or len(certify_point) != 2 or certify_point[1] < 1):
        raise ValueError(f"certify_point must be (heads, budget >= 1) with certification on (got {certify_point}, "
                         f"certify={certify})")
    if certify and certify_seed == search_seed:
        raise ValueError("certify_seed must differ from search_seed: held-out prompts come from unused seeds")
    with dynamo_limits():     # Dynamo's recompile limits raised for the run's many variants (scoped)
        from ..head_map import legacy_config_fingerprint
        # a folder made before the tokenizer was recorded is refused: which tokenizer made its prompts is unknown
        store = Store(out_dir, _settings(model, tokenizer, tgt, kw),
                      aliases={"model": {legacy_config_fingerprint(model.config)}})
        s = Session(model, tokenizer, tgt, store, kw, progress, log)
        t0 = time.perf_counter()
        room = beyond_first(s.global_layers(), model_geometry(model.config)[1])
        if certify_point is not None:
            _check_requested(s, tuple(certify_point), room)
        scores = s.head_scores(head_scores)
        heads = head_counts or default_heads(room)
        points = walk(heads, budgets, lambda n, b: s.evaluate_point(scores, n, b))
        search_s = time.perf_counter() - t0
        dense = s.kv_bytes(None, None)         # a point reading as many bytes saves nothing: never chosen
        best = cheapest(points, dense)
        log(f"search: {len(points)} points visited ({s.points_evaluated} evaluated now, the rest resumed), "
            f"{search_s:.0f} s; chosen: {_describe(best)}"
            + ("" if certify_point is None else f"; certifying the requested point {tuple(certify_point)} instead"))
        attempts, held_out = [], {}
        if certify and (best is not None or certify_point is not None):
            held_out = {task: prompt_set(tokenizer, task, list(lengths), certify_prompts, certify_seed, text,
                                         score_tokens, chat_template) for task in tgt.tasks}
            for task in tgt.tasks:
                check_disjoint(s.search_items(task), held_out[task])
            run = (s, scores, held_out, min_prompts, batch_size, certify_backend, certify_seed, log)
            if certify_point is None:
                attempts = _certify_until(run, points, heads, budgets, certify_attempts, dense)
            else:
                point = _visited(s, scores, points, tuple(certify_point))
                attempts = [_attempt(run, point, "requested", requested=True)]
        chosen, cert = final(attempts) if attempts else (best, None)
        from .outputs import write_outputs
        data = digest(text, *(s.search_items(t) for t in tgt.tasks), *held_out.values())
        status, hm, paths = write_outputs(s, scores, points, chosen, cert, attempts, search_s, data, out_dir)
        return Calibration(status, hm, points, chosen, cert, attempts, paths, s.points_evaluated, s.scorings,
                           sum(c["scored_now"] for _, c in attempts))


def _check_requested(s, point: tuple[int, int], room: int) -> None:
    """Before any scoring: the requested point leaves a head sparse, its budget makes a valid config, and it reads
    fewer KV bytes per step than dense (the bytes depend on how many heads are retrieval, not which)."""
    heads, budget = point
    if not 0 <= heads < room:             # all `room` heads retrieval reads dense's bytes
        raise ValueError(f"certify_point asks for {heads} retrieval heads; this model has {room} beyond its first "
                         f"global layer, and a point must leave at least one sparse")
    s.lychee_config(budget)               # LycheeConfigError (a ValueError) for a budget the config refuses
    import torch
    some = top_heads(torch.zeros(model_geometry(s.model.config)), heads, s.global_layers())
    if s.kv_bytes(some, budget) >= s.kv_bytes(None, None):
        raise ValueError(f"certify_point {point} reads as many KV bytes per step as dense at contexts "
                         f"{s.kw['lengths']}: nothing to certify")


def _visited(s, scores, points, hb: tuple[int, int]) -> dict:
    """The point (heads, budget) of `points`, else searched now and appended."""
    point = next((p for p in points if (p["heads"], p["budget"]) == hb), None)
    if point is None:
        point = s.evaluate_point(scores, *hb)
        points.append(point)
    return point


def _attempt(run, point: dict, label: str, requested: bool = False) -> tuple[dict, dict]:
    """Certify `point` on the held-out prompts; `run` = (session, scores, held_out, min_prompts, batch_size,
    backend, seed, log)."""
    s, scores, held_out, min_prompts, batch_size, backend, seed, log = run
    t1 = time.perf_counter()
    cert = s.certify(scores, point, held_out, min_prompts, batch_size, backend, seed)
    cert.update(wall_s=round(time.perf_counter() - t1, 1), requested=requested)
    log(f"certify {label}: {_describe(point)}: {cert['status']} "
        f"({'; '.join(cert['reasons']) or 'every interval within the target'})")
    return point, cert


def _certify_until(run, points, heads, budgets, cap, dense) -> list[tuple[dict, dict]]:
    """Certify the cheapest candidate (search.next_candidate); while an attempt misses the target, the next one, at
    most `cap` attempts. An unsearched candidate is searched first (appended to `points`) and certified only if it
    passes the search. Returns [(point, certification)] in attempt order."""
    s, scores = run[0], run[1]
    attempts = []
    while len(attempts) < cap:
        hb = next_candidate(points, [p for p, _ in attempts], heads, budgets,
                            lambda n, b: s.kv_bytes(s.head_map(scores, n).retrieval, b), dense)
        if hb is None:
            break
        fresh = all((p["heads"], p["budget"]) != hb for p in points)
        point = _visited(s, scores, points, hb)
        if fresh and not point["passes"]:       # searched just now and failed: not certified
            continue
        attempts.append(_attempt(run, point, f"{len(attempts) + 1}/{cap}"))
        if not attempts[-1][1]["misses"]:
            break
    return attempts


def final(attempts: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """The certified attempt (escalation stops at it); else the last unconfirmed one, else the last failed one. The
    last attempt is the latest candidate, not necessarily the best measured one: a passing search point with fewer
    heads may follow a rejected point's neighbour (next_candidate orders by bytes)."""
    rank = {"certified": 0, "unconfirmed": 1, "failed": 2}
    return min(reversed(attempts), key=lambda a: rank[a[1]["status"]])


def _describe(p) -> str:
    if p is None:
        return "none (no visited point met the target)"
    return f"{p['heads']} retrieval heads beyond the first global layer, budget {p['budget']}, " \
           f"{100 * p['bytes_ratio']:.1f}% of dense KV bytes per step"
