"""The main job's figure: a 1-D predictive with its data (needs matplotlib: `keras-dvi[plot]`)."""

import importlib.util

import numpy as np


def available():
    """Whether matplotlib, which draws the figure, is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def write_predictive_plot(path, x, mean, half_width, train, test, truth=None, title="", level=0.95):
    """Writes a PNG of a 1-D regression predictive: its mean over `x`, the band
    `mean +- half_width` (the central `level` interval), the `(x, y)` points of `train` and
    `test`, and the curve `truth(x)` when given. Axes are labelled and a legend names each part.
    Uses matplotlib's object API (no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    order = np.argsort(x)
    x, mean, half_width = x[order], mean[order], half_width[order]
    figure = Figure(figsize=(7.2, 4.8), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.fill_between(x, mean - half_width, mean + half_width, color="#c6dbef",
                      label=f"{level:.0%} predictive interval")
    axes.plot(x, mean, color="#08519c", lw=2, label="predictive mean")
    if truth is not None:
        axes.plot(x, truth(x), color="black", lw=1, ls="--", label="true mean")
    axes.scatter(*train, s=6, color="#636363", alpha=0.6, label=f"training points ({len(train[0])})")
    axes.scatter(*test, s=14, color="#e6550d", marker="x", label=f"test points ({len(test[0])})")
    axes.set_xlabel("x")
    axes.set_ylabel("y")
    axes.set_title(title)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
