"""The search: walk the pass/fail boundary of retrieval-head count x budget and pick the cheapest passing point.

    points = walk(head_counts, budgets, evaluate)     # evaluate(heads, budget) -> dict with "passes" and "bytes"
    best = cheapest(points)                           # fewest KV bytes per step among the passing points, or None

Quality is taken to grow with both the head count and the budget (a staircase): starting at the most heads and the
smallest budget, a passing point moves to one head count fewer at the same budget, a failing one to the next
budget. That visits at most len(head_counts) + len(budgets) - 1 points and finds, for every head count the walk
reaches, its smallest passing budget -- the frontier. Where quality is not monotone a cheaper passing point can be
missed: every visited point, failing ones included, is in the report and the plot.
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


def cheapest(points: list[dict]) -> dict | None:
    passing = [p for p in points if p["passes"]]
    return min(passing, key=lambda p: (p["bytes"], p["budget"], p["heads"])) if passing else None
