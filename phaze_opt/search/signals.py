"""Signals and the lifetime of worker processes.

- The parent process treats SIGTERM and SIGHUP like Ctrl-C (`handle_termination`): the running
  trial is marked interrupted and queued again, pending MLflow writes are flushed, and the parent
  run is closed as KILLED.
- A worker process (`worker_started`) turns the first SIGINT, SIGTERM or SIGHUP into one
  KeyboardInterrupt and ignores the rest, so a Ctrl-C to the process group followed by the
  parent's own stop request does not interrupt a worker's clean-up. It watches its parent: when the
  parent dies (even by SIGKILL) the worker interrupts itself, removes its spool folder and exits;
  if a solver keeps it from answering, it exits hard after `ORPHAN_GRACE_S` (its running trial is
  then failed and queued again by the next start, see `reconcile.fail_zombies`).
- `stop_workers_on_exit` is the parent's side: when the pool loop ends by an exception, it asks every
  worker to stop, waits for them, then drains what they finished (`drain`), so no trial they
  finished goes unlogged.
- Spool folders are named `phaze-spool-<parent pid>-*`; `clean_stale_spools` removes those of
  parents that are gone.
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
from typing import Callable

from .reconcile import pid_alive

TERMINATING = ("SIGTERM", "SIGHUP")
WATCH_S = 0.5
ORPHAN_GRACE_S = 10.0
SPOOL_PREFIX = "phaze-spool-"


def _signals(names) -> list:
    return [getattr(signal, n) for n in names if hasattr(signal, n)]


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def handle_termination() -> Callable[[], None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread, as Ctrl-C does; returns a
    function restoring the previous handlers (a no-op outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {}
    for sig in _signals(TERMINATING):
        try:
            previous[sig] = signal.signal(sig, _interrupt)
        except (ValueError, OSError):  # pragma: no cover
            pass

    def restore():
        for sig, handler in previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError):  # pragma: no cover
                pass

    return restore


# -- worker processes ------------------------------------------------------------------------------

_WORKER: dict = {}


def _worker_interrupt(signum, _frame):
    if _WORKER.get("interrupted"):
        return  # once: the clean-up of the first interrupt must not be interrupted
    _WORKER["interrupted"] = True
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


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


def worker_started(spool_dir: str | None = None) -> None:
    """Called first in a worker process (as the pool's initializer, so a parent killed before handing
    out the tasks is noticed too; again by the task with its spool folder): signal handling and the
    parent watch (see the module docstring). Idempotent; installs handlers only in the main thread."""
    _WORKER.setdefault("parent", os.getppid())  # the first call's: the pool's initializer, at process start
    if spool_dir is not None:
        _WORKER["spool"] = spool_dir
    _WORKER["interrupted"] = False
    if threading.current_thread() is threading.main_thread():
        for sig in _signals(("SIGINT", *TERMINATING)):
            signal.signal(sig, _worker_interrupt)
        _set_pdeathsig()
    if _WORKER.get("watch") is None:
        watch = threading.Thread(target=_watch_parent, name="parent-watch", daemon=True)
        _WORKER["watch"] = watch
        watch.start()


def orphaned() -> bool:
    parent = _WORKER.get("parent")
    return parent is not None and (os.getppid() != parent or not pid_alive(parent))


def _watch_parent() -> None:
    while not orphaned():
        time.sleep(WATCH_S)
    if not _WORKER.get("interrupted"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the main thread stops its trial and returns
        except OSError:  # pragma: no cover
            pass
    time.sleep(ORPHAN_GRACE_S)
    _exit_orphan(1)


def _exit_orphan(code: int) -> None:
    spool = _WORKER.get("spool")
    if spool:
        shutil.rmtree(spool, ignore_errors=True)
    os._exit(code)


def worker_finished() -> None:
    """Called last in a worker task: an orphan cleans its spool and exits instead of waiting for
    tasks from a parent that is gone."""
    if orphaned():
        _exit_orphan(0)


# -- the parent's side -----------------------------------------------------------------------------

def interrupt_workers(pool) -> None:
    """Ask every live process of a ProcessPoolExecutor to stop (SIGTERM, a KeyboardInterrupt there)."""
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)
        except (OSError, ValueError, AttributeError):
            pass


@contextmanager
def stop_workers_on_exit(pool, drain: Callable[[], None] | None = None):
    """Around a pool's loop: on an exception, stop the workers and wait for them; always `drain`
    (log what they finished) before leaving."""
    try:
        yield pool
    except BaseException:
        interrupt_workers(pool)
        try:
            pool.shutdown(wait=True, cancel_futures=True)
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


def spool_prefix() -> str:
    return f"{SPOOL_PREFIX}{os.getpid()}-"


def clean_stale_spools(root: str | None = None) -> int:
    """Remove spool folders of parent processes that are gone; returns how many."""
    base = Path(root or tempfile.gettempdir())
    removed = 0
    try:
        entries = list(base.glob(f"{SPOOL_PREFIX}*"))
    except OSError:
        return 0
    for path in entries:
        parts = path.name[len(SPOOL_PREFIX):].split("-", 1)
        if not parts[0].isdigit() or not path.is_dir():
            continue  # an old unnamed spool: its owner is unknown, leave it
        if not pid_alive(int(parts[0])):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
