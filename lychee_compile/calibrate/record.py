"""The calibration record a calibrated HeadMap carries: metadata["calibration"] (JSON) plus two flat keys,
"recommended_budget" and "calibration_status", that HeadMap.recommended_budget / .calibration read back.

Fields: status (certified | unconfirmed | failed) and reasons; target; quality per metric on the held-out prompts
(value, paired 95% interval, prompt count) and on the search prompts; prompts (search and held-out counts per task,
seeds); kv_bytes_per_step, dense_kv_bytes_per_step and bytes_per_step_vs_dense (kv_bytes.py's model);
recommended_budget (tokens) and context_range [min, max] it was calibrated for; block_size / sink_tokens /
local_tokens it assumes; data_digest; tool_version; torch; device; search and certify wall seconds (every attempt);
certify_attempts: every certification attempt in order (heads, budget, bytes_per_step_vs_dense, status, quality).
"""
from __future__ import annotations

import json


def tool_version() -> str:
    """'lychee_compile VERSION, commit C' (the installed version, or 'source tree' when run from a checkout that is
    not installed, as on the lent GPU; the commit when the package's files are tracked by a git checkout, '+changes'
    if it has uncommitted changes)."""
    from importlib import metadata
    try:
        version = metadata.version("lychee_compile")
    except metadata.PackageNotFoundError:
        version = "source tree"
    commit = _commit()
    return f"lychee_compile {version}" + (f", commit {commit}" if commit else "")


def _commit() -> str | None:
    import os
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        # only a checkout of this package: not another project's repository that holds an installed copy
        ours = subprocess.run(["git", "-C", here, "ls-files", "--error-unmatch", os.path.basename(__file__)],
                              capture_output=True, text=True, timeout=10)
        head = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if ours.returncode or head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty else "")


def _quality(cert: dict) -> dict:
    return {m: dict(value=q["value"], interval=q["interval"], n=q["n"]) for m, q in cert["quality"].items()}


def calibration_record(kw: dict, target, chosen: dict, cert: dict | None, attempts, dense_bytes: float,
                       search_s: float, data_digest: str, device: str) -> dict:
    import torch
    status = cert["status"] if cert else "unconfirmed"
    reasons = cert["reasons"] if cert else ["not certified: the certification phase did not run"]
    return dict(
        status=status, reasons=reasons, target=str(target),
        quality=None if cert is None else _quality(cert),
        search_quality=chosen["quality"], search_passes=chosen["passes"],
        requested=bool(cert and cert.get("requested")),       # --certify-point: certified whatever the search said
        prompts=dict(search_per_length=kw["search_prompts"], search_seed=kw["search_seed"],
                     held_out={m: q["n"] for m, q in (cert or {}).get("quality", {}).items()},
                     certify_seed=None if cert is None else cert["seed"]),
        retrieval_heads=chosen["heads"], kv_bytes_per_step=chosen["bytes"], dense_kv_bytes_per_step=dense_bytes,
        bytes_per_step_vs_dense=chosen["bytes_ratio"], recommended_budget=chosen["budget"],
        context_range=[min(kw["lengths"]), max(kw["lengths"])], lengths=kw["lengths"],
        block_size=kw["block_size"], sink_tokens=kw["sink_tokens"], local_tokens=kw["local_tokens"],
        head_scorer=kw["scorer"], data_digest=data_digest, text=kw["text"], tool_version=tool_version(),
        torch=torch.__version__, device=device, search_wall_s=round(search_s, 1),
        certify_wall_s=None if cert is None else round(sum(c["wall_s"] for _, c in attempts), 1),
        certify_attempts=[dict(heads=p["heads"], budget=p["budget"], bytes_per_step_vs_dense=p["bytes_ratio"],
                               status=c["status"], quality=_quality(c), requested=c.get("requested", False))
                          for p, c in attempts],
        certify_backend=None if cert is None else cert["backend"],
        certify_batch_size=None if cert is None else cert["batch_size"])


def with_record(head_map, record: dict):
    from ..head_map import HeadMap
    meta = dict(head_map.metadata, calibration=json.dumps(record, sort_keys=True),
                recommended_budget=str(record["recommended_budget"]), calibration_status=record["status"])
    return HeadMap(head_map.retrieval, meta, head_map.streaming)
