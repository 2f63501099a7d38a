"""PNGs for the examples: loss curves and fields side by side (matplotlib, no display)."""

import os
from pathlib import Path

import numpy as np


def save_loss_curves(out, curves, title, ylabel, log=False):
    """Plot `curves` ({label: losses}; the second and later dashed) into the PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, losses) in enumerate(curves.items()):
        ax.plot(losses, "--" if i else "-", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    # (the legend below the axes, off the curves; "tight" keeps it in the PNG)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100, bbox_inches="tight")
    plt.close(fig)
    print(f"loss curve written to {out}")


def save_fields(path, panels):
    """Write the panels (title, global field) side by side as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vmax = max(np.abs(field).max() for _, field in panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4), constrained_layout=True)
    for ax, (title, field) in zip(axes, panels):
        image = ax.imshow(field, cmap="RdBu_r", vmin=-vmax, vmax=vmax, origin="lower")
        ax.set_title(title)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(image, ax=axes, shrink=0.8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
