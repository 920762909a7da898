"""Pareto fronts and their hypervolume, in one convention: every objective minimised.

A caller turns a maximised objective (throughput) into a minimised one by negating it (`minimised`).
The front is a set of objective vectors: two designs with the same vector are one front member, and
a point that some other point weakly dominates (no worse anywhere) adds nothing to it. That is what
the exhaustive sweep's pruning preserves (a point is skipped only when an evaluated point is at
least as good in every objective), so the sweep's front and a brute-force front compare as sets.

The hypervolume (Zitzler and Thiele, "Multiobjective optimization using evolutionary algorithms: a
comparative case study", PPSN 1998) is the measure of the region the front dominates, bounded by a
reference point that every counted point must beat in every objective. Two and three objectives are
computed exactly: the 2-D staircase sum, and 3-D as slabs along the third objective, each slab the
2-D hypervolume of the points at or below it (the "hypervolume by slicing objectives" idea, While,
Hingston, Barone and Huband, IEEE TEC 10(1), 2006). Optuna's own (`optuna._hypervolume`) is private,
so it is not used.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def minimised(values, directions: Sequence[str]) -> np.ndarray:
    """Rows of objective values -> the same rows with every maximised column negated."""
    signs = np.array([-1.0 if d == "maximize" else 1.0 for d in directions])
    return np.asarray(values, dtype=float).reshape(-1, len(signs)) * signs


def front_mask(points) -> np.ndarray:
    """Which rows (minimised) are on the front: no other row weakly dominates them; of equal rows,
    the first is kept. O(n log n + n * front) by sorting on the objectives first."""
    pts = np.asarray(points, dtype=float)
    n = len(pts)
    keep = np.zeros(n, dtype=bool)
    if n == 0:
        return keep
    order = np.lexsort(pts.T[::-1])  # lexicographic: a row can only be weakly dominated by one before it
    if pts.shape[1] == 2:  # two objectives: on the front when strictly below every earlier row's second
        second = pts[order, 1]
        before = np.minimum.accumulate(np.concatenate([[np.inf], second[:-1]]))
        keep[order] = second < before
        return keep
    kept: list[np.ndarray] = []
    for i in order:
        p = pts[i]
        if kept and np.any(np.all(np.stack(kept) <= p, axis=1)):
            continue
        kept.append(p)
        keep[i] = True
    return keep


def front(points) -> np.ndarray:
    """The front's distinct rows (minimised), sorted on the first objective."""
    pts = np.asarray(points, dtype=float)
    f = pts[front_mask(pts)] if len(pts) else pts.reshape(0, pts.shape[-1] if pts.ndim == 2 else 0)
    return f[np.lexsort(f.T[::-1])] if len(f) else f


def hypervolume(points, reference) -> float:
    """The exact hypervolume (minimised objectives) of `points` against `reference`; a point not
    strictly better than the reference in every objective counts nothing. Two or three objectives."""
    ref = np.asarray(reference, dtype=float)
    pts = np.asarray(points, dtype=float).reshape(-1, ref.size)
    pts = pts[np.all(pts < ref, axis=1)]
    if len(pts) == 0:
        return 0.0
    if ref.size == 2:
        return _hv2(front(pts), ref)
    if ref.size == 3:
        return _hv3(front(pts), ref)
    raise ValueError(f"hypervolume: {ref.size} objectives; two or three are supported")


def _hv2(f: np.ndarray, ref: np.ndarray) -> float:
    """A 2-D front sorted on x (so y falls): the union of boxes is a staircase of strips."""
    xs = np.append(f[:, 0], ref[0])
    return float(np.sum((xs[1:] - xs[:-1]) * (ref[1] - f[:, 1])))


def _hv3(f: np.ndarray, ref: np.ndarray) -> float:
    """Slabs between successive values of the third objective, each the 2-D hypervolume of the
    points at or below its lower face."""
    zs = np.unique(f[:, 2])
    bounds = np.append(zs, ref[2])
    total = 0.0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        below = f[f[:, 2] <= lo][:, :2]
        total += _hv2(front(below), ref[:2]) * (hi - lo)
    return total


def best_at_or_below(areas: np.ndarray, scores: np.ndarray):
    """The staircase T(a) = the best score among designs of area <= a, as a function of an array of
    areas (the throughput a design of area a must beat to join the throughput-area front)."""
    order = np.argsort(areas, kind="stable")
    xs, best = np.asarray(areas, dtype=float)[order], np.maximum.accumulate(np.asarray(scores, dtype=float)[order])

    def at(a) -> np.ndarray:
        i = np.searchsorted(xs, np.asarray(a, dtype=float), side="right") - 1
        return np.where(i >= 0, best[np.maximum(i, 0)] if len(best) else 0.0, 0.0)

    return at


class Staircase:
    """The throughput-area front of evaluated designs as the staircase T(a) (`best_at_or_below`),
    with the hypervolume a new vector would add to it. Throughput is maximised, area minimised, and
    the reference point is (throughput 0, area `reference_area`), as the comparison measures."""

    def __init__(self, areas, scores, reference_area: float):
        order = np.argsort(np.asarray(areas, dtype=float), kind="stable")
        self.areas = np.asarray(areas, dtype=float)[order]
        self.best = np.maximum.accumulate(np.asarray(scores, dtype=float)[order]) if len(order) else np.zeros(0)
        self.reference_area = float(reference_area)

    def at(self, area: float) -> float:
        """T(area): the best throughput of a design no larger (0 when there is none)."""
        i = int(np.searchsorted(self.areas, area, side="right"))
        return float(self.best[i - 1]) if i > 0 else 0.0

    def gain(self, throughput: float, area: float) -> float:
        """The hypervolume the vector (throughput, area) adds: the integral over areas x from `area`
        to the reference of max(0, throughput - T(x)). An upper bound on the throughput gives an
        upper bound on the gain, which only falls as the front grows."""
        ref = self.reference_area
        if area >= ref:
            return 0.0
        i = int(np.searchsorted(self.areas, area, side="right"))
        j = int(np.searchsorted(self.areas, ref, side="left"))
        edges = np.concatenate([[area], self.areas[i:j], [ref]])
        levels = np.concatenate([[self.at(area)], self.best[i:j]])
        return float(np.sum(np.maximum(0.0, throughput - levels) * np.diff(edges)))
