"""Optuna and MLflow agree after any stop: trial ownership, zombie trials, and run reconciliation.

Ownership. Every trial records who ran it, as the system attribute `phaze.owner` (written in the
transaction that makes it RUNNING, `install_claim_hooks`; or in the template of an exhaustive point): the host, the pid and start
time of the process that ran it, the invocation (`session`, a random id), and the process that logs
it to MLflow (`logger`: the invocation's parent process) with its parent run. From it:

- `fail_zombies`: at start, a RUNNING trial whose process is gone (same host, pid dead or reused)
  is failed as `interrupted` (it does not count towards `--trials`) and its point queued again. A
  RUNNING trial without an owner (another host, or an older version) is left to Optuna's heartbeat
  (`setup.HEARTBEAT_S`, `GRACE_S`).
- `requeue_lost`: a trial that failed with no result (interrupted outside the evaluation, e.g. in
  the sampler) and was enqueued (a reference design or a retry) is queued again, once.
- `count_own`: a summary's "this run" counts the invocation's own trials, not those of another
  process sharing the storage.
- `stop_at_total`: an Optuna callback stopping a process once the study holds `--trials` finished
  trials, whoever finished them (several processes on one storage stop at the total, overshooting
  by at most the trials in flight at that moment).

Reconciliation (`reconcile_runs`, at every start with tracking on, under a lock): each finished trial
gets exactly one finished MLflow run, keyed by the tag `optuna.trial_number`. Runs left RUNNING by a
dead process (a parent run, or a trial run cut mid-write) are closed as KILLED (trial runs of a
finished trial are deleted and logged again whole); a finished trial without a run whose logger is
gone is logged from the storage, with the `placement.json` its worker spooled when the spool folder is
still there (`signals.spooled_artifact`; otherwise the artifact is missing and the run says so);
extra runs of one trial are deleted.
Trials of a live process are left to it.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

from .processes import pid_alive, proc_start  # noqa: F401  (re-exported)
from .signals import spooled_artifact
from .tracking import retrying

OWNER_ATTR = "phaze.owner"
OWNER_TAG = "phaze.owner"  # on parent runs: host:pid:start of the process that holds the run
TRIAL_TAG = "optuna.trial_number"

_OWNER: dict[str, Any] = {}


# -- processes -------------------------------------------------------------------------------------

def host() -> str:
    return socket.gethostname()


def me() -> dict:
    pid = os.getpid()
    return {"host": host(), "pid": pid, "start": proc_start(pid)}


def alive(who: Mapping | None) -> bool | None:
    """Whether the process `who` ({host, pid, start}) still runs what it recorded: None when it is on
    another host (unknown). This process counts as gone: it is starting a new invocation, so whatever
    an earlier invocation in it left running is over."""
    if not who or "pid" not in who:
        return None
    if who.get("host") != host():
        return None
    if who["pid"] == os.getpid() and who.get("start") in (None, proc_start(os.getpid())):
        return False
    return pid_alive(who["pid"], who.get("start"))


def owner_tag() -> str:
    m = me()
    return f"{m['host']}:{m['pid']}:{m['start']}"


def parse_owner_tag(text: str | None) -> dict | None:
    if not text:
        return None
    parts = str(text).rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return {"host": parts[0], "pid": int(parts[1]), "start": int(parts[2]) if parts[2].isdigit() else None}


# -- ownership -------------------------------------------------------------------------------------

def new_session() -> str:
    """Start an invocation in this (parent) process: a fresh session id, this process as the logger."""
    session = uuid.uuid4().hex[:16]
    _OWNER.clear()
    _OWNER.update(session=session, logger=me(), parent_run=None)
    install_claim_hooks()
    return session


def end_session() -> None:
    """The invocation is over: trials this process creates from now on have no owner."""
    _OWNER.clear()


def set_parent_run(run_id: str | None) -> None:
    _OWNER["parent_run"] = run_id


def owner_context() -> dict:
    """What a worker process needs to claim trials for this invocation (picklable)."""
    return {k: _OWNER.get(k) for k in ("session", "logger", "parent_run")}


def adopt(context: Mapping | None) -> None:
    """In a worker process: claim trials for the invocation `context` (`owner_context`)."""
    if context:
        _OWNER.clear()
        _OWNER.update(context)
        install_claim_hooks()


def owner_record() -> dict | None:
    """The `phaze.owner` value of a trial this process runs now (None outside an invocation)."""
    if not _OWNER.get("session"):
        return None
    return {**me(), "session": _OWNER["session"], "logger": _OWNER.get("logger"),
            "parent_run": _OWNER.get("parent_run")}


def claim(trial) -> None:
    """Record the owner of a running Optuna trial (first thing in the objective), unless the storage's
    hooks (`install_claim_hooks`) did it as the trial became RUNNING."""
    record = owner_record()
    if record is None:
        return
    storage, trial_id = trial.storage, trial._trial_id  # noqa: SLF001
    if OWNER_ATTR not in storage.get_trial_system_attrs(trial_id):
        storage.set_trial_system_attr(trial_id, OWNER_ATTR, record)


_HOOKS: dict = {}


def install_claim_hooks() -> None:
    """Record a trial's owner in the very transaction that makes it RUNNING (Optuna's `ask` creates it,
    or pops a queued one), so no kill can leave a RUNNING trial without an owner. SQLAlchemy ORM events
    on Optuna's trial table, for every RDB storage of this process; idempotent. Without them (another
    Optuna layout) `claim` still records the owner a moment later."""
    if _HOOKS:
        return

    try:
        from optuna.storages._rdb import models
        from optuna.trial import TrialState
        from sqlalchemy import event, inspect
    except ImportError:  # pragma: no cover
        return
    table = models.TrialSystemAttributeModel.__table__

    def write(connection, trial_id) -> None:
        record = owner_record()
        if record is None or trial_id is None:
            return
        connection.execute(table.delete().where(table.c.trial_id == trial_id, table.c.key == OWNER_ATTR))
        connection.execute(table.insert().values(trial_id=trial_id, key=OWNER_ATTR, value_json=json.dumps(record)))

    def on_insert(_mapper, connection, target) -> None:
        if target.state == TrialState.RUNNING:
            write(connection, target.trial_id)

    def on_update(_mapper, connection, target) -> None:
        if target.state == TrialState.RUNNING and inspect(target).attrs.state.history.has_changes():
            write(connection, target.trial_id)

    event.listen(models.TrialModel, "after_insert", on_insert)
    event.listen(models.TrialModel, "after_update", on_update)
    _HOOKS["installed"] = True


def stamp(system_attrs: dict) -> dict:
    """`system_attrs` of a trial created finished (an exhaustive point) with its owner."""
    record = owner_record()
    if record is not None:
        system_attrs[OWNER_ATTR] = record
    return system_attrs


def owner_of(trial) -> dict | None:
    value = trial.system_attrs.get(OWNER_ATTR)
    return value if isinstance(value, dict) else None


def count_own(trials: Iterable, session: str | None) -> int:
    return sum(1 for t in trials if (owner_of(t) or {}).get("session") == session)


def is_mine(trial, session: str | None) -> bool:
    """The trial was run by `session`, or by nobody known (an older trial): this process may log it."""
    owner = owner_of(trial)
    return owner is None or owner.get("session") == session


# -- trials ----------------------------------------------------------------------------------------

def kept_attrs(trial) -> dict:
    """The user attributes a re-queued trial keeps: `reference` (a reference design stays one)."""
    ref = trial.user_attrs.get("reference")
    return {"reference": ref} if ref is not None else {}


def _requeue(study, trial, reason_attrs: Mapping) -> None:
    params = trial.system_attrs.get("fixed_params") or dict(trial.params)
    study.enqueue_trial(dict(params), user_attrs={"retry_of": trial.number, **kept_attrs(trial), **reason_attrs})


def fail_zombies(study) -> list[int]:
    """Fail (as interrupted) every RUNNING trial whose process on this host is gone, and queue its
    point again; returns their numbers. Safe against a concurrent start doing the same: the state
    change is the storage's atomic check-and-set, and only its winner re-queues."""
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = study._storage  # noqa: SLF001
    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = owner_of(t)
        if owner is None or alive(owner) is not False:
            continue
        try:
            storage.set_trial_user_attr(t._trial_id, "interrupted", True)  # noqa: SLF001
            if not storage.set_trial_state_values(t._trial_id, TrialState.FAIL):  # noqa: SLF001
                continue
        except UpdateFinishedTrialError:
            continue  # another process got there first
        _requeue(study, t, {})
        failed.append(t.number)
    return failed


def requeue_lost(study) -> list[int]:
    """Queue again, once, an enqueued point (reference or retry) whose trial failed without a result
    (cut outside the evaluation, e.g. by Ctrl-C in the sampler, so never retried); returns them."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    for t in trials:
        retried.update(t.system_attrs.get("retry_history", []) or [])
    out = []
    for t in trials:
        if (t.state == TrialState.FAIL and "result" not in t.user_attrs and t.number not in retried
                and t.system_attrs.get("fixed_params") and owner_of(t) is not None
                and alive(owner_of(t)) is not True):
            _requeue(study, t, {})
            out.append(t.number)
    return out


def stop_at_total(total: int, counted) -> "callable":
    """An Optuna callback: stop this process's loop once `counted(trials)` (the finished trials) reaches
    `total`, whichever process finished them."""

    def callback(study, _frozen):
        if len(counted(study.get_trials(deepcopy=False))) >= total:
            study.stop()

    return callback


# -- MLflow ----------------------------------------------------------------------------------------

def sessions_of(trials: Iterable) -> set[str]:
    """The invocations (session ids) that ran the study's trials."""
    return {s for s in ((owner_of(t) or {}).get("session") for t in trials) if s}


def _spooled(owner: Mapping, number: int) -> dict | None:
    """The artifact a worker of the dead invocation `owner` spooled for trial `number`, if still there."""
    logger = owner.get("logger") or {}
    if logger.get("host") != host() or "pid" not in logger:
        return None
    return spooled_artifact(logger["pid"], owner.get("session"), number)

def _all_runs(client, experiment_id: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        runs.extend(page)
        token = getattr(page, "token", None)
        if not token:
            return runs


def reconcile_runs(tracker, trials, counted) -> dict:
    """Make the experiment agree with the study (see the module docstring); returns counts of what was
    done: closed (runs set KILLED), logged (missing trial runs), deleted (incomplete or extra runs)."""
    out = {"closed": 0, "logged": 0, "deleted": 0}
    if not getattr(tracker, "enabled", False):
        return out
    client = tracker.client
    runs = retrying(lambda: _all_runs(client, tracker.experiment_id))
    parents = {r.info.run_id: r for r in runs if TRIAL_TAG not in r.data.tags}
    dead = set()
    for run_id, run in parents.items():
        if run_id == tracker.parent_run_id:
            continue
        if alive(parse_owner_tag(run.data.tags.get(OWNER_TAG))) is True:
            continue
        if alive(parse_owner_tag(run.data.tags.get(OWNER_TAG))) is None and run.data.tags.get(OWNER_TAG):
            continue  # held by a process on another host: not ours to judge
        dead.add(run_id)
        if run.info.status == "RUNNING":
            retrying(lambda: client.set_terminated(run_id, "KILLED"))
            out["closed"] += 1
    by_trial: dict[int, list] = {}
    for r in runs:
        if TRIAL_TAG in r.data.tags and r.data.tags[TRIAL_TAG].isdigit():
            by_trial.setdefault(int(r.data.tags[TRIAL_TAG]), []).append(r)
    finished = {t.number: t for t in counted(trials)}

    def orphan(run) -> bool:  # written by a process that is gone
        return run.data.tags.get("mlflow.parentRunId") in dead or run.data.tags.get("mlflow.parentRunId") not in parents

    for number, group in by_trial.items():
        done = sorted((r for r in group if r.info.status in ("FINISHED", "FAILED")), key=lambda r: r.info.start_time or 0)
        for r in group:
            if r.info.status == "RUNNING" and orphan(r):
                if number in finished:  # cut mid-write: logged again below, whole
                    retrying(lambda: client.delete_run(r.info.run_id))
                    out["deleted"] += 1
                else:
                    retrying(lambda: client.set_terminated(r.info.run_id, "KILLED"))
                    out["closed"] += 1
        for r in done[1:]:
            retrying(lambda: client.delete_run(r.info.run_id))
            out["deleted"] += 1
        if not done:
            by_trial[number] = []
    logged = {n for n, g in by_trial.items() if any(r.info.status in ("FINISHED", "FAILED") for r in g)}
    for number, t in sorted(finished.items()):
        if number in logged:
            continue
        owner = owner_of(t) or {}
        if alive(owner.get("logger")) is True and owner.get("session") != _OWNER.get("session"):
            continue  # a live invocation logs it itself
        parent = owner.get("parent_run")
        tracker.log_trial(t, _spooled(owner, number), parent_run_id=parent if parent in parents else None,
                          extra_tags={"reconciled": "true"})
        out["logged"] += 1
    tracker.flush()
    return out
