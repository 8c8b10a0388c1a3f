"""Scores of one searched point on the calibration prompts, against dense, in eval/runner.summarize()'s terms.

    bank = PromptBank(base, items)           # dense prefill of each prompt, made once and kept (lazily)
    recs = bank.score(variant, label)         # one record per prompt (eval/runner.py's fields)
    row = compare(recs, dense_recs, label)    # summarize() row: paired differences with 95% intervals

Every prompt is prefilled once, densely; the dense reference and every point decode copies of that cache, as
`lychee eval` does (eval/scoring.py), so comparisons are paired.
"""
from __future__ import annotations

from ..eval import stats
from ..eval.runner import summarize
from ..eval.scoring import dense_prefill
from .batch_scoring import as_batch, batch_steps, kl_per_token


def records_of(label: str, scores, start: int = 0, kls: list[float] | None = None) -> list[dict]:
    """eval/runner.py's record fields per prompt (+ "kl": the prompt's mean KL(dense || this) per token)."""
    recs = [dict(item=start + i, label=label, nll=s.nll, hit_rate=sum(s.hits) / len(s.hits), all_hit=s.all_hit)
            for i, s in enumerate(scores)]
    for r, k in zip(recs, kls or []):
        r["kl"] = k
    return recs


def compare(records: list[dict], dense: list[dict], label: str) -> dict:
    """The summarize() row of `label` with its paired differences to dense (+ "kl" and its bootstrap "kl_ci" over
    prompts when the records have it)."""
    results = dict(records=list(dense) + list(records),
                   variants=[dict(label="dense", method="dense", budget=None),
                             dict(label=label, method="lychee", budget=None)])
    row = summarize(results)[1]
    if records and "kl" in records[0]:
        kls = [r["kl"] for r in records]
        row["kl"], row["kl_ci"] = stats.mean(kls), stats.bootstrap(kls, stats.mean)
    return row


def counters_of(variant, calls_before: int) -> dict:
    """The counters `lychee eval` checks, with the decode calls this scoring made through the rewritten graph."""
    c = variant.counters()
    return dict(decode_calls=c.decode_calls - calls_before, decode_graphs=c.decode_graphs,
                sites_rewritten=c.sites_rewritten, graphs_left_dense=c.graphs_left_dense)


class PromptBank:
    def __init__(self, base, items):
        self.base, self.items = base, items
        self._prefills: dict[int, object] = {}
        self._dense_rows: dict[int, object] = {}
        self.scored = 0            # (variant, prompt) scorings done: what resume saves

    def prefill(self, i: int):
        if i not in self._prefills:
            it = self.items[i]
            self._prefills[i] = dense_prefill(self.base, it.input_ids, it.max_cache_len)
        return self._prefills[i]

    def dense_rows(self, i: int):
        """Dense log-probabilities at prompt i's scored positions (the KL reference), kept."""
        if i not in self._dense_rows:
            _, (rows,) = batch_steps(self.base, as_batch(self.prefill(i)), [self.items[i].targets], True)
            self._dense_rows[i] = rows
        return self._dense_rows[i]

    def score(self, variant, label: str, progress=None, kl: bool = False) -> list[dict]:
        """One record per prompt; kl: through batch_scoring.batch_steps (batch of one) with the KL to dense."""
        scores, kls = [], []
        for i, it in enumerate(self.items):
            if kl:
                (s,), (rows,) = batch_steps(variant.sequence_call(), as_batch(self.prefill(i)), [it.targets], True,
                                            variant.scratch)
                variant.check_sparse()
                kls.append(kl_per_token(self.dense_rows(i), rows))
            else:
                s = variant.score(self.prefill(i), it.targets)
            scores.append(s)
            self.scored += 1
            if progress is not None:
                progress(1)
        return records_of(label, scores, 0, kls if kl else None)
