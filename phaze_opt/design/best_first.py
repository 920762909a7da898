"""Grid points in decreasing order of their proven throughput bounds, computed only as far as asked.

The exhaustive sweep bounds every (architecture, HBM, microbatch) cell at level 0 before it
evaluates anything (a minute on two cores for the `phaze` space), then evaluates best-first. A
sampler cannot wait that long, and most of that work is spent on cells far below the optimum. This
module gives the same best-first order lazily, as an A*-style search over a tree of bounds (Hart,
Nilsson and Raphael, "A Formal Basis for the Heuristic Determination of Minimum Cost Paths", 1968;
best-first branch and bound, Land and Doig 1960), each level no larger than the one above it:

1. an architecture's roofline: devices x (tensor + vector peak FLOP/s) / the model's FLOPs per
   sequence (`roofline_throughput`); no layer pass can run its FLOPs faster than the peak of the
   units it runs on. Costs nothing: computed for every area-feasible architecture at once;
2. an architecture's level 0 at its fastest HBM (`upper_bound`: operator latencies fall as HBM
   bandwidth rises, so this bounds every HBM choice), the largest over microbatches; computed for a
   batch of architectures at a time when the first of them reaches the top;
3. a cell's level 0 (its own HBM and microbatch);
4. a group of recipes' level 1 (`upper_bound.group_placement_throughput`: one placement DP on a
   relaxation valid for every recipe that differs only in recompute, SP and kernel);
5. a point's level 1 (`upper_bound.placement_throughput`: the placement DP on lower-bound layer
   times, its own recipe), for the recipes no other recipe of the cell provably matches or beats
   (`design.dominance`); dominated recipes are never offered.

`BoundOrder.next_point` pops the tree until the best item is a point; ties (designs with equal
bounds) are broken by a permutation drawn from the seed. Given the same calls (incumbent, points
taken, work budget) in the same order, every instance walks the same sequence: the sampler replays
each trial's call in every process, so processes that share a study agree point by point.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from ..hardware.latency import DesignArrays
from ..training import Training, kernel_choices, most_virtual_stages, point_recipe, recipe_choices
from ..workload.graphs import build_layer_graph
from .dominance import model_dominators
from .evaluate import tp_widths
from .upper_bound import (WidthBounds, group_placement_throughput, ideal_throughput, layer_lower_bounds,
                          pipeline_throughput, placement_throughput, relaxed_recipe)

ROOFLINE, ARCH, CELL, GROUP, POINT = range(5)
# Items of one level bounded together (one vectorised call instead of hundreds): architectures by
# their roofline, and architectures whose other HBM choices are bounded.
BATCH = {ROOFLINE: 256, ARCH: 32}
# Best-first would expand every cell whose level 0 lies above the best level-1 bound found, thousands
# on `phaze` since level 0 is loose; after this many cells expanded with a point waiting, the best
# point is handed out anyway (the exhaustive sweep's dive), so good incumbents come early.
DIVE_AFTER = 4


def level0_throughput(widths_by_attention: Sequence[Sequence[WidthBounds]], mbs: int, system,
                      virtual_stages: int) -> np.ndarray:
    """Level 0 per design: the smaller of the ideal-scaling and pipeline bounds, the larger over the
    attention kernels a space offers (each kernel's graph bounds only its own recipes)."""
    n = system.accelerators
    return np.max(np.stack([np.minimum(ideal_throughput(w, mbs, n),
                                       pipeline_throughput(w, mbs, n, system.global_batch, virtual_stages))
                            for w in widths_by_attention]), axis=0)


def recipe_bounds(model, system, widths: Sequence[Sequence[WidthBounds]], mbs: int, hbm_bytes: float,
                  peak_flops: float, rcs: Sequence[Mapping], attns: Sequence, incumbent: float = 0.0) -> list[float]:
    """Level 1 of one design row at one microbatch for each recipe of `rcs`; widths[a]: kernel a's bounds.

    Recipes are grouped by `relaxed_recipe` (all fields but recompute, SP and kernel); each group is first bounded at once
    (`upper_bound.group_placement_throughput`, valid for every recipe of the group). A group whose
    bound cannot beat `incumbent` gives all its recipes that bound; the others are bounded one by one."""
    pairs = recipe_bound_pairs(model, system, widths, mbs, hbm_bytes, peak_flops, rcs, attns, incumbent)
    return [pick_bound(pair, incumbent) for pair in pairs]


def recipe_bound_pairs(model, system, widths: Sequence[Sequence[WidthBounds]], mbs: int, hbm_bytes: float,
                       peak_flops: float, rcs: Sequence[Mapping], attns: Sequence,
                       incumbent: float = 0.0) -> list[tuple[float, float | None]]:
    """`recipe_bounds` before it reads the incumbent: per recipe (its group's bound, its own bound, or
    None where the group's bound cannot beat `incumbent` and its own was not computed). A task of the
    sweep computes them at the incumbent it was handed; the parent picks at the incumbent it holds
    when it reads the cell (`pick_bound`), so a cell computed ahead of its turn gives the numbers it
    would have given in its turn."""
    recipes = [point_recipe({"mbs": mbs, **rc})[0] for rc in rcs]
    groups: dict = {}
    for i, recipe in enumerate(recipes):
        if recipe is not None:  # a point that names no recipe stays at 0: nothing can run it
            groups.setdefault(relaxed_recipe(recipe), []).append(i)
    out: list[tuple[float, float | None]] = [(0.0, None)] * len(rcs)
    for members in groups.values():
        group_bound = float("inf")
        if len(members) > 1:
            kernels = {recipes[i].attention: widths[attns.index(rcs[i].get("attention"))] for i in members}
            group_bound = group_placement_throughput(model, kernels, 0, system=system,
                                                     recipes=[recipes[i] for i in members], hbm_bytes=hbm_bytes,
                                                     peak_flops=peak_flops)
        for i in members:
            own = None
            if group_bound > incumbent:
                own = placement_throughput(model, widths[attns.index(rcs[i].get("attention"))], 0, system=system,
                                           training=recipes[i], hbm_bytes=hbm_bytes, peak_flops=peak_flops)
            out[i] = (group_bound, own)
    return out


def pick_bound(pair: tuple[float, float | None], incumbent: float) -> float:
    """A recipe's level-1 bound from its (group, own) pair: the group's where that cannot beat
    `incumbent` (no placement DP of its own is needed to settle it), else the tighter of the two.
    With an incumbent at least the one the pair was computed at, every own bound it needs is there."""
    group, own = pair
    return group if own is None or group <= incumbent else min(group, own)


def flops_per_sequence(model, system, attns: Sequence) -> float:
    """The fewest FLOPs one training sequence (forward and backward of every layer) costs at any
    TP width and kernel the space offers: each width's sharded graphs summed over its devices."""
    best = float("inf")
    for attention in attns:
        for tp in tp_widths(model, system):
            graph = build_layer_graph(model, tp, 1, attention=attention)
            total = sum(graph.op_graphs[layer.kind]["fwd"].flops + graph.op_graphs[layer.kind]["bwd"].flops
                        for layer in graph.layers)
            best = min(best, tp * total)
    return best


def roofline_throughput(accelerators: Sequence, devices: int, flops: float) -> np.ndarray:
    """Sequences/s no placement reaches: every device's tensor cores at their fastest format plus its
    vector lanes, busy all the time on the model's FLOPs."""
    peak = np.array([a.peak_flops * max([1.0] + [float(r) for _, r in a.tc_datatypes])
                     + 2.0 * a.num_vc * a.vc_width * a.clock_hz for a in accelerators])
    return devices * peak / flops if flops > 0 else np.full(len(accelerators), np.inf)


class BoundOrder:
    """The space's points, best bound first, for one model on one system (see the module docstring)."""

    def __init__(self, model, system, space, seed: int = 0):
        self.model, self.system, self.space = model, system, space
        self.archs = [{k: v for k, v in a.items() if k != "area_mm2"} for a in space.dies()]
        self.hbms = list(space.params["hbm_gib"])
        self.mbss = [int(m) for m in space.params["mbs"]]
        self.rcs = recipe_choices(space.params)
        self.attns = kernel_choices(space.params)
        self.v_max = most_virtual_stages(space.params)
        bandwidth = [float(space.hbm_bw_table[h]) for h in self.hbms]
        self.fast_hbm = int(np.argmax(bandwidth))  # first of the fastest: bounds every HBM choice
        self._canon: dict[int, list[int]] = {}
        self._arch_index: dict | None = None
        self._recipes: dict[tuple[int, int], Training | None] = {}
        self._widths: dict[tuple, list] = {}  # (arch, hbm, mbs) -> [kernel][tp width] bounds of that one design
        self._cell_bounds: dict[tuple, float] = {}  # (arch, hbm, mbs) -> level 0
        self.tie = np.random.default_rng(seed).permutation(len(self.archs))
        roof = roofline_throughput([self.accelerator(a, self.fast_hbm) for a in range(len(self.archs))],
                                   system.accelerators, flops_per_sequence(model, system, self.attns))
        self.heap = [(-float(b), (int(self.tie[a]), -1, -1, -1), ROOFLINE, a) for a, b in enumerate(roof)]
        heapq.heapify(self.heap)
        self.points: list = []  # bounded points and recipe groups, best first
        self._open: dict[tuple, int] = {}  # (arch, hbm, mbs) -> recipe groups not yet bounded one by one
        self.work = 0  # placement DPs run and vectorised batches bounded: what a caller's budget counts
        self.expanded = 0  # cells expanded since a point was last popped

    def accelerator(self, a: int, h: int):
        return self.space.accelerator(self.point(a, h, 0, 0))

    def point(self, a: int, h: int, m: int, r: int) -> dict:
        return {**self.archs[a], "hbm_gib": self.hbms[h], "mbs": self.mbss[m], **self.rcs[r]}

    def index_of(self, point: Mapping) -> tuple[int, int, int, int] | None:
        """(a, h, m, r) of a decoded point (a trial's values), the inverse of `point`; None when the
        space does not hold it."""
        if self._arch_index is None:
            self._arch_index = {tuple(sorted(arch.items())): a for a, arch in enumerate(self.archs)}
        try:
            arch = tuple(sorted((k, point[k]) for k in self.archs[0]))
            return (self._arch_index[arch], self.hbms.index(point["hbm_gib"]), self.mbss.index(point["mbs"]),
                    self.rcs.index({k: point[k] for k in self.rcs[0]}))
        except (KeyError, ValueError):
            return None


    def next_point(self, incumbent: float, taken: Callable[[dict], bool],
                   budget: float = math.inf) -> tuple[dict, float] | None:
        """The next point whose bound is above `incumbent` and that `taken` does not claim, with its
        level-1 bound; None when every point left is bounded at or below `incumbent` (`exhausted`),
        or when going on would take the work done so far (`work`: placement DPs and vectorised
        batches) past `budget`."""
        while True:
            if self.exhausted(incumbent):
                return None
            if self.points and (self._top(self.points) >= self._top(self.heap) or self.expanded >= DIVE_AFTER):
                found = self._pop_point(incumbent, taken)
                if found is not None:
                    return found
                continue
            if self.work >= budget:
                return None
            _, _, level, item = heapq.heappop(self.heap)
            if level == CELL:
                self._bound_groups(*item)
                self.expanded += 1
                continue
            batch = [item]  # bounded together: one vectorised call
            while self.heap and self.heap[0][2] == level and len(batch) < BATCH[level]:
                batch.append(heapq.heappop(self.heap)[3])
            (self._bound_archs if level == ROOFLINE else self._bound_cells)(batch)
            self.work += 1

    def best_point(self, incumbent: float, taken: Callable[[dict], bool]) -> tuple[dict, float] | None:
        """The best point already bounded that beats `incumbent` and is not taken, bounding nothing
        more (what a caller out of budget proposes instead of waiting); None when there is none."""
        while self.points and self._top(self.points) > incumbent:
            found = self._pop_point(incumbent, taken)
            if found is not None:
                return found
        return None

    def exhausted(self, incumbent: float) -> bool:
        """Whether no point left in the order has a bound above `incumbent`."""
        return max(self._top(self.heap), self._top(self.points)) <= incumbent

    def _pop_point(self, incumbent: float, taken) -> tuple[dict, float] | None:
        """The best of the bounded points and recipe groups: a group is bounded recipe by recipe
        (its points join the others), a point handed out unless it cannot win or is taken."""
        neg, _, level, item = heapq.heappop(self.points)
        if level == GROUP:
            if -neg > incumbent:  # a group bounded at or below the incumbent holds no point that can win
                self._bound_members(*item)
            else:
                self._close(*item[:3])
            return None
        self.expanded = 0
        point = self.point(*item)
        if -neg > incumbent and not taken(point):
            return point, -neg
        return None

    @staticmethod
    def _top(heap: list) -> float:
        return -heap[0][0] if heap else 0.0

    def widths_of(self, accelerators: list, mbs: int) -> list[list[WidthBounds]]:
        designs = DesignArrays.from_accelerators(accelerators)
        return [[layer_lower_bounds(self.model, designs, mbs, self.system, tp, attention)
                 for tp in tp_widths(self.model, self.system)] for attention in self.attns]

    def _bound_archs(self, archs: list[int]) -> None:
        accs = [self.accelerator(a, self.fast_hbm) for a in archs]
        best = np.zeros(len(archs))
        for m, mbs in enumerate(self.mbss):
            widths = self.widths_of(accs, mbs)
            b0 = level0_throughput(widths, mbs, self.system, self.v_max)
            best = np.maximum(best, b0)
            for i, a in enumerate(archs):
                self._widths[(a, self.fast_hbm, m)] = [[w.take([i]) for w in per] for per in widths]
                self._cell_bounds[(a, self.fast_hbm, m)] = float(b0[i])
        for i, a in enumerate(archs):
            heapq.heappush(self.heap, (-float(best[i]), (int(self.tie[a]), -1, -1, -1), ARCH, a))

    def _bound_cells(self, archs: list[int]) -> None:
        others = [(a, h) for a in archs for h in range(len(self.hbms)) if h != self.fast_hbm]
        accs = [self.accelerator(a, h) for a, h in others]
        for m, mbs in enumerate(self.mbss):
            if accs:
                widths = self.widths_of(accs, mbs)
                b0 = level0_throughput(widths, mbs, self.system, self.v_max)
                for i, (a, h) in enumerate(others):
                    self._widths[(a, h, m)] = [[w.take([i]) for w in per] for per in widths]
                    self._cell_bounds[(a, h, m)] = float(b0[i])
            for a in archs:
                for h in range(len(self.hbms)):
                    heapq.heappush(self.heap, (-self._cell_bounds[(a, h, m)], (int(self.tie[a]), h, m, -1), CELL,
                                               (a, h, m)))

    def canonical(self, m: int) -> list[int]:
        """The recipes of microbatch index m that no other recipe provably matches or beats, and
        that are recipes at all."""
        if m not in self._canon:
            dom = model_dominators(self.rcs, self.model, self.system, self.mbss[m])
            # a point that names no recipe (`point_recipe`) is infeasible: never offered
            self._canon[m] = [r for r in range(len(self.rcs)) if dom[r] == r and self._recipe(m, r) is not None]
        return self._canon[m]

    def _bound_groups(self, a: int, h: int, m: int) -> None:
        """A cell's recipe groups: each bounded at once where it has several members, else its one
        recipe bounded as a point."""
        acc = self.accelerator(a, h)
        widths = self._widths[(a, h, m)]
        groups: dict = {}
        for r in self.canonical(m):
            groups.setdefault(relaxed_recipe(self._recipe(m, r)), []).append(r)
        self._open[(a, h, m)] = len(groups)
        for members in groups.values():
            if len(members) == 1:
                self._bound_members(a, h, m, tuple(members), math.inf)
                continue
            kernels = {self._recipe(m, r).attention: widths[self.attns.index(self.rcs[r].get("attention"))]
                       for r in members}
            bound = group_placement_throughput(self.model, kernels, 0, system=self.system,
                                               recipes=[self._recipe(m, r) for r in members],
                                               hbm_bytes=float(acc.hbm_bytes), peak_flops=float(acc.peak_flops))
            self.work += 1
            if bound > 0:  # 0: no placement of any member fits the HBM
                # with the points: a group waits to be taken (bounded recipe by recipe) as a point would
                heapq.heappush(self.points, (-float(bound), (int(self.tie[a]), h, m, members[0]), GROUP,
                                             (a, h, m, tuple(members), float(bound))))
            else:
                self._close(a, h, m)

    def _bound_members(self, a: int, h: int, m: int, members: tuple, group_bound: float) -> None:
        acc = self.accelerator(a, h)
        widths = self._widths[(a, h, m)]
        for r in members:
            recipe = self._recipe(m, r)
            bound = min(group_bound, placement_throughput(
                self.model, widths[self.attns.index(self.rcs[r].get("attention"))], 0, system=self.system,
                training=recipe, hbm_bytes=float(acc.hbm_bytes), peak_flops=float(acc.peak_flops)))
            self.work += 1
            if bound > 0:  # 0: no placement fits the HBM at any time, so the point is infeasible
                heapq.heappush(self.points, (-float(bound), (int(self.tie[a]), h, m, r), POINT, (a, h, m, r)))
        self._close(a, h, m)

    def _close(self, a: int, h: int, m: int) -> None:
        """One group of the cell is bounded; the cell's layer bounds go with its last."""
        self._open[(a, h, m)] -= 1
        if not self._open[(a, h, m)]:
            del self._open[(a, h, m)], self._widths[(a, h, m)]

    def _recipe(self, m: int, r: int) -> Training | None:
        """Recipe r at microbatch index m (None where the point names no recipe), built once: every
        group and member bound of every cell asks for it again."""
        if (m, r) not in self._recipes:
            self._recipes[(m, r)] = point_recipe({"mbs": self.mbss[m], **self.rcs[r]})[0]
        return self._recipes[(m, r)]

    def cell_bound(self, point: Mapping) -> float:
        """Level 0 of one point's cell (its architecture, HBM and microbatch), whatever its recipe."""
        acc = self.space.accelerator(dict(point))
        mbs = int(point["mbs"])
        return float(level0_throughput(self.widths_of([acc], mbs), mbs, self.system, self.v_max)[0])
