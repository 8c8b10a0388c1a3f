"""A quality target: how far from dense each metric may go, e.g. "passkey=1pt,ppl=2%".

    target = QualityTarget.parse("passkey=1pt,ppl=2%")
    target.metrics                       # (Metric("passkey", 1.0, "pt"), Metric("ppl", 2.0, "%"))
    metric.value(row), metric.meets(row, interval=False)   # row: one eval/runner.summarize() row

Metrics and the task each is measured on (eval/tasks.py):
    passkey=Xpt   passkey accuracy (all answer tokens argmax) may drop at most X points below dense, paired per prompt
    ppl=X%        perplexity of real text (task "ppl") at most X% above dense: exp(mean paired NLL difference)
    repeat=X%     the same on the repeat test (task "repeat": the second copy of a segment; the sharp one)
    kl=Xnat       mean KL(dense || lychee) of the next-token distributions, nats per scored token, on the "ppl"
                  prompts (the sensitive one: it sees every change of the distribution, not only the target's)
Search compares point estimates with the bound less a safety margin (a fraction of the bound: on a handful of
prompts a point just inside the bound is as likely just outside it); certification compares the paired 95%
interval's far end with the bound itself.
"""
from __future__ import annotations

import dataclasses

# metric -> (task of eval/tasks.py, unit)
METRICS = {"passkey": ("passkey", "pt"), "ppl": ("ppl", "%"), "repeat": ("repeat", "%"), "kl": ("ppl", "nat")}


@dataclasses.dataclass(frozen=True)
class Metric:
    name: str
    bound: float          # points (passkey) or percent (ppl, repeat)
    unit: str

    @property
    def task(self) -> str:
        return METRICS[self.name][0]

    def value(self, row: dict) -> float:
        """Accuracy difference in points (lychee - dense), or the perplexity ratio's excess in percent."""
        if self.name == "passkey":
            return 100.0 * row["acc_diff_vs_ref"]
        if self.name == "kl":
            return row["kl"]
        return 100.0 * (row["ppl_ratio_vs_ref"] - 1.0)

    def interval(self, row: dict) -> tuple[float, float]:
        if self.name == "passkey":
            lo, hi = row["acc_diff_ci"]
            return 100.0 * lo, 100.0 * hi
        if self.name == "kl":
            return tuple(row["kl_ci"])
        lo, hi = row["ppl_ratio_ci"]
        return 100.0 * (lo - 1.0), 100.0 * (hi - 1.0)

    def meets(self, row: dict, interval: bool = False, margin: float = 0.0) -> bool:
        """Point estimate (search) or the interval's worse end (certify) within the bound less `margin` x bound."""
        if interval:
            return self.within(self.interval(row)[0 if self.name == "passkey" else 1])
        return self.within(self.value(row), margin)

    def within(self, x: float, margin: float = 0.0) -> bool:
        """x (a value or an interval's worse end) within (1 - margin) x the bound."""
        limit = self.bound * (1.0 - margin)
        return x >= -limit if self.name == "passkey" else x <= limit

    def __str__(self) -> str:
        return f"{self.name}={self.bound:g}{self.unit}"


@dataclasses.dataclass(frozen=True)
class QualityTarget:
    metrics: tuple[Metric, ...]

    @classmethod
    def parse(cls, text: str) -> "QualityTarget":
        metrics, seen = [], set()
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, sep, bound = (x.strip() for x in part.partition("="))
            if not sep or name not in METRICS:
                raise ValueError(f"target {part!r}: write METRIC=BOUND with METRIC one of {', '.join(METRICS)} "
                                 "(e.g. passkey=1pt,ppl=2%)")
            unit = METRICS[name][1]
            if not bound.endswith(unit):
                raise ValueError(f"target {part!r}: {name} is bounded in {unit!r} (e.g. {name}=1{unit})")
            try:
                x = float(bound[:-len(unit)])
            except ValueError:
                raise ValueError(f"target {part!r}: {bound[:-len(unit)]!r} is not a number") from None
            if not x >= 0.0:
                raise ValueError(f"target {part!r}: the bound must be >= 0")
            if name in seen:
                raise ValueError(f"target {part!r}: {name} given twice")
            seen.add(name)
            metrics.append(Metric(name, x, unit))
        if not metrics:
            raise ValueError("empty quality target; e.g. passkey=1pt,ppl=2%")
        return cls(tuple(metrics))

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(m.task for m in self.metrics))

    def of_task(self, task: str) -> list[Metric]:
        return [m for m in self.metrics if m.task == task]

    def needs_kl(self, task: str) -> bool:
        return any(m.name == "kl" for m in self.of_task(task))

    def __str__(self) -> str:
        return ",".join(str(m) for m in self.metrics)
