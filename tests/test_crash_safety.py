"""Crash safety and concurrency: zombies, reconciliation, signals, start-up races, limits."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
from optuna.trial import TrialState

from phaze_opt.errors import PhazeError
from phaze_opt.search import branch_bound as bb
from phaze_opt.runs import locks, reconcile, signals
from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import finished_trials
from phaze_opt.search.setup import default_study_name, make_storage
from test_study_fakes import FakeSpace, backend, config, mlflow_uri

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def load(cfg):
    return optuna.load_study(study_name=default_study_name(cfg), storage=make_storage(cfg.storage))


def trial_runs(client, exp_id):
    runs = client.search_runs([exp_id], max_results=10000)
    return [r for r in runs if "optuna.trial_number" in r.data.tags], [r for r in runs if "optuna.trial_number" not in r.data.tags]


def test_a_running_trial_of_a_dead_process_is_failed_and_requeued_at_start(tmp_path):
    cfg = config(tmp_path, trials=5)
    run_study(cfg, backend())
    study = load(cfg)
    codec = SpaceCodec(FakeSpace().params)
    point = {"num_tc": 8, "tc_x": 8, "glb_mib": 2, "hbm_gib": 32, "mbs": 1, "recompute": False}
    study.enqueue_trial(codec.encode(point), user_attrs={"reference": "tpuv4"})
    with pytest.warns(UserWarning):
        zombie = study.ask()  # what a killed process leaves: RUNNING for ever (no heartbeat check ever runs)
    study._storage.set_trial_system_attr(zombie._trial_id, reconcile.OWNER_ATTR,
                                         {"host": reconcile.host(), "pid": dead_pid(), "start": None, "session": "x"})
    summary = run_study(config(tmp_path, trials=7), backend())
    trials = load(cfg).get_trials()
    assert trials[zombie.number].state == TrialState.FAIL and trials[zombie.number].user_attrs["interrupted"]
    retry = [t for t in trials if t.user_attrs.get("retry_of") == zombie.number]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and retry[0].user_attrs["reference"] == "tpuv4"
    assert retry[0].user_attrs["point"] == point
    assert len(finished_trials(trials)) == 7 and summary["trials"]["this_run"] == 2
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert any("left by a process that is gone" in n for n in summary["notes"])


def test_a_trial_of_a_live_process_is_left_alone(tmp_path):
    cfg = config(tmp_path, trials=3)
    run_study(cfg, backend())
    study = load(cfg)
    with pytest.warns(UserWarning):
        live = study.ask()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        study._storage.set_trial_system_attr(live._trial_id, reconcile.OWNER_ATTR,
                                             {"host": reconcile.host(), "pid": other.pid,
                                              "start": reconcile.proc_start(other.pid)})
        assert reconcile.fail_zombies(study) == []
        assert study.get_trials()[live.number].state == TrialState.RUNNING
    finally:
        other.kill()
        other.wait()
    assert reconcile.fail_zombies(study) == [live.number]


def test_mlflow_is_reconciled_with_the_study_at_start(tmp_path):
    from mlflow import MlflowClient

    uri = mlflow_uri(tmp_path)
    cfg = config(tmp_path, trials=8, tracking_uri=uri)
    first = run_study(cfg, backend())
    client = MlflowClient(uri)
    exp_id = first["mlflow"]["experiment_id"]
    children, parents = trial_runs(client, exp_id)
    # what a kill -9 leaves behind: runs never written, one cut mid-write, the parent RUNNING
    gone = {}
    for r in children[:3]:
        gone[int(r.data.tags["optuna.trial_number"])] = r
        client.delete_run(r.info.run_id)
    cut = children[3]
    client.set_terminated(cut.info.run_id, "RUNNING")
    client.create_run(exp_id, run_name="dup", tags={"optuna.trial_number": children[4].data.tags["optuna.trial_number"],
                                                     "mlflow.parentRunId": parents[0].info.run_id})
    client.set_terminated(parents[0].info.run_id, "RUNNING")
    client.set_tag(parents[0].info.run_id, reconcile.OWNER_TAG, f"{reconcile.host()}:{dead_pid()}:1")
    second = run_study(config(tmp_path, trials=10, tracking_uri=uri), backend())
    assert second["mlflow"]["experiment_id"] == exp_id
    children, parents = trial_runs(client, exp_id)
    numbers = sorted(int(r.data.tags["optuna.trial_number"]) for r in children)
    done = finished_trials(load(cfg).get_trials())
    assert numbers == sorted(t.number for t in done)  # one run per finished trial, none missing
    assert all(r.info.status in ("FINISHED", "FAILED") for r in children)
    assert {p.info.status for p in parents} == {"KILLED", "FINISHED"}
    relogged = [r for r in children if r.data.tags.get("reconciled") == "true"]
    assert {int(r.data.tags["optuna.trial_number"]) for r in relogged} >= set(gone)
    assert any("MLflow reconciled" in n for n in second["notes"])


def test_two_storages_with_one_study_name_get_two_experiments(tmp_path):
    uri = mlflow_uri(tmp_path)
    a = run_study(config(tmp_path, trials=3, tracking_uri=uri, study_name="same"), backend())
    b = run_study(config(tmp_path, trials=3, tracking_uri=uri, study_name="same",
                         storage=f"sqlite:///{tmp_path / 'other.db'}"), backend())
    assert a["mlflow"]["experiment"] == "same" and b["mlflow"]["experiment"].startswith("same [")
    assert a["mlflow"]["experiment_id"] != b["mlflow"]["experiment_id"]
    again = run_study(config(tmp_path, trials=4, tracking_uri=uri, study_name="same",
                             storage=f"sqlite:///{tmp_path / 'other.db'}"), backend())
    assert again["mlflow"]["experiment_id"] == b["mlflow"]["experiment_id"]


def _cli(tmp_path, *args, trials=30, workers=2, tracking=None):
    cmd = [sys.executable, str(HERE / "fault_study.py"), "--model", "m-small", "--space", "fake", "--trials",
           str(trials), "--workers", str(workers), "--study-name", "fault", "--output-dir", str(tmp_path / "studies"),
           "--tracking-uri", tracking or f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}", "--no-progress", "--json",
           *args]
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", TMPDIR=str(tmp_path / "tmp"), FAULT_TRIAL_S="0.03",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return cmd, env


def test_two_processes_stop_at_the_total_and_count_their_own(tmp_path):
    """Two processes (2 workers each) start at once on a fresh SQLite study and MLflow database."""
    from mlflow import MlflowClient

    cmd, env = _cli(tmp_path, trials=24)
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    summaries = [json.loads(o[0]) for o in outs]
    study = optuna.load_study(study_name="fault", storage=f"sqlite:///{tmp_path / 'studies' / 'fault.db'}")
    trials = study.get_trials()
    done = finished_trials(trials)
    assert 24 <= len(done) <= 24 + 3  # at most the trials in flight elsewhere when the total was reached
    assert sum(s["trials"]["this_run"] for s in summaries) == len(done)
    refs = sorted((t.user_attrs["point"]["mbs"], t.user_attrs["point"]["recompute"]) for t in done
                  if t.user_attrs.get("reference"))
    assert refs == [(1, False), (1, True), (2, False), (2, True)]  # each queued trial popped once
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    children, parents = trial_runs(client, client.get_experiment_by_name("fault").experiment_id)
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == sorted(t.number for t in done)
    assert len(parents) == 2 and {p.info.status for p in parents} == {"FINISHED"}
    assert not list((tmp_path / "tmp").glob("phaze-spool-*"))


def test_sigterm_stops_like_ctrl_c(tmp_path):
    from mlflow import MlflowClient

    cmd, env = _cli(tmp_path, trials=400)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    db = tmp_path / "studies" / "fault.db"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.3)
        if db.exists() and proc.poll() is None:
            try:
                n = len(finished_trials(optuna.load_study(study_name="fault", storage=f"sqlite:///{db}").get_trials()))
            except Exception:  # noqa: BLE001 - not created yet
                continue
            if n >= 6:
                break
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    trials = optuna.load_study(study_name="fault", storage=f"sqlite:///{db}").get_trials()
    done = finished_trials(trials)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    # interrupted trials are not counted as failures (no failure of the fake here has no result)
    assert all("result" in t.user_attrs for t in done if t.state == TrialState.FAIL)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    children, parents = trial_runs(client, client.get_experiment_by_name("fault").experiment_id)
    assert [p.info.status for p in parents] == ["KILLED"]
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == sorted(t.number for t in done)
    assert not list((tmp_path / "tmp").glob("phaze-spool-*"))


def test_ctrl_c_stops_a_single_worker_study_inside_highs_at_once(tmp_path):
    """--workers 1 evaluates in the parent, so the signal lands while HiGHS runs a MIP with a 300 s
    limit (`fault_study.hard_block`): the study still exits 130 within `STOP_LIMIT_S` of Ctrl-C, no
    traceback, its parent run KILLED, the trial marked interrupted and its point queued again, and
    the solve never returned a result."""
    from fault_injection import STOP_LIMIT_S
    from mlflow import MlflowClient

    cmd, env = _cli(tmp_path, trials=4, workers=1)
    log = tmp_path / "mip.log"
    env.update(FAULT_MIP_S="300", FAULT_MIP_LOG=str(log))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not (log.exists() and "mip-start" in log.read_text()):
        time.sleep(0.05)
    time.sleep(4.0)  # past the relaxation (0.5 s and its last LP) into the MIP itself
    assert proc.poll() is None
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the study did not stop within 120 s of Ctrl-C (it waited for HiGHS)")
    stop_s = time.monotonic() - sent
    assert proc.returncode == 130, err[-2000:]
    assert stop_s <= STOP_LIMIT_S, f"stopped {stop_s:.1f} s after Ctrl-C"
    assert "Traceback" not in err, err[-2000:]
    assert "mip-end" not in log.read_text()  # cut inside HiGHS: no schedule came back
    trials = optuna.load_study(study_name="fault", storage=f"sqlite:///{tmp_path / 'studies' / 'fault.db'}").get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    cut = [t for t in trials if t.user_attrs.get("interrupted")]
    assert len(cut) == 1 and not finished_trials(trials)
    queued = [t for t in trials if t.state == TrialState.WAITING and t.user_attrs.get("retry_of") is not None]
    assert [t.user_attrs["retry_of"] for t in queued] == [cut[0].number]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    children, parents = trial_runs(client, client.get_experiment_by_name("fault").experiment_id)
    assert [p.info.status for p in parents] == ["KILLED"] and children == []


def test_the_interrupt_a_library_logs_during_a_stop_is_not_printed():
    """SQLAlchemy's pool logs a KeyboardInterrupt that lands while it closes a connection, with its
    traceback, then re-raises it (seen in the signal storm: a SIGHUP during a 2-worker start-up).
    During a stop that record is dropped; an interrupt without a stop and any other error still print."""
    code = """
import logging
from phaze_opt import interrupt
interrupt.install()
log = logging.getLogger("sqlalchemy.pool.impl.QueuePool")
def logged(exc):
    try:
        raise exc
    except BaseException:
        log.error("Exception closing connection %r", 1, exc_info=True)
logged(KeyboardInterrupt("by the user"))
interrupt.request_stop("SIGHUP")
logged(KeyboardInterrupt("signal SIGHUP"))
logged(ValueError("disk I/O error"))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("Exception closing connection") == 2, out.stderr
    assert "KeyboardInterrupt: by the user" in out.stderr and "SIGHUP" not in out.stderr
    assert "ValueError: disk I/O error" in out.stderr


def test_native_modules_are_imported_where_a_signal_cannot_cut_them():
    """A SIGINT that landed while cryptography's PyO3 bindings built their types (MLflow's store, first
    open) became a Rust panic: exit 1 with a traceback instead of a stop (the signal storm, in CI). The
    CLI imports every PyO3 module first, in a region where a signal only records; an audit hook sees
    where each one's import began."""
    code = """
import sys
from phaze_opt import cli, interrupt
seen = {}
def hook(event, args):
    if event == "import" and args[0] in interrupt.PYO3_MODULES and args[0] not in seen:
        seen[args[0]] = interrupt._raising()
sys.addaudithook(hook)
try:
    cli.main(["arch", "--help"])
except SystemExit:
    pass
print(sorted(seen.items()))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    from phaze_opt import interrupt

    assert out.stdout.strip().splitlines()[-1] == str(sorted((name, False) for name in interrupt.PYO3_MODULES))


class PanicException(BaseException):
    """Stands in for `pyo3_runtime.PanicException` (what a cut PyO3 module set-up raises)."""


PanicException.__module__ = "pyo3_runtime"


@pytest.mark.parametrize("stopping", [True, False])
def test_a_panic_during_a_stop_is_the_stop_and_otherwise_an_error(monkeypatch, capsys, stopping):
    from phaze_opt import cli, interrupt
    from phaze_opt.commands import arch

    def run(args):
        if stopping:
            interrupt.request_stop("SIGINT")
        raise PanicException("failed to create type object")

    monkeypatch.setattr(arch, "run", run)
    try:
        if stopping:
            assert cli.main(["arch", "--arch", "tpuv4"]) == 130
            assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
        else:
            with pytest.raises(PanicException):
                cli.main(["arch", "--arch", "tpuv4"])
    finally:
        interrupt.reset()


def test_a_stop_requested_before_the_session_opens_stops_the_study(tmp_path, monkeypatch, capsys):
    """A signal recorded in the start-up before the study's session opens (a deferred region, or one
    a library swallowed) used to be forgotten when the session began: the study ran to its end and
    exited 0 (the signal storm, 3 of 90 stops with one worker)."""
    from phaze_opt import cli, interrupt, search
    from phaze_opt.search import sampled
    from test_study_fakes import backend as fake_backend

    real_search, real_held = search.run_study, sampled.held_trials

    def held_then_signal(*args, **kwargs):
        out = real_held(*args, **kwargs)
        interrupt.request_stop("SIGHUP")  # what the handler records in a deferred region
        return out

    monkeypatch.setattr(search, "run_study", lambda cfg, b=None: real_search(cfg, fake_backend()))
    monkeypatch.setattr(sampled, "held_trials", held_then_signal)
    try:
        rc = cli.main(["study", "--model", "m-small", "--space", "fake", "--no-progress", "--json", "--trials", "6",
                       "--study-name", "early", "--output-dir", str(tmp_path / "studies"), "--tracking-uri", "off"])
    finally:
        interrupt.reset()
    assert rc == 130 and capsys.readouterr().err.strip().splitlines()[-1] == "interrupted"
    trials = optuna.load_study(study_name="early", storage=f"sqlite:///{tmp_path / 'studies' / 'early.db'}").get_trials()
    assert not finished_trials(trials)


def _stopped_after(delay_s: float, solve):
    """Run `solve()` as an evaluation (interruptible) with a stop requested after `delay_s` from a
    thread, as a worker's parent watch does: no signal reaches the solver, only the flag."""
    import threading

    from phaze_opt import interrupt

    timer = threading.Timer(delay_s, interrupt.request_stop, args=("test",))
    timer.start()
    try:
        with interrupt.interruptible():
            return solve()
    finally:
        timer.cancel()
        interrupt.reset()


def test_a_stop_request_cuts_the_highs_mip():
    """Without the poll HiGHS runs its MIP to the 60 s limit and returns a time_limit result."""
    from fault_study import solve_hard_block

    with pytest.raises(KeyboardInterrupt):
        _stopped_after(3.0, lambda: solve_hard_block(60.0))


def test_a_stop_request_cuts_the_schedule_solver_and_caches_nothing(tmp_path, monkeypatch):
    from fault_study import hard_block
    from phaze_opt.solve.schedule import cache
    from phaze_opt.solve.schedule.solver import solve_schedule

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    problem = hard_block()
    # The whole schedule solver proves this block optimal in about 1.6 s here, so a stop on a timer
    # (0.3 s once, 2 s before that) misses the solve on a machine fast enough. The stop is requested
    # instead at HiGHS's first interrupt callback (the relaxation, after a first search given no
    # time), which lands it inside the solve on a machine of any speed.
    from phaze_opt import interrupt
    from phaze_opt.solve.schedule import solver as schedule_solver

    monkeypatch.setattr(schedule_solver, "SEARCH_FIRST_S", 0.0)
    asked = []

    def poll(self):
        if not asked:
            asked.append(True)
            interrupt.request_stop("test")
        return self.flag[0] != 0

    monkeypatch.setattr(interrupt.Poll, "__call__", poll)
    with pytest.raises(KeyboardInterrupt):
        _stopped_after(600.0, lambda: solve_schedule(problem, time_limit_s=60.0))
    assert asked  # the stop came from inside HiGHS
    assert cache.get(cache.problem_key(problem), "highs", 60.0, problem=problem) is None
    assert not [f for f in (tmp_path / "cache").rglob("*") if f.is_file()]


def _wait_group_gone(pgid: int, limit_s: float = 30.0) -> float:
    """Seconds until no process of the group `pgid` is left (killed and a test failure after `limit_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return time.monotonic() - start
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail(f"the workers outlived their parent by {limit_s:.0f} s")


def _artifact_missing(client, runs) -> list[int]:
    from phaze_opt.runs.tracking import _local_dir

    return sorted(int(r.data.tags["optuna.trial_number"]) for r in runs
                  if not (_local_dir(r.info.artifact_uri) / "placement.json").is_file())


def test_workers_of_a_killed_parent_exit_and_their_spool_is_logged_at_the_next_start(tmp_path):
    from mlflow import MlflowClient

    cmd, env = _cli(tmp_path, trials=400)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    spools = tmp_path / "tmp"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(spools.glob("phaze-spool-*/*.json"))) < 3:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    _wait_group_gone(proc.pid)
    assert list(spools.glob("phaze-spool-*/*.json"))  # kept for the next start: the parent logged none of it
    db = tmp_path / "studies" / "fault.db"
    done = len(finished_trials(optuna.load_study(study_name="fault", storage=f"sqlite:///{db}").get_trials()))
    # The next start (one more trial: a study asked for no more than it holds opens nothing) reconciles
    # first, logging what the dead parent's workers spooled.
    cmd, env = _cli(tmp_path, trials=done + 1)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    children, _ = trial_runs(client, client.get_experiment_by_name("fault").experiment_id)
    trials = finished_trials(optuna.load_study(study_name="fault", storage=f"sqlite:///{db}").get_trials())
    assert sorted(int(r.data.tags["optuna.trial_number"]) for r in children) == sorted(t.number for t in trials)
    assert _artifact_missing(client, children) == []
    assert not list(spools.glob("phaze-spool-*"))


def _spawned_workers(pid: int) -> list[int]:
    """The spawned worker processes of process `pid` (not its resource tracker)."""
    out = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = children.read_text().split()
        except OSError:
            continue
        for kid in kids:
            try:
                if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                    out.append(int(kid))
            except OSError:
                continue
    return out


@pytest.mark.parametrize("nth", [1, 2])
def test_workers_exit_when_the_parent_dies_as_they_start(tmp_path, nth):
    """The parent is killed the moment its nth worker process exists, before that worker could record
    its parent: every worker still exits within seconds."""
    cmd, env = _cli(tmp_path, trials=400)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and len(_spawned_workers(proc.pid)) < nth:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _wait_group_gone(proc.pid) < 30


def test_stale_spools_of_dead_parents_are_removed(tmp_path):
    stale = tmp_path / f"phaze-spool-{dead_pid()}-abc"
    mine = tmp_path / f"phaze-spool-{os.getpid()}-abc"
    old = tmp_path / "phaze-spool-xyz"
    for d in (stale, mine, old):
        d.mkdir()
    assert signals.clean_stale_spools(str(tmp_path)) == 1
    assert not stale.exists() and mine.exists() and old.exists()


def test_mlflow_database_is_built_aside(tmp_path):
    from phaze_opt.runs.tracking import MlflowTracker

    db = tmp_path / "ml" / "mlflow.db"
    (db.parent).mkdir()
    (db.parent / ".mlflow.db.building-1").write_text("half a database")  # a build whose process was killed
    MlflowTracker.prepare(f"sqlite:///{db}", "e")
    assert db.exists() and not list(db.parent.glob(".mlflow.db.building-*"))


def test_schema_creation_retries_a_lost_race(tmp_path):
    calls = []

    def create():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError('(psycopg2.errors.UniqueViolation) duplicate key value violates unique constraint '
                               '"pg_type_typname_nsp_index"')
        return "storage"

    assert locks.create_schema(create, f"sqlite:///{tmp_path / 'x.db'}") == "storage" and len(calls) == 3
    with pytest.raises(ValueError):
        locks.create_schema(lambda: (_ for _ in ()).throw(ValueError("bad url")), f"sqlite:///{tmp_path / 'x.db'}")


@pytest.mark.parametrize("changes, message", [
    ({"seed": 99999999999999999999}, "--seed: at most"),
    ({"study_name": "../../x"}, "--study-name"),
    ({"study_name": ".hidden"}, "--study-name"),
])
def test_out_of_range_inputs_are_one_line_errors(tmp_path, changes, message):
    with pytest.raises(PhazeError, match=message):
        run_study(config(tmp_path, **changes), backend())


def test_an_unrelated_sqlite_file_is_refused(tmp_path):
    import sqlite3

    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("create table foo (a int)")
    con.commit()
    con.close()
    with pytest.raises(PhazeError, match="another program's tables"):
        run_study(config(tmp_path, storage=f"sqlite:///{path}"), backend())
    con = sqlite3.connect(path)
    assert {r[0] for r in con.execute("select name from sqlite_master where type='table'")} == {"foo"}  # untouched
    con.close()


def test_an_unreachable_tracking_server_fails_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(PhazeError, match="no MLflow server answers"):
        run_study(config(tmp_path, tracking_uri="http://127.0.0.1:9"), backend())
    assert time.monotonic() - start < 60  # not minutes of retries (no tighter bound on a busy machine)


def test_points_file_marks_every_evaluated_point_of_a_resumed_sweep():
    grid = SimpleNamespace(archs=[{"num_tc": 1, "tc_x": 8}, {"num_tc": 2, "tc_x": 8}], hbms=[16, 32], mbss=[1, 2],
                           rcs=[{"recompute": False}, {"recompute": True}])
    cells = bb.Cells(2)

    def trial(point, value, state=TrialState.COMPLETE, feasible=True):
        return SimpleNamespace(user_attrs={"point": point, "result": {}}, state=state,
                               values=None if value is None else [value],
                               constraints={"area": -1.0 if feasible else 1.0})

    trials = [trial({"num_tc": 2, "tc_x": 8, "hbm_gib": 32, "mbs": 2, "recompute": True}, 5.0),
              trial({"num_tc": 1, "tc_x": 8, "hbm_gib": 16, "mbs": 1, "recompute": False}, 3.0, feasible=False),
              trial({"num_tc": 1, "tc_x": 8, "hbm_gib": 32, "mbs": 1, "recompute": False}, None, TrialState.FAIL)]
    assert bb.mark_evaluated(grid, cells, trials) == 3
    status = np.zeros((2, 4, 2), dtype=np.int8)  # the cells as one array [mbs, row, recipe]
    score = np.full((2, 4, 2), np.nan)
    for (m, row), (st, _, sc) in cells.items():
        status[m, row], score[m, row] = st, sc
    assert status[1, 3, 1] == 2 and score[1, 3, 1] == 5.0
    assert status[0, 0, 0] == 2 and score[0, 0, 0] == 0.0
    assert status[0, 1, 0] == 2 and score[0, 1, 0] == 0.0
    assert int((status == 2).sum()) == 3
    assert cells.unsure == {(0, 1, 0)}  # the failed trial: its throughput is not known


def test_a_tracking_store_that_stops_answering_holds_the_end_for_a_bounded_time(tmp_path, monkeypatch, capsys):
    import threading

    from phaze_opt.runs import tracking

    tracker = tracking.MlflowTracker(mlflow_uri(tmp_path), "0", "run", context={})
    monkeypatch.setattr(tracking, "FLUSH_LIMIT_S", 0.5)
    hung = threading.Event()
    tracker._submit(lambda: hung.wait(120))  # a write the store never answers
    start = time.monotonic()
    tracker.close("FINISHED")
    assert time.monotonic() - start < 60
    assert "took no writes" in capsys.readouterr().err
    hung.set()


def test_an_unreachable_database_tracking_store_fails_at_once(tmp_path):
    start = time.monotonic()
    with pytest.raises(PhazeError, match="no database server answers"):
        run_study(config(tmp_path, tracking_uri="postgresql://u@127.0.0.1:9/db"), backend())
    assert time.monotonic() - start < 60  # not MLflow's minutes of retries


class _Server:
    """A tracking server on 127.0.0.1 whose API fails: it answers `status`, or hangs (status None)."""

    def __init__(self, status):
        import http.server
        import threading

        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server name
                if self.path == "/health":  # up, by the old probe's measure
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(b"OK")
                    return
                if status is None:
                    outer.release.wait(60)
                    return
                self.send_response(status)
                self.end_headers()

            do_POST = do_GET

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("status", [500, None], ids=["answers-500", "hangs"])
def test_a_tracking_server_whose_api_fails_stops_the_start_at_once_and_changes_nothing(tmp_path, monkeypatch, status):
    from phaze_opt.runs import locks as locks_module

    monkeypatch.setattr(locks_module, "PROBE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(locks_module.probe_tracking_uri, "__defaults__", (1.0,))
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a broken probe fails fast here, not in minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    server = _Server(status)
    try:
        cfg = config(tmp_path, trials=3, tracking_uri=server.uri)
        start = time.monotonic()
        with pytest.raises(PhazeError, match="500|within 1 s"):
            run_study(cfg, backend())
        assert time.monotonic() - start < 30
    finally:
        server.close()
    assert not (tmp_path / "studies" / "optuna.db").exists()  # no study storage created


@pytest.mark.parametrize("where", ["mlflow-store", "after-the-parent-run"])
def test_a_start_that_fails_late_changes_nothing(tmp_path, monkeypatch, where):
    """The start fails after the Optuna storage was opened (opening the MLflow store), or after the
    parent run was created (reconciling MLflow): no new trial, run or workers_per_run entry."""
    from mlflow import MlflowClient

    from phaze_opt.runs import tracking
    from phaze_opt.search import session as session_module

    uri = mlflow_uri(tmp_path)
    first = run_study(config(tmp_path, trials=3, tracking_uri=uri), backend())
    client = MlflowClient(uri)
    exp_id = first["mlflow"]["experiment_id"]
    before_runs = sorted(r.info.run_id for r in client.search_runs([exp_id], max_results=1000))
    before = load(config(tmp_path))
    before_trials, before_workers = len(before.get_trials()), before.user_attrs["workers_per_run"]

    def boom(*args, **kwargs):
        raise PhazeError("the store broke")

    if where == "mlflow-store":
        monkeypatch.setattr(tracking.MlflowTracker, "prepare", staticmethod(boom))
    else:
        monkeypatch.setattr(session_module.reconcile, "reconcile_runs", boom)
    with pytest.raises(PhazeError, match="the store broke"):
        run_study(config(tmp_path, trials=6, tracking_uri=uri, workers=2), backend())
    after = load(config(tmp_path))
    assert len(after.get_trials()) == before_trials
    assert after.user_attrs["workers_per_run"] == before_workers == [1]
    assert sorted(r.info.run_id for r in client.search_runs([exp_id], max_results=1000)) == before_runs


def _stalled_tracker(tmp_path, monkeypatch, limit_s):
    """A tracker whose store never answers the write in flight (an HTTP server that died: MLflow's
    client retries each request for minutes)."""
    import threading

    from phaze_opt.runs import tracking

    tracker = tracking.MlflowTracker(mlflow_uri(tmp_path), "0", "run", context={})
    monkeypatch.setattr(tracking, "FLUSH_LIMIT_S", limit_s)
    hung = threading.Event()
    tracker._submit(lambda: hung.wait(120))
    return tracker, hung


def _returns_within(fn, seconds):
    import threading

    done = threading.Event()
    thread = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
    start = time.monotonic()
    thread.start()
    assert done.wait(seconds), f"still waiting after {seconds} s"
    return time.monotonic() - start


def test_every_flush_of_a_dead_tracking_store_is_bounded_and_warns_once(tmp_path, monkeypatch, capsys):
    """The pool's last drain and the summary flush without a timeout: a tracking server killed
    mid-study held the study after its trials for good. Each wait is bounded; after the first runs
    out the store is given up, so the writes that follow and the close neither wait nor block."""
    tracker, hung = _stalled_tracker(tmp_path, monkeypatch, 0.5)
    try:
        assert _returns_within(tracker.flush, 20) < 10
        tracker.log_parent(metrics={"trials": 3})  # the summary's writes, after the store was given up
        assert _returns_within(tracker.flush, 5) < 1
        assert _returns_within(lambda: tracker.close("FINISHED"), 5) < 1
        assert capsys.readouterr().err.count("took no writes") == 1
    finally:
        hung.set()


def test_a_stop_cuts_the_wait_for_a_dead_tracking_store(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the end waits for a dead tracking server is answered within seconds, not after
    the full wait."""
    from phaze_opt import interrupt
    from phaze_opt.runs import tracking

    tracker, hung = _stalled_tracker(tmp_path, monkeypatch, 600)
    monkeypatch.setattr(tracking, "STOP_FLUSH_S", 0.5, raising=False)
    interrupt.request_stop("SIGINT")
    try:
        assert _returns_within(tracker.flush, 20) < 10
        assert "took no writes" in capsys.readouterr().err
    finally:
        interrupt.reset()
        hung.set()


def test_a_port_that_answers_but_is_no_database_server_is_one_line_within_seconds(tmp_path):
    """Another program on the database's port takes the connection and never answers the driver:
    it waited minutes (123 s), for the storage and the tracking URI alike."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(8)], daemon=True).start()
    url = f"postgresql://u@127.0.0.1:{listener.getsockname()[1]}/db"
    try:
        for option in ("storage", "tracking_uri"):
            start = time.monotonic()
            with pytest.raises(PhazeError, match=f"--{option.replace('_', '-')} .*(did not log in|timeout expired)"):
                run_study(config(tmp_path, trials=3, **{option: url}), backend())
            assert time.monotonic() - start < 10
    finally:
        listener.close()


def test_a_signal_inside_the_unraisable_hook_is_not_printed_and_still_stops():
    """A signal that lands while the interpreter reports an error it cannot raise (a finaliser's)
    raised its KeyboardInterrupt inside our hook: "Exception ignored in sys.unraisablehook" and a
    7-line traceback on a stop (1 of 40). It is delivered again once the hook has returned."""
    code = """
import os, signal, sys, time
from phaze_opt import interrupt
def reporting(unraisable):  # the interpreter's report, with a signal arriving while it runs
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100000):
        pass
    print("reported", unraisable.exc_type.__name__, file=sys.stderr)
sys.unraisablehook = reporting
interrupt.install()
class Finalised:
    def __del__(self):
        raise ValueError("in a finaliser")
Finalised()
try:
    time.sleep(10)
    print("not stopped")
except KeyboardInterrupt:
    print("stopped")
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "unraisablehook" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "reported ValueError" in out.stderr and out.stdout.strip() == "stopped", (out.stdout, out.stderr)
    assert time.monotonic() - start < 60
