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
from datetime import datetime
from typing import Any, Iterable, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from ..errors import PhazeError
from .encoding import SpaceCodec
from .objective import FatalStudyError, accelerator_fields, evaluate_point, jsonable
from .runner import (
    Progress,
    Session,
    SpoolLogger,
    WorkerSpec,
    finished_trials,
    is_feasible,
    make_storage,
    one_line,
    quiet_optuna,
    run_pool,
    score_label,
)
from . import reconcile, signals
from .tracking import NullTracker

RUN_PARAMS = ("mbs", "recompute")


def _freeze(value: Any):
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def point_key(codec: SpaceCodec, point: dict) -> tuple:
    return tuple(sorted(codec.encode(point).items()))


def plan(space, order: str, area_group_mm2: float) -> list[dict]:
    """The sweep: groups of points, each {"area_group": bin or None, "key": reuse key, "points": [...]}.

    A list of reuse clusters in sweep order; consecutive clusters with the same `area_group` form
    one area group for the hysteresis rule.
    """
    points = space.grid_points(order=order)
    arch_cache: dict = {}
    area_cache: dict = {}
    area_params = getattr(space, "area_params", None)
    entries = []
    for p in points:
        arch_part = tuple(sorted((k, _freeze(v)) for k, v in p.items() if k not in RUN_PARAMS))
        accel = arch_cache.get(arch_part)
        if accel is None:
            accel = arch_cache[arch_part] = space.accelerator(p)
        compute = getattr(accel, "compute_key", None) or arch_part
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


def _frozen_trial(codec: SpaceCodec, point: dict, outcome, error: str | None, started: datetime,
                  ended: datetime, result_extra: dict, space=None) -> FrozenTrial:
    params = codec.encode(point)
    dists = {k: v for k, v in codec.distributions().items()}
    user_attrs = {"point": jsonable(point)}
    system_attrs = {}
    if error is not None:
        user_attrs["result"] = {"error": error, **result_extra}
        if "accelerator" not in user_attrs["result"]:
            user_attrs["result"]["accelerator"] = accelerator_fields(space, point) if space is not None else {}
        state, values = TrialState.FAIL, None
    else:
        user_attrs["result"] = {**outcome.result_attr(), **result_extra}
        state, values = TrialState.COMPLETE, list(outcome.values)
        for key, value in outcome.constraints.items():
            system_attrs[f"constraints:{key}"] = float(value)
    return FrozenTrial(number=0, state=state, value=None, values=values, datetime_start=started,
                       datetime_complete=ended, params=params, distributions=dists, user_attrs=user_attrs,
                       system_attrs=system_attrs, intermediate_values={}, trial_id=0)


def _add(study: optuna.Study, trial: FrozenTrial) -> FrozenTrial:
    """Add a finished trial and return it as stored (with its study-wide number)."""
    storage = study._storage  # noqa: SLF001 - add_trial does not return the new trial's number
    reconcile.stamp(trial.system_attrs)  # who ran it (see `reconcile`)
    trial_id = storage.create_new_trial(study._study_id, template_trial=trial)  # noqa: SLF001
    return storage.get_trial(trial_id)


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
            outcome = evaluate_point(point, self.ctx)
        except FatalStudyError:
            raise
        except Exception as exc:  # noqa: BLE001 - one design's error must not stop the sweep
            error = one_line(exc)
        extra = {"elapsed_s": self.spec.elapsed(), "trial_s": time.perf_counter() - t0}
        score = None
        if outcome is not None:
            score = outcome.score if outcome.feasible else 0.0
            if outcome.feasible and (self.best is None or outcome.score > self.best):
                self.best = outcome.score
                extra["new_best"] = True
        frozen = _add(self.study, _frozen_trial(self.codec, point, outcome, error, started, datetime.now(), extra,
                                                self.spec.backend.space))
        if extra.get("new_best"):
            self.best_number = frozen.number
        artifact = outcome.artifact() if outcome is not None else None
        if self.spec.spool_dir:
            self.spec.spool(frozen.number, artifact)
        else:
            self.tracker.log_trial(frozen, artifact)
        if error is not None:
            from .runner import _say

            _say(f"point {frozen.number} failed: {error}")
        self.done[key] = score
        self.evaluated += 1
        return score


def _existing(session_or_study, codec: SpaceCodec) -> dict:
    done = {}
    for t in finished_trials(session_or_study.get_trials(deepcopy=False)):
        point = t.user_attrs.get("point")
        if point is None:
            continue
        try:
            key = point_key(codec, point)
        except ValueError:
            continue
        done[key] = (t.values[0] if is_feasible(t) else 0.0) if t.state == TrialState.COMPLETE else None
    return done


def run_exhaustive(config, backend=None) -> dict:
    from .report import finish

    session = Session(config, backend)
    config = session.config
    with session.running():
        if config.prune == "bound":
            return _run_pruned(session)
        clusters = plan(session.space, config.order, config.area_group_mm2)
        n_points = sum(len(c["points"]) for c in clusters)
        if n_points == 0:
            raise PhazeError(f"space '{getattr(session.space, 'name', config.space)}': no grid point passes the area rule")
        done = _existing(session.study, session.codec)
        best0 = max((s for s in done.values() if s is not None and s > 0), default=None)
        progress = Progress(n_points, min(len(done), n_points), session.name, "point", config.progress,
                            score_label(config))
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
                    score = sweeper.run_point(point)
                    if config.order == "area":
                        current_best = max(current_best, score or 0.0)
                    progress.update(sweeper.evaluated - before, score if score else None)
                    if sweeper.best is not None and (progress.best is None or sweeper.best > progress.best):
                        progress.update(0, sweeper.best)
                    if sweeper.best is not None and sweeper.best != logged_best:
                        logged_best = sweeper.best
                        session.tracker.log_best(logged_best, sweeper.best_number)
            else:
                if config.order == "area" and current_best is not None:
                    group_best.append(current_best)
                    groups_done += 1
        else:
            workers = min(config.workers, len(clusters))
            with tempfile.TemporaryDirectory(prefix=signals.spool_prefix()) as spool:
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


def _run_pruned(session) -> dict:
    """Every point settled by evaluation or by a proven bound (see `branch_bound`)."""
    from .branch_bound import Grid, run_branch_bound
    from .report import finish

    config = session.config
    total = Grid(session.space).size
    if total == 0:
        raise PhazeError(f"space '{getattr(session.space, 'name', config.space)}': no grid point passes the area rule")
    progress = Progress(total, 0, session.name, "point", config.progress, score_label(config))
    stats = run_branch_bound(session, progress)
    progress.close()
    history = best_history(session.all_trials())
    session.study.set_user_attr("best_history", history)
    info = {"order": "best-first by bound", "hysteresis": None, "prune": "bound", **stats}
    session.study.set_user_attr("exhaustive_status", info)
    return finish(session, [], {"exhaustive": {**info, "evaluated": stats["settled"]["evaluated"],
                                               "best_history": history}})


def best_history(trials: Iterable) -> list[dict]:
    """Each time the best feasible score improved, in wall-clock order: trial, elapsed_s, score."""
    rows = []
    for t in trials:
        if not is_feasible(t):
            continue
        e = (t.user_attrs.get("result") or {}).get("elapsed_s")
        rows.append((float(e) if isinstance(e, (int, float)) else float("inf"), t.number, t.values[0]))
    rows.sort()
    history, best = [], None
    for elapsed, number, score in rows:
        if best is None or score > best:
            best = score
            history.append({"trial": number, "elapsed_s": elapsed, "score": score})
    return history


def _exhaustive_worker(spec: WorkerSpec, index: int, workers: int) -> dict:
    """Evaluate every `workers`-th reuse cluster, starting at `index` (a worker process)."""
    quiet_optuna()
    signals.worker_started(spec.spool_dir)
    reconcile.adopt(spec.owner)
    try:
        storage = make_storage(spec.storage_url)
        study = optuna.load_study(study_name=spec.study_name, storage=storage)
        clusters = plan(spec.backend.space, spec.config.order, spec.config.area_group_mm2)
        codec = SpaceCodec(spec.backend.space.params)
        sweeper = _Sweeper(spec, study, NullTracker(), _existing(study, codec), None)
        for i, cluster in enumerate(clusters):
            if i % workers != index:
                continue
            for point in cluster["points"]:
                sweeper.run_point(point)
        return {"evaluated": sweeper.evaluated}
    except KeyboardInterrupt:
        return {"interrupted": True}
    finally:
        signals.worker_finished()
