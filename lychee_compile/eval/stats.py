"""95% intervals: Wilson for accuracies, paired percentile bootstrap (over prompts) for differences and perplexity."""
from __future__ import annotations

import math
import random


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def bootstrap(values: list, stat, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile 95% interval of stat(resample) over resamples of `values` (items: prompts, paired tuples...)."""
    if not values:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    n = len(values)
    stats = sorted(stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(n_boot))
    return (stats[int(0.025 * n_boot)], stats[min(n_boot - 1, int(0.975 * n_boot))])


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def ppl_of(nll_per_prompt: list[float]) -> float:
    """Perplexity over prompts with equal token counts: exp(mean NLL per token)."""
    return math.exp(mean(nll_per_prompt))
