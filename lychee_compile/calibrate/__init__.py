"""`lychee calibrate`: find the cheapest head map x budget that keeps a model within a quality target of dense, and
confirm it on held-out prompts. docs/calibrate.md is the user's page.

    target.py         the quality target ("passkey=1pt,ppl=2%") and how a summarize() row meets it
    prompts.py        search / held-out prompt sets over the calibration text (eval/tasks.py builders), digest
    head_scores.py    head ordering: retrieval score or HardKuma (lychee_compile/training), top-n map
    kv_bytes.py       KV (+ Quest descriptor) bytes a decode step reads: the cost the search minimizes
    search.py         the staircase walk over head count x budget, the cheapest passing point, the next candidate
                      to certify after a rejection
    evaluate.py       one point on the search prompts vs dense (eval/scoring.py, eval/runner.summarize)
    batch_scoring.py  batched teacher-forced scoring for certification on the GPU
    certify.py        held-out confirmation with paired 95% intervals; certified / unconfirmed / failed; the dense
                      held-out records shared by every attempt
    session.py        one run's state: prompt banks, a compiled variant per budget, the resume store
    store.py          state.json: resumable pieces under the run's settings
    record.py         the calibration record in the HeadMap's metadata
    plot.py, report.py, outputs.py   frontier.png, report.md, the files of a run
    calibration.py    calibrate(): the two phases end to end
    cli.py            `lychee calibrate`
"""
from .calibration import Calibration, calibrate  # noqa: F401
