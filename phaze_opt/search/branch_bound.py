"""The exhaustive sweep with proven-bound pruning: every grid point is settled, exactly.

Evaluating a point in full (per-layer ILPs + placement DP) costs up to seconds; the `phaze` space
has 703,128 points. Most of them provably cannot beat the best design found, so they are settled
by a bound instead (`upper_bound` explains both bounds and why they hold):

1. level 0, vectorised: an ideal-scaling throughput bound for every (architecture, HBM, microbatch),
   covering both recompute settings. Computed for all designs at once, one microbatch per process.
2. level 1: the exact placement DP on lower-bound layer times of one point (~10-30 ms).
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

Every point is recorded: evaluated points as Optuna trials and MLflow runs; the rest in
`<output>/<study>-points.csv.gz` (also an MLflow artifact of the parent run) with how each was
settled ("evaluated", "bound-ideal" or "bound-placement") and its bound, and as counts in the
summary and the parent run's metrics.
"""

from __future__ import annotations

import heapq
import itertools
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from datetime import datetime
from pathlib import Path

import numpy as np

from ..hardware.latency import DesignArrays
from ..system import load_system
from ..workload.models import load_model
from .upper_bound import ideal_throughput, layer_lower_bounds, placement_throughput

SETTLED = ("bound-ideal", "bound-placement", "evaluated")
BOUND_IDEAL, BOUND_PLACEMENT, EVALUATED = range(3)


# -- the grid, as arrays -----------------------------------------------------------------------------

class Grid:
    """Points as (microbatch index, design row, recompute index); design row = arch x HBM."""

    def __init__(self, space):
        self.space = space
        self.archs = [{k: v for k, v in a.items() if k != "area_mm2"} for a in space.architectures(order="grid")]
        self.hbms = list(space.params["hbm_gib"])
        self.mbss = [int(m) for m in space.params["mbs"]]
        self.rcs = list(space.params["recompute"])
        self.n_rows = len(self.archs) * len(self.hbms)

    def point(self, m: int, row: int, r: int) -> dict:
        arch = self.archs[row // len(self.hbms)]
        return {**arch, "hbm_gib": self.hbms[row % len(self.hbms)], "mbs": self.mbss[m], "recompute": self.rcs[r]}

    def accelerators(self):
        return [self.space.accelerator(self.point(0, row, 0)) for row in range(self.n_rows)]

    @property
    def size(self) -> int:
        return len(self.mbss) * self.n_rows * len(self.rcs)


# -- worker side -------------------------------------------------------------------------------------

_W: dict = {}


def _init_worker(model: str, system: str, spec) -> None:
    from .runner import quiet_optuna
    from .signals import worker_started

    quiet_optuna()
    if spec is not None and multiprocessing.parent_process() is not None:
        worker_started()  # a pool process dies with its parent
    _W.update(model=load_model(model), system=load_system(system), spec=spec,
              ctx=spec.context() if spec is not None else None)


def _level0(space, mbs: int) -> tuple[np.ndarray, list]:
    """Ideal bound and lower-bound layer times of every design row at one microbatch."""
    from .evaluate import _tp_widths

    model, system = _W["model"], _W["system"]
    key = ("designs", getattr(space, "name", None), id(space))
    if key not in _W:  # 88k designs take seconds to build; a worker keeps them for every microbatch
        _W[key] = DesignArrays.from_accelerators(Grid(space).accelerators())
    designs = _W[key]
    widths = [layer_lower_bounds(model, designs, mbs, system, tp) for tp in _tp_widths(model, system)]
    return ideal_throughput(widths, mbs, system.accelerators), widths


def _level1(widths, mbs: int, hbm_bytes: float, peak_flops: float, rcs: list) -> list[float]:
    return [placement_throughput(_W["model"], widths, 0, system=_W["system"], mbs=mbs, recompute=bool(rc),
                                 hbm_bytes=hbm_bytes, peak_flops=peak_flops) for rc in rcs]


def _evaluate(points: list[dict]) -> list[tuple]:
    from .objective import evaluate_point
    from .runner import one_line

    out = []
    for point in points:
        started, t0 = datetime.now(), time.perf_counter()
        outcome, error = None, None
        try:
            outcome = evaluate_point(point, _W["ctx"])
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


def _executor(workers: int, initargs):
    if workers <= 1:
        return _Inline(_init_worker, initargs)
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=initargs)


# -- the parent ----------------------------------------------------------------------------------------

def run_branch_bound(session, progress) -> dict:
    """Settle every grid point of the session's space; returns the sweep's statistics."""
    from .exhaustive import _add, _existing, _frozen_trial, point_key
    from .report import unproven_points

    config = session.config
    model_name = config.models[0]
    grid = Grid(session.space)
    t_start = time.perf_counter()
    done = _existing(session.study, session.codec)  # resumed points: key -> score
    incumbent = max((s for s in done.values() if s is not None), default=0.0)
    progress.update(0, incumbent if incumbent > 0 else None)

    n_m, n_r = len(grid.mbss), len(grid.rcs)
    status = np.full((n_m, grid.n_rows, n_r), BOUND_IDEAL, dtype=np.int8)
    bound = np.zeros((n_m, grid.n_rows, n_r))
    score = np.full((n_m, grid.n_rows, n_r), np.nan)
    spec = session.worker_spec()
    stats = {"workers": config.workers, "evaluated_this_run": 0, "resumed": 0, "level1_runs": 0, "failed": []}

    pool = _executor(config.workers, (model_name, config.system, spec))
    try:
        t0 = time.perf_counter()
        level0 = list(pool.map(_level0, itertools.repeat(session.space, n_m), grid.mbss))
        stats["level0_s"] = time.perf_counter() - t0
        widths = [w for _, w in level0]
        ub0 = np.stack([u for u, _ in level0])  # [n_m, n_rows]
        bound[:] = ub0[:, :, None]
        order = np.argsort(-ub0, axis=None, kind="stable")
        accels: dict[int, object] = {}

        def accel(row):
            if row not in accels:
                accels[row] = session.space.accelerator(grid.point(0, row, 0))
            return accels[row]

        pos = 0  # next level-0 candidate in `order`
        heap: list = []  # (-bound, seq, m, row, {r: ub1})
        seq = itertools.count()
        inflight: dict[Future, tuple] = {}
        failed_keys: set = set()

        def record(cells, results):
            nonlocal incumbent
            for (m, row, r), (point, outcome, error, started, ended, trial_s) in zip(cells, results):
                extra = {"elapsed_s": session.elapsed(), "trial_s": trial_s, "settled": "evaluated"}
                value = 0.0
                if outcome is not None and outcome.feasible:
                    value = float(outcome.score)
                    if value > incumbent:
                        incumbent = value
                        extra["new_best"] = True
                frozen = _add(session.study, _frozen_trial(session.codec, point, outcome, error, started, ended,
                                                           extra, session.space))
                session.tracker.log_trial(frozen, outcome.artifact() if outcome is not None else None)
                done[point_key(session.codec, point)] = value if error is None else None
                score[m, row, r] = value
                stats["evaluated_this_run"] += 1
                if error is not None:  # its throughput is unknown, so it may have beaten the optimum
                    failed_keys.add(point_key(session.codec, point))
                    stats["failed"].append({"trial": frozen.number, "point": point, "bound": float(bound[m, row, r]),
                                            "error": error})
                progress.update(1, incumbent if incumbent > 0 else None)
                if extra.get("new_best"):
                    session.tracker.log_best(incumbent, frozen.number)

        while True:
            while len(inflight) < max(config.workers, 1):
                top0 = ub0.flat[order[pos]] if pos < order.size else -np.inf
                top1 = -heap[0][0] if heap else -np.inf
                if max(top0, top1) <= incumbent:
                    break
                if top1 >= top0:  # a point whose placement bound is known: evaluate what can still win
                    _, _, m, row, ub1 = heapq.heappop(heap)
                    todo, cells = [], []
                    for r, b in ub1.items():
                        if b <= incumbent:
                            continue
                        status[m, row, r] = EVALUATED
                        point = grid.point(m, row, r)
                        key = point_key(session.codec, point)
                        if key in done:  # finished in an earlier run of this study
                            score[m, row, r] = done[key] or 0.0
                            stats["resumed"] += 1
                        else:
                            todo.append(point)
                            cells.append((m, row, r))
                    if todo:
                        _end_bounding(session, stats)
                        inflight[pool.submit(_evaluate, todo)] = ("eval", cells)
                else:
                    flat = int(order[pos])
                    pos += 1
                    m, row = divmod(flat, grid.n_rows)
                    a = accel(row)
                    rows = [w.take([row]) for w in widths[m]]
                    inflight[pool.submit(_level1, rows, grid.mbss[m], float(a.hbm_bytes), float(a.peak_flops),
                                         grid.rcs)] = ("l1", m, row)
                    stats["level1_runs"] += n_r
            if not inflight:
                break
            finished, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
            for f in finished:
                tag = inflight.pop(f)
                if tag[0] == "eval":
                    record(tag[1], f.result())
                    continue
                _, m, row = tag
                ub1 = dict(enumerate(f.result()))
                for r, b in ub1.items():
                    status[m, row, r] = BOUND_PLACEMENT
                    bound[m, row, r] = b
                live = {r: b for r, b in ub1.items() if b > incumbent}
                if live:
                    heapq.heappush(heap, (-max(live.values()), next(seq), m, row, live))
    finally:
        pool.shutdown(cancel_futures=True) if isinstance(pool, ProcessPoolExecutor) else pool.shutdown()

    _end_bounding(session, stats)  # nothing left to evaluate in this run: it was all bounding
    stats["wall_s"] = time.perf_counter() - t_start
    counts = {name: int(np.sum(status == code)) for code, name in enumerate(SETTLED)}
    # The optimum is proven only if no point that could beat it failed to evaluate (an ILP that hit its
    # time limit, say); resumed failures count too.
    stats["failed"] += [{"point": None, "bound": None, "error": "failed in an earlier run"}
                        for k, v in done.items() if v is None and k not in failed_keys]
    # Likewise a point evaluated on unproven layer schedules: its score is reached, but its proven bound
    # may lie above the best; the optimum then lies between the best and the largest such bound.
    stats["unproven"] = unproven_points(session.study.get_trials(deepcopy=False))
    open_bounds = [f["bound"] for f in stats["failed"]] + [u["bound"] for u in stats["unproven"]]
    stats["optimum_proven"] = not any(b is None or b > incumbent for b in open_bounds)
    if not stats["optimum_proven"]:
        stats["optimum_upper_bound"] = (None if None in open_bounds
                                        else max([incumbent] + [b for b in open_bounds if b is not None]))
    stats.update(points=grid.size, settled=counts, evaluated_by_bound=counts["bound-ideal"] + counts["bound-placement"],
                 optimum=incumbent)
    from .reconcile import mark_evaluated

    mark_evaluated(grid, status, score, session.study.get_trials(deepcopy=False))  # resumed points too
    path = _write_points(grid, status, bound, score, Path(config.output_dir) / f"{session.name}-points.csv.gz")
    stats["points_file"] = str(path)
    session.tracker.log_parent(metrics={"points": grid.size, "evaluated": counts["evaluated"],
                                        "evaluated_by_bound": stats["evaluated_by_bound"],
                                        "bound_ideal": counts["bound-ideal"],
                                        "bound_placement": counts["bound-placement"]})
    session.tracker.log_parent_file(path)
    progress.set_done(grid.size, incumbent if incumbent > 0 else None)
    return stats


def _end_bounding(session, stats: dict) -> None:
    """Record this invocation's bounding phase (see the module docstring), once."""
    if "bounding_s" in stats:
        return
    end = session.elapsed()
    stats["bounding_s"] = end - session.offset_s
    phases = list(session.study.user_attrs.get("bounding_phases") or [])
    session.study.set_user_attr("bounding_phases", [*phases, [session.offset_s, end]])


def _write_points(grid: Grid, status, bound, score, path: Path) -> Path:
    """Every point, how it was settled and its bound (the file users check the pruning with)."""
    import pandas as pd

    n_m, n_rows, n_r = status.shape
    m_idx, row_idx, r_idx = (a.ravel() for a in np.meshgrid(np.arange(n_m), np.arange(n_rows), np.arange(n_r),
                                                            indexing="ij"))
    arch_idx, hbm_idx = np.divmod(row_idx, len(grid.hbms))
    frame = pd.DataFrame({k: np.asarray([a[k] for a in grid.archs])[arch_idx] for k in grid.archs[0]})
    frame["hbm_gib"] = np.asarray(grid.hbms)[hbm_idx]
    frame["mbs"] = np.asarray(grid.mbss)[m_idx]
    frame["recompute"] = np.asarray(grid.rcs)[r_idx]
    frame["settled"] = np.asarray(SETTLED)[status.ravel()]
    frame["upper_bound"] = bound.ravel()
    frame["throughput"] = score.ravel()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written aside, moved into place: never half a file
    frame.to_csv(partial, index=False, compression="gzip", float_format="%.6g")
    os.replace(partial, path)
    return path
