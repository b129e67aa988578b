"""A group's figures (``plot_group``): bars of time, cost and energy, time against cost, and the
scores as a heat map."""
from __future__ import annotations

import os

from jaxaccel.compare.join import Group
from jaxaccel.compare.tables import energy_unit


def _log_if_wide(set_scale, values) -> None:
    """Log axis when the values span more than 100x (a CPU beside an accelerator)."""
    if max(values) > 100 * min(values) > 0:
        set_scale("log")


def plot_group(g: Group, out_dir: str, stem: str) -> list[str]:
    """Bars (time, cost, energy), time-vs-cost scatter (marker size = energy), score heat map."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for name, figure in (("bars", _bars), ("scatter", _scatter), ("scores", _scores)):
        fig = figure(plt, g)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"{stem}-{name}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _bars(plt, g: Group):
    labels = [c.label for c in g.candidates]
    unit, div = energy_unit(g)
    fig, axes = plt.subplots(1, 3, figsize=(13, 1.2 + 0.45 * len(labels)), sharey=True)
    for ax, (name, vals) in zip(axes, (("time s", [c.time_s for c in g.candidates]),
                                       ("cost $", [c.cost_usd for c in g.candidates]),
                                       (f"energy {unit}", [c.energy_j / div
                                                          for c in g.candidates]))):
        colors = ["tab:gray" if name.startswith("energy") and
                  c.energy_source.startswith("estimate") else "tab:blue" for c in g.candidates]
        ax.barh(range(len(labels)), vals, color=colors)
        _log_if_wide(ax.set_xscale, vals)
        ax.set_title(name + (" (grey: estimate)" if "tab:gray" in colors else ""), fontsize=9)
        ax.tick_params(labelsize=8)
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].invert_yaxis()
    fig.suptitle(g.title, fontsize=10)
    return fig


def _scatter(plt, g: Group):
    fig, ax = plt.subplots(figsize=(7, 5))
    e = [c.energy_j for c in g.candidates]
    sizes = [60 + 600 * v / max(e) for v in e]
    ax.scatter([c.time_s for c in g.candidates], [c.cost_usd for c in g.candidates], s=sizes,
               alpha=0.6)
    for c in g.candidates:
        ax.annotate(c.label, (c.time_s, c.cost_usd), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    _log_if_wide(ax.set_xscale, [c.time_s for c in g.candidates])
    _log_if_wide(ax.set_yscale, [c.cost_usd for c in g.candidates])
    ax.set_xlabel("time s")
    ax.set_ylabel("cost $")
    ax.set_title(f"{g.title}\nmarker area ~ energy", fontsize=9)
    return fig


def _scores(plt, g: Group):
    labels = [c.label for c in g.candidates]
    strategies = list(g.candidates[0].scores)
    grid = [[c.scores[s] for s in strategies] for c in g.candidates]
    fig, ax = plt.subplots(figsize=(2 + 1.1 * len(strategies), 1.2 + 0.45 * len(labels)))
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for i, row in enumerate(grid):
        best = [min(r[j] for r in grid) for j in range(len(strategies))]
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.3f}" + ("*" if v == best[j] else ""), ha="center",
                    va="center", fontsize=7, color="w" if v > (max(map(max, grid)) +
                                                            min(map(min, grid))) / 2 else "k")
    ax.set_xticks(range(len(strategies)), strategies, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(f"score (lower is better, * best)\n{g.title}", fontsize=9)
    fig.colorbar(im, ax=ax)
    return fig
