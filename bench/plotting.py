"""The benchmarks' plots: matplotlib without a display, one figure per PNG.

    from plotting import save, subplots

    fig, axes = subplots(1, 2, figsize=(11, 4))
    axes[0].plot(...)
    save(fig, path)

The benchmarks run as scripts (``python bench/NAME.py``), so this directory is on ``sys.path``.
matplotlib is imported on first use: a run that draws nothing never loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 110
"""The resolution of the benchmarks' PNGs unless a plot asks for another."""


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (writes files, needs no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def subplots(nrows: int = 1, ncols: int = 1, **options: Any) -> tuple[Figure, Any]:
    """A new figure and its axes: ``plt.subplots(nrows, ncols, **options)`` on the Agg backend."""
    fig, axes = pyplot().subplots(nrows, ncols, **options)
    return fig, axes


def save(fig: Figure, path: str | Path, dpi: int = DPI) -> None:
    """Lay ``fig`` out tight, write it to ``path`` (its suffix picks the format) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
