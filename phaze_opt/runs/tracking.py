"""Our small MLflow logger: one parent run per invocation, one nested run per trial.

optuna-integration's MLflowCallback is deprecated and logs too little (no placement, no reasons),
so we log ourselves, with `MlflowClient` rather than the fluent API: no global "active run"
state, so worker processes can log nested runs under the parent that their parent process opened.

What a trial's run holds is decided by `trial_record`, a pure function of the finished Optuna
trial: sampled and exhaustive trials, and trials finished by other worker processes, are logged
the same way. Each run costs four small database writes (create, one `log_batch`, the
`placement.json` artifact, terminate); they are done on a background thread so the evaluation of
the next design does not wait for the tracking database. SQLite tracking stores shared by several
processes can answer "database is locked"; such writes are retried.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence
from urllib.parse import unquote, urlparse

from .. import interrupt
from ..errors import PhazeError
from ..jsonable import jsonable
from ..training import Training
from . import locks
from .locks import driver_url  # noqa: F401  (where the runs' other modules have always read it)
from .disk import DATABASE_HEADROOM_BYTES, DiskFull, is_full, write_whole
from .urls import redact

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
OFF = ("off", "none", "")
MAX_PARAM = 6000
MAX_TAG = 5000
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")
# A model's result field -> its MLflow metric, the unit in the name (a model prefix `<model>.` with several models)
MODEL_METRICS = {"throughput": "throughput_seq_per_s", "throughput_bound": "throughput_bound_seq_per_s",
                 "tokens_per_s": "tokens_per_s", "time_per_batch_s": "time_per_batch_s", "mfu": "mfu",
                 "energy_j": "energy_j"}
PLACEMENT_METRICS = ("tp", "pp", "dp", "ep", "cp", "microbatches")  # ep, cp: expert and context parallelism
TIMINGS = ("graph_s", "estimate_s", "ilp_s", "dp_s")
# What every metric means, in its unit: the experiment's description lists them.
TRIAL_METRICS = {
    "score": "the score maximised: throughput_seq_per_s with one model, the mean ratio of each model's "
             "throughput to its TPUv4 expert baseline with several",
    "score_bound": "proven upper bound of the score (equal to it unless a layer schedule is unproven)",
    "throughput_seq_per_s": "training throughput, sequences per second",
    "throughput_bound_seq_per_s": "proven upper bound of the throughput, sequences per second",
    "tokens_per_s": "training throughput, tokens per second",
    "time_per_batch_s": "time of one global batch, seconds",
    "mfu": "model FLOPs utilisation, a fraction (0 to 1, not percent)",
    "energy_j": "energy of one global batch, joules",
    "area_mm2": "chip area, mm^2",
    "cost_usd": "the cluster's capital cost (every device with its share of the network), US dollars",
    "tp, pp, dp, microbatches": "the placement: tensor, pipeline and data parallel degrees, microbatches per batch",
    "graph_s, estimate_s, ilp_s, dp_s": "solver time: workload graph, latency estimates, layer schedule ILPs, "
                                        "placement DP, seconds",
    "trial_s": "wall time of the trial, seconds",
    "elapsed_s": "study search time when the trial finished, seconds (summed over invocations)",
    "objective.<name>_<unit>": "the objective values Optuna sees (throughput_seq_per_s or "
                               "throughput_ratio_to_tpuv4, area_mm2, energy_j or energy_ratio_to_tpuv4, cost_usd)",
}
PARENT_METRICS = {
    "best_score": "best score so far, by trial number (step = trial number)",
    "best_throughput_seq_per_s, best_tokens_per_s, best_mfu, best_area_mm2, best_trial":
        "the best design at the end of the invocation",
    "ratio_to_tpuv4_expert": "best throughput / the TPUv4 design's with the expert placement",
    "trials, feasible_trials, wall_s": "finished and feasible trials in the study, wall time of the invocation (s)",
}
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
# MLflow 3's UI opens an experiment on its GenAI overview unless this tag says it holds training runs
# (`custom_model_development`, labelled "Machine learning"); then it opens on the runs table.
EXPERIMENT_KIND = "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # the description shown at the top of an experiment or run
UI_QUERY = "workflowType=machine_learning"  # see `run_url`
TRIALS_VIEW = "trials"  # the shared view `trials_view` of the runs table
VIEW_TAG = "mlflow.sharedViewState."
UI_HOST, UI_PORT = "127.0.0.1", 5000
FLUSH_LIMIT_S = 60.0  # the end of a study waits this long at most for the tracking store's last writes
STOP_FLUSH_S = 5.0  # and this long once a stop (Ctrl-C, SIGTERM) is requested


def tracking_enabled(uri: str | None) -> bool:
    return uri is not None and str(uri).strip().lower() not in OFF


def sqlite_path(uri: str) -> Path | None:
    if not str(uri).startswith("sqlite:///"):
        return None
    rest = str(uri)[len("sqlite:///"):]
    return Path(unquote(rest.split("?", 1)[0]))


def _key(name: str) -> str:
    return _KEY_BAD.sub("_", str(name))[:250]


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


@dataclass
class RunRecord:
    name: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    status: str = "FINISHED"
    step: int = 0
    start_ms: int | None = None  # the trial's own start and end, so the UI's Duration is the trial's
    end_ms: int | None = None


def trial_state(trial) -> str:
    """COMPLETE, INFEASIBLE (finished, but a constraint is violated) or FAIL/other Optuna states."""
    name = trial.state.name
    if name == "COMPLETE" and any(v > 0 for v in trial.constraints.values()):
        return "INFEASIBLE"
    return name


def objective_metric(name: str, n_models: int = 1) -> str:
    """The metric of an objective value, with its unit: with several models throughput and energy are ratios
    (area and cost are the design's and the cluster's, whatever the models)."""
    if name in ("area", "cost"):
        return {"area": "objective.area_mm2", "cost": "objective.cost_usd"}[name]
    if n_models > 1:
        return f"objective.{name}_ratio_to_tpuv4"
    return {"throughput": "objective.throughput_seq_per_s", "energy": "objective.energy_j"}.get(name, f"objective.{name}")


def design_fields(trial) -> dict[str, Any]:
    """A trial's design with its values as stored: its point, its accelerator's fields as
    `arch.<field>`, its whole training recipe as `recipe.<field>` (the fields a space does not
    sample at their defaults, the recompute mode by name) and, where the space samples the cluster,
    the cluster it trained on as `system.<field>`."""
    ua = trial.user_attrs
    point = ua.get("point") or {}
    fields = dict(point)
    if "mbs" in point and "recompute" in point:
        try:
            recipe = Training.from_point(point).recipe()
        except (PhazeError, ValueError, TypeError):
            recipe = {}
        fields.update({f"recipe.{k}": v for k, v in recipe.items() if k not in ("mbs", "placement")})
    result = ua.get("result") or {}
    fields.update({f"arch.{k}": v for k, v in (result.get("accelerator") or {}).items()})
    fields.update({f"system.{k}": v for k, v in (result.get("system") or {}).items()})
    return fields


def trial_params(trial) -> dict[str, str]:
    """A trial's design (`design_fields`) as MLflow params."""
    return {_key(k): str(v)[:MAX_PARAM] for k, v in design_fields(trial).items()}


FRONT_TAG = "pareto_front"  # on the trial runs of a multi-objective study's Pareto front


def trial_record(trial, *, study_name: str, sampler: str, models: Sequence[str], mode: str,
                 objectives: Sequence[str] = ("throughput",), constant: Collection[str] = (),
                 model_tags: Mapping[str, str] | None = None) -> RunRecord:
    """The MLflow run of one finished trial, from the trial alone (see the module docstring).

    `constant`: params every design of the space shares (`constant_params`); the parent run holds them.
    `model_tags`: the models' features (`model.*`), tagged on every trial run.
    """
    ua = trial.user_attrs
    res = ua.get("result") or {}
    state = trial_state(trial)
    rec = RunRecord(name=f"trial {trial.number}", step=trial.number,
                    status="FINISHED" if trial.state.name == "COMPLETE" else "FAILED",
                    start_ms=_ms(trial.datetime_start), end_ms=_ms(trial.datetime_complete))
    rec.tags[NOTE_TAG] = trial_note(state, res)
    skip = set(constant)
    rec.params.update({k: v for k, v in trial_params(trial).items() if k not in skip})
    rec.tags.update({
        "trial_state": state,
        "optuna.state": trial.state.name,
        "optuna.trial_number": str(trial.number),
        "optuna.study": study_name,
        "sampler": sampler,
        "models": ",".join(models),
        "mode": mode,
        **(model_tags or {}),
    })
    if "feasible" in res:
        rec.tags["feasible"] = "true" if res["feasible"] else "false"
    if res.get("reason"):
        rec.tags["infeasible_reason"] = str(res["reason"])[:MAX_TAG]
    if res.get("error"):
        rec.tags["error"] = str(res["error"])[:MAX_TAG]
    if ua.get("retry_of") is not None:
        rec.tags["retry_of"] = str(ua["retry_of"])
    if res.get("new_best"):
        rec.tags["new_best"] = "true"
    if "proven" in res:  # false: a layer schedule hit the ILP time limit (score reached, bound higher)
        rec.tags["proven"] = "true" if res["proven"] else "false"
    metrics = rec.metrics
    if trial.values is not None:
        for name, value in zip(objectives, trial.values):
            if _finite(value) is not None:
                metrics[objective_metric(name, len(models))] = float(value)
    for k in ("score", "score_bound", "area_mm2", "cost_usd", "trial_s", "elapsed_s"):
        if _finite(res.get(k)) is not None:
            metrics[k] = float(res[k])
    per_model = res.get("models") or {}
    totals = {t: 0.0 for t in TIMINGS}
    for model, summary in per_model.items():
        prefix = "" if len(per_model) == 1 else f"{_key(model)}."
        for k, name in MODEL_METRICS.items():
            if _finite(summary.get(k)) is not None:
                metrics[prefix + name] = float(summary[k])
        placement = summary.get("placement") or {}
        for k in PLACEMENT_METRICS:
            if _finite(placement.get(k)) is not None:
                metrics[prefix + k] = float(placement[k])
        for k, v in (summary.get("timings") or {}).items():
            if _finite(v) is not None:
                if len(per_model) > 1:
                    metrics[prefix + _key(k)] = float(v)
                if k in totals:
                    totals[k] += float(v)
                else:
                    metrics[_key(k)] = metrics.get(_key(k), 0.0) + float(v)
    if per_model:
        metrics.update(totals)
    return rec


def _ms(when) -> int | None:
    return int(when.timestamp() * 1000) if when is not None else None


def trial_note(state: str, result: Mapping) -> str:
    """One paragraph on a trial, the description at the top of its run page."""
    if state == "INFEASIBLE":
        return f"Infeasible: {result.get('reason') or 'a constraint is violated'}."
    if state != "COMPLETE":
        return f"Failed: {result.get('error') or state}."
    parts = []
    for model, s in (result.get("models") or {}).items():
        p = s.get("placement") or {}
        text = f"{model}: {s.get('throughput', 0.0):,.1f} sequences/s"
        if _finite(s.get("tokens_per_s")) is not None:
            text += f" ({s['tokens_per_s']:,.0f} tokens/s)"
        if _finite(s.get("mfu")) is not None:
            text += f", MFU {s['mfu']:.1%}"
        if p:
            text += f", placement TP {p.get('tp')} x PP {p.get('pp')} x DP {p.get('dp')}"
            text += (f" (EP {p['ep']})" if (p.get("ep") or 1) > 1 else "") + (f" x CP {p['cp']}" if (p.get("cp") or 1) > 1 else "")
            text += f", {p.get('microbatches')} microbatches"
        parts.append(text)
    if _finite(result.get("area_mm2")) is not None:
        parts.append(f"area {result['area_mm2']:.1f} mm^2")
    if result.get("proven") is False:
        parts.append("not proven optimal (see score_bound)")
    return "Feasible: " + "; ".join(parts) + "."


def retrying(op: Callable, attempts: int = 10, upsert: bool = False):
    """`op()`, done again while the database reports a lock, busy or deadlock error. With `upsert`
    (`op` writes a row that MLflow upserts by reading it, then inserting it at commit: an experiment
    tag, `SqlAlchemyStore.set_experiment_tag`), also after a unique-key violation: another process
    inserted the same key between the read and the insert, and done again the read finds its row."""
    delay = 0.05
    for attempt in range(attempts):
        try:
            return op()
        except Exception as exc:  # noqa: BLE001 - only lock/busy errors (and upsert collisions) are retried
            text = str(exc).lower()
            transient = "locked" in text or "busy" in text or "deadlock" in text
            collided = upsert and ("unique" in text or "duplicate key" in text)
            if attempt + 1 == attempts or not (transient or collided):
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


class NullTracker:
    """Tracking switched off (`--tracking-uri off`)."""

    enabled = False
    parent_run_id = None
    run_name = None
    experiment_id = None
    errors: list = []

    def log_trial(self, trial, artifact=None, **_):
        pass

    def log_parent(self, **_):
        pass

    def log_parent_file(self, path, artifact_path=None):
        pass

    def log_best(self, score, step):
        pass

    def log_best_of(self, trials, settled_only=True):
        pass

    def log_best_final(self, trials):
        pass

    def tag_trials(self, study_name, numbers, tags):
        pass

    def flush(self):
        pass

    def close(self, status="FINISHED"):
        pass

    def discard(self):
        pass

    def stop(self):
        pass

    def where(self) -> str:
        return "MLflow tracking is off"


class MlflowTracker:
    """Logs runs to one experiment; `start` opens the parent run, `attach` joins one in a worker."""

    enabled = True
    experiment_name: str | None = None

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str | None, *, context: Mapping,
                 background: bool = True, run_name: str | None = None):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(driver_url(tracking_uri))
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.run_name = run_name
        self.context = dict(context)  # study_name, sampler, models, mode, objectives
        self.errors: list[str] = []
        self.logged_trials: set[int] = set()
        self.best_logged: tuple[int, float] | None = None  # (step, value) of the last best_score
        self._best_cursor = -1  # trials up to this number were scanned by `log_best_of`
        self._queue: queue.Queue | None = None
        self._thread = None
        self._given_up = False  # the store stopped answering (`flush`); later writes are dropped
        self._dropped = 0
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._drain, name="mlflow-logger", daemon=True)
            self._thread.start()

    # -- opening -------------------------------------------------------------------------------
    @staticmethod
    def prepare(tracking_uri: str, experiment_name: str, artifact_root: str | None = None,
                storage_key: str | None = None) -> str:
        """Create the tracking database (in the parent, before any worker opens it) and the experiment.

        The database is built aside and moved into place, and an http(s) server is probed first
        (`locks`). With `storage_key` (the Optuna storage, `storage_key`) the experiment is
        the study's in that storage: an experiment of the name holding another storage's study gives
        way to `<name> [<storage hash>]` (`experiment_for`).
        """
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        db = sqlite_path(tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        locks.probe_tracking_uri(tracking_uri)
        from mlflow import MlflowClient

        # MLflow logs each database error with its traceback before raising it; we report it in one line
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

        try:
            if db is not None:
                locks.build_mlflow_db(db, _open_store)
            elif str(tracking_uri).startswith(("postgresql", "postgres://", "mysql")):
                # a new server database: several processes create MLflow's schema at once (seen:
                # UniqueViolation pg_type_typname_nsp_index); under the lock and retries Optuna's has
                locks.create_schema(lambda: _open_store(driver_url(tracking_uri)), tracking_uri)
            client = MlflowClient(driver_url(tracking_uri))
            experiment_name, exp = experiment_for(client, experiment_name, storage_key)
            if exp is not None:
                if exp.lifecycle_stage == "deleted":
                    client.restore_experiment(exp.experiment_id)
                return exp.experiment_id
            location = None
            scheme = urlparse(str(tracking_uri)).scheme
            if not scheme.startswith(("http", "databricks")):
                root = Path(artifact_root) if artifact_root else (
                    db.parent / "artifacts" if db is not None else Path("mlruns") / "artifacts")
                location = (root.resolve() / _key(experiment_name).replace(" ", "_").replace("/", "_")).as_uri()
            tags = {STORAGE_TAG: storage_key} if storage_key else None
            try:
                return client.create_experiment(experiment_name, artifact_location=location, tags=tags)
            except Exception:  # noqa: BLE001 - another process created it a moment ago: look again
                name, exp = experiment_for(client, experiment_name, storage_key)
                if exp is None or name != experiment_name:
                    raise
                return exp.experiment_id
        except PhazeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad URI is the user's input
            if is_full(exc):
                raise DiskFull(db or redact(tracking_uri), DATABASE_HEADROOM_BYTES) from None
            raise PhazeError(f"--tracking-uri {redact(tracking_uri)}: cannot open the MLflow store: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

    @classmethod
    def start(cls, tracking_uri: str, experiment_name: str, *, run_name: str, params: Mapping[str, Any],
              tags: Mapping[str, str], context: Mapping, background: bool = True,
              experiment_tags: Mapping[str, str] | None = None, storage_key: str | None = None) -> "MlflowTracker":
        """Open the parent run `run_name` (made unique in the experiment) in the experiment, which is
        marked as holding training runs (`EXPERIMENT_KIND`) and given `experiment_tags`."""
        exp_id = cls.prepare(tracking_uri, experiment_name, storage_key=storage_key)
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(driver_url(tracking_uri))
        exp_tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, **(experiment_tags or {})}
        for k, v in exp_tags.items():
            retrying(lambda: client.set_experiment_tag(exp_id, k, v), upsert=True)  # every start tags it
        run_name = _unique_run_name(client, exp_id, run_name)
        run = retrying(lambda: client.create_run(exp_id, tags=dict(tags), run_name=run_name))
        try:
            if params:
                retrying(lambda: client.log_batch(run.info.run_id, params=[
                    Param(_key(k), str(v)[:MAX_PARAM]) for k, v in params.items()]))
            tracker = cls(tracking_uri, exp_id, run.info.run_id, context=context, background=background,
                          run_name=run_name)
            tracker.experiment_name = retrying(lambda: client.get_experiment(exp_id).name)
        except BaseException:  # a start that fails here leaves no run behind
            try:
                client.delete_run(run.info.run_id)
            except Exception:  # noqa: BLE001 - keep the error that stopped the start
                pass
            raise
        return tracker

    @classmethod
    def attach(cls, tracking_uri: str, experiment_id: str, parent_run_id: str | None, *, context: Mapping,
               background: bool = True) -> "MlflowTracker":
        """Join the parent run `parent_run_id` (a worker), or none (a start that only reconciles)."""
        return cls(tracking_uri, experiment_id, parent_run_id, context=context, background=background)

    # -- logging -------------------------------------------------------------------------------
    def log_trial(self, trial, artifact: Mapping | None = None, parent_run_id: str | None = None,
                  extra_tags: Mapping[str, str] | None = None) -> None:
        """Log one finished trial as a nested run (asynchronously when a background thread runs), under
        this invocation's parent run or `parent_run_id` (the run of the invocation that ran it)."""
        record = trial_record(trial, **self.context)
        record.tags.update(extra_tags or {})
        self.logged_trials.add(trial.number)
        self._submit(lambda: self._write_trial(record, artifact, parent_run_id))

    def _write_trial(self, record: RunRecord, artifact: Mapping | None, parent_run_id: str | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        c = self.client
        parent = parent_run_id or self.parent_run_id
        # a tracker that only reconciles has no parent run: a trial whose own parent run is gone stands alone
        tags = {**({"mlflow.parentRunId": parent} if parent else {}), **record.tags}
        run = retrying(lambda: c.create_run(self.experiment_id, start_time=record.start_ms, tags=tags,
                                             run_name=record.name))
        run_id = run.info.run_id
        now = record.end_ms or int(time.time() * 1000)
        metrics = [Metric(_key(k), v, now, record.step) for k, v in record.metrics.items()]
        params = [Param(k, v) for k, v in record.params.items()]
        retrying(lambda: c.log_batch(run_id, metrics=metrics, params=params, tags=[RunTag("logged_by", "phaze_opt")]))
        if artifact is not None:
            self._write_json(run_id, run.info.artifact_uri, "placement.json", artifact)
        retrying(lambda: c.set_terminated(run_id, record.status, end_time=record.end_ms))

    def _write_json(self, run_id: str, artifact_uri: str, name: str, data: Mapping) -> None:
        text = json.dumps(data, indent=1, allow_nan=False)
        local = _local_dir(artifact_uri)
        if local is not None:
            write_whole(local / name, text)  # a full disk leaves no half-written artifact
        else:
            self.client.log_text(run_id, text, name)

    def log_parent(self, *, metrics: Mapping[str, float] | None = None, params: Mapping[str, Any] | None = None,
                   tags: Mapping[str, str] | None = None, step: int = 0) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        m = [Metric(_key(k), float(v), now, step) for k, v in (metrics or {}).items() if _finite(v) is not None]
        p = [Param(_key(k), str(v)[:MAX_PARAM]) for k, v in (params or {}).items()]
        t = [RunTag(_key(k), str(v)[:MAX_TAG]) for k, v in (tags or {}).items()]
        self._submit(lambda: retrying(lambda: self.client.log_batch(self.parent_run_id, metrics=m, params=p, tags=t)))

    def log_best(self, score: float, step: int) -> None:
        """`best_score` at `step` (a trial number), kept monotone: logged only when both the step and
        the score are above the last ones logged."""
        if _finite(score) is None or step is None:
            return
        if self.best_logged is not None and (step <= self.best_logged[0] or score <= self.best_logged[1]):
            return
        self.best_logged = (int(step), float(score))
        self.log_parent(metrics={"best_score": score}, step=int(step))

    def log_best_of(self, trials, settled_only: bool = True) -> None:
        """`best_score` from the study's trials in trial-number order, from where the last call stopped.

        `settled_only`: stop at the first trial still waiting or running (with several workers a later
        trial may finish first; its score is logged once every earlier trial is settled), so the series
        is the best-so-far by trial number and never changes behind the last step logged.
        """
        for t in sorted((t for t in trials if t.number > self._best_cursor), key=lambda t: t.number):
            if t.state.name in ("RUNNING", "WAITING"):
                if settled_only:
                    return
                continue
            self._best_cursor = t.number
            if trial_state(t) == "COMPLETE" and t.values:
                self.log_best(t.values[0], t.number)

    def log_best_final(self, trials) -> None:
        """At the end of an invocation: the rest of the series, so it ends at the study's best. A best
        that finished behind the last step logged (a trial another process ran) goes one step later."""
        self.log_best_of(trials, settled_only=False)
        best = max(((t.values[0], -t.number) for t in trials if trial_state(t) == "COMPLETE" and t.values),
                   default=None)
        if best is not None and (self.best_logged is None or best[0] > self.best_logged[1]):
            last = self.best_logged[0] if self.best_logged is not None else -1
            self.log_best(best[0], max(-best[1], last + 1))

    def tag_trials(self, study_name: str, numbers: Collection[int], tags: Mapping[str, str]) -> None:
        """Tag the trial runs of `study_name` numbered `numbers` (the study's Pareto front, at its
        end), whichever invocation logged them; queued behind the trial runs themselves."""
        wanted = {str(n) for n in numbers}
        if wanted:
            self._submit(lambda: self._tag_runs(study_name, wanted, tags))

    def _tag_runs(self, study_name: str, wanted: set[str], tags: Mapping[str, str]) -> None:
        c, token = self.client, None
        query = f"tags.`optuna.study` = '{study_name}'"
        while True:
            page = retrying(lambda: c.search_runs([self.experiment_id], query, max_results=1000, page_token=token))
            for run in page:
                if run.data.tags.get("optuna.trial_number") in wanted:
                    for k, v in tags.items():
                        retrying(lambda: c.set_tag(run.info.run_id, k, v))
            token = page.token
            if not token:
                return

    def log_parent_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = str(path)
        self._submit(lambda: self._write_file(path, artifact_path))

    def _write_file(self, path: str, artifact_path: str | None) -> None:
        """A file into the parent run's artifacts; into a local store whole or not at all (a full disk)."""
        local = _local_dir(retrying(lambda: self.client.get_run(self.parent_run_id)).info.artifact_uri)
        if local is None:
            retrying(lambda: self.client.log_artifact(self.parent_run_id, path, artifact_path))
            return
        write_whole(local / (artifact_path or "") / Path(path).name, Path(path).read_bytes())

    def _submit(self, op: Callable) -> None:
        if self._given_up:  # the store stopped answering: what is left is the next start's to log
            self._dropped += 1
        elif self._queue is None:
            self._run(op)
        else:
            self._queue.put(op)

    def _run(self, op: Callable) -> None:
        try:
            op()
        except Exception as exc:  # noqa: BLE001 - tracking must not kill a study; reported at the end
            if is_full(exc) and not isinstance(exc, DiskFull):  # the store's database: say where and how much
                exc = DiskFull(sqlite_path(self.tracking_uri) or redact(self.tracking_uri), DATABASE_HEADROOM_BYTES)
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _drain(self) -> None:
        q = self._queue  # its own: `close` may drop the tracker's reference to a stuck queue
        while True:
            op = q.get()
            try:
                if op is None:
                    return
                self._run(op)
            finally:
                q.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the pending writes; whether they are all done.

        Every wait is bounded: `timeout_s`, by default `FLUSH_LIMIT_S`, and at most `STOP_FLUSH_S`
        once a stop is requested. An HTTP tracking server that dies mid-study costs minutes a write
        (MLflow's client retries each request with back-off), so an unbounded wait held the study's
        end for good and left Ctrl-C unanswered. A wait that runs out gives the store up for the rest
        of the invocation (`_give_up`): one warning, and later writes are dropped, never waited for.
        """
        if self._given_up:
            return False
        if self._queue is None:
            return True
        start = time.monotonic()
        deadline = start + (FLUSH_LIMIT_S if timeout_s is None else timeout_s)
        stopping = False
        while self._queue.unfinished_tasks:
            now = time.monotonic()
            if not stopping and interrupt.stop_requested():
                stopping = True
                deadline = min(deadline, now + STOP_FLUSH_S)
            if now >= deadline:
                self._give_up(now - start)
                return False
            time.sleep(0.05)
        return True

    def _give_up(self, waited_s: float) -> None:
        """The store took no writes for `waited_s`: warn once and stop waiting for it. The writes in
        flight stay with the daemon thread, which the process abandons at its exit."""
        left = self._queue.unfinished_tasks if self._queue is not None else 0
        print(f"warning: MLflow at {redact(self.tracking_uri)} took no writes for {waited_s:.0f} s; "
              f"{left} left unwritten (the study is intact; its next start logs them)", file=sys.stderr, flush=True)
        self._given_up = True
        self._queue = None

    def close(self, status: str = "FINISHED") -> None:
        """Flush pending writes and end the parent run (only the process that started it calls this).
        A tracking store that stops answering holds the end for at most `FLUSH_LIMIT_S`: then a
        warning, and the study (whole in its storage) ends; the next start logs what is missing."""
        if self.parent_run_id is not None:  # a reconciling tracker (`attach` with no run) opened none
            self._submit(lambda: retrying(lambda: self.client.set_terminated(self.parent_run_id, status)))
        self._end()

    def discard(self) -> None:
        """End the parent run of a start that failed by deleting it: an invocation that ran nothing
        leaves no run (an interrupted one is closed as KILLED instead, `close`)."""
        if self.parent_run_id is not None:
            self._submit(lambda: retrying(lambda: self.client.delete_run(self.parent_run_id)))
        self._end()

    def _end(self) -> None:
        self.stop()

    def stop(self) -> None:
        """Flush (bounded, `flush`) and stop the background thread, leaving the parent run open (workers)."""
        if self.flush() and self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._queue = None

    def where(self) -> str:
        return f"MLflow: experiment id {self.experiment_id}, parent run {self.parent_run_id} at {redact(self.tracking_uri)}"


def _open_store(uri: str):
    """Open (so create and migrate) the MLflow tracking store at `uri`; returns it."""
    from mlflow.tracking._tracking_service.utils import _get_store

    store = _get_store(uri)
    store.search_experiments(max_results=1)
    return store


def _local_dir(artifact_uri: str) -> Path | None:
    parsed = urlparse(str(artifact_uri))
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and str(artifact_uri).startswith("/"):
        return Path(str(artifact_uri))
    return None


def _unique_run_name(client, experiment_id: str, name: str) -> str:
    """`name`, or `name #2`, `#3`... when a run of the experiment already has it."""
    def taken(candidate):
        quoted = candidate.replace("'", "\\'")
        return bool(client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{quoted}'",
                                       max_results=1))

    try:
        for n in range(1, 100):
            candidate = name if n == 1 else f"{name} #{n}"
            if not retrying(lambda: taken(candidate)):
                return candidate
    except Exception:  # noqa: BLE001 - a name is cosmetic; never stop a study for it
        pass
    return name


def venv_command(name: str) -> str:
    """The running interpreter's `name` script (e.g. `.venv/bin/mlflow`), relative to the current
    directory when inside it, so the command works without an activated virtualenv; else `name`."""
    path = Path(os.path.abspath(sys.executable)).parent / name  # not resolved: a venv's python is a link
    if not path.exists():
        return name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def ui_command(tracking_uri: str, host: str = UI_HOST, port: int = UI_PORT) -> str:
    """How to open the UI on this store, from the directory the study ran in (one worker: the SQLite
    store is not for concurrent servers)."""
    return (f"MLFLOW_DISABLE_TELEMETRY=true {venv_command('mlflow')} ui --backend-store-uri {redact(tracking_uri)} "
            f"--host {host} --port {port} --workers 1")


def run_url(experiment_id: str, run_id: str, host: str = UI_HOST, port: int = UI_PORT) -> str:
    """The page of a run in the UI that `ui_command` starts.

    `workflowType=machine_learning`: MLflow 3.17's UI picks its GenAI or model-training layout from
    this parameter (or the user's last choice, GenAI at first), not from the experiment's kind tag.
    """
    return f"http://{host}:{port}/#/experiments/{experiment_id}/runs/{run_id}?{UI_QUERY}"


def trials_url(experiment_id: str, host: str = UI_HOST, port: int = UI_PORT) -> str:
    """The experiment's runs table in the trials view (`trials_view`)."""
    return f"http://{host}:{port}/#/experiments/{experiment_id}/runs?{UI_QUERY}&viewStateShareKey={TRIALS_VIEW}"


def trials_view(models: Sequence[str], params: Sequence[str]) -> str:
    """The UI's saved view of a study's trials (an experiment tag `mlflow.sharedViewState.<key>`, the
    format the UI's "Share" button writes): the trial runs, best score first, with the metrics that
    matter, units in their names, and the design params `params`."""
    metrics = ["score"] if len(models) > 1 else []
    for m in models:
        prefix = "" if len(models) == 1 else f"{_key(m)}."
        metrics += [prefix + k for k in ("throughput_seq_per_s", "tokens_per_s", "mfu", "time_per_batch_s")]
        if len(models) == 1:
            metrics += [prefix + k for k in PLACEMENT_METRICS]
    metrics.append("area_mm2")
    columns = ([f"metrics.`{k}`" for k in metrics] + [f"params.`{_key(p)}`" for p in params]
               + ["tags.`trial_state`", "tags.`infeasible_reason`"])
    return json.dumps({"searchFilter": "attributes.run_name LIKE 'trial %'", "orderByKey": "metrics.`score`",
                       "orderByAsc": False, "selectedColumns": columns, "columnOrder": columns})


def constant_params(space) -> dict[str, str]:
    """The trial params every design of the space shares, from the space's definition: sampled
    parameters with one choice, and the accelerator fields (`arch.<field>`) the space fixes
    (`constant_arch_fields`). They go to the parent run once instead of to every trial."""
    out = {_key(k): str(v[0])[:MAX_PARAM] for k, v in space.params.items() if len(v) == 1}
    fields = getattr(space, "constant_arch_fields", None)
    if fields is not None:
        out.update({_key(f"arch.{k}"): str(v)[:MAX_PARAM] for k, v in jsonable(fields()).items()})
    return out


def experiment_description(*, study: str, models: Sequence[str], space: str, space_description: str, system: str,
                           objectives: Sequence[str], directions: Sequence[str], sampler: str, mode: str) -> str:
    """The experiment's description (markdown): what the study searches and what each metric means."""
    lines = [f"**phaze_opt study `{study}`**: accelerator architecture x device placement search.", "",
             f"- models: {', '.join(models)}" + (" (one common design, scored by the mean ratio to each model's "
                                                "TPUv4 expert baseline)" if len(models) > 1 else ""),
             f"- space: {space}" + (f" ({space_description})" if space_description else ""),
             f"- system: {system}",
             "- objectives: " + ", ".join(f"{o} ({d})" for o, d in zip(objectives, directions)),
             f"- sampler: {sampler} ({mode})", "",
             "The study's end prints a link to its trials table, best first, with the main metrics as columns "
             f"(`#/experiments/<id>/runs?{UI_QUERY}&viewStateShareKey={TRIALS_VIEW}`).", "",
             "Each invocation is a parent run named `<study> <date> <time>` (`(resumed)` when the study already "
             "had trials) with the settings, the params every design shares and `best_score` by trial number; "
             "each trial is a nested run with its design as params (`arch.*`: the accelerator, SI units), its "
             "state and any infeasibility reason as tags, and `placement.json`.", "",
             "Trial metrics (units in the names):", ""]
    lines += [f"- `{k}`: {v}" for k, v in TRIAL_METRICS.items()]
    lines += ["", "Parent run metrics:", ""] + [f"- `{k}`: {v}" for k, v in PARENT_METRICS.items()]
    return "\n".join(lines)[:MAX_TAG]


# -- one experiment per storage and study (a study name reused elsewhere must not mix runs) ------

STORAGE_TAG = "phaze.storage"  # on experiments: the Optuna storage their study lives in


def storage_key(url: str) -> str:
    """The identity of an Optuna storage: a SQLite file's absolute path, else the URL without password."""
    path = sqlite_path(url)
    if path is not None:
        return "sqlite:///" + str(path.expanduser().resolve())
    return redact(url)


def storage_suffix(key: str) -> str:
    return hashlib.sha1(key.encode()).hexdigest()[:8]


def experiment_for(client, name: str, key: str | None):
    """The MLflow experiment of study `name` in the Optuna storage `key`: (its name, the experiment or
    None when it is still to be created).

    The experiment is `name` unless that one holds another storage's study (tag `phaze.storage`); then
    `<name> [<hash of the storage>]`. An experiment without the tag (made before it existed) is adopted.
    """
    exp = client.get_experiment_by_name(name)
    if key is None or exp is None:
        return name, exp
    held = (exp.tags or {}).get(STORAGE_TAG)
    if held is None:
        retrying(lambda: client.set_experiment_tag(exp.experiment_id, STORAGE_TAG, key), upsert=True)
        return name, exp
    if held == key:
        return name, exp
    other = f"{name} [{storage_suffix(key)}]"
    return other, client.get_experiment_by_name(other)
