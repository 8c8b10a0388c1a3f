"""The frontier plot: KV bytes per decode step (relative to dense) against each target metric (one panel each), one
marker per visited point (passes / misses the search), the points certification rejected ringed, the chosen point
starred, the metric's bound dashed."""
from __future__ import annotations

YLABEL = {"passkey": "passkey accuracy vs dense, points", "kl": "KL(dense || lychee), nats per token",
          "ppl": "perplexity vs dense, % above", "repeat": "repeat-test perplexity vs dense, % above"}


def plot_frontier(points: list[dict], chosen: dict | None, metrics, path: str, title: str = "",
                  rejected: list[dict] = ()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(metrics), 1, figsize=(6.4, 0.6 + 3.4 * len(metrics)), squeeze=False)
    for ax, metric in zip(axes[:, 0], metrics):
        _panel(ax, points, chosen, metric, rejected)
    axes[0, 0].set_title(title or "calibration frontier (search prompts)", fontsize=9)
    axes[-1, 0].set_xlabel("KV bytes read per decode step, % of dense")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel(ax, points, chosen, metric, rejected) -> None:
    def xy(p):
        return 100 * p["bytes_ratio"], p["quality"][metric.name]["value"]

    for passes, style, label in ((True, dict(marker="o", color="tab:green"), "passes the search"),
                                 (False, dict(marker="x", color="tab:red"), "misses")):
        pts = [xy(p) for p in points if p["passes"] == passes]
        if pts:
            ax.scatter(*zip(*pts), label=label, **style)
    for p in points:
        ax.annotate(f"{p['heads']}h/{p['budget']}", xy(p), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if rejected:
        ax.scatter(*zip(*[xy(p) for p in rejected]), marker="o", s=140, facecolors="none", edgecolors="tab:red",
                   label="rejected by certification")
    if chosen is not None:
        ax.scatter(*xy(chosen), marker="*", s=220, facecolors="none", edgecolors="k", label="chosen")
    ax.axhline(-metric.bound if metric.name == "passkey" else metric.bound, color="k", ls="--", lw=0.8,
               label=f"bound {metric}")
    ax.set_ylabel(YLABEL[metric.name], fontsize=8)
    ax.legend(fontsize=7)
