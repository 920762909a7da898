"""Running a study: one invocation (`Session`), its trial loop, and its worker processes.

`run_study(config, backend)` is what `python -m phaze_opt.study` calls. It

1. validates the settings and opens (or resumes) the Optuna study in its storage;
2. computes each model's TPUv4 baseline once per study (kept in the study's attributes, so a
   resumed study normalises by the very same numbers);
3. opens one MLflow parent run for this invocation;
4. enqueues the reference design (TPUv4 at every microbatch/recompute choice) unless the study
   already has it;
5. runs trials until the study holds `--trials` finished ones, in this process or in `--workers`
   processes that share the storage (Optuna's distributed mode);
6. returns the summary (`report.summarise`).

Resume: `--trials N` is the study's total. Finished trials (complete, infeasible or failed with an
error) are never re-run. A trial cut short by Ctrl-C is marked `interrupted` and its point is
queued again; a trial whose process died is failed by Optuna's heartbeat check after
`GRACE_S` and queued again (RetryFailedTrialCallback). Neither counts as finished.

Wall-clock: every trial records `elapsed_s`, seconds since the study began summed over its
invocations (an invocation starts at `offset` = the study's wall time so far, `study_wall_s`), so
the convergence comparison sees search time, not the idle time between two runs. The study's wall
time is the one number both the end-of-study report and `compare` print (see `study_wall_s`); the
workers of each invocation are kept in the study attribute `workers_per_run`.
"""

from __future__ import annotations

from contextlib import contextmanager

import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Callable

import optuna
from optuna.trial import TrialState

from ..errors import PhazeError
from . import reconcile, signals
from .encoding import SpaceCodec
from .objective import (
    Baseline,
    Context,
    FatalStudyError,
    accelerator_fields,
    compute_baselines,
    evaluate_point,
    jsonable,
)
from .setup import (
    Backend,
    StudyConfig,
    check_space,
    make_sampler,
    make_storage,
    open_study,
    storage_url,
    study_name,
    validate,
)
from .tracking import (
    NOTE_TAG,
    TRIALS_VIEW,
    VIEW_TAG,
    MlflowTracker,
    NullTracker,
    constant_params,
    experiment_description,
    redact,
    tracking_enabled,
    trials_view,
)


class TrialError(Exception):
    """An unexpected error in one trial: the trial fails with its message and the study goes on."""


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # Said once in the summary's notes instead of at every trial: CMA-ES learns from the 0 throughput.
    warnings.filterwarnings("ignore", message="Constraints have been set, but CmaEsSampler")


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def finished_trials(trials) -> list:
    """Trials that count towards `--trials`: complete (feasible or not) or failed by an error."""
    retried = set()
    for t in trials:
        retried.update(t.system_attrs.get("retry_history", []) or [])
        if t.user_attrs.get("retry_of") is not None:
            retried.add(t.user_attrs["retry_of"])
    out = []
    for t in trials:
        if t.state == TrialState.COMPLETE:
            out.append(t)
        elif (t.state == TrialState.FAIL and not t.user_attrs.get("interrupted") and t.number not in retried
              and "result" in t.user_attrs):  # no result: cut outside the evaluation (Ctrl-C in the sampler)
            out.append(t)
    return out


def is_feasible(trial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def elapsed_of(trial) -> float | None:
    value = (trial.user_attrs.get("result") or {}).get("elapsed_s")
    return float(value) if isinstance(value, (int, float)) else None


def study_wall_s(attrs: dict, trials) -> float:
    """A study's wall time: its search time summed over its invocations, in seconds.

    Each invocation counts from its start (opening the study, before the baselines) to its end (the
    summary built, or the run interrupted), when the study attribute `wall_s` is updated; a run
    killed before its end counts up to its last finished trial's `elapsed_s`. Hence the max of the
    two. The end-of-study report (`report.finish`) and `compare` both print this number.
    """
    times = [e for e in map(elapsed_of, trials) if e is not None and math.isfinite(e)]
    stored = attrs.get("wall_s")
    if isinstance(stored, (int, float)) and math.isfinite(stored):
        times.append(float(stored))
    return max(times, default=0.0)


def split_quota(total: int, workers: int) -> list[int]:
    base, extra = divmod(total, workers)
    return [base + (1 if i < extra else 0) for i in range(workers)]


@dataclass
class WorkerSpec:
    """Everything a worker process needs; picklable."""

    config: StudyConfig
    backend: Backend
    storage_url: str
    study_name: str
    baselines: dict
    clock_start: float  # time.time() when this invocation began
    offset_s: float
    spool_dir: str | None = None  # worker processes leave each trial's placement.json here for the parent
    owner: dict | None = None  # the invocation whose trials the workers claim (`reconcile.owner_context`)

    def elapsed(self) -> float:
        return self.offset_s + (time.time() - self.clock_start)

    def context(self) -> Context:
        return Context(models=self.config.models, system=self.config.system, space=self.backend.space,
                       evaluator=self.backend.evaluator, objectives=self.config.objectives,
                       baselines=self.baselines)

    def spool(self, number: int, artifact: dict | None) -> None:
        if self.spool_dir and artifact is not None:
            path = os.path.join(self.spool_dir, f"{number}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(artifact, f)
            os.replace(path + ".tmp", path)


class SpoolLogger:
    """The parent's side of worker logging: one MLflow writer for every trial the workers finish.

    Workers do not open MLflow at all (each client costs seconds to start, and several writers on
    one SQLite store contend for its lock). The parent polls the storage and logs each newly
    finished trial once, with the artifact its worker spooled; `trial_record` needs nothing else.
    """

    def __init__(self, session: "Session", spool_dir: str):
        self.session = session
        self.spool_dir = spool_dir
        self.seen = set(session.finished_at_start)

    def poll(self, trials) -> None:
        for t in finished_trials(trials):
            if t.number in self.seen or not reconcile.is_mine(t, self.session.session_id):
                continue  # another process's trial: it logs it
            self.seen.add(t.number)
            path = os.path.join(self.spool_dir, f"{t.number}.json")
            artifact = None
            if os.path.exists(path):
                with open(path) as f:
                    artifact = json.load(f)
                os.remove(path)
            self.session.tracker.log_trial(t, artifact)


class Session:
    """One invocation of a sampled or exhaustive study (the parent process)."""

    def __init__(self, config: StudyConfig, backend: Backend | None = None):
        self.clock_start = time.time()
        quiet_optuna()
        backend = backend or Backend()
        self.config = config = validate(config, backend)
        self.backend = backend.resolved(config)
        check_space(self.backend.space)
        self.space = self.backend.space
        self.codec = SpaceCodec(self.space.params)
        self.name = study_name(config)
        self.url = storage_url(config)
        self.storage = make_storage(self.url)
        sampler = (optuna.samplers.RandomSampler(seed=config.seed) if config.exhaustive
                   else make_sampler(config.sampler, config.seed, len(config.objectives)))
        self.study, self.resumed = open_study(config, self.storage, self.space, sampler)
        self.session_id = reconcile.new_session()
        self.zombies = reconcile.fail_zombies(self.study) + reconcile.requeue_lost(self.study)
        signals.clean_stale_spools()
        trials = self.study.get_trials(deepcopy=False)
        self.offset_s = study_wall_s(self.study.user_attrs, trials)
        self.wall_s: float | None = None  # set by end_wall
        self.study.set_user_attr("workers_per_run",
                                 [*(self.study.user_attrs.get("workers_per_run") or []), config.workers])
        self.finished_at_start = {t.number for t in finished_trials(trials)}
        self.trials_before = len(self.finished_at_start)
        self.notes: list[str] = []
        if config.sampler == "cmaes" and not config.exhaustive:
            self.notes.append("cmaes ignores Optuna constraints; it learns infeasible designs from their 0 throughput")
        self.baselines = self._baselines()
        self.tracker = self._start_tracker()
        reconcile.set_parent_run(self.tracker.parent_run_id)
        self.reconciled = reconcile.reconcile_runs(self.tracker, self.all_trials(), finished_trials)

    # -- set-up ----------------------------------------------------------------------------------
    def _baselines(self) -> dict[str, Baseline]:
        stored = self.study.user_attrs.get("baselines") or {}
        if all(m in stored for m in self.config.models):
            return {m: Baseline.from_json(stored[m]) for m in self.config.models}
        params = self.space.params
        baselines = compute_baselines(self.config.models, self.backend.evaluator, self.backend.reference_arch,
                                      self.config.system, params["mbs"], params["recompute"])
        if len(self.config.models) > 1:
            for m, b in baselines.items():
                if not b.feasible or not b.throughput > 0:
                    raise FatalStudyError(f"model '{m}' has no feasible TPUv4 baseline ({b.reason}); a common design "
                                          "is scored by throughput relative to it, so drop the model")
        self.study.set_user_attr("baselines", {m: b.to_json() for m, b in baselines.items()})
        self.study.set_user_attr("baseline_arch", getattr(self.backend.reference_arch, "name", "") or
                                 self.config.reference_arch)
        return baselines

    def _start_tracker(self):
        """The MLflow parent run of this invocation, named `<study> <date> <time>` (`(resumed)` when the
        study already had trials), in the study's experiment (see `tracking.experiment_description`)."""
        c = self.config
        if not tracking_enabled(c.tracking_uri):
            return NullTracker()
        constant = constant_params(self.space)
        context = {"study_name": self.name, "sampler": "exhaustive" if c.exhaustive else c.sampler,
                   "models": list(c.models), "mode": c.mode, "objectives": list(c.objectives),
                   "constant": sorted(constant)}
        trials = self.study.get_trials(deepcopy=False)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        run_name = f"{self.name} {stamp}" + (" (resumed)" if trials else "")
        space_name = getattr(self.space, "name", c.space)
        params = {"study": self.name, "mode": c.mode, "models": ",".join(c.models), "space": space_name,
                  "system": c.system, "sampler": context["sampler"], "seed": c.seed, "trials": c.trials,
                  "objectives": ",".join(c.objectives), "workers": c.workers, **constant}
        if c.exhaustive:
            params.update({"order": c.order, "hysteresis": "off" if c.hysteresis is None else c.hysteresis})
        tags = {"optuna.study": self.name, "optuna.storage": redact(self.url), "mode": c.mode,
                "sampler": context["sampler"], "models": ",".join(c.models), "resumed": str(self.resumed).lower(),
                reconcile.OWNER_TAG: reconcile.owner_tag()}
        for m, b in self.baselines.items():
            prefix = "" if len(c.models) == 1 else f"{m}."
            if b.feasible:
                params[f"{prefix}baseline_throughput_seq_per_s"] = b.throughput
        description = experiment_description(
            study=self.name, models=c.models, space=space_name, space_description=getattr(self.space, "description", ""),
            system=c.system, objectives=c.objectives, directions=c.directions, sampler=context["sampler"], mode=c.mode)
        view = trials_view(c.models, [p for p, choices in self.space.params.items() if len(choices) > 1])
        tracker = MlflowTracker.start(c.tracking_uri, self.name, run_name=run_name, params=params, tags=tags,
                                      context=context, experiment_tags={NOTE_TAG: description,
                                                                        VIEW_TAG + TRIALS_VIEW: view},
                                      storage_key=reconcile.storage_key(self.url))
        tracker.log_best_of(trials, settled_only=False)  # a resumed study's best-so-far curve, by trial number
        return tracker

    def worker_spec(self, spool_dir: str | None = None) -> WorkerSpec:
        return WorkerSpec(self.config, self.backend, self.url, self.name, self.baselines, self.clock_start,
                          self.offset_s, spool_dir, reconcile.owner_context())

    def elapsed(self) -> float:
        return self.offset_s + (time.time() - self.clock_start)

    def end_wall(self) -> float:
        """The end of this invocation: store the study's wall time (`study_wall_s`) once; returns it."""
        if self.wall_s is None:
            self.wall_s = self.elapsed()
            self.study.set_user_attr("wall_s", self.wall_s)
        return self.wall_s

    def all_trials(self):
        return self.study.get_trials(deepcopy=False)

    def enqueue_references(self) -> int:
        """TPUv4 (the reference) at every microbatch and recompute choice, first, once per study."""
        n = 0
        for mbs in self.space.params["mbs"]:
            for rc in self.space.params["recompute"]:
                try:
                    point = self.space.reference_point(arch=self.config.reference_arch, mbs=mbs, recompute=rc)
                    params = self.codec.encode(point)
                except (PhazeError, ValueError) as exc:
                    self.notes.append(f"reference design not enqueued: {exc}")
                    return n
                self.study.enqueue_trial(params, user_attrs={"reference": self.config.reference_arch},
                                         skip_if_exists=True)
                n += 1
        return n

    def close(self, status: str = "FINISHED") -> None:
        self.tracker.close(status)

    @contextmanager
    def running(self):
        """The body of an invocation: on the way out, close any progress bar and end the MLflow
        parent run as FINISHED, KILLED (Ctrl-C) or FAILED, so an interrupted study is marked as such."""
        status = "FINISHED"
        restore = signals.handle_termination()  # SIGTERM, SIGHUP: as Ctrl-C
        try:
            yield self
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except BaseException:
            status = "FAILED"
            raise
        finally:
            if status != "FINISHED":  # this process's (and its dead workers') trials cut short: interrupted, re-queued
                try:
                    reconcile.fail_zombies(self.study)
                except Exception:  # noqa: BLE001 - the storage may be what failed; keep the real error
                    pass
            if self.wall_s is None:  # interrupted or failed before its summary
                try:
                    self.end_wall()
                except Exception:  # noqa: BLE001 - the storage may be what failed; keep the real error
                    pass
            if _PROGRESS.get("bar") is not None:
                _PROGRESS["bar"].close()
                _PROGRESS["bar"] = None
            self.close(status)
            restore()
            reconcile.end_session()


# -- the trial loop (in this process or a worker) ---------------------------------------------------

def run_worker(spec: WorkerSpec, quota: int, index: int = 0, on_trial: Callable | None = None,
               tracker=None) -> dict:
    """Run `quota` trials of the study in this process; returns the counts of each outcome.

    In the parent process trials are logged with its `tracker`; a worker process spools each
    trial's artifact for the parent instead (see `SpoolLogger`).
    """
    quiet_optuna()
    reconcile.adopt(spec.owner)
    config = spec.config
    storage = make_storage(spec.storage_url)
    sampler = make_sampler(config.sampler, config.seed, len(config.objectives), worker=index)
    study = optuna.load_study(study_name=spec.study_name, storage=storage, sampler=sampler)
    ctx = spec.context()
    codec = SpaceCodec(spec.backend.space.params)
    tracker = tracker or NullTracker()
    artifacts: dict[int, dict] = {}
    counts = {"complete": 0, "infeasible": 0, "failed": 0}

    def objective(trial):
        reconcile.claim(trial)  # host and pid: a trial whose process dies is failed at the next start
        start = time.perf_counter()
        point = codec.suggest(trial)
        trial.set_user_attr("point", jsonable(point))
        try:
            outcome = evaluate_point(point, ctx)
        except FatalStudyError:
            trial.set_user_attr("interrupted", True)  # a set-up problem, not this design's: do not count it
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number, **reconcile.kept_attrs(trial)})
            raise
        except Exception as exc:  # noqa: BLE001 - one design's error must not stop the study
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
        trial.set_user_attr("result", result)
        if spec.spool_dir:
            spec.spool(trial.number, outcome.artifact())
        else:
            artifacts[trial.number] = outcome.artifact()
        return outcome.values if len(outcome.values) > 1 else outcome.values[0]

    def callback(_study, frozen):
        if frozen.state == TrialState.FAIL:
            counts["failed"] += 1
            error = (frozen.user_attrs.get("result") or {}).get("error", "failed")
            _say(f"trial {frozen.number} failed: {error}")
        elif is_feasible(frozen):
            counts["complete"] += 1
        else:
            counts["infeasible"] += 1
        tracker.log_trial(frozen, artifacts.pop(frozen.number, None))
        if on_trial is not None:
            on_trial(frozen)

    study.optimize(objective, n_trials=quota, catch=(TrialError,), gc_after_trial=False,
                   callbacks=[callback, reconcile.stop_at_total(config.trials, finished_trials)])
    return counts


def _worker_entry(spec: WorkerSpec, quota: int, index: int) -> dict:
    signals.worker_started(spec.spool_dir)  # dies with the parent; one interrupt
    try:
        return run_worker(spec, quota, index)
    except KeyboardInterrupt:
        return {"interrupted": True}
    finally:
        signals.worker_finished()


_PROGRESS = {"bar": None}


def _say(text: str) -> None:
    bar = _PROGRESS["bar"]
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr)


class Progress:
    """A tqdm bar over the study's finished trials, with the best throughput so far."""

    def __init__(self, total: int, initial: int, label: str, unit: str, enabled: bool | None, fmt: Callable):
        from tqdm import tqdm

        self.fmt = fmt
        self.bar = tqdm(total=total, initial=initial, desc=label, unit=unit, disable=None if enabled is None else not enabled,
                        dynamic_ncols=True, file=sys.stderr)
        _PROGRESS["bar"] = self.bar
        self.best = None

    def update(self, n: int = 1, best: float | None = None) -> None:
        if best is not None and (self.best is None or best > self.best):
            self.best = best
            self.bar.set_postfix_str(f"best {self.fmt(best)}", refresh=False)
        if n:
            self.bar.update(n)

    def set_done(self, done: int, best: float | None) -> None:
        self.update(max(0, done - self.bar.n), best)

    def close(self) -> None:
        self.bar.close()
        _PROGRESS["bar"] = None


def score_label(config: StudyConfig) -> Callable[[float], str]:
    if len(config.models) > 1:
        return lambda v: f"{v:.3f}x TPUv4"
    return lambda v: f"{v:,.1f} seq/s"


def best_score(trials) -> float | None:
    values = [t.values[0] for t in trials if is_feasible(t)]
    return max(values) if values else None


def run_study(config: StudyConfig, backend: Backend | None = None) -> dict:
    """Run (or resume) a sampled study, or an exhaustive sweep when `config.exhaustive`."""
    if config.exhaustive:
        from .exhaustive import run_exhaustive

        return run_exhaustive(config, backend)
    from .report import finish

    session = Session(config, backend)
    with session.running():
        session.enqueue_references()
        done = len(finished_trials(session.all_trials()))
        remaining = max(0, session.config.trials - done)
        progress = Progress(session.config.trials, min(done, session.config.trials), session.name, "trial",
                            session.config.progress, score_label(session.config))
        progress.update(0, best_score(session.all_trials()))
        worker_stats = []
        if remaining and session.config.workers == 1:
            spec = session.worker_spec()

            def on_trial(frozen):
                improved = is_feasible(frozen) and (progress.best is None or frozen.values[0] > progress.best)
                progress.update(1, frozen.values[0] if is_feasible(frozen) else None)
                if improved:
                    session.tracker.log_best(frozen.values[0], frozen.number)

            worker_stats.append(run_worker(spec, remaining, 0, on_trial, tracker=session.tracker))
        elif remaining:
            worker_stats = _run_pool(session, remaining, progress)
        progress.close()
        return finish(session, worker_stats)


def _run_pool(session: Session, remaining: int, progress: Progress) -> list[dict]:
    quotas = [q for q in split_quota(remaining, session.config.workers) if q > 0]
    with tempfile.TemporaryDirectory(prefix=signals.spool_prefix()) as spool:
        spec = session.worker_spec(spool if session.tracker.enabled else None)
        logger = SpoolLogger(session, spool)
        return run_pool(session, progress, logger, [(_worker_entry, (spec, q, i)) for i, q in enumerate(quotas)])


def run_pool(session: Session, progress: Progress, logger: SpoolLogger, tasks: list) -> list[dict]:
    """Run worker tasks in spawned processes, polling the storage for progress and MLflow logging."""
    context = multiprocessing.get_context("spawn")
    with (ProcessPoolExecutor(max_workers=len(tasks), mp_context=context, initializer=signals.worker_started) as pool,
          signals.stop_workers_on_exit(pool, drain=lambda: logger.poll(session.all_trials()))):  # logs what they finished
        futures = [pool.submit(fn, *args) for fn, args in tasks]
        pending = set(futures)
        while True:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
            trials = session.all_trials()
            logger.poll(trials)
            score = best_score(trials)
            n = len(finished_trials(trials))
            progress.set_done(n, score)
            session.tracker.log_best_of(trials)
            for f in done:
                exc = f.exception()
                if exc is not None:
                    for other in pending:
                        other.cancel()
                    raise exc
            if not pending:
                break
        stats = [f.result() for f in futures]
    if any(s.get("interrupted") for s in stats):
        raise KeyboardInterrupt
    return stats
