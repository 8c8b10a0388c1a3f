"""LycheeDecode Fig. 7-style plots: E[z] per head over training steps (heatmap) and the final map."""
from __future__ import annotations

import torch


def plot_history(history: list[dict], num_layers: int, num_kv: int, path: str, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = torch.tensor([h["score"] for h in history])                 # [steps, H] (layers 1.. x heads)
    full = torch.cat([torch.ones(scores.shape[0], num_kv), scores], dim=1)  # first layer: always 1
    fig, ax = plt.subplots(figsize=(7, 8))
    im = ax.imshow(full.T.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest",
                   extent=(0.5, scores.shape[0] + 0.5, num_layers * num_kv - 0.5, -0.5))
    ax.set_xlabel("training step")
    ax.set_ylabel(f"head (layer x {num_kv} + KV head)")
    ax.set_yticks([l * num_kv for l in range(0, num_layers, 2)], [f"L{l}" for l in range(0, num_layers, 2)])
    ax.set_title(title or "E[z] per head over training")
    fig.colorbar(im, ax=ax, label="E[z]  (score)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_map(score_matrix: torch.Tensor, retrieval: torch.Tensor, path: str, title: str = "",
             score_label: str = "final score") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(6, 8))
    im = axes[0].imshow(score_matrix.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    axes[0].set_title(score_label)
    axes[1].imshow(retrieval.float().numpy(), aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    axes[1].set_title(f"map: {int(retrieval.sum())} retrieval (black)")
    for ax in axes:
        ax.set_ylabel("layer")
        ax.set_xlabel("KV head")
        ax.set_xticks(range(score_matrix.shape[1]))
    axes[0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
