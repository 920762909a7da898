"""The sampled study: Optuna's sampler proposes designs, `--trials` of them, in one or more processes.

Resume: `--trials N` is the study's total. Finished trials (complete, infeasible or failed with an
error) are never re-run. A trial cut short by Ctrl-C is marked `interrupted` and its point is
queued again; a trial whose process died is failed by Optuna's heartbeat check after
`GRACE_S` and queued again (RetryFailedTrialCallback). Neither counts as finished.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from ..runs import reconcile, signals
from ..runs.cluster import ClusterExecutor
from ..runs.disk import DiskFull
from .. import interrupt
from ..activity import phase
from .bound_sampler import SETTLED_ATTR, settled_note, stop_when_settled
from .encoding import SpaceCodec
from .objective import FatalStudyError, accelerator_fields, evaluate_point, jsonable
from .report import crash_notes, describe_trial, finish
from ..runs.progress import Progress, say
from .session import (
    Session,
    SpoolLogger,
    WorkerLost,
    WorkerSpec,
    best_trial,
    finished_trials,
    is_feasible,
    lost_worker,
    one_line,
    quiet_optuna,
    run_pool,
    split_quota,
    tally,
)
from .strategy import Sampled, register
from .trials import mark_design
from .setup import Backend, StudyConfig, load_study, locate, make_storage, release_storage, study_identity
from ..runs.tracking import NullTracker, sqlite_path
from ..runs.urls import redact


class TrialError(Exception):
    """An unexpected error in one trial: the trial fails with its message and the study goes on."""


class TrialInterrupted(Exception):
    """A stop request cut this trial's evaluation: it fails as `interrupted` (not counted), its point is
    queued again, and the loop stops after Optuna has recorded it."""


# -- the trial loop (in this process or a worker) ---------------------------------------------------

def run_worker(spec: WorkerSpec, quota: int, index: int = 0, on_trial: Callable | None = None,
               tracker=None, study: optuna.Study | None = None) -> dict:
    """Run `quota` trials of the study in this process; returns the counts of each outcome.

    In the parent process trials are logged with its `tracker` and run on the session's own open
    `study`: its sampler is the one worker 0 would build (same sampler, seed + 0, nothing drawn
    from it yet), and the storage stays the one the session holds. A worker process opens the study
    itself with its own sampler (seed + index) and spools each trial's artifact for the parent
    instead (see `SpoolLogger`).
    """
    quiet_optuna()
    reconcile.adopt(spec.owner)
    ctx = spec.context()
    if study is None:
        study = load_study(spec.config, spec.storage_url, spec.study_name, worker=index, space=spec.backend.space)
    codec = SpaceCodec(spec.backend.space.params)
    tracker = tracker or NullTracker()
    artifacts: dict[int, dict] = {}
    counts = {"complete": 0, "infeasible": 0, "failed": 0}

    def interrupted(trial):
        trial.set_user_attr("interrupted", True)
        study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number, **reconcile.kept_attrs(trial)})
        return TrialInterrupted(interrupt.stop_requested() or "stop")

    def objective(trial):
        reconcile.claim(trial)  # host and pid: a trial whose process dies is failed at the next start
        start = time.perf_counter()
        point = codec.suggest(trial)
        trial.set_user_attr("point", jsonable(point))
        mark_design(study, trial, point)
        outcome = None
        try:
            with interrupt.interruptible(), phase(f"evaluating trial {trial.number}"):  # only the evaluation is cut
                outcome = evaluate_point(point, ctx)  # by a signal, never Optuna's writes
        except FatalStudyError:
            trial.set_user_attr("interrupted", True)  # a set-up problem, not this design's: do not count it
            raise
        except KeyboardInterrupt:
            interrupt.request_stop("KeyboardInterrupt")  # raised without a signal too (a library's own)
            if outcome is None:  # a finished evaluation is kept (the signal came just after it)
                raise interrupted(trial) from None
        except Exception as exc:  # noqa: BLE001 - one design's error must not stop the study
            if interrupt.stop_requested():  # a solver that turned the interrupt into an error
                raise interrupted(trial) from None
            message = one_line(exc)
            trial.set_user_attr("result", {"error": message, "elapsed_s": spec.elapsed(),
                                           "trial_s": time.perf_counter() - start, "worker": index,
                                           "accelerator": accelerator_fields(spec.backend.space, point)})
            raise TrialError(message) from exc
        for key, value in outcome.constraints.items():
            trial.set_constraint(key, value)
        result = outcome.result_attr()
        result["elapsed_s"] = spec.elapsed()
        result["worker"] = index
        if spec.spool_dir:
            try:
                spec.spool(trial.number, outcome.artifact())
            except DiskFull:  # its artifact is lost with the disk: not counted, its point queued again
                interrupted(trial)
                raise
        trial.set_user_attr("result", result)
        if not spec.spool_dir:
            artifacts[trial.number] = outcome.artifact()
        return outcome.values if len(outcome.values) > 1 else outcome.values[0]

    def callback(study_, frozen):
        if interrupt.stop_requested():
            study_.stop()  # after Optuna has recorded this trial: the loop's safe point
        if frozen.user_attrs.get("interrupted"):
            return  # not finished: queued again, neither counted nor logged
        if frozen.state == TrialState.FAIL:
            counts["failed"] += 1
            error = (frozen.user_attrs.get("result") or {}).get("error", "failed")
            say(f"trial {frozen.number} failed: {error}")
        elif is_feasible(frozen):
            counts["complete"] += 1
        else:
            counts["infeasible"] += 1
        tracker.log_trial(frozen, artifacts.pop(frozen.number, None))
        if on_trial is not None:
            on_trial(frozen)

    try:
        with interrupt.deferred():
            if not interrupt.stop_requested() and SETTLED_ATTR not in study.user_attrs:
                study.optimize(objective, n_trials=quota, catch=(TrialError, TrialInterrupted), gc_after_trial=False,
                               callbacks=[callback, reconcile.stop_at_total(spec.config.trials, finished_trials),
                                          stop_when_settled])
    except KeyboardInterrupt:
        release_storage(study)  # a transaction the interrupt cut short must not keep the write lock
        raise
    if interrupt.stop_requested():
        counts["interrupted"] = True
    return counts


def _worker_entry(spec: WorkerSpec, quota: int, index: int) -> dict:
    with signals.worker_task(spec.spool_dir):  # dies with the parent
        if interrupt.stop_requested():
            return {"interrupted": True}  # stopped while starting: nothing to open
        try:
            return run_worker(spec, quota, index)
        except KeyboardInterrupt:
            return {"interrupted": True}


def held_trials(config: StudyConfig, backend: Backend | None = None) -> tuple[str, str, int, dict | None]:
    """(study name, storage URL, finished trials it holds; 0 when it does not exist yet or was run
    with other settings, which opening it refuses; and when its sampler settled the space, when it
    did), without creating the study or touching it."""
    quiet_optuna()
    backend = backend or Backend()
    config, name, url = locate(config, backend)
    db = sqlite_path(url)
    if db is not None and not db.is_file():
        return name, url, 0, None
    storage = make_storage(url)
    try:
        if name not in optuna.study.get_all_study_names(storage):
            return name, url, 0, None
        study = optuna.load_study(study_name=name, storage=storage)
        identity = study_identity(config, backend.resolved(config).space)
        if any(study.user_attrs.get(k, v) != v for k, v in identity.items()):
            return name, url, 0, None
        return name, url, len(finished_trials(study.get_trials(deepcopy=False))), study.user_attrs.get(SETTLED_ATTR)
    finally:
        release_storage(storage)


def nothing_to_run(config: StudyConfig, name: str, url: str, held: int, backend: Backend | None = None,
                   settled: dict | None = None) -> dict:
    """A study that already holds `--trials` (its total) finished trials, or whose sampler settled
    the space (no point left can beat its best): reconciled as every start is
    (a parent killed once the last trial finished leaves runs missing and its own run RUNNING), then
    said at once; no parent run, study attribute or wall time is added for an invocation that runs
    nothing."""
    session = Session(config, backend)
    session.reconcile_only()
    try:
        done = finished_trials(session.all_trials())
        notes = crash_notes(session, done)
        best = best_trial(done)  # the study's own, for when no run lived to write its summary
        best = describe_trial(best, {}) if best is not None else None  # no baselines: this start evaluates none
    finally:
        session.release()
    for note in notes:
        say(note)
    if settled and held < config.trials:
        above = ("the best throughput evaluated at or below its area" if len(config.objectives) > 1
                 else f"its best ({settled.get('best', 0):.6g})")
        say(f"study {name} was settled by its sampler after trial {settled.get('trial')}: no point left has a "
            f"proven bound above {above}, so more trials cannot improve it: nothing to run (no MLflow run started)")
    else:
        say(f"study {name} already holds {held} finished trials and --trials {config.trials} is the study's total: "
            f"nothing to run (no MLflow run started); give --trials above {held} to add trials")
    held_note = {"nothing_to_run": True, "held": held, "requested": config.trials, "reconciled": notes}
    path = Path(config.output_dir) / f"{name}-summary.json"
    try:  # the summary of the run that finished it, so callers (`published --resume`) read the same fields
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # the run that finished the study was stopped before its summary
        return {"study": name, "storage": redact(url), "summary_file": None, "best": best, **held_note}
    return {**saved, **held_note}


def run_sampled(config: StudyConfig, backend: Backend | None = None) -> dict:
    """Run (or resume) a sampled study."""
    name, url, held, settled = held_trials(config, backend)
    if held >= config.trials or settled:
        return nothing_to_run(config, name, url, held, backend, settled)
    session = Session(config, backend)
    session.begin()
    with session.running():
        session.enqueue_references()
        done, best, feasible = tally(session.all_trials())
        remaining = max(0, session.config.trials - done)
        progress = session.progress(session.config.trials, "trial", initial=min(done, session.config.trials),
                                    feasible=feasible)
        progress.update(0, best)
        worker_stats = []
        if remaining and session.config.workers == 1 and not session.config.cluster:
            spec = session.worker_spec()

            def on_trial(frozen):
                ok = is_feasible(frozen)
                improved = ok and (progress.best is None or frozen.values[0] > progress.best)
                progress.update(1, frozen.values[0] if ok else None, feasible=int(ok))
                if improved:
                    session.tracker.log_best(frozen.values[0], frozen.number)

            worker_stats.append(run_worker(spec, remaining, 0, on_trial, tracker=session.tracker, study=session.study))
            if worker_stats[-1].get("interrupted"):
                raise KeyboardInterrupt
        elif remaining:
            worker_stats = _run_pool(session, remaining, progress)
        progress.close()
        note = settled_note(session.study)
        if note:
            session.notes.append(note)
        return finish(session, worker_stats)


def _run_pool(session: Session, remaining: int, progress: Progress) -> list[dict]:
    """The workers of a study with --workers > 1; a worker that dies (the OOM killer) costs its trial,
    failed and queued again, and the pool is started again for what is left of the total."""
    cluster = session.config.cluster
    with tempfile.TemporaryDirectory(prefix=signals.spool_prefix(session.session_id)) as spool:
        # a cluster's workers may not see this machine's folders: their trials are logged without artifacts
        spec = session.worker_spec(spool if session.tracker.enabled and not cluster else None)
        logger = SpoolLogger(session, spool)
        for restarts in itertools.count():
            quotas = [q for q in split_quota(remaining, session.config.workers) if q > 0]
            try:
                return run_pool(session, progress, logger, [(_worker_entry, (spec, q, i)) for i, q in enumerate(quotas)],
                                ClusterExecutor(cluster) if cluster else None)
            except WorkerLost:
                lost_worker(session, restarts)
            remaining = session.config.trials - len(finished_trials(session.all_trials()))
            if remaining <= 0:
                return []


class SampledStrategy(Sampled):
    """The sampled strategy: its rules (`strategy.Sampled`) and `run_sampled`."""

    def run(self, config: StudyConfig, backend: Backend | None = None) -> dict:
        return run_sampled(config, backend)


SAMPLED = register(SampledStrategy())
