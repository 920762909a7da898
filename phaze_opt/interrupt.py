"""One interrupt path for Ctrl-C, SIGTERM and SIGHUP: a stop flag, raised only where that is safe.

A KeyboardInterrupt raised at an arbitrary bytecode can land inside Optuna's bookkeeping (seen:
`_tell_with_warning` failing with `UnboundLocalError`), inside a SQLAlchemy callback that swallows
it, or inside a transaction that then keeps SQLite's write lock. So a signal only *records* a stop
request (`stop_requested`), and what happens next depends on where the main thread is:

- inside an `interruptible()` block (an evaluation: pure computation, nothing half-written if it is
  cut), the handler raises KeyboardInterrupt at once;
- inside a `deferred()` block (a trial loop, a poll loop, the clean-up on the way out) it raises
  nothing; the loop checks `stop_requested()` at its next safe point and stops there;
- elsewhere it follows the process's default (`install(raise_outside=...)`): the parent raises
  (set-up code is short and restartable), a worker process only records the request.

Compiled solvers cannot be cut by an exception: the interpreter runs a signal's handler only
between bytecodes, so inside HiGHS it waits for the call to return (up to its time limit), and a
KeyboardInterrupt raised in a callback from compiled code turns into a SystemError or is lost. So
a solver call runs inside `polled()`: there a signal only records the request (and sets the byte
`STOP`, which compiled code can read), the solver polls it from its own loop (HiGHS's interrupt
callbacks, the numba search's deadline check) and returns early, and the KeyboardInterrupt is
raised when the call has returned, if the caller may be cut. What such a call returns is never
used: the exception replaces it.

Only the main thread handles signals (Python's rule), so the regions are the main thread's.
Standard library only: the CLI installs this before importing anything heavy.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading
import time
from contextlib import contextmanager

SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
RAISE, DEFER = "raise", "defer"

_STATE: dict = {"stop": None, "regions": [], "outside": RAISE, "settled": False, "resender": None}
STOP = bytearray(1)  # 1 once a stop is requested: read by compiled solvers (`polled`)


def _signals() -> list:
    return [getattr(signal, n) for n in SIGNALS if hasattr(signal, n)]


def _on_signal(signum, frame) -> None:
    request_stop(signal.Signals(signum).name)
    if _raising():
        _start_resender(signum)
        if _in_unraisable_hook(frame):  # raised there, it is printed as "Exception ignored in sys.unraisablehook"
            return  # the resender delivers it again once the hook has returned
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _in_unraisable_hook(frame) -> bool:
    """Whether `frame` runs inside our `sys.unraisablehook` (`_unraisable`), at any depth."""
    while frame is not None:
        if frame.f_code is _HOOK_CODE:
            return True
        frame = frame.f_back
    return False


def _raising() -> bool:
    regions = _STATE["regions"]
    return (regions[-1] if regions else _STATE["outside"]) == RAISE


RESEND_S = 2.0


def _start_resender(signum) -> None:
    """A KeyboardInterrupt raised inside a garbage-collection callback or a finaliser is printed and
    dropped by the interpreter (seen inside SQLAlchemy and weakref callbacks). So while the main
    thread stays where a signal should have raised, the signal is sent again every `RESEND_S`
    (`settle` ends this at the top level)."""
    if _STATE.get("resender") is not None:
        return
    import os

    def resend():
        try:
            while True:
                time.sleep(RESEND_S)
                if _STATE.get("settled") or _STATE["stop"] is None:
                    return
                if _raising():
                    os.kill(os.getpid(), signum)
        except OSError:  # pragma: no cover
            pass
        finally:
            _STATE["resender"] = None

    thread = threading.Thread(target=resend, name="interrupt-resend", daemon=True)
    _STATE["resender"] = thread
    thread.start()


def settle() -> None:
    """The stop reached the top level: later signals only record (no KeyboardInterrupt escapes it)."""
    _STATE["settled"] = True
    _STATE["outside"] = DEFER


def _unraisable(hook):
    def quiet(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _STATE["stop"] is not None:
            return  # a signal that landed in a callback: recorded, and sent again (`_start_resender`)
        hook(unraisable)

    quiet.phaze_quiet = True
    return quiet


_HOOK_CODE = _unraisable(print).__code__  # the code of every hook `_unraisable` makes


def _quiet_record(record) -> bool:
    """A logging filter: drop a record that carries a KeyboardInterrupt of a stop under way. A library
    that catches the interrupt only to log it with its traceback (SQLAlchemy's pool, closing a
    connection) re-raises it, or `_start_resender` sends the signal again; the traceback would be
    the only trace, on a stop that is otherwise one line."""
    exc = record.exc_info[1] if record.exc_info else None
    return not (isinstance(exc, KeyboardInterrupt) and _STATE["stop"] is not None)


def _quiet_logs() -> None:
    """`_quiet_record` on the handler that prints records when nobody configured logging (this CLI
    does not) and on the root logger's handlers."""
    import logging

    for handler in [logging.lastResort, *logging.getLogger().handlers]:
        if handler is not None and _quiet_record not in handler.filters:
            handler.addFilter(_quiet_record)


def install(raise_outside: bool = True):
    """Route SIGINT, SIGTERM and SIGHUP to the stop flag in this process (main thread only; elsewhere
    a no-op). `raise_outside`: raise KeyboardInterrupt outside any region (a parent process) or only
    record the request (a worker, whose loop checks it). Returns a function restoring the previous
    handlers and default."""
    if not getattr(sys.unraisablehook, "phaze_quiet", False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)
    _quiet_logs()
    previous_outside = _STATE["outside"]
    _STATE["outside"] = RAISE if raise_outside else DEFER
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _signals():
            try:
                previous[sig] = signal.signal(sig, _on_signal)
            except (ValueError, OSError):  # pragma: no cover - not settable here
                pass

    def restore() -> None:
        _STATE["outside"] = previous_outside
        for sig, handler in previous.items():
            if handler is not None and handler is not _on_signal:
                try:
                    signal.signal(sig, handler)
                except (ValueError, OSError):  # pragma: no cover
                    pass

    return restore


# Extension modules built with PyO3 that the commands import (MLflow's tracking store imports
# cryptography's bindings on first use; MLflow's schemas import pydantic-core). PyO3 builds a module's
# type objects as it is imported; an exception raised inside that (our KeyboardInterrupt) becomes a
# `pyo3_runtime.PanicException`, a BaseException with a Rust panic's traceback, not a stop (seen in
# the signal storm: a SIGINT during the MLflow store's first open, exit 1).
PYO3_MODULES = ("cryptography.hazmat.bindings._rust", "pydantic_core._pydantic_core")


def preload_native() -> None:
    """Import `PYO3_MODULES` where a signal only records its stop, so none can land inside their set-up;
    the caller's next safe point acts on it. A missing module is skipped: a later import fails as
    it would have."""
    with deferred():
        for name in PYO3_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def is_stop(exc: BaseException) -> bool:
    """Whether `exc`, reaching the top level, is this process's stop: a KeyboardInterrupt, or a PyO3
    panic raised while a stop was requested (our interrupt cut a native module's set-up: a module not
    in `PYO3_MODULES`, imported late)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    kind = type(exc)
    return _STATE["stop"] is not None and (kind.__module__, kind.__name__) == ("pyo3_runtime", "PanicException")


def request_stop(reason: str = "stop") -> None:
    if _STATE["stop"] is None:
        _STATE["stop"] = reason
    STOP[0] = 1


def stop_requested() -> str | None:
    """The signal that asked this process to stop (its name), or None."""
    return _STATE["stop"]


def reset() -> None:
    """Forget a stop request (a new invocation in the same process, e.g. a test)."""
    _STATE["stop"] = None
    _STATE["settled"] = False
    STOP[0] = 0


@contextmanager
def command():
    """Around one command of this process (the CLI's `main`): it starts with no stop request, and
    one requested anywhere inside it stands until it ends (`fresh_start` keeps it)."""
    reset()
    _STATE["command"] = True
    try:
        yield
    finally:
        _STATE["command"] = False


def fresh_start() -> None:
    """Forget the stop of an earlier run in this process (an API caller running a study again), but
    never one requested during the current command: a signal that landed in the start-up before a
    study's session opened (the signal storm lost 3 of 90 that way: each study ran to its end)."""
    if not _STATE.get("command"):
        reset()


def _main() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _region(kind: str):
    if not _main():
        yield
        return
    _STATE["regions"].append(kind)
    try:
        yield
    finally:
        _STATE["regions"].pop()


@contextmanager
def interruptible():
    """A block a signal may cut (an evaluation): raises KeyboardInterrupt at once when a stop was
    already requested, and from the signal handler while it runs."""
    with _region(RAISE):
        if _STATE["stop"] is not None and _main():
            raise KeyboardInterrupt(f"signal {_STATE['stop']}")
        yield


@contextmanager
def deferred():
    """A block a signal must not cut (bookkeeping, a loop that checks `stop_requested` itself)."""
    with _region(DEFER):
        yield


def checkpoint() -> None:
    """A solver's safe point: raise KeyboardInterrupt here when a stop was requested and the caller
    is interruptible (a signal the interpreter delivered late, or one swallowed by a callback)."""
    if _STATE["stop"] is None or not _main():
        return
    regions = _STATE["regions"]
    if (regions[-1] if regions else _STATE["outside"]) == RAISE:
        raise KeyboardInterrupt(f"signal {_STATE['stop']}")


class Poll:
    """What a solver inside `polled()` checks: `poll()` is True once it should stop; `flag` is the
    byte compiled code reads instead (1: stop). A caller that may not be cut gets a byte that
    never changes, so its solver always runs to the end."""

    def __init__(self, cut: bool):
        self.cut = cut
        self.flag = STOP if cut else bytearray(1)

    def __call__(self) -> bool:
        return self.flag[0] != 0


@contextmanager
def polled():
    """Around a call into compiled code that polls for a stop itself (see the module docstring):
    yields its `Poll`; raises KeyboardInterrupt after the call when a stop was requested and the
    caller may be cut, so an early return is never taken for a result."""
    poll = Poll(_main() and _raising())
    if poll.cut:
        checkpoint()
    with _region(DEFER):
        yield poll
    if poll.cut:
        checkpoint()


def checkpoint_deferred() -> None:
    """A safe point of a deferred block (between storage writes): raise KeyboardInterrupt here when a
    stop was requested."""
    if _STATE["stop"] is not None and _main():
        raise KeyboardInterrupt(f"signal {_STATE['stop']}")


@contextmanager
def blocked():
    """Hold SIGINT, SIGTERM and SIGHUP pending in this thread for the block (they are delivered at
    its end). Processes started inside inherit the mask, so a spawned worker cannot be interrupted
    before it installs its own handlers (`runs.signals.worker_started` unblocks them)."""
    sigs = set(_signals())
    if not hasattr(signal, "pthread_sigmask") or not _main():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock() -> None:
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(_signals()))
