"""The exhaustive sweep with proven-bound pruning: every grid point is settled, exactly.

Evaluating a point in full (per-layer ILPs + placement DP) costs up to seconds; the `phaze` space
has 703,128 points. Most of them provably cannot beat the best design found, so they are settled
by a bound instead (`upper_bound` explains both bounds and why they hold):

1. level 0, vectorised: an ideal-scaling throughput bound for every (architecture, HBM, microbatch),
   covering every recipe (recompute, and the further recipe fields a space samples; the larger
   over the attention kernels). Computed in tasks of `LEVEL0_ROWS` designs of one microbatch,
   so the processes share the work and its progress is reported as the tasks finish.
2. level 1: the exact placement DP on lower-bound layer times of one point (~10-30 ms), for the
   next cells of the best-first order in one task (`level1_task_s`: a cluster's scheduler costs
   about as much per task as one cell's level 1).
3. full evaluation, logged as a trial like any sampled or swept point.

Best-first branch and bound: candidates are taken in decreasing order of their current bound, so
the best designs are evaluated first and the incumbent is strong early; a candidate whose bound is
not above the incumbent is settled "by bound" (and so is every candidate after it). The optimum is
therefore exact: a point is only skipped when its proven upper bound cannot beat a throughput that
some evaluated design reaches. A point that failed, or whose layer schedules were not all proven
optimal (its score is reached, its proven bound is higher), leaves the optimum proven only when its
bound cannot beat the best; otherwise the summary gives the best and the largest open bound. With `--workers N` the candidates are handed to N processes, up to
N at a time; a worker may start on a candidate that a result still in flight would have pruned,
which costs time, never exactness.

Bounding phase: until its first full evaluation an invocation only computes bounds (level 0 for
the whole grid, then level 1 for the best candidates). Each invocation appends that phase, as
[start, end] in the study's elapsed seconds, to the study attribute `bounding_phases` (the
`compare` plot shades it); the end is when the first full evaluation is handed out.

With `--objectives throughput,area` the sweep settles the exact throughput-area front instead of
the optimum: the same steps, the cells visited in groups of equal area, smallest first, and the
incumbent the best throughput at or below the group's area (`search.pareto` says why it is exact).

Every point is recorded: evaluated points as Optuna trials and MLflow runs; the rest in
`<output>/<study>-points.csv.gz` (also an MLflow artifact of the parent run) with how each was
settled ("evaluated", "bound-ideal" or "bound-placement") and its bound, and as counts in the
summary and the parent run's metrics.
"""

from __future__ import annotations

import gzip
import heapq
import json
import itertools
import multiprocessing
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, as_completed, wait
from datetime import datetime
from pathlib import Path

import numpy as np

from ..activity import phase
from ..design.dominance import model_dominators
from ..design.evaluate import tp_widths
from ..design.best_first import level0_throughput, pick_bound, recipe_bound_pairs
from ..design.upper_bound import CHUNK, WidthBounds, concat_bounds, layer_lower_bounds, slice_designs
from ..errors import PhazeError
from ..hardware.latency import DesignArrays
from ..jsonable import jsonable
from ..system import load_system
from ..training import kernel_choices, most_virtual_stages, recipe_choices
from ..workload.models import load_model
from . import objective
from ..runs import signals
from ..runs.cluster import ClusterExecutor
from ..runs.progress import say
from ..runs.disk import write_whole
from .pareto import AreaOrder, front_open, resumed_points, row_areas
from .report import finish, unproven_points
from .session import Session, one_line, quiet_optuna
from .setup import Backend, StudyConfig
from .strategy import BranchAndBound, register
from .trials import add_trial, best_history, existing_scores, frozen_trial, point_key

# Design rows per level-0 task: a multiple of upper_bound.CHUNK, so every `estimate` call sees exactly
# the slice of designs it saw when a task bounded all of them (the same numbers, bit for bit). One
# chunk is about 16 s of work at ~1 ms a design row (BENCHMARKS.md, "The sweep on a Dask cluster"),
# a thousand times the engine's cost per task, so level 0 needs no larger tasks; smaller ones would
# change the numbers.
LEVEL0_ROWS = CHUNK

# Level-1 tasks. One scheduler and one parent hand out every task, at 10-21 ms each on Dask
# (`ENGINE_TASK_S`, measured by benchmarks/bench_cluster.py --noop), while one cell's level 1 costs
# ~35 ms of CPU a recipe: a task of one cell spends 8% of a 2-worker sweep in the engine. A task
# therefore carries the next cells of the best-first order up to `level1_task_s(workers)` CPU seconds
# of work, priced at the CPU time per recipe measured on the tasks so far (CPU, not wall time, so a
# loaded machine does not shrink the batches): at least LEVEL1_TASK_S, 50 times the engine's slowest
# cost per task (the engine at most 2% of a task; about 15 cells of `phaze`), and with many workers
# 2 x workers x ENGINE_TASK_S, so that handing each worker its next task takes the one scheduler at
# most half a task's time. The size decides nothing about exactness (`_Sweep._hand_out`).
ENGINE_TASK_S = 0.015
LEVEL1_TASK_S = 1.0

SETTLED = ("bound-ideal", "bound-placement", "evaluated", "dominated")
BOUND_IDEAL, BOUND_PLACEMENT, EVALUATED, DOMINATED = range(4)
# Best-first hands out level-1 cells while their level-0 bound beats every level-1 bound; after this
# many with no evaluation in flight, the best level-1 point is evaluated anyway (its score, the
# incumbent, then settles cells at level 0). Only the order changes: exactness does not depend on it.
DIVE_AFTER = 8


# -- the grid, as arrays -----------------------------------------------------------------------------

class Grid:
    """Points as (microbatch index, design row, recipe index); design row = arch x HBM; a recipe is
    one choice of recompute and of each further recipe field the space samples."""

    def __init__(self, space):
        self.space = space
        self.archs = [{k: v for k, v in a.items() if k != "area_mm2"} for a in space.dies()]
        self.hbms = list(space.params["hbm_gib"])
        self.mbss = [int(m) for m in space.params["mbs"]]
        self.rcs = recipe_choices(space.params)
        self.attns = kernel_choices(space.params)  # level 0 and 1 bound each kernel's graph
        self.n_rows = len(self.archs) * len(self.hbms)

    def point(self, m: int, row: int, r: int) -> dict:
        arch = self.archs[row // len(self.hbms)]
        return {**arch, "hbm_gib": self.hbms[row % len(self.hbms)], "mbs": self.mbss[m], **self.rcs[r]}

    def accelerators(self):
        return [self.space.accelerator(self.point(0, row, 0)) for row in range(self.n_rows)]

    @property
    def size(self) -> int:
        return len(self.mbss) * self.n_rows * len(self.rcs)


# -- worker side -------------------------------------------------------------------------------------

_W: dict = {}  # this process's worker state: model, system, trial context and one space's design arrays


def _init_worker(model: str, system: str, ctx, parent: int | None = None, parent_start: int | None = None) -> None:
    if multiprocessing.parent_process() is not None:
        signals.worker_started(parent, parent_start)  # a pool process dies with its parent
    _load_worker(model, system, ctx)


def _load_worker(model: str, system: str, ctx) -> None:
    """A worker's state; a cluster's worker outlives the parent and serves other studies, so it
    takes this part alone (no parent watch)."""
    quiet_optuna()
    _W.clear()  # a cluster's worker may have served another study: none of its state carries over
    _W.update(model=load_model(model), system=load_system(system), ctx=ctx)


def _level0(space, mbs: int, lo: int, hi: int, attention=None) -> list[WidthBounds]:
    """Lower-bound layer times of design rows lo..hi at one microbatch, at every TP width."""
    model, system = _W["model"], _W["system"]
    key = (space.name, id(space))
    if _W.get("designs_of") != key:  # 88k designs take seconds to build; a worker keeps one space's for every chunk
        _W.update(designs_of=key, designs=DesignArrays.from_accelerators(Grid(space).accelerators()))
    designs = slice_designs(_W["designs"], lo, hi)
    return [layer_lower_bounds(model, designs, mbs, system, tp, attention) for tp in tp_widths(model, system)]


def _bound_level0(session, grid: Grid, pool) -> tuple[np.ndarray, list[list[WidthBounds]]]:
    """Level 0 for every (microbatch, design row): the ideal bound [n_m, n_rows] (the largest over
    the space's attention kernels) and each microbatch's lower-bound layer times per kernel
    (widths[m][a][t]), computed in chunks whose progress is reported as they finish."""
    n_a = len(grid.attns)
    tasks = [(m, a, lo, min(lo + LEVEL0_ROWS, grid.n_rows)) for m in range(len(grid.mbss)) for a in range(n_a)
             for lo in range(0, grid.n_rows, LEVEL0_ROWS)]
    progress = session.progress(len(grid.mbss) * n_a * grid.n_rows, "design", phase="bounding")
    results: list = [None] * len(tasks)
    calls = [(session.space, grid.mbss[m], lo, hi, grid.attns[a]) for m, a, lo, hi in tasks]
    for i, part in _as_completed(pool, _level0, calls):
        results[i] = part
        progress.update(tasks[i][3] - tasks[i][2])
    progress.close()
    system = load_system(session.config.system)
    v_max = most_virtual_stages(session.space.params)
    widths = []
    for k in range(len(grid.mbss)):
        per_attn = []
        for a in range(n_a):
            chunks = [part for (m, aa, _, _), part in zip(tasks, results) if m == k and aa == a]
            per_attn.append([_concat([chunk[t] for chunk in chunks]) for t in range(len(chunks[0]))])
        widths.append(per_attn)
    ub0 = np.stack([level0_throughput(per_attn, mbs, system, v_max) for per_attn, mbs in zip(widths, grid.mbss)])
    return ub0, widths


def _concat(chunks: list[WidthBounds]) -> WidthBounds:
    return concat_bounds(chunks)  # keeps the context-parallel widths' bounds


def level1_task_s(workers: int) -> float:
    """CPU seconds of level-1 work one task carries (see LEVEL1_TASK_S)."""
    return max(LEVEL1_TASK_S, 2.0 * max(workers, 1) * ENGINE_TASK_S)


def _level1(cells: list[tuple], attns: list, incumbent: float = 0.0) -> tuple[list, float]:
    """Level 1 of each (widths, mbs, HBM bytes, peak FLOP/s, recipes) cell: per recipe its
    `best_first.recipe_bound_pairs` (the parent picks the bound at its incumbent), with this worker's
    model and system, and the CPU seconds the cells took (the parent sizes the next tasks by them);
    `incumbent` is the best score when the task was handed out."""
    t0 = time.process_time()
    pairs = [recipe_bound_pairs(_W["model"], _W["system"], widths, mbs, hbm_bytes, peak_flops, rcs, attns, incumbent)
             for widths, mbs, hbm_bytes, peak_flops, rcs in cells]
    return pairs, time.process_time() - t0


def _evaluate(points: list[dict]) -> list[tuple]:
    out = []
    for point in points:
        started, t0 = datetime.now(), time.perf_counter()
        outcome, error = None, None
        try:
            outcome = objective.evaluate_point(point, _W["ctx"])
        except Exception as exc:  # noqa: BLE001 - one design's error must not stop the sweep
            error = one_line(exc)
        out.append((point, outcome, error, started, datetime.now(), time.perf_counter() - t0))
    return out


class _Inline:
    """An executor that runs each task when submitted (one worker: no process start, no pickling)."""

    def __init__(self, initializer, initargs):
        initializer(*initargs)

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))
        return f

    def map(self, fn, *iterables):
        return map(fn, *iterables)

    def shutdown(self, *_, **__):
        pass


def _as_completed(pool, fn, calls: list[tuple]):
    """(index, fn(*args)) for each of `calls`, as each finishes: a slow task holds back no report."""
    if isinstance(pool, _Inline):
        return ((i, fn(*args)) for i, args in enumerate(calls))
    futures = {pool.submit(fn, *args): i for i, args in enumerate(calls)}
    return ((futures[f], f.result()) for f in as_completed(futures))


def _executor(workers: int, initargs, cluster: str | None = None):
    """Where the sweep's tasks run: a Dask cluster when one is named (`runs.cluster`), else this
    process for one worker, else a pool of `workers` processes."""
    if cluster:
        pool = ClusterExecutor(cluster, _load_worker, initargs)
        if workers < pool.workers:
            say(f"--cluster {cluster}: {pool.workers} workers, but --workers {workers} keeps only {workers} "
                f"task(s) in flight; give --workers {pool.workers} to use them all")
        return pool
    if workers <= 1:
        return _Inline(_init_worker, initargs)
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(*initargs, *signals.worker_args()))


# -- the parent ----------------------------------------------------------------------------------------

def run_pruned(session: Session) -> dict:
    """The bound-pruned exhaustive sweep: every point settled by evaluation or by a proven bound."""
    if Grid(session.space).size == 0:
        raise PhazeError(f"space '{session.space.name}': no grid point passes the area rule")
    stats = run_branch_bound(session)
    history = best_history(session.all_trials())
    session.study.set_user_attr("best_history", history)
    info = {"order": "best-first by bound", "hysteresis": None, "prune": "bound", **stats}
    session.study.set_user_attr("exhaustive_status", info)
    return finish(session, [], {"exhaustive": {**info, "evaluated": stats["settled"]["evaluated"],
                                               "best_history": history}})


class Cells:
    """The recipe-level state of the (microbatch, design row) cells the sweep expanded.

    A cell is expanded once level 1 bounds its recipes (or a resumed run evaluated one of them);
    every recipe of a cell never expanded is settled by its level-0 bound, valid for all recipes, so
    the sweep holds [recipes] arrays only for expanded cells (a space listing every recipe field has
    over 50 million points, 351,564 cells for gpt3-175b on `phaze-recipes`).
    """

    def __init__(self, n_r: int, ub0: np.ndarray | None = None):
        self.n_r, self.ub0, self.cells = n_r, ub0, {}
        self.unsure: set = set()  # (m, row, r) evaluated without a proven throughput (failed or unproven)

    def get(self, m: int, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(status, bound, score) of the cell's recipes, created as settled by level 0."""
        cell = self.cells.get((m, row))
        if cell is None:
            b0 = float(self.ub0[m, row]) if self.ub0 is not None else 0.0
            cell = (np.full(self.n_r, BOUND_IDEAL, dtype=np.int8), np.full(self.n_r, b0), np.full(self.n_r, np.nan))
            self.cells[(m, row)] = cell
        return cell

    def __contains__(self, key) -> bool:
        return key in self.cells

    def items(self):
        return self.cells.items()


def recipe_dominators(grid: Grid, model, system) -> list[list[int]]:
    """Per microbatch, for each recipe the index of the recipe that dominates it
    (`design.dominance`; its own index when none does)."""
    return [model_dominators(grid.rcs, model, system, mbs) for mbs in grid.mbss]


def run_branch_bound(session) -> dict:
    """Settle every grid point of the session's space; returns the sweep's statistics."""
    sweep = _Sweep(session)
    pool = _executor(sweep.config.workers, (sweep.config.models[0], sweep.config.system, session.context()),
                     sweep.config.cluster)
    try:
        sweep.bound(pool)
        sweep.settle(pool)
    finally:
        pool.shutdown(cancel_futures=True) if isinstance(pool, ProcessPoolExecutor) else pool.shutdown()
    return sweep.conclude()


class _Sweep:
    """One invocation's best-first sweep. Its steps share the grid, the bounds, the incumbent and the
    tasks in flight, so they are methods on this state: level 0 (`bound`), the loop that hands out
    level-1 bounds and evaluations and takes their results (`settle`), then the accounting
    (`conclude`)."""

    def __init__(self, session):
        self.session = session
        self.config = session.config
        self.grid = Grid(session.space)
        self.t_start = time.perf_counter()
        self.done = existing_scores(session.study, session.codec)  # resumed points: key -> score
        self.visit = (AreaOrder(row_areas(session.space, self.grid),
                                resumed_points(session.space, session.study.get_trials(deepcopy=False)))
                      if self.pareto else _BestFirst())
        self.incumbent = self.visit.incumbent(self.done)
        self.n_m, self.n_r = len(self.grid.mbss), len(self.grid.rcs)
        self.stats = {"workers": self.config.workers, "evaluated_this_run": 0, "resumed": 0, "level1_runs": 0,
                      "level1_tasks": 0, "level1_unused": 0, "failed": []}
        self.accels: dict[int, object] = {}
        self.pos = 0  # next level-0 candidate in `order` not handed out
        self.since_eval = 0  # cells bounded at level 1 since the last evaluation was handed out
        self.heap: list = []  # (-bound, seq, m, row, {r: ub1})
        self.ready: list = []  # cells whose level 1 came back, not yet read: (index in `order`, m, row, pairs)
        self.level1_cost = [0.0, 0]  # CPU seconds and recipes of the level-1 tasks so far
        self.seq = itertools.count()
        self.inflight: dict[Future, tuple] = {}
        self.failed_keys: set = set()

    # -- level 0 -------------------------------------------------------------------------------------
    def bound(self, pool) -> None:
        """Level 0 for the whole grid, the recipes dominance leaves to level 1, the candidates' order."""
        t0 = time.perf_counter()
        with phase("bounding the designs"):
            self.ub0, self.widths = _bound_level0(self.session, self.grid, pool)  # [n_m, n_rows], per TP width
        self.stats["level0_s"] = time.perf_counter() - t0
        model, system = load_model(self.config.models[0]), load_system(self.config.system)
        self.dom = recipe_dominators(self.grid, model, system)
        self.canon = [[r for r in range(self.n_r) if d[r] == r] for d in self.dom]  # what level 1 bounds, per mbs
        self.stats["recipes"] = self.n_r
        self.stats["recipes_not_dominated"] = [len(c) for c in self.canon]
        self.cells = Cells(self.n_r, self.ub0)
        # Settled so far: evaluated, or bounded at or below the best (best-first never evaluates those).
        self.progress = self.session.progress(self.grid.size, "point", phase="settled", steady=False)
        self.progress.update(0, self.incumbent if self.incumbent > 0 else None)

    # -- the best-first loop -------------------------------------------------------------------------
    @property
    def pareto(self) -> bool:
        """The throughput-area front is asked for: visit by area (`search.pareto`), not best-first alone."""
        return len(self.config.objectives) > 1

    def settle(self, pool) -> None:
        """Visit the cells in the order's groups (one group for one objective), each to the end."""
        for order, floor in self.visit.orders(self.ub0):
            self.order, self.pos = order, 0
            self.incumbent = max(self.incumbent, floor)
            self.heap.clear()  # a drained group leaves only bounds at or below the incumbent
            self._drain(pool)
            self.stats["level1_unused"] += sum(len(self.canon[m]) for _, m, _, _ in self.ready)
            self.ready.clear()  # computed ahead of their turn, which never came: level 0 settles them
        self._report()
        self.progress.close()

    def _drain(self, pool) -> None:
        """Hand out tasks while a candidate's bound beats the incumbent; take each result as it comes."""
        while True:
            self._hand_out(pool)
            if not self.inflight:
                break
            finished, _ = wait(list(self.inflight), return_when=FIRST_COMPLETED)
            for f in finished:
                self._take(f)
            if self.progress.due():
                self._report()

    def _hand_out(self, pool) -> None:
        """Fill the workers: the best candidate is evaluated when its placement bound (level 1) is
        known and not below the best level-0 bound, else the best level-0 cell is bounded at level 1:
        read from a task that already computed it, or handed out with the cells after it.

        The cells of a task come back together but are read one at a time, each when the best-first
        loop reaches it, at the incumbent it holds then; cells it never reaches are dropped. So with
        one worker the sweep takes the same steps, and settles every point the same way, whatever
        the tasks' size: a batch changes which work runs ahead, never what is settled."""
        while len(self.inflight) < max(self.config.workers, 1):
            top0 = self._top0()
            top1 = -self.heap[0][0] if self.heap else -np.inf
            if max(top0, top1) <= self.incumbent:
                break
            evaluating = any(tag[0] == "eval" for tag in self.inflight.values())
            dive = self.heap and not evaluating and self.since_eval >= DIVE_AFTER
            if dive:  # evaluate the best bounded recipe early: an incumbent prunes cells at level 0
                m, row, ub1 = self._dive()
            if dive or top1 >= top0:  # a point whose placement bound is known: evaluate what can still win
                if not dive:
                    _, _, m, row, ub1 = heapq.heappop(self.heap)
                    self.since_eval = 0
                self._evaluate_cell(pool, m, row, ub1)
            elif self.ready:
                self._read_cell()
            else:
                self._bound_cells(pool, top1, evaluating)

    def _top0(self) -> float:
        """The level-0 bound of the best cell not yet read and not in flight."""
        if self.ready:
            return float(self.ub0.flat[self.order[self.ready[0][0]]])
        return float(self.ub0.flat[self.order[self.pos]]) if self.pos < self.order.size else -np.inf

    def _dive(self) -> tuple[int, int, dict]:
        """The best level-1 cell's best recipe alone; the cell's other recipes go back on the heap."""
        _, _, m, row, ub1 = heapq.heappop(self.heap)
        r_best = max(ub1, key=ub1.get)
        rest = {r: b for r, b in ub1.items() if r != r_best}
        if rest:
            heapq.heappush(self.heap, (-max(rest.values()), next(self.seq), m, row, rest))
        self.since_eval = 0
        return m, row, {r_best: ub1[r_best]}

    def _evaluate_cell(self, pool, m: int, row: int, ub1: dict) -> None:
        """Hand out the evaluation of a cell's recipes whose bound beats the incumbent (a point an
        earlier run of the study evaluated takes its score from there)."""
        status, bound, score = self.cells.get(m, row)
        todo, todo_cells = [], []
        for r, b in ub1.items():
            if b <= self.incumbent:
                continue
            status[r] = EVALUATED
            point = self.grid.point(m, row, r)
            key = point_key(self.session.codec, point)
            if key in self.done:  # finished in an earlier run of this study
                score[r] = self.done[key] or 0.0
                self.stats["resumed"] += 1
            else:
                todo.append(point)
                todo_cells.append((m, row, r))
        if todo:
            _end_bounding(self.session, self.stats)
            self.inflight[pool.submit(_evaluate, todo)] = ("eval", todo_cells)

    def _bound_cells(self, pool, top1: float, evaluating: bool) -> None:
        """Hand out level 1 of the next level-0 cells in one task, for the recipes no other recipe
        dominates: as many as `level1_task_s` CPU seconds of work at the measured cost per recipe (one
        until a task was measured), and only cells the loop would bound before it evaluates anything,
        so no batch delays an evaluation that is due: each cell's level-0 bound above the best
        level-1 bound waiting (`top1`) and the incumbent, and no more cells than are left before a
        dive (`DIVE_AFTER`) while a point waits."""
        seconds, recipes = self.level1_cost
        per_recipe = seconds / recipes if recipes else None
        floor = max(self.incumbent, top1)
        room = DIVE_AFTER - self.since_eval if self.heap and not evaluating else self.order.size
        target, work, batch = level1_task_s(self.config.workers), 0.0, []
        while self.pos < self.order.size and len(batch) < max(room, 1):
            flat = int(self.order[self.pos])
            if batch and (per_recipe is None or work >= target or self.ub0.flat[flat] <= floor):
                break
            m, row = divmod(flat, self.grid.n_rows)
            a = self._accel(row)
            rows = [[w.take([row]) for w in per_attn] for per_attn in self.widths[m]]
            batch.append((self.pos, m, row, (rows, self.grid.mbss[m], float(a.hbm_bytes), float(a.peak_flops),
                                             [self.grid.rcs[r] for r in self.canon[m]])))
            work += (per_recipe or 0.0) * len(self.canon[m])
            self.pos += 1
        self.inflight[pool.submit(_level1, [cell for *_, cell in batch], self.grid.attns, self.incumbent)] = \
            ("l1", [(i, m, row) for i, m, row, _ in batch])
        self.stats["level1_tasks"] += 1

    def _read_cell(self) -> None:
        """The best computed cell's level-1 bounds, at the incumbent held now; the recipes that can
        still beat it go on the heap."""
        _, m, row, pairs = heapq.heappop(self.ready)
        status, bound, _ = self.cells.get(m, row)
        ub1 = {r: pick_bound(pair, self.incumbent) for r, pair in zip(self.canon[m], pairs)}
        for r, b in ub1.items():
            status[r] = BOUND_PLACEMENT
            bound[r] = b
        live = {r: b for r, b in ub1.items() if b > self.incumbent}
        if live:
            heapq.heappush(self.heap, (-max(live.values()), next(self.seq), m, row, live))
        self.stats["level1_runs"] += len(self.canon[m])
        self.since_eval += 1

    def _accel(self, row: int):
        if row not in self.accels:
            self.accels[row] = self.session.space.accelerator(self.grid.point(0, row, 0))
        return self.accels[row]

    def _take(self, future: Future) -> None:
        """A finished task: an evaluation's trials recorded, or its cells' level-1 bounds kept until
        the loop reads them (`_read_cell`) and its time added to the cost per recipe."""
        tag = self.inflight.pop(future)
        if tag[0] == "eval":
            self._record(tag[1], future.result())
            return
        pairs, seconds = future.result()
        self.level1_cost[0] += seconds
        for (i, m, row), cell in zip(tag[1], pairs):
            self.level1_cost[1] += len(cell)
            heapq.heappush(self.ready, (i, m, row, cell))

    def _record(self, cells_done, results) -> None:
        """Each evaluated point as a trial (and MLflow run), its score in its cell, the incumbent raised."""
        session = self.session
        for (m, row, r), (point, outcome, error, started, ended, trial_s) in zip(cells_done, results):
            extra = {"elapsed_s": session.elapsed(), "trial_s": trial_s, "settled": "evaluated"}
            value = 0.0
            if outcome is not None and outcome.feasible:
                value = float(outcome.score)
                if value > self.incumbent:
                    self.incumbent = value
                    extra["new_best"] = True
            frozen = add_trial(session.study, frozen_trial(session.codec, point, outcome, error, started, ended,
                                                           extra, session.space))
            session.tracker.log_trial(frozen, outcome.artifact() if outcome is not None else None)
            self.done[point_key(session.codec, point)] = value if error is None else None
            status, bound, score = self.cells.get(m, row)
            score[r] = value
            if error is not None or (outcome is not None and outcome.feasible and outcome.score_bound > value):
                self.cells.unsure.add((m, row, r))
            self.stats["evaluated_this_run"] += 1
            if error is not None:  # its throughput is unknown, so it may have beaten the optimum
                self.failed_keys.add(point_key(session.codec, point))
                self.stats["failed"].append({"trial": frozen.number, "point": point, "bound": float(bound[r]),
                                             "error": error})
            if extra.get("new_best"):
                session.tracker.log_best(self.incumbent, frozen.number)

    def _report(self) -> None:
        """The progress line: points settled (evaluated, bounded at or below the best, or dominated)."""
        n_r, ub0, incumbent = self.n_r, self.ub0, self.incumbent
        floor = np.broadcast_to(self.visit.floor(incumbent), ub0.shape)  # what a point must beat, per cell
        settled = n_r * int(np.count_nonzero(ub0 <= floor))
        evaluated = 0
        for (m, row), (_, b, sc) in self.cells.items():
            settled -= n_r * int(ub0[m, row] <= floor[m, row])
            done_here = ~np.isnan(sc) | (b <= floor[m, row]) | (np.asarray(self.dom[m]) != np.arange(n_r))
            settled += int(np.count_nonzero(done_here))
            evaluated += int(np.count_nonzero(~np.isnan(sc)))
        self.progress.set_done(settled, incumbent if incumbent > 0 else None, evaluated=evaluated)

    # -- the accounting --------------------------------------------------------------------------------
    def conclude(self) -> dict:
        """The sweep's statistics: how every point was settled, whether the optimum is proven, the
        points file written and logged."""
        session, grid, stats = self.session, self.grid, self.stats
        _end_bounding(session, stats)  # nothing left to evaluate in this run: it was all bounding
        stats["wall_s"] = time.perf_counter() - self.t_start
        mark_evaluated(grid, self.cells, session.study.get_trials(deepcopy=False))  # resumed points too
        settle_dominated(self.cells, self.dom)
        counts = count_settled(self.cells, self.n_m * grid.n_rows, self.n_r)
        self._prove_optimum()
        stats.update(points=grid.size, settled=counts, cells=self.n_m * grid.n_rows,
                     cells_expanded=len(self.cells.cells),
                     evaluated_by_bound=counts["bound-ideal"] + counts["bound-placement"] + counts["dominated"],
                     optimum=self.incumbent)
        path = _write_points(grid, self.cells, self.ub0, Path(self.config.output_dir) / f"{session.name}-points.csv.gz")
        stats["points_file"] = str(path)
        session.tracker.log_parent(metrics={"points": grid.size, "evaluated": counts["evaluated"],
                                            "evaluated_by_bound": stats["evaluated_by_bound"],
                                            "bound_ideal": counts["bound-ideal"],
                                            "bound_placement": counts["bound-placement"],
                                            "dominated": counts["dominated"]})
        session.tracker.log_parent_file(path)
        return stats

    def _prove_optimum(self) -> None:
        """The optimum is proven only if no point that could beat it failed to evaluate (an ILP that
        hit its time limit, say; resumed failures count too), nor was evaluated on unproven layer
        schedules with a proven bound above the best (its score is reached, but the optimum then lies
        between the best and the largest such bound)."""
        stats, incumbent = self.stats, self.incumbent
        stats["failed"] += [{"point": None, "bound": None, "error": "failed in an earlier run"}
                            for k, v in self.done.items() if v is None and k not in self.failed_keys]
        stats["unproven"] = unproven_points(self.session.study.get_trials(deepcopy=False))
        open_bounds = [f["bound"] for f in stats["failed"]] + [u["bound"] for u in stats["unproven"]]
        stats["optimum_proven"] = not any(b is None or b > incumbent for b in open_bounds)
        if self.pareto:
            stats["front_proven"] = not front_open(self.session.study.get_trials(deepcopy=False),
                                                   stats["failed"] + stats["unproven"], self.session.space)
        if not stats["optimum_proven"]:
            stats["optimum_upper_bound"] = (None if None in open_bounds
                                            else max([incumbent] + [b for b in open_bounds if b is not None]))


class _BestFirst:
    """One objective: every cell in one group, in decreasing level-0 bound, from the best score held."""

    @staticmethod
    def incumbent(done_scores: dict) -> float:
        return max((s for s in done_scores.values() if s is not None), default=0.0)

    @staticmethod
    def orders(ub0: np.ndarray):
        yield np.argsort(-ub0, axis=None, kind="stable"), 0.0

    @staticmethod
    def floor(incumbent: float) -> float:
        return incumbent


def settle_dominated(cells: Cells, dom: list[list[int]]) -> None:
    """Every dominated recipe of an expanded cell that was not itself evaluated is settled by the
    recipe dominating it: its throughput is at most that recipe's, so its bound is that recipe's
    score when it was evaluated in this run with a proven throughput, else that recipe's bound."""
    for (m, row), (status, bound, score) in cells.items():
        for r, d in enumerate(dom[m]):
            if d != r and status[r] != EVALUATED:
                status[r] = DOMINATED
                proven = status[d] == EVALUATED and not np.isnan(score[d]) and (m, row, d) not in cells.unsure
                bound[r] = score[d] if proven else bound[d]


def count_settled(cells: Cells, n_cells: int, n_r: int) -> dict:
    """How every point was settled: the expanded cells' recipes as recorded, every recipe of the other
    cells by level 0."""
    counts = {name: 0 for name in SETTLED}
    for status, _, _ in (c for _, c in cells.items()):
        for code, name in enumerate(SETTLED):
            counts[name] += int(np.sum(status == code))
    counts["bound-ideal"] += (n_cells - len(cells.cells)) * n_r
    return counts


def _end_bounding(session, stats: dict) -> None:
    """Record this invocation's bounding phase (see the module docstring), once."""
    if "bounding_s" in stats:
        return
    end = session.elapsed()
    stats["bounding_s"] = end - session.offset_s
    phases = list(session.study.user_attrs.get("bounding_phases") or [])
    session.study.set_user_attr("bounding_phases", [*phases, [session.offset_s, end]])


def mark_evaluated(grid, cells: Cells, trials) -> int:
    """Mark every grid point the study holds a finished trial of as evaluated, with its throughput (0
    when infeasible or failed), so the points file of a resumed sweep agrees with the study:
    a point evaluated by an earlier run stays `evaluated` even when this run's bounds would have
    settled it (its cell is expanded if it was not). Returns how many points it marked."""
    def key(value) -> str:  # a stored point went through JSON: compare in that form
        return json.dumps(jsonable(value), sort_keys=True)

    fields = list(grid.archs[0]) if grid.archs else []
    rows = {tuple(key(a[k]) for k in fields): i for i, a in enumerate(grid.archs)}
    hbm = {key(h): i for i, h in enumerate(grid.hbms)}
    mbs = {int(m): i for i, m in enumerate(grid.mbss)}
    rc = {key(r): i for i, r in enumerate(grid.rcs)}  # a recipe: {recompute, further sampled fields}
    names = list(grid.rcs[0]) if grid.rcs else []
    marked = 0
    for t in trials:
        point = t.user_attrs.get("point")
        if not isinstance(point, dict) or t.state.name not in ("COMPLETE", "FAIL"):
            continue
        if t.state.name == "FAIL" and "result" not in t.user_attrs:
            continue
        try:
            a = rows[tuple(key(point[k]) for k in fields)]
            m, h, r = mbs[int(point["mbs"])], hbm[key(point["hbm_gib"])], rc[key({n: point[n] for n in names})]
        except (KeyError, TypeError, ValueError):
            continue
        status, _, score = cells.get(m, a * len(grid.hbms) + h)
        status[r] = EVALUATED
        feasible = t.state.name == "COMPLETE" and all(v <= 0 for v in t.constraints.values()) and t.values
        score[r] = float(t.values[0]) if feasible else 0.0  # as `run_branch_bound` records them
        result = t.user_attrs.get("result")
        if t.state.name == "FAIL" or (isinstance(result, dict) and result.get("proven") is False):
            cells.unsure.add((m, a * len(grid.hbms) + h, r))
        marked += 1
    return marked


def _write_points(grid: Grid, cells: Cells, ub0: np.ndarray, path: Path) -> Path:
    """Every point, how it was settled and its bound (the file users check the pruning with). A cell
    (architecture, HBM, microbatch) whose recipes were all settled by the ideal-scaling bound is one
    row with `*` in every recipe column (it stands for every recipe, with that bound); an expanded
    cell has one row per recipe."""
    import pandas as pd

    n_m, n_rows = ub0.shape
    n_r = len(grid.rcs)
    expanded = sorted(cells.cells)
    flat = np.ones(n_m * n_rows, dtype=bool)
    for m, row in expanded:
        flat[m * n_rows + row] = False
    whole = np.flatnonzero(flat)  # cells settled whole by level 0
    m_idx = np.concatenate([whole // n_rows, np.repeat([m for m, _ in expanded], n_r).astype(int)])
    row_idx = np.concatenate([whole % n_rows, np.repeat([row for _, row in expanded], n_r).astype(int)])
    r_idx = np.concatenate([np.full(whole.size, -1), np.tile(np.arange(n_r), len(expanded))]).astype(int)
    status = np.concatenate([np.full(whole.size, BOUND_IDEAL, dtype=np.int8)] + [cells.cells[k][0] for k in expanded])
    bound = np.concatenate([ub0.ravel()[whole]] + [cells.cells[k][1] for k in expanded])
    score = np.concatenate([np.full(whole.size, np.nan)] + [cells.cells[k][2] for k in expanded])
    arch_idx, hbm_idx = np.divmod(row_idx, len(grid.hbms))
    frame = pd.DataFrame({k: np.asarray([a[k] for a in grid.archs])[arch_idx] for k in grid.archs[0]})
    frame["hbm_gib"] = np.asarray(grid.hbms)[hbm_idx]
    frame["mbs"] = np.asarray(grid.mbss)[m_idx]
    for name in grid.rcs[0]:
        values = np.asarray([rc[name] for rc in grid.rcs] + ["*"], dtype=object)
        frame[name] = values[r_idx]  # -1: the "*" of a whole cell
    frame["settled"] = np.asarray(SETTLED)[status]
    frame["upper_bound"] = bound
    frame["throughput"] = score
    data = frame.to_csv(index=False, float_format="%.6g").encode()
    # compressed in memory, then written aside and moved into place: never half a file
    return write_whole(path, gzip.compress(data, mtime=0))


class BranchAndBoundStrategy(BranchAndBound):
    """The bound-pruned sweep: its rules (`strategy.BranchAndBound`) and `run_pruned` in a session."""

    def run(self, config: StudyConfig, backend: Backend | None = None) -> dict:
        session = Session(config, backend)
        session.begin()
        with session.running():
            return run_pruned(session)


BRANCH_AND_BOUND = register(BranchAndBoundStrategy())
