"""report.md: what was asked, every visited point, every certification attempt, the chosen point."""
from __future__ import annotations


def _q(quality: dict) -> str:
    return ", ".join(f"{m} {q['value']:+.3g} [{q['interval'][0]:+.3g}, {q['interval'][1]:+.3g}] (n={q['n']})"
                     for m, q in quality.items())


def _attempts(attempts) -> list[str]:
    lines = ["| attempt | retrieval heads | budget | KV bytes vs dense | held-out quality [95% paired intervals] | "
             "verdict |", "|---|---|---|---|---|---|"]
    lines += [f"| {k + 1} | {p['heads']} | {p['budget']} | {100 * p['bytes_ratio']:.1f}% | {_q(c['quality'])} | "
              f"{c['status']}" + (" (the requested point, certified whatever its search verdict)"
                                  if c.get("requested") else "")
              + (": " + "; ".join(c["reasons"]) if c["reasons"] else "") + " |"
              for k, (p, c) in enumerate(attempts)]
    return lines


def _chosen_attempt(record: dict, attempts) -> int:
    return next(k + 1 for k, (p, _) in enumerate(attempts)
                if (p["heads"], p["budget"]) == (record["retrieval_heads"], record["recommended_budget"]))


def render(record: dict | None, points: list[dict], attempts, kw: dict, target, status: str) -> str:
    lines = [f"# Calibration: {status}", "",
             f"Target {target} (passkey: accuracy points vs dense; ppl / repeat: % perplexity above dense), contexts "
             f"{kw['lengths']}, {kw['search_prompts']} search prompts per length and task (seed {kw['search_seed']}), "
             f"heads ordered by {kw['scorer']}, block {kw['block_size']}, sink {kw['sink_tokens']}, local "
             f"{kw['local_tokens']}.", "",
             "## Search (point estimates on the search prompts; [95% paired intervals])", "",
             f"A point passes the search when every point estimate is within the bound less "
             f"{100 * kw['search_margin']:g}% of it (--search-margin).", "",
             "| retrieval heads | budget | KV bytes vs dense | quality | passes |", "|---|---|---|---|---|"]
    lines += [f"| {p['heads']} | {p['budget']} | {100 * p['bytes_ratio']:.1f}% | {_q(p['quality'])} | "
              f"{'yes' if p['passes'] else 'no'} |" for p in points]
    if record is None and any(p["passes"] for p in points):
        lines += ["", "Only points that read as many KV bytes per step as dense (every head retrieval) met the "
                      "target: no map written. At this target and these contexts, sparse heads on this model cost "
                      "more quality than the target allows; larger budgets or a looser target may find one."]
        return "\n".join(lines) + "\n"
    if record is None:
        lines += ["", "No visited point met the target: no map written. Widen the grid (more heads, larger "
                      "budgets) or loosen the target."]
        return "\n".join(lines) + "\n"
    lines += ["", "## Chosen", "",
              f"{record['retrieval_heads']} retrieval heads beyond the first global layer, recommended budget "
              f"**{record['recommended_budget']} tokens**, {100 * record['bytes_per_step_vs_dense']:.1f}% of dense "
              f"KV bytes per step, for contexts {record['context_range'][0]}-{record['context_range'][1]}."
              + (f" Requested by --certify-point, not the search's choice; on the search prompts it "
                 f"{'passed' if record['search_passes'] else 'missed'}." if record.get("requested") else ""), "",
              "## Certification (held-out prompts)", ""]
    if record["quality"] is None:
        lines.append("Not run.")
    else:
        lines += _attempts(attempts) + ["", f"Backend {record['certify_backend']}, batch "
                                            f"{record['certify_batch_size']}, device {record['device']}, seed "
                                            f"{record['prompts']['certify_seed']}; the map is written for attempt "
                                            f"{_chosen_attempt(record, attempts)}."]
    lines += ["", f"Status **{record['status']}**" + (": " + "; ".join(record["reasons"]) if record["reasons"] else ""),
              "", f"Search {record['search_wall_s']} s, certification {record['certify_wall_s']} s; data digest "
              f"{record['data_digest']}; {record['tool_version']}, torch {record['torch']}."]
    return "\n".join(lines) + "\n"
