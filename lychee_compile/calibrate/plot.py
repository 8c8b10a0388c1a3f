"""The frontier plot: KV bytes per decode step (relative to dense) against the first target metric, one marker per
visited point (meets / misses the target on the search prompts), the chosen point starred, the bound dashed."""
from __future__ import annotations


def plot_frontier(points: list[dict], chosen: dict | None, metric, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for passes, style, label in ((True, dict(marker="o", color="tab:green"), "meets the target"),
                                 (False, dict(marker="x", color="tab:red"), "misses")):
        pts = [p for p in points if p["passes"] == passes]
        if pts:
            ax.scatter([100 * p["bytes_ratio"] for p in pts], [p["quality"][metric.name]["value"] for p in pts],
                       label=label, **style)
    for p in points:
        ax.annotate(f"{p['heads']}h/{p['budget']}", (100 * p["bytes_ratio"], p["quality"][metric.name]["value"]),
                    fontsize=6, xytext=(3, 3), textcoords="offset points")
    if chosen is not None:
        ax.scatter([100 * chosen["bytes_ratio"]], [chosen["quality"][metric.name]["value"]], marker="*", s=220,
                   facecolors="none", edgecolors="k", label="chosen")
    ax.axhline(-metric.bound if metric.name == "passkey" else metric.bound, color="k", ls="--", lw=0.8,
               label=f"bound {metric}")
    ax.set_xlabel("KV bytes read per decode step, % of dense")
    ax.set_ylabel({"passkey": "passkey accuracy vs dense, points", "kl": "KL(dense || lychee), nats per token"}.get(
        metric.name, f"{metric.name} perplexity vs dense, % above"))
    ax.set_title(title or "calibration frontier (search prompts)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
