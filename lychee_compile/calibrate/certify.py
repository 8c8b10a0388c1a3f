"""Certification: the chosen point on held-out prompts (seeds the search never used), with paired 95% intervals.

    result = certify(base, variants, held_out, target, min_prompts=300, batch_size=32, store=store, key=key,
                     dense_key=dense_key)

`variants()` gives (dense Variant, lychee Variant) -- on a CUDA model the lychee one is built with the Inductor
backend, so the GPU kernels score it, `batch_size` prompts per decode step. Records are saved after every batch
(resumable): the lychee ones under `key` (one certification attempt), the dense ones under `dense_key` (the held-out
set's, shared by every attempt: a later attempt decodes only its lychee variant, except for the KL metric, which
needs the dense distributions again). Status:
    certified     every metric's interval lies within its bound, on >= min_prompts held-out prompts each
    unconfirmed   the point estimates meet the target but an interval does not, or there are too few prompts
    failed        a point estimate misses the target on the held-out prompts
"""
from __future__ import annotations

from .batch_scoring import score_batches
from .evaluate import compare, counters_of, records_of


def score_task(base, variants, items, batch_size: int, store, key: str, dense_key: str, pad_id: int,
               progress=None, kl: bool = False) -> tuple[dict, list[dict]]:
    """(this attempt's lychee records and counters, the dense records). `variants()` -> (dense, lychee) Variants,
    called only if prompts are left to score."""
    done = store.get(key) or {"lychee": [], "decode_calls": 0}
    dense_done = store.get(dense_key)
    if dense_done is None:                  # state.json files that kept the dense records in the attempt
        dense_done = done.pop("dense", [])
        if dense_done:
            store.put(dense_key, dense_done)
    start = len(done["lychee"])
    done["resumed_prompts"] = start
    if start and progress is not None:
        progress(start)
    for at in range(start, len(items), batch_size):
        dense, lychee = variants()
        chunk = items[at:at + batch_size]
        with_dense = kl or len(dense_done) < at + len(chunk)
        before = lychee.counters().decode_calls
        scores, kls = score_batches(base, [dense, lychee] if with_dense else [lychee], chunk, batch_size, pad_id,
                                    progress, kl)
        if len(dense_done) == at:
            dense_done += records_of("dense", scores[0], at)
            store.put(dense_key, dense_done)
        done["lychee"] += records_of("lychee", scores[-1], at, kls[-1] if kl else None)
        c = counters_of(lychee, before)
        done["decode_calls"] += c.pop("decode_calls")
        done["counters"] = c
        store.put(key, done)
    return done, dense_done[:len(done["lychee"])]


def certify(base, variants, held_out: dict, target, min_prompts: int, batch_size: int, store, key: str,
            dense_key: str, pad_id: int = 0, progress=None) -> dict:
    """The attempt's status, reasons, quality per metric; `misses`: a point estimate or an interval is outside the
    target (a more expensive point may certify; too few prompts alone is no miss)."""
    quality, reasons, status, scored, misses = {}, [], "certified", 0, False
    for task in target.tasks:
        done, dense = score_task(base, variants, held_out[task], batch_size, store, f"{key}/{task}",
                                 f"{dense_key}/{task}", pad_id, progress, target.needs_kl(task))
        scored += len(done["lychee"]) - done["resumed_prompts"]
        row = compare(done["lychee"], dense, "lychee")
        for metric in target.of_task(task):
            n = row["n"]
            quality[metric.name] = dict(value=metric.value(row), interval=metric.interval(row), n=n,
                                        decode_calls=done["decode_calls"], counters=done.get("counters"),
                                        resumed_prompts=done["resumed_prompts"])
            if not metric.meets(row):
                status, misses = "failed", True
                reasons.append(f"{metric}: {metric.value(row):+.3g} {metric.unit} on {n} held-out prompts")
                continue
            if not metric.meets(row, interval=True):
                misses = True
                reasons.append(f"{metric}: 95% interval {_fmt(metric.interval(row))} {metric.unit} reaches beyond "
                               "the bound")
            if n < min_prompts:
                reasons.append(f"{metric}: {n} held-out prompts < {min_prompts}")
    if status != "failed" and reasons:
        status = "unconfirmed"
    return dict(status=status, reasons=reasons, quality=quality, scored_now=scored, misses=misses)


def _fmt(ci) -> str:
    return f"[{ci[0]:+.3g}, {ci[1]:+.3g}]"
