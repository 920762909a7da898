"""The exhaustive sweep: every grid point of the space, logged exactly like a sampled trial.

Order. `--order area` follows the published system (msr-fiddle/phaze, Solver/solver.py): designs
by decreasing area, in area groups of `area_group_mm2` (their 10,000 um^2 = 0.01 mm^2 bins).
`--order grid` takes the space's grid order. Within that order the points of one compute
architecture and microbatch are kept together (first appearance decides), because those share
every workload graph, operator latency and ILP: the evaluator caches by content, and keeping
them adjacent means the second to last of them hit a hot cache. HBM capacity and recompute change
only the placement DP.

Hysteresis. With `--hysteresis K` the sweep stops after the area group at which the best score
(throughput objective) of the last K completed groups has not increased from one group to the
next: M[i-K+1] >= M[i-K+2] >= ... >= M[i], the published rule (`get_next_acc_config`, hysterisis
level 5). An area group without a feasible design counts as score 0.

Logging. Each point becomes a finished trial of an Optuna study (added with its real start and
end time, one storage write) and a nested MLflow run, with the same attributes as a sampled trial,
so `compare` treats sampled and exhaustive studies alike. A resumed sweep skips the points already
in the study and replays their scores into the hysteresis rule. `best_history` records the
wall-clock (elapsed_s) at which each new best was found.

With `--workers N` (hysteresis off) the groups are dealt round-robin to N processes, each group
wholly to one process so its cache reuse stays intact.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import replace
from datetime import datetime
from typing import Any, Sequence

import optuna

from ..design.protocols import area_params as space_area_params
from ..errors import PhazeError
from ..training import RECIPE_FIELDS
from .encoding import SpaceCodec
from .objective import FatalStudyError, evaluate_point
from ..runs import reconcile, signals
from .. import interrupt
from ..runs.progress import say
from .report import finish
from .session import (
    Session,
    SpoolLogger,
    WorkerSpec,
    finished_trials,
    one_line,
    quiet_optuna,
    run_pool,
)
from .setup import Backend, StudyConfig, load_study, release_storage, validate
from .strategy import AutoSweep, Grid, register, strategy_for
from .trials import add_trial, best_history, existing_scores, frozen_trial, point_key
from ..runs.tracking import NullTracker

RUN_PARAMS = RECIPE_FIELDS


def _freeze(value: Any):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def plan(space, order: str, area_group_mm2: float) -> list[dict]:
    """The sweep: groups of points, each {"area_group": bin or None, "key": reuse key, "points": [...]}.

    A list of reuse clusters in sweep order; consecutive clusters with the same `area_group` form
    one area group for the hysteresis rule.
    """
    points = space.grid_points(order=order)
    arch_cache: dict = {}
    area_cache: dict = {}
    area_params = space_area_params(space)
    entries = []
    for p in points:
        arch_part = tuple(sorted((k, _freeze(v)) for k, v in p.items() if k not in RUN_PARAMS))
        accel = arch_cache.get(arch_part)
        if accel is None:
            accel = arch_cache[arch_part] = space.accelerator(p)
        compute = accel.compute_key or arch_part
        reuse = (compute, _freeze(p["mbs"]))
        group = None
        if order == "area":
            akey = tuple(_freeze(p[k]) for k in area_params) if area_params else arch_part
            area = area_cache.get(akey)
            if area is None:
                area = area_cache[akey] = float(space.area_check(p)[1])
            group = int(math.floor(area / area_group_mm2 + 1e-9))
        entries.append((group, reuse, p))
    if order == "area":
        entries.sort(key=lambda e: -e[0])  # stable: keeps the space's order inside a group
    clusters: list[dict] = []
    index: dict = {}
    for group, reuse, p in entries:
        slot = index.get((group, reuse))
        if slot is None:
            slot = index[(group, reuse)] = len(clusters)
            clusters.append({"area_group": group, "key": reuse, "points": []})
        clusters[slot]["points"].append(p)
    return clusters


def hysteresis_stop(group_best: Sequence[float], k: int | None) -> bool:
    """True when the last k area-group maxima never increase from one group to the next."""
    if k is None or len(group_best) < k:
        return False
    window = list(group_best)[-k:]
    return all(a >= b for a, b in zip(window, window[1:]))


class _Sweeper:
    """Evaluates clusters of points in one process and logs each as a trial."""

    def __init__(self, spec: WorkerSpec, study: optuna.Study, tracker, done: dict, best: float | None):
        self.spec = spec
        self.study = study
        self.tracker = tracker
        self.ctx = spec.context()
        self.codec = SpaceCodec(spec.backend.space.params)
        self.done = done  # point key -> score (None when failed)
        self.best = best
        self.best_number = None  # the trial number of `best` when this sweeper found it
        self.evaluated = 0

    def run_point(self, point: dict) -> float | None:
        key = point_key(self.codec, point)
        if key in self.done:
            return self.done[key]
        started = datetime.now()
        t0 = time.perf_counter()
        outcome, error = None, None
        try:
            with interrupt.interruptible():  # a signal cuts the evaluation (the point is not recorded)
                outcome = evaluate_point(point, self.ctx)
        except FatalStudyError:
            raise
        except KeyboardInterrupt:
            if outcome is None:
                raise
        except Exception as exc:  # noqa: BLE001 - one design's error must not stop the sweep
            if interrupt.stop_requested():  # a solver that turned the interrupt into an error
                raise KeyboardInterrupt from None
            error = one_line(exc)
        extra = {"elapsed_s": self.spec.elapsed(), "trial_s": time.perf_counter() - t0}
        score = None
        if outcome is not None:
            score = outcome.score if outcome.feasible else 0.0
            if outcome.feasible and (self.best is None or outcome.score > self.best):
                self.best = outcome.score
                extra["new_best"] = True
        frozen = add_trial(self.study, frozen_trial(self.codec, point, outcome, error, started, datetime.now(), extra,
                                                self.spec.backend.space))
        if extra.get("new_best"):
            self.best_number = frozen.number
        artifact = outcome.artifact() if outcome is not None else None
        if self.spec.spool_dir:
            self.spec.spool(frozen.number, artifact)
        else:
            self.tracker.log_trial(frozen, artifact)
        if error is not None:
            say(f"point {frozen.number} failed: {error}")
        self.done[key] = score
        self.evaluated += 1
        return score


def run_exhaustive(config, backend=None) -> dict:
    """Run (or resume) the grid sweep: every grid point, in area groups (with hysteresis) or grid order."""
    session = Session(config, backend)
    session.begin()
    config = session.config
    with session.running():
        clusters = plan(session.space, config.order, config.area_group_mm2)
        n_points = sum(len(c["points"]) for c in clusters)
        if n_points == 0:
            raise PhazeError(f"space '{session.space.name}': no grid point passes the area rule")
        done = existing_scores(session.study, session.codec)
        best0 = max((s for s in done.values() if s is not None and s > 0), default=None)
        progress = session.progress(n_points, "point", initial=min(len(done), n_points),
                                    feasible=sum(1 for s in done.values() if s))
        progress.update(0, best0)
        groups_total = len({c["area_group"] for c in clusters}) if config.order == "area" else None
        stopped, groups_done = False, 0
        if config.workers == 1:
            sweeper = _Sweeper(session.worker_spec(), session.study, session.tracker, done, best0)
            group_best: list[float] = []
            current, current_best = object(), None
            logged_best = best0
            for cluster in clusters:
                if config.order == "area" and cluster["area_group"] != current:
                    if current_best is not None:
                        group_best.append(current_best)
                        groups_done += 1
                        if hysteresis_stop(group_best, config.hysteresis):
                            stopped = True
                            break
                    current, current_best = cluster["area_group"], 0.0
                for point in cluster["points"]:
                    before = sweeper.evaluated
                    with interrupt.deferred():  # a signal cuts the evaluation, never the storage write
                        score = sweeper.run_point(point)
                    if interrupt.stop_requested():
                        raise KeyboardInterrupt
                    if config.order == "area":
                        current_best = max(current_best, score or 0.0)
                    n = sweeper.evaluated - before
                    progress.update(n, sweeper.best, feasible=int(n > 0 and bool(score)))
                    if sweeper.best is not None and sweeper.best != logged_best:
                        logged_best = sweeper.best
                        session.tracker.log_best(logged_best, sweeper.best_number)
            else:
                if config.order == "area" and current_best is not None:
                    group_best.append(current_best)
                    groups_done += 1
        else:
            workers = min(config.workers, len(clusters))
            with tempfile.TemporaryDirectory(prefix=signals.spool_prefix(session.session_id)) as spool:
                spec = session.worker_spec(spool if session.tracker.enabled else None)
                run_pool(session, progress, SpoolLogger(session, spool),
                         [(_exhaustive_worker, (spec, i, workers)) for i in range(workers)])
            groups_done = groups_total
        progress.close()
        progress = None
        history = best_history(session.all_trials())
        session.study.set_user_attr("best_history", history)
        total_done = len(finished_trials(session.all_trials()))
        extra = {"exhaustive": {
            "order": config.order, "hysteresis": config.hysteresis, "area_group_mm2": config.area_group_mm2,
            "points": n_points, "evaluated": total_done, "reuse_groups": len(clusters),
            "groups": groups_total, "groups_done": groups_done, "stopped_early": stopped,
            "best_history": history,
        }}
        session.study.set_user_attr("exhaustive_status", {k: v for k, v in extra["exhaustive"].items()
                                                          if k != "best_history"})
        return finish(session, [], extra)


def _exhaustive_worker(spec: WorkerSpec, index: int, workers: int) -> dict:
    """Evaluate every `workers`-th reuse cluster, starting at `index` (a worker process)."""
    quiet_optuna()
    reconcile.adopt(spec.owner)
    study = None
    with signals.worker_task(spec.spool_dir):
        try:
            study = load_study(spec.config, spec.storage_url, spec.study_name)
            clusters = plan(spec.backend.space, spec.config.order, spec.config.area_group_mm2)
            codec = SpaceCodec(spec.backend.space.params)
            sweeper = _Sweeper(spec, study, NullTracker(), existing_scores(study, codec), None)
            for i, cluster in enumerate(clusters):
                if i % workers != index:
                    continue
                for point in cluster["points"]:
                    if interrupt.stop_requested():
                        raise KeyboardInterrupt
                    sweeper.run_point(point)
            return {"evaluated": sweeper.evaluated}
        except KeyboardInterrupt:
            if study is not None:
                release_storage(study)  # a transaction the interrupt cut short must not keep the write lock
            return {"interrupted": True}


class GridStrategy(Grid):
    """The grid sweep: its rules (`strategy.Grid`) and `run_exhaustive`."""

    def run(self, config: StudyConfig, backend: Backend | None = None) -> dict:
        return run_exhaustive(config, backend)


class AutoSweepStrategy(AutoSweep):
    """`--exhaustive --prune auto`: the settings validated once to choose between branch and bound
    and the grid (`setup.resolve_strategy`), then that strategy's run."""

    def run(self, config: StudyConfig, backend: Backend | None = None) -> dict:
        chosen = replace(config, strategy=validate(config, backend).strategy)
        return strategy_for(chosen).run(chosen, backend)


GRID = register(GridStrategy())
AUTO_SWEEP = register(AutoSweepStrategy())
