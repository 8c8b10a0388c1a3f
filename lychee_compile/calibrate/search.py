"""The search: walk the pass/fail boundary of retrieval-head count x budget and pick the cheapest passing point.

    points = walk(head_counts, budgets, evaluate)     # evaluate(heads, budget) -> dict with "passes" and "bytes"
    best = cheapest(points, dense)                    # fewest KV bytes per step among the passing points that
                                                      # read fewer than dense, or None
    nxt = next_candidate(points, failed, head_counts, budgets, cost, dense)   # what to certify after `failed`

Quality is taken to grow with both the head count and the budget (a staircase): starting at the most heads and the
smallest budget, a passing point moves to one head count fewer at the same budget, a failing one to the next
budget. That visits at most len(head_counts) + len(budgets) - 1 points and finds, for every head count the walk
reaches, its smallest passing budget -- the frontier. Where quality is not monotone a cheaper passing point can be
missed: every visited point, failing ones included, is in the report and the plot.

Escalation, when certification rejects a point: the next candidate is the cheapest (KV bytes) of the passing search
points and the unsearched grid neighbours (one head count up, or one budget up) of each rejected point, leaving out
every point with fewer-or-equal heads and a smaller-or-equal budget than a rejected one (by the same monotonicity it
cannot do better) and, among the unsearched neighbours, those below a point that failed the search.
"""
from __future__ import annotations


def walk(head_counts: list[int], budgets: list[int], evaluate) -> list[dict]:
    heads, buds = sorted(set(head_counts)), sorted(set(budgets))
    i, j, visited = len(heads) - 1, 0, []
    while i >= 0 and j < len(buds):
        point = evaluate(heads[i], buds[j])
        visited.append(point)
        if point["passes"]:
            i -= 1
        else:
            j += 1
    return visited


def cheapest(points: list[dict], dense: float | None = None) -> dict | None:
    """The passing point with the fewest KV bytes per step that reads fewer than `dense` (dense attention's bytes; a
    point with every head retrieval saves nothing, so it is no map to write); None if there is none."""
    passing = [p for p in points if p["passes"] and (dense is None or p["bytes"] < dense)]
    return min(passing, key=lambda p: (p["bytes"], p["budget"], p["heads"])) if passing else None


def _below(hb, points) -> bool:
    """(heads, budget) has fewer-or-equal heads and a smaller-or-equal budget than one of `points`."""
    return any(hb[0] <= p["heads"] and hb[1] <= p["budget"] for p in points)


def next_candidate(points: list[dict], rejected: list[dict], head_counts, budgets, cost,
                   dense: float | None = None) -> tuple[int, int] | None:
    """(heads, budget) to certify next, or None. `points`: every searched point; `rejected`: the points
    certification rejected; cost(heads, budget) -> KV bytes (for unsearched points); `dense`: as for cheapest(), no
    candidate reads as many bytes. With nothing rejected: the cheapest passing point, as cheapest()."""
    heads, buds = sorted(set(head_counts)), sorted(set(budgets))
    searched = {(p["heads"], p["budget"]): p for p in points}
    pool = {hb for hb, p in searched.items() if p["passes"]}
    for r in rejected:
        i, j = heads.index(r["heads"]), buds.index(r["budget"])
        pool |= {hb for hb in ((heads[min(i + 1, len(heads) - 1)], r["budget"]),
                               (r["heads"], buds[min(j + 1, len(buds) - 1)])) if hb not in searched}
    failing = [p for p in points if not p["passes"]]
    pool = [hb for hb in pool if not _below(hb, rejected) and (hb in searched or not _below(hb, failing))]

    def key(hb):
        return (searched[hb]["bytes"] if hb in searched else cost(*hb), hb[1], hb[0])
    pool = [hb for hb in pool if dense is None or key(hb)[0] < dense]
    return min(pool, key=key) if pool else None
