"""The loss curve of a run, from its metrics.jsonl, as a PNG (krnl train --plot)."""

import io
import json

from ..io.fileio import atomic_write_bytes


def plot_metrics(metrics_path, png_path):
    """Loss curve (train, and validation where present) from a metrics JSONL file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, vsteps, vlosses = [], [], [], []
    with open(metrics_path) as f:
        for line in f:
            r = json.loads(line)
            steps.append(r["step"])
            losses.append(r["loss"])
            if "val_loss" in r:
                vsteps.append(r["step"])
                vlosses.append(r["val_loss"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label="train", lw=1)
    if vsteps:
        ax.plot(vsteps, vlosses, "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if min(losses + vlosses, default=1.0) > 0:  # GRPO's and DPO's losses may be 0 or below
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(png_path, buf.getvalue())
