"""Write a run's results into its folder: calibrated.safetensors, frontier.png, report.md, certify_log.jsonl."""
from __future__ import annotations

import json
import os

from .plot import plot_frontier
from .record import calibration_record, with_record
from .report import render


def write_outputs(session, scores, points, chosen, cert, attempts, search_s: float, data_digest: str,
                  out_dir: str):
    """`attempts`: [(point, certification)] in order, `cert` the chosen point's (None: not certified)."""
    kw, target = session.kw, session.target
    paths = {"frontier": os.path.join(out_dir, "frontier.png"), "report": os.path.join(out_dir, "report.md")}
    plot_frontier(points, chosen, target.metrics, paths["frontier"], rejected=[p for p, c in attempts if c is not cert])
    record, hm = None, None
    if chosen is not None:
        record = calibration_record(kw, target, chosen, cert, attempts, session.kv_bytes(None, None), search_s,
                                    data_digest, str(session.model.device))
        hm = with_record(session.head_map(scores, chosen["heads"]), record)
        paths["head_map"] = os.path.join(out_dir, "calibrated.safetensors")
        hm.save(paths["head_map"])
    if attempts:
        paths["certify_log"] = os.path.join(out_dir, "certify_log.jsonl")
        with open(paths["certify_log"], "a") as f:
            for k, (p, c) in enumerate(attempts):
                f.write(json.dumps(dict(c, number=k + 1, point=dict(heads=p["heads"], budget=p["budget"],
                                                                    bytes_ratio=p["bytes_ratio"]))) + "\n")
    status = (record["status"] if record else "no point reading fewer bytes than dense met the target"
              if any(p["passes"] for p in points) else "no point met the target")
    with open(paths["report"], "w") as f:
        f.write(render(record, points, attempts, kw, target, status))
    return status, hm, paths
