"""Throughput-area fronts of compared studies: hypervolume against trials and time, and a plot.

Every study's feasible trials are points (throughput, area): the area is the design's own
(`result.area_mm2`), so a single-objective study (the bound-guided searcher, say) is measured on the
same plane as a multi-objective one. The hypervolume (`design.pareto.hypervolume`) is taken against
the reference point throughput 0 and area = the space's area budget (a feasible design has area at
most the budget, so every feasible point counts). The front it is compared with is the exact one of
an exhaustive study that proved it (`exhaustive_status.front_proven`), else the union of every
study's points ("best known").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..design.pareto import front, hypervolume
from ..design.space import load_space
from ..errors import PhazeError
from ..figures import pyplot, write_figure
from ..search import finished_trials, is_feasible

THRESHOLD = 0.95  # the fraction of the reference front's hypervolume a study must reach


@dataclass
class FrontCurve:
    name: str
    exact: bool  # an exhaustive study that proved its throughput-area front
    points: np.ndarray  # [n, 2] (throughput, area) in wall-clock order
    elapsed: list  # seconds into the study of each point's trial
    trial_index: list  # how many finished trials when the point came (1-based)
    hv: list = field(default_factory=list)  # hypervolume after each point


def study_points(trials, elapsed: dict) -> tuple[np.ndarray, list, list]:
    """(throughput, area) of the feasible trials in wall-clock order, their times and trial counts."""
    done = sorted(finished_trials(trials), key=lambda t: (elapsed[t.number], t.number))
    rows, times, counts = [], [], []
    for i, t in enumerate(done, 1):
        area = (t.user_attrs.get("result") or {}).get("area_mm2")
        if is_feasible(t) and isinstance(area, (int, float)) and math.isfinite(area):
            rows.append((float(t.values[0]), float(area)))
            times.append(elapsed[t.number])
            counts.append(i)
    return np.array(rows, dtype=float).reshape(-1, 2), times, counts


def reference_point(space_name: str | None, curves: Sequence[FrontCurve]) -> tuple[float, float]:
    """(throughput 0, the space's area budget); the largest area any study holds when the space
    cannot be loaded (a study made elsewhere)."""
    try:
        budget = float(load_space(space_name).area_budget_mm2) if space_name else None
    except PhazeError:
        budget = None
    if budget is None:
        budget = max((float(c.points[:, 1].max()) for c in curves if len(c.points)), default=1.0)
    return 0.0, budget


def _minimised(points: np.ndarray) -> np.ndarray:
    return np.column_stack([-points[:, 0], points[:, 1]]) if len(points) else points.reshape(0, 2)


def with_hypervolume(curve: FrontCurve, ref: tuple[float, float]) -> FrontCurve:
    """The hypervolume after each point: recomputed only when a point joins the front."""
    r = np.array([-ref[0], ref[1]])
    mins = _minimised(curve.points)
    hv, current, members = [], 0.0, np.zeros((0, 2))
    for p in mins:
        if not np.any(np.all(members <= p, axis=1)):
            members = front(np.vstack([members, p]))
            current = hypervolume(members, r)
        hv.append(current)
    curve.hv = hv
    return curve


def table(curves: Sequence[FrontCurve], ref: tuple[float, float], threshold: float = THRESHOLD) -> tuple[list[dict], float, str]:
    """Per study: its front's size and hypervolume, the fraction of the reference front's, and the
    trials and seconds it took to reach `threshold` of it. Returns (rows, reference hypervolume, what
    the reference front is)."""
    exact = [c for c in curves if c.exact]
    if exact:
        base, what = exact[0].hv[-1] if exact[0].hv else 0.0, f"the exact front of {exact[0].name}"
    else:
        union = np.vstack([c.points for c in curves])
        base, what = hypervolume(_minimised(union), np.array([-ref[0], ref[1]])), "the union of the studies' fronts"
    rows = []
    for c in curves:
        final = c.hv[-1] if c.hv else 0.0
        hit = next((i for i, v in enumerate(c.hv) if base > 0 and v >= threshold * base), None)
        rows.append({"study": c.name, "front_size": len(front(_minimised(c.points))) if len(c.points) else 0,
                     "hypervolume": final, "fraction": final / base if base > 0 else None,
                     "trials_to_target": c.trial_index[hit] if hit is not None else None,
                     "time_to_target_s": c.elapsed[hit] if hit is not None else None})
    return rows, base, what


def rows_markdown(rows: list[dict], base: float, what: str, ref: tuple[float, float], threshold: float = THRESHOLD) -> str:
    pct = f"{threshold * 100:g}%"
    head = ["study", "front size", "hypervolume (seq/s x mm^2)", "fraction of reference", f"trials to {pct}",
            f"time to {pct} (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["study"], str(r["front_size"]), f"{r['hypervolume']:.6g}",
            "n/a" if r["fraction"] is None else f"{r['fraction'] * 100:.2f}%",
            "not reached" if r["trials_to_target"] is None else str(r["trials_to_target"]),
            "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"]) + " |")
    return ("\n".join(lines) + f"\n\nReference front: {what}, hypervolume {base:.6g}; reference point: throughput "
            f"{ref[0]:g} seq/s, area {ref[1]:.6g} mm^2 (the space's area budget).\n")


def plot(curves: Sequence[FrontCurve], base: float, path: Path, title: str, threshold: float = THRESHOLD) -> Path:
    """Left: each study's front (area against throughput). Right: hypervolume fraction against time."""
    fig, (ax, bx) = pyplot().subplots(1, 2, figsize=(11, 4.8))
    for i, c in enumerate(curves):
        if not len(c.points):
            continue
        f = front(_minimised(c.points))
        f = f[np.argsort(f[:, 1])]  # by area: the staircase of the best throughput at or below each area
        ax.step(f[:, 1], -f[:, 0], where="post", color=f"C{i}", marker="o", ms=3,
                label=f"{c.name}{' (exact)' if c.exact else ''}: {len(f)} on the front")
        if base > 0:
            bx.step(c.elapsed, np.array(c.hv) / base, where="post", color=f"C{i}", label=c.name)
    ax.set_xlabel("area (mm^2)")
    ax.set_ylabel("throughput (sequences/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    bx.axhline(threshold, color="0.4", ls="--", lw=1, label=f"{threshold * 100:g}% of the reference")
    bx.set_xlabel("wall-clock (s): the study's search time")
    bx.set_ylabel("hypervolume / reference front's")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    write_figure(fig, path, tight=True)
    return path
