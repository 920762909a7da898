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
invocations (an invocation starts at `offset` = the largest `elapsed_s` already stored), so the
convergence comparison sees search time, not the idle time between two runs.
"""

from __future__ import annotations

from contextlib import contextmanager

import json
import math
import multiprocessing
import os
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
from .progress import Progress, close_bar, say
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
from .tracking import MlflowTracker, NullTracker, redact, tracking_enabled


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
        elif t.state == TrialState.FAIL and not t.user_attrs.get("interrupted") and t.number not in retried:
            out.append(t)
    return out


def is_feasible(trial) -> bool:
    return trial.state == TrialState.COMPLETE and all(v <= 0 for v in trial.constraints.values())


def elapsed_of(trial) -> float | None:
    value = (trial.user_attrs.get("result") or {}).get("elapsed_s")
    return float(value) if isinstance(value, (int, float)) else None


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
            if t.number in self.seen:
                continue
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
        trials = self.study.get_trials(deepcopy=False)
        self.offset_s = max([e for e in map(elapsed_of, trials) if e is not None], default=0.0)
        self.finished_at_start = {t.number for t in finished_trials(trials)}
        self.trials_before = len(self.finished_at_start)
        self.notes: list[str] = []
        if config.sampler == "cmaes" and not config.exhaustive:
            self.notes.append("cmaes ignores Optuna constraints; it learns infeasible designs from their 0 throughput")
        self.baselines = self._baselines()
        self.tracker = self._start_tracker()

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
        c = self.config
        if not tracking_enabled(c.tracking_uri):
            return NullTracker()
        context = {"study_name": self.name, "sampler": "exhaustive" if c.exhaustive else c.sampler,
                   "models": list(c.models), "mode": c.mode, "objectives": list(c.objectives)}
        stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        params = {"study": self.name, "mode": c.mode, "models": ",".join(c.models), "space": c.space,
                  "system": c.system, "sampler": context["sampler"], "seed": c.seed, "trials": c.trials,
                  "objectives": ",".join(c.objectives), "workers": c.workers}
        if c.exhaustive:
            params.update({"order": c.order, "hysteresis": "off" if c.hysteresis is None else c.hysteresis})
        tags = {"optuna.study": self.name, "optuna.storage": redact(self.url), "mode": c.mode,
                "sampler": context["sampler"], "models": ",".join(c.models), "resumed": str(self.resumed).lower()}
        for m, b in self.baselines.items():
            prefix = "" if len(c.models) == 1 else f"{m}."
            if b.feasible:
                params[f"{prefix}baseline_throughput"] = b.throughput
        return MlflowTracker.start(c.tracking_uri, self.name, run_name=f"{self.name} {c.mode} {stamp}",
                                   params=params, tags=tags, context=context)

    def worker_spec(self, spool_dir: str | None = None) -> WorkerSpec:
        return WorkerSpec(self.config, self.backend, self.url, self.name, self.baselines, self.clock_start,
                          self.offset_s, spool_dir)

    def elapsed(self) -> float:
        return self.offset_s + (time.time() - self.clock_start)

    def progress(self, total: int, unit: str, initial: int = 0, **options) -> Progress:
        """Progress of this invocation, titled with the study's name and scored as its summary is."""
        return Progress(total, initial, self.name, unit, self.config.progress, score_label(self.config), **options)

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
        try:
            yield self
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        except BaseException:
            status = "FAILED"
            raise
        finally:
            close_bar()
            self.close(status)


# -- the trial loop (in this process or a worker) ---------------------------------------------------

def run_worker(spec: WorkerSpec, quota: int, index: int = 0, on_trial: Callable | None = None,
               tracker=None) -> dict:
    """Run `quota` trials of the study in this process; returns the counts of each outcome.

    In the parent process trials are logged with its `tracker`; a worker process spools each
    trial's artifact for the parent instead (see `SpoolLogger`).
    """
    quiet_optuna()
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
            study.enqueue_trial(dict(trial.params), user_attrs={"retry_of": trial.number})
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
            say(f"trial {frozen.number} failed: {error}")
        elif is_feasible(frozen):
            counts["complete"] += 1
        else:
            counts["infeasible"] += 1
        tracker.log_trial(frozen, artifacts.pop(frozen.number, None))
        if on_trial is not None:
            on_trial(frozen)

    study.optimize(objective, n_trials=quota, catch=(TrialError,), callbacks=[callback], gc_after_trial=False)
    return counts


def _worker_entry(spec: WorkerSpec, quota: int, index: int) -> dict:
    try:
        return run_worker(spec, quota, index)
    except KeyboardInterrupt:
        return {"interrupted": True}


def score_label(config: StudyConfig) -> Callable[[float], str]:
    if len(config.models) > 1:
        return lambda v: f"{v:.3f}x TPUv4"
    return lambda v: f"{v:,.1f} seq/s"


def best_score(trials) -> float | None:
    values = [t.values[0] for t in trials if is_feasible(t)]
    return max(values) if values else None


def tally(trials) -> tuple[int, float | None, int]:
    """What progress shows of a study's trials: how many finished, the best score, how many feasible."""
    done = finished_trials(trials)
    return len(done), best_score(done), sum(map(is_feasible, done))


def run_study(config: StudyConfig, backend: Backend | None = None) -> dict:
    """Run (or resume) a sampled study, or an exhaustive sweep when `config.exhaustive`."""
    if config.exhaustive:
        from .exhaustive import run_exhaustive

        return run_exhaustive(config, backend)
    from .report import finish

    session = Session(config, backend)
    with session.running():
        session.enqueue_references()
        done, best, feasible = tally(session.all_trials())
        remaining = max(0, session.config.trials - done)
        progress = session.progress(session.config.trials, "trial", initial=min(done, session.config.trials),
                                    feasible=feasible)
        progress.update(0, best)
        worker_stats = []
        if remaining and session.config.workers == 1:
            spec = session.worker_spec()

            def on_trial(frozen):
                ok = is_feasible(frozen)
                improved = ok and (progress.best is None or frozen.values[0] > progress.best)
                progress.update(1, frozen.values[0] if ok else None, feasible=int(ok))
                if improved:
                    session.tracker.log_parent(metrics={"best_score": frozen.values[0]}, step=frozen.number)

            worker_stats.append(run_worker(spec, remaining, 0, on_trial, tracker=session.tracker))
        elif remaining:
            worker_stats = _run_pool(session, remaining, progress)
        progress.close()
        return finish(session, worker_stats)


def _run_pool(session: Session, remaining: int, progress: Progress) -> list[dict]:
    quotas = [q for q in split_quota(remaining, session.config.workers) if q > 0]
    with tempfile.TemporaryDirectory(prefix="phaze-spool-") as spool:
        spec = session.worker_spec(spool if session.tracker.enabled else None)
        logger = SpoolLogger(session, spool)
        return run_pool(session, progress, logger, [(_worker_entry, (spec, q, i)) for i, q in enumerate(quotas)])


def run_pool(session: Session, progress: Progress, logger: SpoolLogger, tasks: list) -> list[dict]:
    """Run worker tasks in spawned processes, polling the storage for progress and MLflow logging."""
    context = multiprocessing.get_context("spawn")
    best = None
    with ProcessPoolExecutor(max_workers=len(tasks), mp_context=context) as pool:
        futures = [pool.submit(fn, *args) for fn, args in tasks]
        pending = set(futures)
        while True:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
            trials = session.all_trials()
            logger.poll(trials)
            n, score, feasible = tally(trials)
            progress.set_done(n, score, feasible)
            if score is not None and (best is None or score > best):
                best = score
                session.tracker.log_parent(metrics={"best_score": score}, step=n)
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
