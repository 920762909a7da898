"""Points in the order that best extends a throughput-area front, and a proven ceiling on that front.

Area is exact per design and costs nothing (`hardware/area.py`); throughput has proven upper bounds
(level 0 per cell, level 1 per point: `design.best_first`). A point of area a whose bound u is at
or below T(a), the best evaluated throughput at area <= a, can never join the front: a design
already evaluated is at least as fast and no larger (the rule the exhaustive sweep prunes by,
`search.pareto`). Every other point could; if its bound were met it would add the hypervolume
`Staircase.gain(u, a)` (reference: throughput 0, the space's area budget). `FrontOrder` proposes
the point of largest such gain, so a short study spends its trials where the front can grow most,
and a long one evaluates every point the rule cannot settle, which is all the exact front needs.

The gain of a bound only falls as the front grows and as a cell's level 0 is replaced by its
points' level 1, so a stored gain is an upper bound on the current one: the order is a lazy greedy
heap (Minoux, "Accelerated greedy algorithms for maximizing submodular set functions", 1978): pop
the top, recompute its gain, take it if it still beats the next stored one, else push it back.

`bound_front` is the same bounds read as a front: the vectors (u, a) of every cell, whose
hypervolume is at least the exact front's (every design's true vector is weakly dominated by its
cell's bound vector, and hypervolume is monotone under dominance), so a sampled front's hypervolume
divided by it is a proven lower bound on the fraction of the exact front's hypervolume reached.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Mapping

import numpy as np

from .best_first import BoundOrder, level0_throughput, recipe_bounds
from .pareto import Staircase, front_mask

CELL, POINT = 0, 1
CHUNK = 4096  # designs bounded in one vectorised call: a few hundred MB of layer bounds at most
# A proposal splits at most this many cells into their recipes (each a placement DP per recipe,
# 10-100 ms), then takes a recipe of the top cell at the cell's bound; where the order stops is a
# function of the calls made, never of time.
EXPAND_PER_PROPOSAL = 16


def level0_cells(order: BoundOrder) -> np.ndarray:
    """Level 0 of every (architecture, HBM, microbatch) cell of `order`'s space, shape (A, H, M):
    vectorised over the architectures, one pass per HBM and microbatch."""
    out = np.zeros((len(order.archs), len(order.hbms), len(order.mbss)))
    for h in range(len(order.hbms)):
        accs = [order.accelerator(a, h) for a in range(len(order.archs))]
        for m, mbs in enumerate(order.mbss):
            for s in range(0, len(accs), CHUNK):
                widths = order.widths_of(accs[s:s + CHUNK], mbs)
                out[s:s + CHUNK, h, m] = level0_throughput(widths, mbs, order.system, order.v_max)
    return out


def _on_front(bounds: np.ndarray, areas: np.ndarray) -> np.ndarray:
    """Which (bound, area) rows with a positive bound no other row weakly dominates (first of equal
    rows kept)."""
    return front_mask(np.column_stack([-np.asarray(bounds, dtype=float), areas])) & (np.asarray(bounds) > 0)


def bound_front(areas: np.ndarray, cells: np.ndarray) -> np.ndarray:
    """The front of the cells' bound vectors: rows (throughput bound, area), area ascending, each
    architecture's best cell (area is the architecture's alone)."""
    areas = np.asarray(areas, dtype=float)
    best = np.asarray(cells, dtype=float).reshape(len(areas), -1).max(axis=1) if len(areas) else np.zeros(0)
    keep = _on_front(best, areas)
    rows = np.column_stack([best[keep], areas[keep]])
    return rows[np.argsort(rows[:, 1], kind="stable")]


def refine_front_cells(order: BoundOrder, areas: np.ndarray, cells: np.ndarray, limit: float = math.inf,
                       known: Mapping[tuple[int, int, int, int], float] | None = None) -> tuple[np.ndarray, int]:
    """`cells` with level 1 in place of level 0 where it matters to the bound front: while an
    architecture on it takes its bound from a cell still at level 0, that cell gets the largest
    bound of its recipes (those no other recipe dominates: a dominated recipe's throughput is at most
    its dominator's, so the largest still bounds the cell), each recipe's bound its level 1 or, when
    `known` holds the point (a, h, m, r), the smaller of that and its evaluated upper bound (a
    trial's `score_bound`: its throughput where the schedules were proven). Each replacement only
    lowers a valid bound, so the front stays a proven ceiling, and a tighter one. Stops after
    `limit` cells (each costs a placement DP per recipe). Returns the refined cells and how many
    were refined."""
    known = known or {}
    cells = np.array(cells, dtype=float)
    flat = cells.reshape(len(areas), -1)
    refined = np.zeros(flat.shape, dtype=bool)
    shape = cells.shape[1:]
    count = 0
    while True:
        top = flat.argmax(axis=1)
        best = flat[np.arange(len(areas)), top]
        todo = [a for a in np.flatnonzero(_on_front(best, np.asarray(areas, dtype=float))) if not refined[a, top[a]]]
        if not todo or count >= limit:
            return cells, count
        for a in todo[:int(min(len(todo), limit - count))]:
            h, m = (int(i) for i in np.unravel_index(top[a], shape))
            level1 = [min(b, known.get((int(a), h, m, r), math.inf))
                      for r, b in cell_recipe_bounds(order, int(a), h, m)]
            flat[a, top[a]] = min(flat[a, top[a]], max([0.0, *level1]))
            refined[a, top[a]] = True
            count += 1


def cell_recipe_bounds(order: BoundOrder, a: int, h: int, m: int, incumbent: float = 0.0) -> list[tuple[int, float]]:
    """Level 1 of the recipes of cell (a, h, m) that no other recipe dominates, as (recipe, bound);
    a recipe group bounded at or below `incumbent` gives its members the group's bound."""
    acc = order.accelerator(a, h)
    mbs = order.mbss[m]
    canon = order.canonical(m)
    bounds = recipe_bounds(order.model, order.system, order.widths_of([acc], mbs), mbs, float(acc.hbm_bytes),
                           float(acc.peak_flops), [order.rcs[r] for r in canon], order.attns, incumbent=incumbent)
    return list(zip(canon, [float(b) for b in bounds]))


class FrontOrder:
    """The space's points by the hypervolume their bound could add (see the module docstring), for
    one model on one system. The level 0 of every cell is computed at the first call (about 35 s
    for the 351,564 cells of `phaze` on one core); points are bounded at level 1 as their cells
    come to the top."""

    def __init__(self, model, system, space, seed: int = 0):
        self.base = BoundOrder(model, system, space, seed=seed)
        self.archs, self.hbms, self.mbss, self.rcs = self.base.archs, self.base.hbms, self.base.mbss, self.base.rcs
        self.areas = np.array([d["area_mm2"] for d in space.dies()], dtype=float)
        self.reference_area = float(space.area_budget_mm2)
        self._heap: list | None = None
        self.points: list = []  # recipes bounded at level 1 that could join the front, by stored gain
        self.work = 0  # cells expanded (each: one placement DP per recipe)

    def point(self, a: int, h: int, m: int, r: int) -> dict:
        return self.base.point(a, h, m, r)

    def staircase(self, areas, scores) -> Staircase:
        return Staircase(areas, scores, self.reference_area)

    @property
    def heap(self) -> list:
        """The cells still at level 0, by stored gain (built at the first call)."""
        if self._heap is None:
            cells = level0_cells(self.base)
            empty = self.staircase([], [])
            self._heap = []
            for (a, h, m), u in np.ndenumerate(cells):
                if u > 0:
                    self._heap.append(self._entry(empty, float(u), CELL, (a, h, m)))
            heapq.heapify(self._heap)
        return self._heap

    def _entry(self, front: Staircase, bound: float, level: int, item: tuple) -> tuple:
        """A heap entry: largest gain first, then the largest margin over T(a) (a design at the
        reference area adds no hypervolume yet may join the front), then the seeded tie-break."""
        area = float(self.areas[item[0]])
        tie = (int(self.base.tie[item[0]]), *item[1:], -1 if level == CELL else 0)
        return (-front.gain(bound, area), -(bound - front.at(area)), tie, level, item, bound)

    def next_point(self, front: Staircase, taken: Callable[[dict], bool],
                   expand: int | None = None) -> tuple[dict, float] | None:
        """The untaken point whose bound could add the most hypervolume to `front`, with its bound;
        None when no point left can join the front (then the evaluated front is exact, once every
        point taken has been evaluated). Points and cells that cannot join are dropped for good: a
        front only grows. After `expand` cells split into their recipes in one call, the proposal is
        the best point already bounded at level 1 (a recipe some placement fits), or, when there is
        none, the top cell's first untaken recipe at the cell's level 0 (above T(a), so the rule
        holds): where level 0 is loose, proving cell after cell would otherwise hold a trial for
        minutes, and a recipe taken unbounded is often one no placement fits (level 0 does not read
        HBM capacity)."""
        expanded = 0
        expand = EXPAND_PER_PROPOSAL if expand is None else expand
        while (top := self._pop_best((self.heap, self.points), front, taken)) is not None:
            fresh, source = top
            level, item, bound = fresh[3], fresh[4], fresh[5]
            if level == POINT:
                return self.point(*item), bound
            if expanded >= expand:
                best = self._pop_best((self.points,), front, taken)
                if best is not None:
                    found = self.point(*best[0][4]), best[0][5]
                else:
                    a, h, m = item
                    untaken = [r for r in self.base.canonical(m) if not taken(self.point(a, h, m, r))]
                    if not untaken:
                        continue  # every recipe taken: the cell is spent
                    found = self.point(a, h, m, untaken[0]), bound
                heapq.heappush(source, fresh)  # its recipes stay to be bounded
                return found
            self._expand(front, bound, *item)
            expanded += 1
        return None

    def _pop_best(self, heaps: tuple, front: Staircase, taken: Callable[[dict], bool]) -> tuple | None:
        """Lazy greedy over `heaps` (the cells', the points', or both): pop the entry of largest
        current gain that can still join `front`, as (entry, the heap it came from); None when no
        entry left can. A popped entry whose recomputed gain falls below another's stored gain (an
        upper bound on that one's) goes back."""
        while any(heaps):
            source = min((h for h in heaps if h), key=lambda h: h[0][:3])  # the cells' first on a tie
            fresh = self._current(front, taken, heapq.heappop(source))
            if fresh is None:
                continue
            if any(h and fresh[:3] > h[0][:3] for h in heaps):
                heapq.heappush(source, fresh)
                continue
            return fresh, source
        return None

    def _current(self, front: Staircase, taken: Callable[[dict], bool], entry: tuple) -> tuple | None:
        """`entry` with its gain against `front`, or None when it can no longer join it (or, a point,
        a trial holds it)."""
        level, item, bound = entry[3], entry[4], entry[5]
        if bound <= front.at(float(self.areas[item[0]])) or (level == POINT and taken(self.point(*item))):
            return None
        return self._entry(front, bound, level, item)

    def _expand(self, front: Staircase, cell_bound: float, a: int, h: int, m: int) -> None:
        """A cell's recipes that no other recipe of it dominates, each bounded at level 1 (under
        the cell's level 0, so a stored gain stays an upper bound) and pushed when it can join."""
        floor = front.at(float(self.areas[a]))
        self.work += 1
        for r, b in cell_recipe_bounds(self.base, a, h, m, incumbent=floor):
            b = min(b, cell_bound)
            if b > floor:
                heapq.heappush(self.points, self._entry(front, b, POINT, (a, h, m, r)))
