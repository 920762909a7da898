"""One invocation of a study (`Session`), its worker spec, its process pool and its progress line.

Every strategy (`sampled`, `exhaustive`, `branch_bound`) opens a `Session`, which validates the
settings and opens (or resumes) the Optuna study in its storage, and evaluates nothing. Its
`begin` then computes each model's TPUv4 baseline once per study (kept in the study's attributes,
so a resumed study normalises by the very same numbers) and opens one MLflow parent run for this
invocation; `enqueue_references` queues the reference design (TPUv4 at every microbatch/recompute
choice) unless the study already has it.

Wall-clock: every trial records `elapsed_s`, seconds since the study began summed over its
invocations (an invocation starts at `offset` = the study's wall time so far, `study_wall_s`), so
the convergence comparison sees search time, not the idle time between two runs. The study's wall
time is the one number both the end-of-study report and `compare` print (see `study_wall_s`); the
workers of each invocation are kept in the study attribute `workers_per_run`.

Also here, for every strategy: which trials count as finished (`finished_trials`), feasibility,
the worker spec a process needs (`WorkerSpec`), the parent's MLflow logging of worker trials
(`SpoolLogger`), the pool of spawned workers (`run_pool`) and each invocation's progress
(`Session.progress`, drawn by `progress.Progress`).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
import warnings
from concurrent.futures import FIRST_EXCEPTION, Executor, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Callable

import optuna
from optuna.trial import TrialState

from ..design.protocols import BoundedEvaluator
from ..errors import PhazeError
from .encoding import SpaceCodec
from .objective import Baseline, Context, FatalStudyError, compute_baselines, reference_cluster, reference_recipes
from ..runs import locks, reconcile, signals
from ..runs.disk import DATABASE_HEADROOM_BYTES, DiskFull, is_full, quiet_full_threads, write_whole
from .. import interrupt
from ..activity import phase
from ..runs.progress import Progress, close_bar, say
from .setup import Backend, StudyConfig, database_place, prepare, release_storage
from ..runs.tracking import (
    NOTE_TAG,
    TRIALS_VIEW,
    VIEW_TAG,
    MlflowTracker,
    NullTracker,
    constant_params,
    experiment_description,
    redact,
    storage_key,
    tracking_enabled,
    trials_view,
)


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    quiet_full_threads()  # Optuna's heartbeat thread on a full disk: the study's own line says it
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
        if self.spool_dir and artifact is not None:  # whole or not at all: a full disk leaves no part
            write_whole(os.path.join(self.spool_dir, f"{number}.json"), json.dumps(artifact))


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
        """Log the newly finished trials. A trial counts as seen once its log is queued, and its spool
        file stays until the folder goes at the end of the pool (after the tracker's flush), so a
        parent that dies before its writes reach MLflow leaves the artifact for the next start."""
        for t in finished_trials(trials):
            if t.number in self.seen or not reconcile.is_mine(t, self.session.session_id):
                continue  # another process's trial: it logs it
            path = os.path.join(self.spool_dir, f"{t.number}.json")
            artifact = None
            try:
                with open(path) as f:
                    artifact = json.load(f)
            except (OSError, ValueError):
                pass  # none spooled (tracking off in the worker), or unreadable: logged without it
            self.session.tracker.log_trial(t, artifact)
            self.seen.add(t.number)


class Session:
    """One invocation of a study (the parent process), in two steps: opening it (the constructor)
    evaluates nothing; `begin` starts the run proper (the TPUv4 baselines, the MLflow parent run).
    A start that will run nothing (the study holds its total) calls `reconcile_only` instead, then
    `release`."""

    def __init__(self, config: StudyConfig, backend: Backend | None = None):
        """Open the invocation: validate the settings, open (or resume) the study, take this
        invocation's place in it. A signal cuts what only reads or builds aside (opening the stores)
        at once and waits for the end of each group of writes."""
        self.clock_start = time.time()
        interrupt.fresh_start()  # a stop request of an earlier invocation in this process is over
        self.restore_signals = signals.handle_termination()  # SIGINT, SIGTERM, SIGHUP: the stop flag
        self.tracker = NullTracker()
        self._set_up(self._open, config, backend)

    def begin(self) -> None:
        """Start the run: each model's TPUv4 baseline (evaluated once per study, then read from its
        attributes), the MLflow parent run that records them, MLflow reconciled with the study, this
        invocation's worker count. Kept out of the constructor so that opening a session costs no
        evaluation; every strategy calls it before `running()`. A signal cuts the baselines at once;
        the parent run, if opened, is then closed as KILLED."""
        self._set_up(self._start)

    def reconcile_only(self) -> None:
        """A start that will run nothing still makes MLflow agree with the study (a parent killed once
        the last trial finished leaves runs missing and its own run RUNNING), but opens no parent run
        and records no worker count."""
        with phase("reconciling MLflow with the study"):
            self._set_up(self._reconcile_only)

    def _set_up(self, step, *args) -> None:
        """Run one set-up step; when it fails, undo this invocation's hold (signals, the reconcile
        session) and leave no parent run: a start that failed ran nothing (nor counts as a worker
        run, `_count_workers`)."""
        try:
            step(*args)
        except BaseException as exc:
            with interrupt.deferred():
                if isinstance(exc, KeyboardInterrupt):
                    self.close("KILLED")
                else:
                    self.tracker.discard()
                reconcile.end_session()
                self.restore_signals()
            full = disk_full(exc, getattr(self, "url", None))
            if full is not None:
                raise full from None
            raise

    def _open(self, config: StudyConfig, backend: Backend | None) -> None:
        """The opening, one job a step; the config is read here and by the steps, never passed on."""
        quiet_optuna()
        with phase("opening the study"):
            self._adopt(prepare(config, backend))
            with interrupt.deferred():
                trials = self._claim_trials()
        interrupt.checkpoint_deferred()
        self._count_start(trials)

    def _start(self) -> None:
        """`begin`'s steps, in the order a resumed study relies on: the baselines before the parent
        run (its params carry them), MLflow reconciled under that run, the worker count last."""
        with interrupt.deferred(), phase("computing the TPUv4 baselines"):  # cut at once, its storing is not
            self.baselines = self._baselines()
        interrupt.checkpoint_deferred()
        with phase("starting the MLflow run"):
            if tracking_enabled(self.config.tracking_uri):  # the slow part (imports, database), cut at once
                MlflowTracker.prepare(self.config.tracking_uri, self.name, storage_key=storage_key(self.url))
            with interrupt.deferred():
                self.tracker = self._start_tracker()
                self._reconcile_runs()
                self._count_workers()  # last: only a start that succeeded counts
        interrupt.checkpoint_deferred()

    # -- set-up ----------------------------------------------------------------------------------
    def _adopt(self, ready) -> None:
        """Hold what `setup.prepare` opened: the validated config, the backend, the study and its storage."""
        self.config = ready.config
        self.backend = ready.backend
        self.space = self.backend.space
        self.codec = SpaceCodec(self.space.params)
        self.name, self.url, self.storage = ready.name, ready.url, ready.storage
        self.study, self.resumed = ready.study, ready.resumed

    def _claim_trials(self) -> list:
        """Take this invocation's place in the study: a session id for the trials it will own, the
        trials of dead invocations failed or requeued, the study's wall time so far, this run's
        worker count. Returns the study's trials after the claim."""
        self.session_id = reconcile.new_session()
        self.zombies = reconcile.fail_zombies(self.study) + reconcile.requeue_lost(self.study)
        trials = self.study.get_trials(deepcopy=False)
        self.offset_s = study_wall_s(self.study.user_attrs, trials)
        self.wall_s: float | None = None  # set by end_wall
        return trials

    def _count_workers(self) -> None:
        """This invocation's worker count, appended to the study's `workers_per_run` once its start
        has succeeded (a start that fails leaves no phantom entry for `compare` to report)."""
        self.study.set_user_attr("workers_per_run",
                                 [*(self.study.user_attrs.get("workers_per_run") or []), self.config.workers])

    def _count_start(self, trials) -> None:
        """What the study held when this invocation began (the summary counts its own trials against it)."""
        self.finished_at_start = {t.number for t in finished_trials(trials)}
        self.trials_before = len(self.finished_at_start)
        self.notes: list[str] = list(self.config.searcher.notes(self.config))

    def _reconcile_runs(self) -> None:
        """MLflow agrees with the study before the first trial: missing runs logged, dead runs closed."""
        reconcile.set_parent_run(self.tracker.parent_run_id)
        self.reconciled = reconcile.reconcile_runs(self.tracker, self.all_trials(), finished_trials)
        if self.tracker.enabled:  # the spools of this study's dead invocations are logged now
            signals.clean_stale_spools(sessions=reconcile.sessions_of(self.all_trials()))

    def _reconcile_only(self) -> None:
        """MLflow made to agree with the study by a tracker with no parent run of its own."""
        c = self.config
        if tracking_enabled(c.tracking_uri):
            exp_id = MlflowTracker.prepare(c.tracking_uri, self.name, storage_key=storage_key(self.url))
            with interrupt.deferred():
                self.tracker = MlflowTracker.attach(c.tracking_uri, exp_id, None, context=self._tracker_context(),
                                                    background=False)
        with interrupt.deferred():
            self._reconcile_runs()

    def release(self) -> None:
        """The end of a start that ran nothing (`reconcile_only`): the tracker and the signals let go."""
        with interrupt.deferred():
            try:
                self.tracker.close()
            finally:
                reconcile.end_session()
                self.restore_signals()

    def _baselines(self) -> dict[str, Baseline]:
        stored = self.study.user_attrs.get("baselines") or {}
        if all(m in stored for m in self.config.models):
            return {m: Baseline.from_json(stored[m]) for m in self.config.models}
        with interrupt.interruptible():  # evaluations: a signal cuts them (nothing is stored yet)
            baselines = compute_baselines(self.config.models, self.backend.evaluator, self.backend.reference_arch,
                                          self.config.baseline_system, self.space.params,
                                          dominance=isinstance(self.backend.evaluator, BoundedEvaluator),
                                          references=reference_recipes(self.space))
        if len(self.config.models) > 1:
            for m, b in baselines.items():
                if not b.feasible or not b.throughput > 0:
                    raise FatalStudyError(f"model '{m}' has no feasible TPUv4 baseline ({b.reason}); a common design "
                                          "is scored by throughput relative to it, so drop the model")
        self.study.set_user_attr("baselines", {m: b.to_json() for m, b in baselines.items()})
        self.study.set_user_attr("baseline_arch", self.backend.reference_arch.name or self.config.reference_arch)
        self.study.set_user_attr("baseline_system", self.config.baseline_system)
        return baselines

    def _start_tracker(self):
        """The MLflow parent run of this invocation, named `<study> <date> <time>` (`(resumed)` when the
        study already had trials), in the study's experiment (see `tracking.experiment_description`)."""
        c = self.config
        if not tracking_enabled(c.tracking_uri):
            return NullTracker()
        constant = constant_params(self.space)
        context = self._tracker_context()
        trials = self.study.get_trials(deepcopy=False)
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        run_name = f"{self.name} {stamp}" + (" (resumed)" if trials else "")
        space_name = getattr(self.space, "name", c.space)
        params = self._run_params(space_name, context["sampler"], constant)
        tags = {"optuna.study": self.name, "optuna.storage": redact(self.url), "mode": c.mode,
                "sampler": context["sampler"], "models": ",".join(c.models), "resumed": str(self.resumed).lower(),
                reconcile.OWNER_TAG: reconcile.owner_tag()}
        params.update(context["model_tags"])
        description = experiment_description(
            study=self.name, models=c.models, space=space_name, space_description=getattr(self.space, "description", ""),
            system=c.system, objectives=c.objectives, directions=c.directions, sampler=context["sampler"], mode=c.mode)
        view = trials_view(c.models, [p for p, choices in self.space.params.items() if len(choices) > 1])
        tracker = MlflowTracker.start(c.tracking_uri, self.name, run_name=run_name, params=params, tags=tags,
                                      context=context, experiment_tags={NOTE_TAG: description,
                                                                        VIEW_TAG + TRIALS_VIEW: view},
                                      storage_key=storage_key(self.url))
        tracker.log_best_of(trials, settled_only=False)  # a resumed study's best-so-far curve, by trial number
        return tracker

    def _tracker_context(self) -> dict:
        """What every trial run of the study is logged with (`tracking.trial_record`)."""
        c = self.config
        return {"study_name": self.name, "sampler": c.searcher.sampler_label(c),
                "models": list(c.models), "mode": c.mode, "objectives": list(c.objectives),
                "constant": sorted(constant_params(self.space)),
                # each model's shape and features (`feature_fields`): params of the parent, tags of each
                # trial, so runs of different models compare by them
                "model_tags": {f"{'' if len(c.models) == 1 else m + '.'}model.{k}": v
                               for m in c.models for k, v in self.backend.describe_model(m).items()}}

    def _run_params(self, space_name: str, sampler: str, constant: dict) -> dict:
        """The parent run's MLflow params: the settings, the strategy's own, each model's baseline."""
        c = self.config
        params = {"study": self.name, "mode": c.mode, "models": ",".join(c.models), "space": space_name,
                  "system": c.system, "sampler": sampler, "seed": c.seed, "trials": c.trials,
                  "objectives": ",".join(c.objectives), "workers": c.workers, **constant}
        params.update({key: "off" if value is None else value for key, value in c.searcher.settings(c).items()})
        for m, b in self.baselines.items():
            prefix = "" if len(c.models) == 1 else f"{m}."
            if b.feasible:
                params[f"{prefix}baseline_throughput_seq_per_s"] = b.throughput
                params[f"{prefix}baseline_recipe"] = ",".join(f"{k}={v}" for k, v in b.point.items())
                params[f"{prefix}baseline_system"] = b.system or c.baseline_system
        return params

    def worker_spec(self, spool_dir: str | None = None) -> WorkerSpec:
        return WorkerSpec(self.config, self.backend, self.url, self.name, self.baselines, self.clock_start,
                          self.offset_s, spool_dir, reconcile.owner_context())

    def context(self) -> Context:
        """What a trial needs besides its point (the same as a worker's)."""
        return self.worker_spec().context()

    def elapsed(self) -> float:
        return self.offset_s + (time.time() - self.clock_start)

    def progress(self, total: int, unit: str, initial: int = 0, **options) -> Progress:
        """Progress of this invocation, titled with the study's name and scored as its summary is."""
        return Progress(total, initial, self.name, unit, self.config.progress, score_label(self.config), **options)

    def end_wall(self) -> float:
        """The end of this invocation: store the study's wall time (`study_wall_s`) once; returns it."""
        if self.wall_s is None:
            self.wall_s = self.elapsed()
            self.study.set_user_attr("wall_s", self.wall_s)
        return self.wall_s

    def all_trials(self):
        return self.study.get_trials(deepcopy=False)

    def enqueue_references(self) -> int:
        """The reference chip, first, once per study: at every microbatch and recompute choice (the
        other recipe fields at their defaults), then at each model's baseline recipe where that is
        none of those, so the study evaluates the very recipe its ratios divide by."""
        # a space naming its published reference recipes is compared with those alone
        recipes = [] if reference_recipes(self.space) else [{"mbs": mbs, "recompute": rc} for mbs in self.space.params["mbs"]
                                                            for rc in self.space.params["recompute"]]
        for b in self.baselines.values():
            if b.feasible:
                if b.point not in recipes:
                    recipes.append(b.point)
        n = 0
        # Optuna's skip_if_exists reads, then inserts: processes starting together each enqueued them
        with locks.study_lock(self.url, self.storage, self.name, "references"):
            for recipe in recipes:
                try:
                    point = self.space.reference_point(arch=self.config.reference_arch, recipe=recipe,
                                                       **reference_cluster(self.space, self.config.baseline_system))
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
        restore = self.restore_signals
        try:
            interrupt.checkpoint_deferred()  # a stop requested at the end of the set-up
            yield self
            if interrupt.stop_requested():  # a signal the loops saw at their last safe point
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except BaseException as exc:
            status = "FAILED"
            full = disk_full(exc, self.url)
            if full is not None:
                raise full from None
            raise
        finally:
            with interrupt.deferred():  # the clean-up itself is not cut by a second signal
                try:
                    self._end(status)
                finally:
                    restore()

    def _end(self, status: str) -> None:
        """Mark what this invocation cut short, store its wall time, close its MLflow run."""
        if status != "FINISHED":  # this process's (and its dead workers') trials cut short: interrupted, re-queued
            release_storage(self.study)
            try:
                reconcile.fail_zombies(self.study)
            except Exception:  # noqa: BLE001 - the storage may be what failed; keep the real error
                pass
        if self.wall_s is None:  # interrupted or failed before its summary
            try:
                self.end_wall()
            except Exception:  # noqa: BLE001 - the storage may be what failed; keep the real error
                pass
        close_bar()
        with phase("flushing the trial runs to MLflow"):
            self.close(status)
        reconcile.end_session()


def disk_full(exc: BaseException, url: str | None) -> DiskFull | None:
    """A full disk under an error that ended an invocation, as one line: the file an OSError names,
    else the study's storage (whose database the writes that failed went to); None for other errors."""
    if isinstance(exc, DiskFull) or not is_full(exc):
        return None
    filename = getattr(exc, "filename", None) if isinstance(exc, OSError) else None
    place = filename or (database_place(url) if url else os.getcwd())
    return DiskFull(place, DATABASE_HEADROOM_BYTES)


def score_label(config: StudyConfig) -> Callable[[float], str]:
    if len(config.models) > 1:
        return lambda v: f"{v:.3f}x TPUv4"
    return lambda v: f"{v:,.1f} seq/s"


def best_score(trials) -> float | None:
    values = [t.values[0] for t in trials if is_feasible(t)]
    return max(values) if values else None


def best_trial(trials):
    """The feasible trial with the best first objective; of several with that score, the first to reach
    it (the lowest trial number, the order Optuna hands trials out). The one rule the summary, the
    MLflow tags, the best_score chart, compare and Optuna's SQLite `best_trial` agree on."""
    feasible = [t for t in trials if is_feasible(t)]
    return max(feasible, key=lambda t: (t.values[0], -t.number)) if feasible else None


REPEAT_ATTR = "repeat_of"  # a sampled trial's design was tried before: the first trial that tried it


def repeated_designs(trials) -> int:
    """How many finished trials repeat a design tried by an earlier trial (flagged `repeat_of`)."""
    return sum(1 for t in finished_trials(trials) if REPEAT_ATTR in t.user_attrs)


def tally(trials) -> tuple[int, float | None, int]:
    """What progress shows of a study's trials: how many finished, the best score, how many feasible."""
    done = finished_trials(trials)
    return len(done), best_score(done), sum(map(is_feasible, done))


class WorkerLost(PhazeError):
    """A worker process died without a word (SIGKILL: the kernel's out-of-memory killer, or a user), which
    breaks the whole pool; the others are stopped as on Ctrl-C. One line, where it was a traceback."""

    def __init__(self, message: str = "a worker process died (killed: out of memory?); its trial is failed and "
                                      "queued again by the next start: run the same command again"):
        super().__init__(message)


LOST_WORKER_RESTARTS = 3  # pools started again after a worker died, before the study stops in one line


def lost_worker(session: Session, restarts: int) -> None:
    """After a pool broke (`WorkerLost`, every worker gone): fail the trials its dead workers held as
    interrupted and queue their points again (`reconcile.fail_zombies`, as a start does), noted in
    the summary; a caller may then start the workers again, at most `LOST_WORKER_RESTARTS` times."""
    failed = reconcile.fail_zombies(session.study)
    session.zombies = [*session.zombies, *failed]
    if restarts >= LOST_WORKER_RESTARTS:
        raise WorkerLost(f"worker processes died {restarts + 1} times (killed: out of memory?); their trials are "
                         "failed and queued again: run the same command again, perhaps with fewer --workers")
    say(f"a worker process died (killed: out of memory?); trial(s) {', '.join(map(str, failed)) or 'none'} "
        "failed and queued again; the workers start again")


def run_pool(session: Session, progress: Progress, logger: SpoolLogger, tasks: list,
             executor: Executor | None = None) -> list[dict]:
    """Run worker tasks in spawned processes (or on `executor`: a cluster's), polling the storage for
    progress and MLflow logging. A worker that dies breaks the pool: `WorkerLost`, after the other
    workers are stopped."""
    context = multiprocessing.get_context("spawn")

    def drain():  # log what the workers finished, written before the spool folder goes
        logger.poll(session.all_trials())
        session.tracker.flush()

    interrupt.checkpoint_deferred()  # no workers are started for a stop already requested
    with interrupt.blocked():  # multiprocessing's resource tracker starts here: SIGHUP would kill it
        executor = executor or ProcessPoolExecutor(max_workers=len(tasks), mp_context=context,
                                                   initializer=signals.worker_started, initargs=signals.worker_args())
    with (interrupt.deferred(),  # a signal stops this loop at its next poll, never inside the storage
          executor as pool,
          signals.stop_workers_on_exit(pool, drain=drain)):
        with interrupt.blocked():  # the workers start with the stop signals pending (see signals)
            futures = [pool.submit(fn, *args) for fn, args in tasks]
        pending = set(futures)
        while True:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            if interrupt.stop_requested():
                raise KeyboardInterrupt
            trials = session.all_trials()
            logger.poll(trials)
            n, score, feasible = tally(trials)
            progress.set_done(n, score, feasible)
            session.tracker.log_best_of(trials)
            for f in done:
                exc = f.exception()
                if exc is not None:
                    for other in pending:
                        other.cancel()
                    if isinstance(exc, BrokenProcessPool):  # its traceback says nothing a user can act on
                        raise WorkerLost() from None
                    raise exc
            if not pending:
                break
        stats = [f.result() for f in futures]
    if any(s.get("interrupted") for s in stats):
        raise KeyboardInterrupt
    return stats
