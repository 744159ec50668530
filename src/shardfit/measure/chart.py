"""A PNG of a profile: per phase, a stacked bar of measured bytes by category, the prediction beside."""
from __future__ import annotations

from shardfit.estimate.result import CATEGORIES, PHASES

COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "temporaries": "#8172b3"}


def write_chart(measured: dict, predicted: dict | None, path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in PHASES if p in measured]
    series = [("measured", measured)] + ([("predicted", predicted)] if predicted else [])
    width = 0.8 / len(series)
    scale, unit = _unit(max(sum(measured[p].get(c, 0) for c in CATEGORIES) for p in phases) if phases else 1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(phases), 4.2))
    for index, (name, data) in enumerate(series):
        xs = [i + (index - (len(series) - 1) / 2) * width for i in range(len(phases))]
        bottoms = [0.0] * len(phases)
        for cat in CATEGORIES:
            values = [data.get(p, {}).get(cat, 0) / scale for p in phases]
            ax.bar(xs, values, width * 0.95, bottom=bottoms, color=COLORS[cat],
                   label=cat if index == 0 else None, hatch="//" if name == "predicted" else None,
                   edgecolor="white" if name == "measured" else "black", linewidth=0.4)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels(phases if len(series) == 1 else [f"{p}\n(meas | pred)" for p in phases])
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_title(title or "memory by phase", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _unit(value: float):
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return size, unit
    return 1, "B"
