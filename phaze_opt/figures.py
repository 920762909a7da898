"""The one place figures are made and written: a headless pyplot, and a writer that saves and frees.

Reports, the study's Pareto plot and the convergence comparison all go through it, so every figure
is drawn without a display (Agg), saved at one resolution into a folder made on demand, and closed
(pyplot keeps every open figure alive otherwise; a long published comparison draws dozens).
"""

from __future__ import annotations

from pathlib import Path

DPI = 110


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: most commands draw nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figure(fig, path: Path, *, tight: bool = False) -> Path:
    """Save `fig` as `path` (PNG by its suffix), making the folder; `tight` crops to what is drawn,
    legends outside the axes included. The figure is closed afterwards."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(path, dpi=DPI, bbox_inches="tight" if tight else None)
    finally:
        pyplot().close(fig)
    return path
