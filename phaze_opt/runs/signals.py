"""Signals and the lifetime of worker processes.

- Every process routes SIGINT, SIGTERM and SIGHUP to one stop flag (`phaze_opt.interrupt`): an
  evaluation is cut at once, bookkeeping never is, and each trial loop stops at its next safe point.
  The parent then asks its workers to stop, waits for them (at most `STOP_GRACE_S`, then kills the
  ones stuck in a solver: their trials are failed and queued again at once, see
  `reconcile.fail_zombies`), logs what they finished and closes its MLflow run as KILLED.
- A worker process (`worker_started`, the pool's initializer) is handed its parent's pid and start
  time by the parent (`worker_args`), so a parent that died before the worker even started is
  recognised (`os.getppid()` would already name init). It starts with the stop signals blocked (the
  parent spawns it inside `interrupt.blocked`), installs its handlers, then unblocks them, so no
  signal reaches it before it can handle one. It watches its parent: when the parent dies (even by
  SIGKILL) the worker stops its trial and exits within `WATCH_S` plus, when a solver keeps it busy,
  `ORPHAN_GRACE_S` (its running trial is then failed and queued again by the next start).
  An orphan leaves its spool folder in place: the next start logs the trials it holds
  (`reconcile.reconcile_runs`) and then removes it (`clean_stale_spools`).
- Spool folders are named `phaze-spool-<parent pid>-<session>-*`; `clean_stale_spools` removes those
  of parents that are gone once their session's trials are logged.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Collection

from .. import interrupt
from .processes import pid_alive, proc_start

WATCH_S = 0.5
ORPHAN_GRACE_S = 10.0
STOP_GRACE_S = 5.0  # the parent's wait for its workers after a stop request, then they are killed
SPOOL_PREFIX = "phaze-spool-"
STALE_SPOOL_S = 7 * 24 * 3600.0  # a spool of a dead parent no start of its study came back for


def handle_termination() -> Callable[[], None]:
    """This process (a parent) routes SIGINT, SIGTERM and SIGHUP to the stop flag; returns a function
    restoring the previous handlers."""
    return interrupt.install(raise_outside=True)


# -- worker processes ------------------------------------------------------------------------------

_WORKER: dict = {}


def _set_pdeathsig() -> None:
    """Linux: the kernel sends SIGTERM when the parent dies (the watch thread covers the rest)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort
        pass


def worker_args() -> tuple:
    """The initializer arguments of a worker pool: this (the parent) process's pid and start time."""
    return (os.getpid(), proc_start(os.getpid()))


def worker_started(parent: int | None = None, parent_start: int | None = None, spool_dir: str | None = None) -> None:
    """Called first in a worker process (the pool's initializer, with `worker_args()`; again by each
    task with its spool folder): signal handling and the parent watch (see the module docstring).
    A worker whose parent is already gone exits here. Idempotent."""
    if parent is not None:
        _WORKER.setdefault("parent", (int(parent), parent_start))
    if spool_dir is not None:
        _WORKER["spool"] = spool_dir
    if threading.current_thread() is threading.main_thread():
        interrupt.install(raise_outside=False)  # a worker's loops check the flag; evaluations are cut
        _set_pdeathsig()
        interrupt.unblock()  # the parent spawned it with the stop signals held pending
    if orphaned():
        os._exit(0)  # the parent died before this worker could watch it: nothing was started
    if _WORKER.get("watch") is None:
        watch = threading.Thread(target=_watch_parent, name="parent-watch", daemon=True)
        _WORKER["watch"] = watch
        watch.start()


def orphaned() -> bool:
    parent = _WORKER.get("parent")
    if parent is None:
        return False
    pid, start = parent
    return os.getppid() != pid or not pid_alive(pid, start)


def _watch_parent() -> None:
    while not orphaned():
        time.sleep(WATCH_S)
    interrupt.request_stop("parent gone")
    if not _WORKER.get("busy"):
        os._exit(0)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # cuts the evaluation in the main thread, if one runs
    except OSError:  # pragma: no cover
        pass
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while _WORKER.get("busy") and time.monotonic() < deadline:
        time.sleep(0.05)
    os._exit(1 if _WORKER.get("busy") else 0)


@contextmanager
def worker_task(spool_dir: str | None = None):
    """Around one worker task: its spool folder, and an orphan's exit at its end (instead of waiting
    for tasks from a parent that is gone; the spool stays for the next start)."""
    worker_started(spool_dir=spool_dir)
    _WORKER["busy"] = True
    try:
        yield
    finally:
        _WORKER["busy"] = False
        if orphaned():
            os._exit(0)


# -- the parent's side -----------------------------------------------------------------------------

def interrupt_workers(pool) -> None:
    """Ask every live process of a ProcessPoolExecutor to stop (SIGTERM: its stop flag)."""
    for proc in _processes(pool):
        try:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        except (OSError, ValueError, AttributeError):
            pass


def _processes(pool) -> list:
    return list((getattr(pool, "_processes", None) or {}).values())


def stop_pool(pool, grace_s: float = STOP_GRACE_S) -> None:
    """Stop a pool's workers: ask them (`interrupt_workers`), let them end their trial for `grace_s`,
    kill those still busy (a solver that does not return), then shut the pool down."""
    procs = _processes(pool)  # the pool forgets them at shutdown
    manager = getattr(pool, "_executor_manager_thread", None)
    interrupt_workers(pool)
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.join(max(0.0, deadline - time.monotonic()))
        except (AssertionError, ValueError, AttributeError):  # not started, or already reaped
            continue
    for proc in procs:
        try:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        except (OSError, ValueError, AttributeError, AssertionError):
            pass
    if manager is not None:
        manager.join(5.0)  # results of the last tasks handed over


@contextmanager
def stop_workers_on_exit(pool, drain: Callable[[], None] | None = None):
    """Around a pool's loop: on an exception (a stop request is one), stop the workers (`stop_pool`);
    always `drain` (log what they finished) before leaving."""
    try:
        yield pool
    except BaseException:
        with interrupt.deferred():
            try:
                stop_pool(pool)
            finally:
                if drain is not None:
                    _quietly(drain)
        raise
    if drain is not None:
        drain()


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - keep the error that stopped the loop
        pass


def spool_prefix(session: str | None = None) -> str:
    """The name of this process's spool folders (the parent's pid and its invocation's session)."""
    return f"{SPOOL_PREFIX}{os.getpid()}-" + (f"{session}-" if session else "")


def spool_owner(path: Path) -> tuple[int, str | None] | None:
    """(parent pid, session) of a spool folder, from its name; None for another name."""
    parts = path.name[len(SPOOL_PREFIX):].split("-")
    if not parts or not parts[0].isdigit():
        return None
    session = parts[1] if len(parts) >= 3 else None
    return int(parts[0]), session


def spool_dirs(root: str | None = None) -> list[Path]:
    base = Path(root or tempfile.gettempdir())
    try:
        return [p for p in base.glob(f"{SPOOL_PREFIX}*") if p.is_dir()]
    except OSError:
        return []


def spooled_artifact(pid: int, session: str | None, number: int, root: str | None = None) -> dict | None:
    """The placement artifact a worker spooled for trial `number` of the invocation (`pid`, `session`),
    if its folder is still there (the parent died before logging it); None otherwise."""
    import json

    if not session:
        return None
    for path in spool_dirs(root):
        if spool_owner(path) == (pid, session):
            try:
                return json.loads((path / f"{number}.json").read_text())
            except (OSError, ValueError):
                continue
    return None


def clean_stale_spools(root: str | None = None, sessions: Collection[str] | None = None) -> int:
    """Remove spool folders of parent processes that are gone, once logged: those of `sessions` (the
    invocations of the study just reconciled), those holding nothing, and those older than
    `STALE_SPOOL_S`; returns how many."""
    removed = 0
    for path in spool_dirs(root):
        owner = spool_owner(path)
        if owner is None or pid_alive(owner[0]):
            continue  # an old unnamed spool (owner unknown), or a live parent's
        try:
            empty = not any(path.iterdir())
            old = time.time() - path.stat().st_mtime > STALE_SPOOL_S
        except OSError:
            continue
        if owner[1] is None or empty or old or owner[1] in set(sessions or ()):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
