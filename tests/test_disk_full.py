"""A full disk during a study: one line naming the path and the space it needs, nothing half-written.

The disk is filled by stand-ins that raise what the system raises: `OSError(ENOSPC)` from a file
write after part of it went out, SQLite's "database or disk is full" from a storage write.
"""

import errno
import json
import os
import pickle
import sqlite3
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from phaze_opt import cli, search
from phaze_opt.runs import disk
from phaze_opt.search.session import WorkerSpec, finished_trials
from test_study_fakes import backend, mlflow_uri


class _Filling:
    """A file on a disk with `room` bytes left: a write past it writes what fits, then fails."""

    def __init__(self, f, disk_):
        self.f, self.disk = f, disk_

    def write(self, data):
        fits = data[:max(0, self.disk.room)]
        self.f.write(fits)
        self.f.flush()
        self.disk.room -= len(data)
        if len(fits) < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return len(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class FullOs:
    """`os` as `runs.disk` sees it, on a disk with `room` bytes left."""

    def __init__(self, room: int):
        self.room = room

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, mode="r", *args, **kw):
        return _Filling(os.fdopen(fd, mode, *args, **kw), self)


def leftovers(root: Path) -> list[str]:
    return sorted(str(p) for p in root.rglob("*") if p.name.endswith((".partial", ".tmp")) or ".building-" in p.name)


def test_a_refused_write_leaves_no_file_and_says_where_and_how_much(tmp_path, monkeypatch):
    target = tmp_path / "out" / "summary.json"
    monkeypatch.setattr(disk, "os", FullOs(room=10))
    with pytest.raises(disk.DiskFull) as info:
        disk.write_whole(target, "x" * 5000)
    assert str(target) in str(info.value) and "4.9 KiB" in str(info.value)
    assert "\n" not in str(info.value)
    assert not target.exists() and leftovers(tmp_path) == []
    target.write_text("the last good one")
    with pytest.raises(disk.DiskFull):
        disk.write_whole(target, "y" * 5000)
    assert target.read_text() == "the last good one"  # an old file is kept whole, never half-replaced


def test_a_workers_full_disk_reaches_the_parent_whole_and_its_spool_has_no_part(tmp_path, monkeypatch):
    spec = WorkerSpec(config=None, backend=None, storage_url="", study_name="s", baselines={}, clock_start=0.0,
                      offset_s=0.0, spool_dir=str(tmp_path))
    monkeypatch.setattr(disk, "os", FullOs(room=3))
    with pytest.raises(disk.DiskFull) as info:
        spec.spool(7, {"placement": list(range(100))})
    assert leftovers(tmp_path) == [] and not (tmp_path / "7.json").exists()
    again = pickle.loads(pickle.dumps(info.value))  # as a worker's error crosses to the parent
    assert isinstance(again, disk.DiskFull) and str(again) == str(info.value)


def test_is_full_sees_a_database_full_error_under_its_wrappers():
    inner = sqlite3.OperationalError("database or disk is full")
    try:
        try:
            raise inner
        except sqlite3.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc
    except optuna.exceptions.StorageInternalError as outer:
        assert disk.is_full(outer)
    assert not disk.is_full(ValueError("solver exploded"))
    assert disk.is_full(OSError(errno.ENOSPC, "No space left on device"))


def _study_cli(monkeypatch, capsys, argv) -> tuple[int, str]:
    real = search.run_study
    monkeypatch.setattr(search, "run_study", lambda cfg, b=None: real(cfg, backend()))
    rc = cli.main(["study", "--model", "m-small", "--space", "fake", "--no-progress", "--json", *argv])
    return rc, capsys.readouterr().err


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_full_storage_during_the_trials_is_one_line_and_the_study_resumes(tmp_path, monkeypatch, capsys):
    db = tmp_path / "studies" / "full.db"
    argv = ["--trials", "16", "--study-name", "full", "--output-dir", str(tmp_path / "studies"),
            "--tracking-uri", mlflow_uri(tmp_path)]
    real = optuna.storages.RDBStorage.set_trial_user_attr
    calls = []

    def filling(self, *args, **kw):  # the 40th attribute write finds the disk full, and every one after it
        calls.append(1)
        if len(calls) >= 40:
            raise sqlite3.OperationalError("database or disk is full")
        return real(self, *args, **kw)

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_user_attr", filling)
    rc, err = _study_cli(monkeypatch, capsys, argv)
    assert rc == 1, err
    assert "Traceback" not in err and len(_errors(err)) == 1, err
    line = _errors(err)[0]
    assert str(db) in line and "7.8 MiB" in line and "run the same command again" in line
    assert leftovers(tmp_path) == []
    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_user_attr", real)  # room again
    rc, err = _study_cli(monkeypatch, capsys, argv)
    assert rc == 0, err
    trials = optuna.load_study(study_name="full", storage=f"sqlite:///{db}").get_trials()
    assert len(finished_trials(trials)) == 16
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_a_full_disk_for_the_summary_is_one_line_and_leaves_no_part(tmp_path, monkeypatch, capsys):
    out = tmp_path / "studies"
    argv = ["--trials", "6", "--study-name", "sum", "--output-dir", str(out), "--tracking-uri", "off"]
    monkeypatch.setattr(disk, "os", FullOs(room=100))  # the summary is the study's only file written here
    rc, err = _study_cli(monkeypatch, capsys, argv)
    assert rc == 1 and "Traceback" not in err and len(_errors(err)) == 1, err
    assert str(out / "sum-summary.json") in _errors(err)[0]
    assert not (out / "sum-summary.json").exists() and leftovers(tmp_path) == []
    monkeypatch.setattr(disk, "os", os)
    rc, err = _study_cli(monkeypatch, capsys, [*argv[:1], "7", *argv[2:]])
    assert rc == 0, err
    assert json.loads((out / "sum-summary.json").read_text())["trials"]["finished"] == 7


def test_a_full_tracking_store_at_start_is_one_line(tmp_path, monkeypatch, capsys):
    from phaze_opt.runs import tracking

    def full(uri):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(tracking, "_open_store", full)  # building a new MLflow database finds the disk full
    uri = f"sqlite:///{tmp_path / 'ml' / 'mlflow.db'}"
    rc, err = _study_cli(monkeypatch, capsys, ["--trials", "4", "--study-name", "t", "--output-dir",
                                               str(tmp_path / "studies"), "--tracking-uri", uri])
    assert rc == 1 and "Traceback" not in err and len(_errors(err)) == 1, err
    assert str(tracking.sqlite_path(uri)) in _errors(err)[0]
    assert leftovers(tmp_path) == []


def test_a_file_size_limit_hit_mid_study_is_one_line_and_the_study_resumes(tmp_path):
    """`ulimit -f`: Python ignores SIGXFSZ, so SQLite's write to its log fails (EFBIG, "disk I/O
    error") in a worker: 117 lines and 6 tracebacks ending in Optuna's "exceeding max length"."""
    import resource
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    cmd = [sys.executable, str(here / "fault_study.py"), "--model", "m-small", "--space", "fake", "--trials", "200",
           "--workers", "2", "--study-name", "capped", "--output-dir", str(tmp_path / "studies"),
           "--tracking-uri", "off", "--no-progress"]
    env = {**os.environ, "FAULT_TRIAL_S": "0.02", "PYTHONPATH": os.pathsep.join(
        [str(here.parent), os.environ.get("PYTHONPATH", "")])}

    def capped():
        resource.setrlimit(resource.RLIMIT_FSIZE, (400 * 1024, resource.RLIM_INFINITY))

    proc = subprocess.run(cmd, env=env, preexec_fn=capped, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("trial ")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(lines) == 1 and "file-size limit (ulimit -f" in lines[0] and "capped.db" in lines[0], proc.stderr[-3000:]
    again = subprocess.run([*cmd[:7], "3", *cmd[8:]], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_background_thread_that_meets_a_full_disk_prints_nothing_but_other_errors_still_print():
    """Optuna's heartbeat thread meeting the file-size limit printed a 50-line traceback beside the
    study's one line; the thread's full-disk error is dropped, any other one still reaches the hook
    that prints it (a recording fake here)."""
    import errno
    import threading

    from phaze_opt.runs.disk import quiet_full_threads

    before = threading.excepthook
    seen = []
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        quiet_full_threads()

        def fail(exc):
            def run():
                raise exc
            t = threading.Thread(target=run)
            t.start()
            t.join()

        fail(OSError(errno.ENOSPC, "No space left on device"))
        assert seen == []
        bug = ValueError("a real bug")
        fail(bug)
        assert seen == [bug]
    finally:
        threading.excepthook = before
