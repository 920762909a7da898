"""Fault injection: a 2-worker study killed with SIGKILL at random moments, resumed each time, checked.

    PYTHONPATH=. python tests/fault_injection.py [--kills 20] [--trials 100] [--seed 0] [--dir DIR]

Each round starts the real study CLI (`fault_study.py`: a fake evaluator, 32 designs) in its own
process group and kills it with SIGKILL: the first round while the Optuna schema is being created,
the second while the MLflow database is being built (aside), the rest after a random delay (from
start-up to a little into the trials; each round asks for a few more trials, so each has work); odd rounds kill
the parent alone (its workers must then exit by themselves, and are waited for), even rounds the
whole process group. Every fifth round from the fourth kills one worker instead (as the kernel's
out-of-memory killer would): the study must go on and end by itself (exit 0, no traceback); every
fifth from the fifth kills the parent the moment the round's trials are all finished (before it
logs them), which the next start must reconcile. A last round runs to the end. Then it checks:

- every trial finished exactly once: no trial RUNNING or WAITING, `--trials` finished trials (at most
  one more, in flight in the other worker), and each queued reference design finished once;
- no MLflow run RUNNING (parent or trial), and one finished run per finished trial (trial number
  tag), none for other trials;
- no worker outlived its parent by more than `ORPHAN_LIMIT_S`, and no spool folder is left;
- the best equals the best of an uninterrupted run of the same study (and of the space).

`run()` returns the counts (and the list of failed checks); tests/test_fault_injection.py runs it at a
small size.

    PYTHONPATH=. python tests/fault_injection.py --postgres [--processes 3] [--kills 20] [--trials 150]

`crowd()`: several study processes share one study whose Optuna storage and MLflow tracking store are
both PostgreSQL (a throwaway server, or `--storage URL --tracking-uri URL`); one is SIGKILLed at each
of `--kills` moments spread over the study (the start-up, random moments, a worker, the parent that
has just finished a trial, and last the parent that finished the study's last trial) and started
again at once, until the study holds its trials; a last start reconciles, and the same checks run.
A point queued again for a longer run (an interrupted trial's) may be left WAITING, never a finished
reference design.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ORPHAN_LIMIT_S = 30.0
TRIAL_S = 0.1  # seconds a trial of the fake evaluator takes (FAULT_TRIAL_S)


@dataclass(frozen=True)
class Stores:
    """Where a study of these runs keeps its trials (`storage`, None: the CLI's SQLite file in the run's
    folder) and its MLflow runs (`tracking`, None: a SQLite database in the run's folder), and its name."""

    storage: str | None = None
    tracking: str | None = None
    name: str = "fault"

    def storage_url(self, work: Path) -> str:
        return self.storage or f"sqlite:///{work / 'studies' / f'{self.name}.db'}"

    def tracking_uri(self, work: Path) -> str:
        return self.tracking or f"sqlite:///{work / 'mlruns' / 'mlflow.db'}"


def _command(work: Path, trials: int, workers: int, stores: Stores = Stores()) -> list[str]:
    storage = ["--storage", stores.storage] if stores.storage else []
    return [sys.executable, str(HERE / "fault_study.py"), "--model", "m-small", "--space", "fake",
            "--trials", str(trials), "--workers", str(workers), "--study-name", stores.name, "--sampler", "tpe",
            "--output-dir", str(work / "studies"), "--tracking-uri", stores.tracking_uri(work), *storage,
            "--no-progress", "--json"]


def _env(work: Path) -> dict:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", TMPDIR=str(work / "tmp"), FAULT_TRIAL_S=str(TRIAL_S))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    (work / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for(predicate, timeout: float, proc) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.005)
    return False


def _run_to_end(work: Path, trials: int, workers: int, timeout: float = 1800, stores: Stores = Stores()) -> dict:
    # in the run's folder: a server-backed MLflow store keeps its artifacts under ./mlruns
    out = subprocess.run(_command(work, trials, workers, stores), env=_env(work), capture_output=True, text=True,
                         timeout=timeout, cwd=work)
    if out.returncode != 0:
        raise RuntimeError(f"the study exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout)


def _workers_of(pid: int) -> list[int]:
    """The worker processes of the study whose parent is `pid` (spawned: `multiprocessing.spawn` in
    their command line; not the resource tracker)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            out.append(int(stat.parent.name))
    return out


def _finished(db: Path) -> int:
    """Finished trials in the Optuna SQLite storage `db`, read without writing it."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            return con.execute("SELECT count(*) FROM trials WHERE state IN ('COMPLETE', 'FAIL')").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def _kill_a_worker(proc, workers: int, rng, problems: list, where: str, err_path: Path) -> bool:
    """SIGKILL one worker of the running study `proc` (once it has `workers` of them), then let the
    study end by itself: it must exit 0 within its trials' time, with no traceback."""
    if not _wait_for(lambda: len(_workers_of(proc.pid)) >= workers, 120, proc):
        return False
    _wait_for(lambda: False, rng.uniform(0.0, 1.0), proc)
    alive = _workers_of(proc.pid)
    if not alive or proc.poll() is not None:
        return False
    os.kill(rng.choice(alive), signal.SIGKILL)
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        problems.append(f"{where}: still running 600 s after a worker was killed")
        return True
    stderr = err_path.read_text(errors="replace")
    if proc.returncode != 0:
        problems.append(f"{where}: exit {proc.returncode} after a worker was killed: {stderr[-500:]}")
    if "Traceback" in stderr:
        problems.append(f"{where}: a traceback after a worker was killed: {stderr[-1500:]}")
    return True


def run(kills: int = 20, trials: int = 100, workers: int = 2, seed: int = 0, work: Path | None = None) -> dict:
    import tempfile

    rng = random.Random(seed)
    work = Path(work or tempfile.mkdtemp(prefix="phaze-fault-"))
    ref_dir, dir_ = work / "uninterrupted", work / "killed"
    t0 = time.monotonic()
    reference = _run_to_end(ref_dir, trials, workers)
    # kills land anywhere from start-up to a little into the trials (a resumed run starts faster than the
    # first, which built both databases: hence 0.7), so most rounds are cut
    startup = max(0.5, time.monotonic() - t0 - trials * TRIAL_S / workers)
    counts = {"kills": 0, "kills_during_mlflow_db_creation": 0, "kills_during_optuna_schema_creation": 0,
              "kills_parent_only": 0, "kills_process_group": 0, "runs_finished_before_kill": 0,
              "max_orphan_s": 0.0, "orphans_over_limit": 0, "kills_of_a_worker": 0, "kills_at_the_end": 0}
    problems: list[str] = []
    mlflow_db = dir_ / "mlruns" / "mlflow.db"
    optuna_db = dir_ / "studies" / "fault.db"
    step = max(1, trials // (kills + 1))
    for i in range(3 * kills):
        if counts["kills"] == kills:
            break
        # each round asks for a few more trials than the last, so every round has work to cut
        target = min(trials, step * (i + 1))
        err_path = dir_ / f"stderr-{i}.txt"
        dir_.mkdir(parents=True, exist_ok=True)
        with open(err_path, "w") as err:
            proc = subprocess.Popen(_command(dir_, target, workers), env=_env(dir_), stdout=subprocess.DEVNULL,
                                    stderr=err, start_new_session=True)
        if i % 5 == 3 and workers > 1:  # a worker killed as the OOM killer would: the study goes on
            if _kill_a_worker(proc, workers, rng, problems, f"round {i}", err_path):
                counts["kills"] += 1
                counts["kills_of_a_worker"] += 1
            else:
                proc.wait()
                counts["runs_finished_before_kill"] += 1
            continue
        if i % 5 == 4:  # the parent, as the round's last trial finishes: the next start reconciles
            _wait_for(lambda: _finished(optuna_db) >= target, 600, proc)
        elif i == 0 and not optuna_db.exists():
            hit = _wait_for(lambda: optuna_db.exists() or any(optuna_db.parent.glob(".fault.db.building-*")), 60, proc)
            counts["kills_during_optuna_schema_creation"] += hit
        elif i == 1 and not mlflow_db.exists():  # while MLflow migrates its new database, aside
            hit = _wait_for(lambda: any(mlflow_db.parent.glob(".mlflow.db.building-*")), 60, proc)
            counts["kills_during_mlflow_db_creation"] += hit
        else:
            _wait_for(lambda: False, rng.uniform(0.2, 0.7 * startup + step * TRIAL_S / workers), proc)
        if proc.poll() is not None:
            counts["runs_finished_before_kill"] += 1
            continue
        parent_only = i % 2 == 1 or i % 5 == 4
        counts["kills"] += 1
        counts["kills_at_the_end"] += i % 5 == 4
        if parent_only:
            counts["kills_parent_only"] += 1
            os.kill(proc.pid, signal.SIGKILL)
        else:
            counts["kills_process_group"] += 1
            os.killpg(proc.pid, signal.SIGKILL)
        _reap(proc, counts)
    final = _run_to_end(dir_, trials, workers)
    return _conclude(counts, check(dir_, trials, workers, final, reference), problems, t0)


def _reap(proc, counts: dict) -> None:
    """Wait for the killed study `proc` and for its process group (workers of a parent killed alone
    must exit by themselves): the longest wait into `max_orphan_s`; past `ORPHAN_LIMIT_S` they are
    killed and counted in `orphans_over_limit`."""
    proc.wait()
    start = time.monotonic()
    while _group_alive(proc.pid) and time.monotonic() - start < ORPHAN_LIMIT_S:
        time.sleep(0.05)
    counts["max_orphan_s"] = max(counts["max_orphan_s"], round(time.monotonic() - start, 2))
    if _group_alive(proc.pid):
        counts["orphans_over_limit"] += 1
        os.killpg(proc.pid, signal.SIGKILL)


def _conclude(counts: dict, checked: dict, problems: list[str], t0: float) -> dict:
    """The kill run's counts with the stores' check: every problem seen, the run's wall time."""
    counts.update(checked)
    counts["problems"][:0] = problems
    if counts["orphans_over_limit"]:
        counts["problems"].append(f"{counts['orphans_over_limit']} times workers outlived their parent by "
                                  f"{ORPHAN_LIMIT_S:.0f} s")
    counts["wall_s"] = round(time.monotonic() - t0, 1)
    return counts


# -- several processes on one PostgreSQL study --------------------------------------------------------

POLL_S = 0.02  # how often the crowd run reads the study's progress
STARTUP_S = 8.0  # the start-up kill lands this long after the start at most (imports take 3-6 s under load)
CROWD_TRIAL_S = 2.0  # a trial of the crowd: 150 trials on 3 x 2 workers are about a minute of trials
# Finished trials as `session.finished_trials` counts them (complete, or failed with a result and not
# interrupted), read straight from Optuna's tables so the poll costs one query.
_FINISHED_SQL = """SELECT count(*) FROM trials t JOIN studies s ON s.study_id = t.study_id
WHERE s.study_name = %s AND (t.state = 'COMPLETE' OR (t.state = 'FAIL'
  AND EXISTS (SELECT 1 FROM trial_user_attributes a WHERE a.trial_id = t.trial_id AND a.key = 'result')
  AND NOT EXISTS (SELECT 1 FROM trial_user_attributes a WHERE a.trial_id = t.trial_id AND a.key = 'interrupted')))"""
# The owner (`reconcile.OWNER_ATTR`) of the trial finished last: its logger is the process that has yet to log it.
_LAST_OWNER_SQL = """SELECT a.value_json FROM trials t JOIN studies s ON s.study_id = t.study_id
JOIN trial_system_attributes a ON a.trial_id = t.trial_id AND a.key = 'phaze.owner'
WHERE s.study_name = %s AND t.state IN ('COMPLETE', 'FAIL') ORDER BY t.datetime_complete DESC NULLS LAST LIMIT 1"""


class _Progress:
    """A study's progress in a PostgreSQL storage, read on one connection of its own."""

    def __init__(self, url: str, name: str):
        import psycopg2

        self._conn = psycopg2.connect(url.replace("postgresql+psycopg2://", "postgresql://", 1))
        self._conn.autocommit = True
        self.name = name

    def _one(self, sql: str):
        import psycopg2

        try:
            with self._conn.cursor() as cur:
                cur.execute(sql, (self.name,))
                row = cur.fetchone()
                return row[0] if row else None
        except psycopg2.Error:  # Optuna's tables are not there yet
            return None

    def finished(self) -> int:
        return self._one(_FINISHED_SQL) or 0

    def last_logger(self) -> int | None:
        """The pid of the process that logs the trial finished last."""
        owner = self._one(_LAST_OWNER_SQL)
        try:
            return int(json.loads(owner)["logger"]["pid"])
        except (TypeError, ValueError, KeyError):
            return None

    def close(self) -> None:
        self._conn.close()


@dataclass
class _Slot:
    """One of the crowd's study processes (its own process group) and its stderr."""

    proc: subprocess.Popen
    err: Path
    worker_killed: bool = False


def _kill_plan(kills: int, trials: int, rng) -> list[tuple[str, float]]:
    """(kind, finished trials to wait for) of each kill: the first in the start-up, the last the moment
    the study holds its trials; between, at random points of the study, a worker every fifth from the
    fourth, the parent that has just finished a trial every fifth from the fifth, else the parent alone
    (odd) or its whole process group (even)."""
    marks = sorted(rng.uniform(0.03, 0.85) * trials for _ in range(max(0, kills - 2)))
    plan = [("start-up", 0.0)]
    for i, mark in enumerate(marks, start=1):
        kind = "worker" if i % 5 == 3 else "trial-end" if i % 5 == 4 else "parent" if i % 2 else "group"
        plan.append((kind, mark))
    return (plan + [("end", float(trials))])[:kills]


def crowd(kills: int = 20, trials: int = 150, processes: int = 3, workers: int = 2, seed: int = 0,
          work: Path | None = None, storage: str | None = None, tracking: str | None = None,
          trial_s: float = CROWD_TRIAL_S) -> dict:
    """`processes` study processes sharing one study on PostgreSQL (Optuna storage and MLflow tracking
    store), SIGKILLed `kills` times at random moments (`_kill_plan`) and each killed one started again
    at once, until the study holds `trials` finished trials; then a last start (which reconciles) and
    `check`. Without `storage` and `tracking` a throwaway server is started (pg_server) and stopped at
    the end. A process that exits by itself must exit 0 with no traceback (also one whose worker was
    killed: it goes on without it). Its trials take `trial_s` (the uninterrupted reference run's
    `TRIAL_S`): long enough that the study outlasts several restarts, so kills land in trials too."""
    import tempfile
    import uuid
    from contextlib import ExitStack

    import pg_server

    rng = random.Random(seed)
    work = Path(work or tempfile.mkdtemp(prefix="phaze-crowd-"))
    with ExitStack() as stack:
        ref_storage, ref_tracking = storage, tracking
        if storage is None or tracking is None:  # separate databases: the crowd's first start builds both schemas
            urls = stack.enter_context(pg_server.throwaway(("optuna", "mlflow", "optuna_ref", "mlflow_ref")))
            storage, ref_storage = storage or urls["optuna"], storage or urls["optuna_ref"]
            tracking, ref_tracking = tracking or urls["mlflow"], tracking or urls["mlflow_ref"]
        name = f"fault-{uuid.uuid4().hex[:8]}"  # a server given may hold earlier runs' studies
        stores = Stores(storage, tracking, name)
        t0 = time.monotonic()
        reference = _run_to_end(work / "uninterrupted", trials, workers, stores=Stores(ref_storage, ref_tracking,
                                                                                      f"{name}-uninterrupted"))
        run_dir = work / "killed"
        counts = {"kills": 0, "kills_parent_only": 0, "kills_process_group": 0, "kills_of_a_worker": 0,
                  "kills_as_a_trial_finished": 0, "kills_at_the_end": 0, "kills_before_the_first_trial": 0,
                  "starts": 0, "exits_by_themselves": 0, "max_orphan_s": 0.0, "orphans_over_limit": 0}
        problems: list[str] = []
        progress = _Progress(storage, name)
        stack.callback(progress.close)
        env = dict(_env(run_dir), FAULT_TRIAL_S=str(trial_s))

        def launch() -> _Slot:
            err = run_dir / f"stderr-{counts['starts']}.txt"
            counts["starts"] += 1
            with open(err, "w") as f:
                proc = subprocess.Popen(_command(run_dir, trials, workers, stores), env=env, cwd=run_dir,
                                        stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
            return _Slot(proc, err)

        slots: list[_Slot | None] = []

        def tend() -> None:
            """A process that exited by itself: exit 0 and no traceback, and started again if the study is short."""
            for k, slot in enumerate(slots):
                if slot is None or slot.proc.poll() is None:
                    continue
                counts["exits_by_themselves"] += 1
                stderr = slot.err.read_text(errors="replace")
                if slot.proc.returncode != 0 or "Traceback" in stderr:
                    problems.append(f"{slot.err.name}: exit {slot.proc.returncode}: {stderr[-1500:]}")
                slots[k] = launch() if progress.finished() < trials else None

        def wait_until(predicate, timeout: float = 1200.0) -> bool:
            """Until `predicate()`, or `timeout`, or no process is left to change anything."""
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                tend()
                if predicate():
                    return True
                if all(s is None for s in slots):
                    return False
                time.sleep(POLL_S)
            return False

        def pick(kind: str) -> int | None:
            """The slot to kill: the logger of the trial just finished, a process with workers whose
            worker was not killed yet, or any live one."""
            live = [k for k, s in enumerate(slots) if s is not None and s.proc.poll() is None]
            if kind == "worker":
                live = [k for k in live if not slots[k].worker_killed and _workers_of(slots[k].proc.pid)]
            if not live:
                return None
            pid = progress.last_logger() if kind in ("trial-end", "end") else None
            return next((k for k in live if slots[k].proc.pid == pid), rng.choice(live))

        try:
            slots.extend(launch() for _ in range(processes))
            for i, (kind, mark) in enumerate(_kill_plan(kills, trials, rng)):
                if kind == "start-up":  # the processes start together: imports, schemas, references
                    wait_until(lambda: progress.finished() > 0, timeout=rng.uniform(0.2, STARTUP_S))
                elif kind in ("trial-end", "end"):  # the moment a trial finishes, before its process logs it
                    seen = progress.finished()
                    wait_until(lambda: progress.finished() >= min(trials, max(mark, seen + 1)))
                else:
                    wait_until(lambda: progress.finished() >= mark)
                    wait_until(lambda: False, rng.uniform(0.0, 1.0))
                if kind == "worker":
                    wait_until(lambda: pick(kind) is not None, timeout=120)
                k = pick(kind)
                if k is None:
                    continue
                slot, before = slots[k], progress.finished()
                counts["kills"] += 1
                counts["kills_before_the_first_trial"] += before == 0
                if kind == "worker":  # as the OOM killer would: the process goes on without it
                    os.kill(rng.choice(_workers_of(slot.proc.pid)), signal.SIGKILL)
                    slot.worker_killed = True
                    counts["kills_of_a_worker"] += 1
                else:
                    group = kind in ("start-up", "group")
                    (os.killpg if group else os.kill)(slot.proc.pid, signal.SIGKILL)
                    counts["kills_process_group" if group else "kills_parent_only"] += 1
                    counts["kills_as_a_trial_finished"] += kind == "trial-end"
                    counts["kills_at_the_end"] += kind == "end"
                    _reap(slot.proc, counts)
                    slots[k] = launch() if kind != "end" else None
                with open(work / "kills.jsonl", "a") as f:
                    f.write(json.dumps({"kill": i, "kind": kind, "finished": before, "stderr": slot.err.name,
                                        "s": round(time.monotonic() - t0, 1)}) + "\n")
            if not wait_until(lambda: all(s is None for s in slots), timeout=900):
                problems.append("processes still running 900 s after the last kill")
        finally:
            for slot in slots:
                if slot is not None and slot.proc.poll() is None:
                    os.killpg(slot.proc.pid, signal.SIGKILL)
                    slot.proc.wait()
        if counts["kills"] < kills:
            problems.append(f"{counts['kills']} of {kills} kills landed (the study ended first)")
        final = _run_to_end(run_dir, trials, workers, stores=stores)
        return _conclude(counts, check(run_dir, trials, processes * workers, final, reference, stores), problems, t0)


# -- the signal storm: clean stops --------------------------------------------------------------------

STOP_LIMIT_S = 10.0  # a clean stop ends within this many seconds of its signal
STORM_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def _handles_sigterm(pid: int) -> bool:
    """The process has installed its SIGTERM handler (bit 15 of SigCgt in /proc/<pid>/status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def storm(rounds: int = 50, workers: int = 2, trials: int = 400, seed: int = 0, work: Path | None = None,
          max_delay_s: float = 6.0, stop_limit_s: float = STOP_LIMIT_S) -> dict:
    """Each round starts the study, waits until it handles signals, sends SIGINT (to the process group,
    as Ctrl-C does), SIGTERM (to the parent or the group) or SIGHUP (to the group) after a random delay
    (even rounds: anywhere in the start-up; odd rounds: after its first evaluation), and checks the stop: exit 130 within `STOP_LIMIT_S`, no
    traceback, no worker left. A last round runs to the end; then the stores are checked (`check`),
    and no trial cut by a stop had finished its evaluation (the fake evaluator logs each one it
    finishes, `FAULT_EVAL_LOG`)."""
    import tempfile

    rng = random.Random(seed)
    work = Path(work or tempfile.mkdtemp(prefix="phaze-storm-"))
    log = work / "evaluations.log"
    env = dict(_env(work), FAULT_EVAL_LOG=str(log))
    counts = {"rounds": 0, "signals": {}, "finished_before_signal": 0, "max_stop_s": 0.0, "problems": []}
    problems = counts["problems"]
    step = max(1, trials // (rounds + 1))
    t0 = time.monotonic()
    for i in range(rounds):
        target = min(trials, step * (i + 1))
        err_path = work / f"stderr-{i}.txt"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(_command(work, target, workers), env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        _wait_for(lambda: _handles_sigterm(proc.pid), 120, proc)
        if i % 2:  # into the trials: once this round's first evaluation is done
            seen = _lines(log)
            _wait_for(lambda: _lines(log) > seen, 120, proc)
            _wait_for(lambda: False, rng.uniform(0.0, 1.0), proc)
        else:  # anywhere in the start-up
            _wait_for(lambda: False, rng.uniform(0.0, max_delay_s), proc)
        if proc.poll() is not None:
            counts["finished_before_signal"] += 1
            continue
        name = STORM_SIGNALS[i % len(STORM_SIGNALS)]
        group = name != "SIGTERM" or rng.random() < 0.5
        counts["signals"][name] = counts["signals"].get(name, 0) + 1
        counts["rounds"] += 1
        sent = time.monotonic()
        (os.killpg if group else os.kill)(proc.pid, getattr(signal, name))
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop_s = round(time.monotonic() - sent, 2)
        counts["max_stop_s"] = max(counts["max_stop_s"], stop_s)
        stderr = err_path.read_text(errors="replace")
        where = f"round {i} ({name} to the {'group' if group else 'parent'})"
        if proc.returncode != 130:
            problems.append(f"{where}: exit {proc.returncode}: {stderr[-500:]}")
        if stop_s > stop_limit_s:
            problems.append(f"{where}: stopped in {stop_s} s")
        if "Traceback" in stderr:
            problems.append(f"{where}: a traceback: {stderr[-1500:]}")
        start = time.monotonic()
        while _group_alive(proc.pid) and time.monotonic() - start < ORPHAN_LIMIT_S:
            time.sleep(0.05)
        if _group_alive(proc.pid):
            problems.append(f"{where}: workers left running")
            os.killpg(proc.pid, signal.SIGKILL)
        killed = _parent_runs_not_killed(work)
        if killed:
            problems.append(f"{where}: parent runs {killed}")
        with open(work / "rounds.jsonl", "a") as f:  # each round as it ends: a long storm cut short keeps them
            f.write(json.dumps({"round": i, "signal": name, "group": group, "exit": proc.returncode,
                                "stop_s": stop_s}) + "\n")
    final = _run_to_end(work, trials, workers, timeout=1800)  # all that is left, on a loaded machine
    checked = check(work, trials, workers, final, final)
    problems.extend(checked.pop("problems"))
    counts.update(checked)
    redone = _redone_evaluations(work, log)
    if redone:
        problems.append(f"interrupted trials whose evaluation had finished: {redone}")
    counts["wall_s"] = round(time.monotonic() - t0, 1)
    return counts


def _lines(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


def _parent_runs_not_killed(work: Path) -> list[str]:
    """Statuses of the parent runs that are neither KILLED nor FINISHED (every stop ends its run)."""
    from mlflow import MlflowClient

    db = work / "mlruns" / "mlflow.db"
    if not db.exists():
        return []
    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("fault")
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], max_results=50000)
    return [r.info.status for r in runs if "optuna.trial_number" not in r.data.tags
            and r.info.status not in ("KILLED", "FINISHED")]


def _redone_evaluations(work: Path, log: Path) -> list[int]:
    """Interrupted trials whose process had finished evaluating their point (so it is evaluated again)."""
    import optuna

    from phaze_opt.runs.reconcile import owner_of

    if not log.exists():
        return []
    finished = []
    for line in log.read_text().splitlines():
        pid, end, point = line.split(" ", 2)
        finished.append((int(pid), float(end), json.loads(point)))
    study = optuna.load_study(study_name="fault", storage=f"sqlite:///{work / 'studies' / 'fault.db'}")
    out = []
    for t in study.get_trials(deepcopy=False):
        if not t.user_attrs.get("interrupted") or t.datetime_start is None:
            continue
        pid = (owner_of(t) or {}).get("pid")
        begin = t.datetime_start.timestamp()
        end = t.datetime_complete.timestamp() if t.datetime_complete else float("inf")
        point = t.user_attrs.get("point") or {}
        if any(p == pid and begin <= e <= end and all(q.get(k) == v for k, v in point.items() if k in q)
               for p, e, q in finished):
            out.append(t.number)
    return out


def _queued_point(trial) -> tuple:
    """(mbs, recompute) of a WAITING trial, from the parameters it was queued with."""
    from phaze_opt.search.encoding import SpaceCodec

    sys.path.insert(0, str(HERE))
    from fault_study import FaultSpace

    params = trial.system_attrs.get("fixed_params")
    if not params:
        return None, None
    point = SpaceCodec(FaultSpace().params).decode(params)
    return point["mbs"], point["recompute"]


def check(work: Path, trials: int, in_flight: int, summary: dict, reference: dict, stores: Stores = Stores()) -> dict:
    """The stores of the study in `work` after its last run (`summary`), against `reference`'s best;
    `in_flight`: the most trials that could run at once (the overshoot `--trials` allows)."""
    import optuna
    from mlflow import MlflowClient
    from optuna.trial import TrialState

    from phaze_opt.search.session import finished_trials

    sys.path.insert(0, str(HERE))
    from fault_study import best_of_space

    problems = []
    from phaze_opt.runs.tracking import driver_url

    study = optuna.load_study(study_name=stores.name, storage=driver_url(stores.storage_url(work)))
    all_trials = study.get_trials(deepcopy=False)
    done = finished_trials(all_trials)
    open_trials = [t.number for t in all_trials if t.state == TrialState.RUNNING]
    if open_trials:
        problems.append(f"trials still RUNNING: {open_trials}")
    # a point queued again for a later, longer run: only that of an interrupted trial (a kill at the end of
    # the study cuts the trials in flight, and the next start queues their points), and never a reference
    # design that has finished (it would be evaluated twice)
    interrupted = {t.number for t in all_trials if t.user_attrs.get("interrupted")}
    queued = [t for t in all_trials if t.state == TrialState.WAITING]
    finished_refs = {(t.user_attrs["point"]["mbs"], t.user_attrs["point"]["recompute"]) for t in done
                     if t.user_attrs.get("reference")}
    wrong = [t.number for t in queued if t.user_attrs.get("retry_of") not in interrupted
             or (t.user_attrs.get("reference") and _queued_point(t) in finished_refs)]
    if wrong:
        problems.append(f"trials WAITING that are no re-queued interrupted point, or a finished reference: {wrong}")
    if not trials <= len(done) <= trials + in_flight - 1:
        problems.append(f"{len(done)} finished trials for --trials {trials}")
    refs = [(t.user_attrs["point"]["mbs"], t.user_attrs["point"]["recompute"]) for t in done
            if t.user_attrs.get("reference")]
    if sorted(refs) != sorted({(m, r) for m in (1, 2) for r in (False, True)}):
        problems.append(f"reference designs finished {sorted(refs)} (each of 4 expected once)")
    client = MlflowClient(driver_url(stores.tracking_uri(work)))
    exp = client.get_experiment_by_name(stores.name)
    runs = client.search_runs([exp.experiment_id], max_results=50000)
    running = [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    if running:
        problems.append(f"MLflow runs left RUNNING: {running}")
    trial_runs = [r for r in runs if "optuna.trial_number" in r.data.tags]
    numbers = sorted(int(r.data.tags["optuna.trial_number"]) for r in trial_runs
                     if r.info.status in ("FINISHED", "FAILED"))
    if numbers != sorted(t.number for t in done):
        missing = sorted({t.number for t in done} - set(numbers))
        extra = sorted(n for n in set(numbers) if numbers.count(n) > 1 or n not in {t.number for t in done})
        problems.append(f"MLflow trial runs do not match the finished trials: missing {missing}, extra {extra}")
    best = (summary.get("best") or {}).get("score")
    ref_best = (reference.get("best") or {}).get("score")
    if best is None or best != ref_best or abs(best - best_of_space()) > 1e-6 * best:
        problems.append(f"best {best} != uninterrupted best {ref_best} (space best {best_of_space()})")
    spools = list((work / "tmp").glob("phaze-spool-*"))
    if spools:
        problems.append(f"spool folders left: {[p.name for p in spools]}")
    from phaze_opt.runs.tracking import _local_dir

    no_artifact = sorted(int(r.data.tags["optuna.trial_number"]) for r in trial_runs
                         if r.info.status == "FINISHED" and not (_local_dir(r.info.artifact_uri) / "placement.json").is_file())
    return {
        "optuna_trials": len(all_trials), "finished_trials": len(done),
        "interrupted_trials": sum(1 for t in all_trials if t.user_attrs.get("interrupted")),
        "requeued_trials": sum(1 for t in all_trials if t.user_attrs.get("retry_of") is not None),
        "mlflow_trial_runs": len(numbers), "mlflow_parent_runs": len(runs) - len(trial_runs),
        "killed_parent_runs": sum(1 for r in runs if "optuna.trial_number" not in r.data.tags and r.info.status == "KILLED"),
        "reconciled_runs": sum(1 for r in trial_runs if r.data.tags.get("reconciled") == "true"),
        "runs_without_placement": len(no_artifact),
        "running_runs": len(running), "open_trials": len(open_trials), "queued_trials": len(queued),
        "best": best, "uninterrupted_best": ref_best, "problems": problems,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--trials", type=int, default=None, help="default 100 (--postgres 150)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None)
    p.add_argument("--storm", type=int, default=0, help="instead of kills: this many clean stops (signal storm)")
    p.add_argument("--postgres", action="store_true",
                   help="kill --processes studies sharing one study on a throwaway PostgreSQL server (default 150 trials)")
    p.add_argument("--processes", type=int, default=3, help="with --postgres or --storage: the study processes")
    p.add_argument("--storage", default=None, help="as --postgres, on this PostgreSQL database (Optuna)")
    p.add_argument("--tracking-uri", default=None, help="as --postgres, on this PostgreSQL database (MLflow)")
    p.add_argument("--trial-s", type=float, default=CROWD_TRIAL_S, help="with --postgres or --storage: seconds a trial takes")
    args = p.parse_args(argv)
    if args.postgres or args.storage or args.tracking_uri:
        counts = crowd(args.kills, args.trials or 150, args.processes, args.workers, args.seed,
                       Path(args.dir) if args.dir else None, args.storage, args.tracking_uri, args.trial_s)
    elif args.storm:
        counts = storm(args.storm, args.workers, args.trials or 100, args.seed, Path(args.dir) if args.dir else None)
    else:
        counts = run(args.kills, args.trials or 100, args.workers, args.seed, Path(args.dir) if args.dir else None)
    print(json.dumps(counts, indent=1))
    return 1 if counts["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
