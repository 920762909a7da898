"""The exhaustive sweep's visiting order for the throughput-area front, and what proves the front.

A point of area a whose proven throughput bound u is no higher than the best throughput T(a) of an
evaluated design of area <= a is weakly dominated by that design (at least its throughput, at most
its area), so it cannot add a vector to the front (`design.pareto`). The pruned sweep
(`branch_bound._Sweep`) settles a point when its bound is at or below its incumbent; this module
makes the incumbent T(a): it visits the designs in groups of equal area, smallest first, each group
best-first by bound like the single-objective sweep, with the incumbent carried from group to group
(T only rises with area). A group is drained before the next begins, because a larger design's
throughput proves nothing about a smaller one.

Area is exact per design and depends on the architecture alone (`hardware/area.py`; HBM capacity
and the recipe do not change it), so every point of a (microbatch, design row) cell shares one
area. Energy has no proven lower bound here, so a study with the energy objective sweeps the grid
(`setup.bound_obstacle`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..design.pareto import best_at_or_below
from .session import finished_trials, is_feasible


class AreaOrder:
    """Cells in groups of equal area, smallest area first, each group in decreasing level-0 bound."""

    def __init__(self, row_areas: np.ndarray, resumed: list[tuple[float, float]]):
        """`row_areas`: each design row's area (mm^2); `resumed`: (area, throughput) of the points an
        earlier run of the study evaluated, which raise the incumbent of every group at or above them."""
        self.row_areas = np.asarray(row_areas, dtype=float)
        self.visited = np.zeros(self.row_areas.size, dtype=bool)
        areas, scores = (np.array([a for a, _ in resumed]), np.array([s for _, s in resumed])) if resumed else ([], [])
        self.resumed_best = best_at_or_below(areas, scores)

    @staticmethod
    def incumbent(done_scores) -> float:
        """Nothing is known before the smallest group: resumed scores enter group by group."""
        return 0.0

    def orders(self, ub0: np.ndarray) -> Iterator[tuple[np.ndarray, float]]:
        """(flat cell indices of one area group in decreasing bound, the best resumed throughput at
        or below its area), group by group."""
        n_m, n_rows = ub0.shape
        values, group = np.unique(self.row_areas, return_inverse=True)
        by_group = np.argsort(group, kind="stable")
        starts = np.searchsorted(group[by_group], np.arange(values.size + 1))
        for g, area in enumerate(values):
            rows = by_group[starts[g]:starts[g + 1]]
            self.visited[rows] = True
            flat = (np.arange(n_m)[:, None] * n_rows + rows[None, :]).ravel()
            yield flat[np.argsort(-ub0.ravel()[flat], kind="stable")], float(self.resumed_best(area))

    def floor(self, incumbent: float) -> np.ndarray:
        """Per design row, the throughput a point must beat to be unsettled: the incumbent in the
        groups visited so far, nothing settled yet in the others."""
        return np.where(self.visited, incumbent, -np.inf)


def row_areas(space, grid) -> np.ndarray:
    """Each design row's area (architecture-major, HBM minor, as `branch_bound.Grid` numbers rows)."""
    areas = np.array([a["area_mm2"] for a in space.dies()], dtype=float)
    return np.repeat(areas, len(grid.hbms))


def resumed_points(space, trials) -> list[tuple[float, float]]:
    """(area, throughput) of every finished trial holding a point of the space (0 when infeasible)."""
    out = []
    for t in finished_trials(trials):
        point = t.user_attrs.get("point")
        if isinstance(point, dict) and t.state.name == "COMPLETE":
            out.append((float(space.area_check(point)[1]), float(t.values[0]) if is_feasible(t) else 0.0))
    return out


def front_open(trials, open_points: list[dict], space) -> bool:
    """Whether the front is proven: no point that failed or rests on unproven schedules has a bound
    above the best evaluated throughput at or below its area (else a better vector may exist there)."""
    done = resumed_points(space, trials)
    at = best_at_or_below(np.array([a for a, _ in done]), np.array([s for _, s in done])) if done else None
    for p in open_points:
        if p.get("bound") is None or not isinstance(p.get("point"), dict) or at is None:
            return True
        if p["bound"] > float(at(space.area_check(p["point"])[1])):
            return True
    return False
