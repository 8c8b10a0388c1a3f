"""Write a run's results into its folder: calibrated.safetensors, frontier.png, report.md, certify_log.jsonl."""
from __future__ import annotations

import json
import os

from .plot import plot_frontier
from .record import calibration_record, with_record
from .report import render


def write_outputs(session, scores, points, chosen, cert, search_s: float, data_digest: str, out_dir: str):
    kw, target = session.kw, session.target
    paths = {"frontier": os.path.join(out_dir, "frontier.png"), "report": os.path.join(out_dir, "report.md")}
    plot_frontier(points, chosen, target.metrics, paths["frontier"])
    record, hm = None, None
    if chosen is not None:
        record = calibration_record(kw, target, chosen, cert, session.kv_bytes(None, None), search_s, data_digest,
                                    str(session.model.device))
        hm = with_record(session.head_map(scores, chosen["heads"]), record)
        paths["head_map"] = os.path.join(out_dir, "calibrated.safetensors")
        hm.save(paths["head_map"])
    if cert is not None:
        paths["certify_log"] = os.path.join(out_dir, "certify_log.jsonl")
        with open(paths["certify_log"], "a") as f:
            f.write(json.dumps(dict(cert, point=dict(heads=chosen["heads"], budget=chosen["budget"]))) + "\n")
    status = record["status"] if record else "no point met the target"
    with open(paths["report"], "w") as f:
        f.write(render(record, points, kw, target, status))
    return status, hm, paths
