"""The one place figures are made and written: a headless pyplot, and a writer that saves and frees.

Reports, the study's Pareto plot and the convergence comparison all go through it, so every figure
is drawn without a display (Agg), saved at one resolution into a folder made on demand, and closed
(pyplot keeps every open figure alive otherwise; a long published comparison draws dozens).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

DPI = 110


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: most commands draw nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_figure(fig, path: Path, *, tight: bool = False, write=None) -> Path:
    """Save `fig` as `path` (PNG by its suffix), making the folder; `tight` crops to what is drawn,
    legends outside the axes included. The figure is closed afterwards. The image is drawn in
    memory and handed whole to `write(path, data)` (a study passes its full-disk-aware writer);
    by default it is written beside its place and renamed into it, so no half-written file stays."""
    path = Path(path)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=path.suffix.lstrip(".") or "png", dpi=DPI, bbox_inches="tight" if tight else None)
    finally:
        pyplot().close(fig)
    (write or _write_aside)(path, buffer.getvalue())
    return path


def _write_aside(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
