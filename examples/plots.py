"""Loss-curve PNGs for the examples (matplotlib, no display needed)."""

import os


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
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    print(f"loss curve written to {out}")
