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

import json
import math
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import unquote, urlparse

from ..errors import PhazeError

DEFAULT_TRACKING_URI = "sqlite:///mlruns/mlflow.db"
OFF = ("off", "none", "")
MAX_PARAM = 6000
MAX_TAG = 5000
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-. /]")
MODEL_METRICS = ("throughput", "throughput_bound", "tokens_per_s", "time_per_batch_s", "mfu", "energy_j")
PLACEMENT_METRICS = ("tp", "pp", "dp", "microbatches")
TIMINGS = ("graph_s", "estimate_s", "ilp_s", "dp_s")


def tracking_enabled(uri: str | None) -> bool:
    return uri is not None and str(uri).strip().lower() not in OFF


def redact(url: str) -> str:
    """A storage URL with its password hidden, fit for a tag or a report."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", str(url))


def driver_url(url: str) -> str:
    """`postgresql://` with the driver that is installed.

    SQLAlchemy 2.1 maps a bare `postgresql://` to psycopg 3; we ship psycopg2, so name it unless
    psycopg 3 is there. Other URLs pass unchanged.
    """
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is not None:
            return "postgresql+psycopg2://" + text.split("://", 1)[1]
    return text


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


def trial_state(trial) -> str:
    """COMPLETE, INFEASIBLE (finished, but a constraint is violated) or FAIL/other Optuna states."""
    name = trial.state.name
    if name == "COMPLETE" and any(v > 0 for v in trial.constraints.values()):
        return "INFEASIBLE"
    return name


def trial_record(trial, *, study_name: str, sampler: str, models: Sequence[str], mode: str,
                 objectives: Sequence[str] = ("throughput",)) -> RunRecord:
    """The MLflow run of one finished trial, from the trial alone (see the module docstring)."""
    ua = trial.user_attrs
    res = ua.get("result") or {}
    state = trial_state(trial)
    rec = RunRecord(name=f"trial {trial.number}", step=trial.number,
                    status="FINISHED" if trial.state.name == "COMPLETE" else "FAILED")
    for k, v in (ua.get("point") or {}).items():
        rec.params[_key(k)] = str(v)[:MAX_PARAM]
    for k, v in (res.get("accelerator") or {}).items():
        rec.params[_key(f"arch.{k}")] = str(v)[:MAX_PARAM]
    rec.tags.update({
        "trial_state": state,
        "optuna.state": trial.state.name,
        "optuna.trial_number": str(trial.number),
        "optuna.study": study_name,
        "sampler": sampler,
        "models": ",".join(models),
        "mode": mode,
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
                metrics[f"objective.{name}"] = float(value)
    for k in ("score", "score_bound", "area_mm2", "trial_s", "elapsed_s"):
        if _finite(res.get(k)) is not None:
            metrics[k] = float(res[k])
    per_model = res.get("models") or {}
    totals = {t: 0.0 for t in TIMINGS}
    for model, summary in per_model.items():
        prefix = "" if len(per_model) == 1 else f"{_key(model)}."
        for k in MODEL_METRICS:
            if _finite(summary.get(k)) is not None:
                metrics[prefix + k] = float(summary[k])
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


def _retrying(op: Callable, attempts: int = 10):
    delay = 0.05
    for attempt in range(attempts):
        try:
            return op()
        except Exception as exc:  # noqa: BLE001 - only lock/busy errors are retried
            text = str(exc).lower()
            if attempt + 1 == attempts or not ("locked" in text or "busy" in text or "deadlock" in text):
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


class NullTracker:
    """Tracking switched off (`--tracking-uri off`)."""

    enabled = False
    parent_run_id = None
    experiment_id = None
    errors: list = []

    def log_trial(self, trial, artifact=None, **_):
        pass

    def log_parent(self, **_):
        pass

    def log_parent_file(self, path, artifact_path=None):
        pass

    def flush(self):
        pass

    def close(self, status="FINISHED"):
        pass

    def stop(self):
        pass

    def where(self) -> str:
        return "MLflow tracking is off"


class MlflowTracker:
    """Logs runs to one experiment; `start` opens the parent run, `attach` joins one in a worker."""

    enabled = True

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str, *, context: Mapping,
                 background: bool = True):
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.client = MlflowClient(driver_url(tracking_uri))
        self.experiment_id = experiment_id
        self.parent_run_id = parent_run_id
        self.context = dict(context)  # study_name, sampler, models, mode, objectives
        self.errors: list[str] = []
        self.logged_trials: set[int] = set()
        self._queue: queue.Queue | None = None
        self._thread = None
        if background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._drain, name="mlflow-logger", daemon=True)
            self._thread.start()

    # -- opening -------------------------------------------------------------------------------
    @staticmethod
    def prepare(tracking_uri: str, experiment_name: str, artifact_root: str | None = None) -> str:
        """Create the tracking database (in the parent, before any worker opens it) and the experiment."""
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        db = sqlite_path(tracking_uri)
        if db is not None:
            db.parent.mkdir(parents=True, exist_ok=True)
        from mlflow import MlflowClient

        try:
            client = MlflowClient(driver_url(tracking_uri))
            exp = client.get_experiment_by_name(experiment_name)
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
            return client.create_experiment(experiment_name, artifact_location=location)
        except PhazeError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad URI is the user's input
            raise PhazeError(f"--tracking-uri {redact(tracking_uri)}: cannot open the MLflow store: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

    @classmethod
    def start(cls, tracking_uri: str, experiment_name: str, *, run_name: str, params: Mapping[str, Any],
              tags: Mapping[str, str], context: Mapping, background: bool = True) -> "MlflowTracker":
        exp_id = cls.prepare(tracking_uri, experiment_name)
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(driver_url(tracking_uri))
        run = _retrying(lambda: client.create_run(exp_id, tags=dict(tags), run_name=run_name))
        if params:
            _retrying(lambda: client.log_batch(run.info.run_id, params=[
                Param(_key(k), str(v)[:MAX_PARAM]) for k, v in params.items()]))
        return cls(tracking_uri, exp_id, run.info.run_id, context=context, background=background)

    @classmethod
    def attach(cls, tracking_uri: str, experiment_id: str, parent_run_id: str, *, context: Mapping,
               background: bool = True) -> "MlflowTracker":
        return cls(tracking_uri, experiment_id, parent_run_id, context=context, background=background)

    # -- logging -------------------------------------------------------------------------------
    def log_trial(self, trial, artifact: Mapping | None = None) -> None:
        """Log one finished trial as a nested run (asynchronously when a background thread runs)."""
        record = trial_record(trial, **self.context)
        self.logged_trials.add(trial.number)
        self._submit(lambda: self._write_trial(record, artifact))

    def _write_trial(self, record: RunRecord, artifact: Mapping | None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        c = self.client
        tags = {"mlflow.parentRunId": self.parent_run_id, **record.tags}
        run = _retrying(lambda: c.create_run(self.experiment_id, tags=tags, run_name=record.name))
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        metrics = [Metric(_key(k), v, now, record.step) for k, v in record.metrics.items()]
        params = [Param(k, v) for k, v in record.params.items()]
        _retrying(lambda: c.log_batch(run_id, metrics=metrics, params=params, tags=[RunTag("logged_by", "phaze_opt")]))
        if artifact is not None:
            self._write_json(run_id, run.info.artifact_uri, "placement.json", artifact)
        _retrying(lambda: c.set_terminated(run_id, record.status))

    def _write_json(self, run_id: str, artifact_uri: str, name: str, data: Mapping) -> None:
        text = json.dumps(data, indent=1, allow_nan=False)
        local = _local_dir(artifact_uri)
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
            (local / name).write_text(text)
        else:
            self.client.log_text(run_id, text, name)

    def log_parent(self, *, metrics: Mapping[str, float] | None = None, params: Mapping[str, Any] | None = None,
                   tags: Mapping[str, str] | None = None, step: int = 0) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        m = [Metric(_key(k), float(v), now, step) for k, v in (metrics or {}).items() if _finite(v) is not None]
        p = [Param(_key(k), str(v)[:MAX_PARAM]) for k, v in (params or {}).items()]
        t = [RunTag(_key(k), str(v)[:MAX_TAG]) for k, v in (tags or {}).items()]
        self._submit(lambda: _retrying(lambda: self.client.log_batch(self.parent_run_id, metrics=m, params=p, tags=t)))

    def log_parent_file(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = str(path)
        self._submit(lambda: _retrying(lambda: self.client.log_artifact(self.parent_run_id, path, artifact_path)))

    def _submit(self, op: Callable) -> None:
        if self._queue is None:
            self._run(op)
        else:
            self._queue.put(op)

    def _run(self, op: Callable) -> None:
        try:
            op()
        except Exception as exc:  # noqa: BLE001 - tracking must not kill a study; reported at the end
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def _drain(self) -> None:
        while True:
            op = self._queue.get()
            try:
                if op is None:
                    return
                self._run(op)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.join()

    def close(self, status: str = "FINISHED") -> None:
        """Flush pending writes and end the parent run (only the process that started it calls this)."""
        self._submit(lambda: _retrying(lambda: self.client.set_terminated(self.parent_run_id, status)))
        self.stop()

    def stop(self) -> None:
        """Flush and stop the background thread, leaving the parent run open (workers)."""
        self.flush()
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._queue = None

    def where(self) -> str:
        return f"MLflow: experiment id {self.experiment_id}, parent run {self.parent_run_id} at {redact(self.tracking_uri)}"


def _local_dir(artifact_uri: str) -> Path | None:
    parsed = urlparse(str(artifact_uri))
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and str(artifact_uri).startswith("/"):
        return Path(str(artifact_uri))
    return None


def ui_command(tracking_uri: str) -> str:
    """How to open the UI on this store (one worker: the SQLite store is not for concurrent servers)."""
    return f"mlflow ui --backend-store-uri {redact(tracking_uri)} --workers 1"
