"""A study's tasks on a Dask.distributed cluster (`--cluster ADDRESS`), behind `concurrent.futures`.

The sweep and the sampled study hand their tasks to an executor and wait on `concurrent.futures`
futures; `ClusterExecutor` is that executor on a Dask cluster, so neither loop knows which engine
runs them. Why Dask and not Ray: docs/architecture.md ("Running on a cluster").

- Exactly once: a task's result reaches the caller once, through one future; the parent alone
  writes trials, so a task run twice (its worker died, Dask ran it elsewhere) records nothing
  twice. A worker that dies takes its running task with it; Dask's scheduler runs it again on
  another worker (`distributed.scheduler.allowed-failures` times), and after that this executor
  submits it afresh (`RESUBMITS` times) before the error reaches the caller.
- Worker state: a pool process runs an initializer once; a Dask worker is long-lived and may serve
  several studies, so each task carries its executor's token and the worker runs the initializer
  when the token differs from the last one it ran (`_call`).
- Large arguments (the space's ~2 MB of architectures) are scattered once to every worker and
  passed by reference (`SHARE_BYTES`). Dask cannot recompute scattered data: when the workers
  holding it die, the tasks waiting on it are cancelled, and this executor scatters it again and
  submits them afresh (`RESCATTERS`).
- One thread per worker process: the model's caches are per process and the work holds the GIL,
  so a worker with several threads gains nothing and shares state; it is refused.

`distributed` is imported only here and only when a cluster is named: a study without one never
loads it.
"""

from __future__ import annotations

import pickle
import threading
import uuid
from collections import Counter
from concurrent.futures import CancelledError, Executor, Future
from typing import Any, Callable

from ..errors import PhazeError

FLAG = "--cluster"
CONNECT_S = 30.0  # waiting for the scheduler to answer, and for its first worker
RESUBMITS = 3  # fresh submissions of a task whose workers kept dying, after Dask's own retries
# how long a task lost with every worker waits for a nanny to restart one (seconds on a quiet machine;
# a restart imports the package again, so minutes on a loaded one) before the cluster counts as gone
WORKER_RETURN_S = 180.0
# Fresh submissions of a task whose inputs died with their workers (each scatters them again): every
# task in flight loses them at once, so this counts losses of the cluster, not of the task.
RESCATTERS = 20
SHARE_BYTES = 64 * 1024  # a pickled argument at least this large is scattered once, not sent per task

_WORKER: dict = {}  # on a worker: the token whose initializer ran last


def _call(token: str, initializer: Callable | None, initargs: tuple, fn: Callable, *args):
    """A task on a worker: this executor's initializer first, once per worker process and token."""
    if _WORKER.get("token") != token:
        if initializer is not None:
            initializer(*initargs)
        _WORKER["token"] = token
    return fn(*args)


def check_address(address: str) -> str:
    """The scheduler's address as Dask takes it ("tcp://host:port", or "host:port")."""
    text = str(address).strip()
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host.split("://")[-1]:
        raise PhazeError(f"{FLAG} {address!r}: expected the Dask scheduler's address, tcp://HOST:PORT "
                         "(as `dask scheduler` prints it)")
    return text


def connect(address: str, timeout_s: float = CONNECT_S):
    """A Dask client on the scheduler at `address`, with at least one worker of one thread."""
    address = check_address(address)
    try:
        from distributed import Client
    except ImportError:
        raise PhazeError(f"{FLAG}: the Dask engine is not installed; pip install 'distributed'") from None
    try:
        client = Client(address, timeout=timeout_s, set_as_default=False)
    except (OSError, TimeoutError) as exc:
        raise PhazeError(f"{FLAG} {address}: no Dask scheduler answers there ({type(exc).__name__}); start one "
                         "with `dask scheduler` and its workers with `dask worker ADDRESS --nthreads 1`") from None
    try:
        client.wait_for_workers(1, timeout=timeout_s)
    except TimeoutError:
        client.close()
        raise PhazeError(f"{FLAG} {address}: the scheduler has no worker; start them with "
                         f"`dask worker {address} --nthreads 1 --nworkers N`") from None
    threaded = {w["id"]: w["nthreads"] for w in client.scheduler_info()["workers"].values() if w["nthreads"] != 1}
    if threaded:
        name, n = next(iter(threaded.items()))
        client.close()
        raise PhazeError(f"{FLAG} {address}: worker {name} runs {n} threads; phaze-opt needs one thread per "
                         f"worker process: `dask worker {address} --nthreads 1 --nworkers N`")
    return client


def worker_count(client) -> int:
    return len(client.scheduler_info()["workers"])


class ClusterExecutor(Executor):
    """`concurrent.futures.Executor` over a Dask client: `submit` returns a plain Future that settles
    once, whatever the cluster lost on the way (see the module docstring)."""

    def __init__(self, address: str, initializer: Callable | None = None, initargs: tuple = ()):
        self.address = check_address(address)
        self.client = connect(address)
        self.workers = worker_count(self.client)
        self._token = uuid.uuid4().hex
        self._initializer, self._initargs = initializer, initargs
        self._shared: dict[int, list] = {}  # id(value) -> [value, its scattered Dask future]
        self._live: dict[Future, Any] = {}  # each unsettled Future and its Dask future
        self._lock = threading.Lock()
        self._closing = False
        self.stats = {"tasks": 0, "resubmitted": 0, "workers": self.workers}

    # -- arguments -------------------------------------------------------------------------------------

    def _share(self, value, always: bool = False):
        """`value`, or a reference to its one scattered copy when it is large (or `always`)."""
        with self._lock:
            held = self._shared.get(id(value))
        if held is None:
            if not always and len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)) < SHARE_BYTES:
                return value
            held = [value, None]  # the value is held, so its id names it for as long as this executor lives
        with self._lock:  # one scatter for every task that finds the value lost at once
            if held[1] is None or held[1].status != "finished":
                [held[1]] = self.client.scatter([value], broadcast=True, hash=False)
            self._shared[id(value)] = held
            return held[1]

    def _forget_shared(self, lost: set) -> None:
        """Scatter again, at the next use, every value whose scattered copy is among `lost`."""
        with self._lock:
            for held in self._shared.values():
                if held[1] is not None and held[1].key in lost:
                    held[1] = None

    # -- tasks -----------------------------------------------------------------------------------------

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if kwargs:
            raise TypeError("ClusterExecutor.submit takes positional arguments only")
        if self._closing:
            raise RuntimeError("cannot submit to a ClusterExecutor that was shut down")
        outer: Future = Future()
        self.stats["tasks"] += 1
        self._launch(outer, fn, args, Counter())
        return outer

    def _launch(self, outer: Future, fn, args: tuple, tries: Counter) -> None:
        inputs = [self._share(self._initargs, always=True)] + [self._share(a) for a in args]
        key = f"{getattr(fn, '__name__', 'task').strip('_')}-{uuid.uuid4().hex}"  # the dashboard's task name
        task = self.client.submit(_call, self._token, self._initializer, inputs[0], fn, *inputs[1:], key=key)
        with self._lock:
            self._live[outer] = task
            keys = {h[1].key for h in self._shared.values() if any(h[1] is x for x in inputs)}
        task.add_done_callback(lambda done: self._settle(outer, fn, args, tries, done, keys))

    def _settle(self, outer: Future, fn, args: tuple, tries: Counter, task, keys: set) -> None:
        """Pass a finished Dask task's outcome on; a task lost with its workers is submitted again."""
        if self._closing:
            return
        try:
            result = task.result()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's future, or retried
            why = _lost(exc)
            if why is not None and tries[why] < (RESUBMITS if why == "worker" else RESCATTERS):
                tries[why] += 1
                self.stats["resubmitted"] += 1
                if why == "inputs":
                    self._forget_shared(keys)
                try:
                    self._relaunch(outer, fn, args, tries)
                    return
                except Exception as again:  # noqa: BLE001 - the cluster is gone: one line on the future
                    exc = PhazeError(f"{FLAG} {self.address}: the cluster is gone ({type(again).__name__}: "
                                     f"{again}); the same command resumes the study")
            with self._lock:
                self._live.pop(outer, None)
            if not outer.done():
                outer.set_exception(exc)
            return
        with self._lock:
            self._live.pop(outer, None)
        if not outer.done():
            outer.set_result(result)

    def _relaunch(self, outer: Future, fn, args: tuple, tries: Counter) -> None:
        """Submit a lost task again. When every worker died at once (the scatter finds none), wait for
        a nanny to bring one back (`WORKER_RETURN_S`) before the cluster counts as gone. This runs in
        Dask's one callback thread, so other results wait too; with no worker alive none can come."""
        try:
            self._launch(outer, fn, args, tries)
        except (TimeoutError, OSError):
            self.client.wait_for_workers(1, timeout=WORKER_RETURN_S)  # raises TimeoutError: gone for good
            self._launch(outer, fn, args, tries)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Cancel what is still pending (a loop ends with nothing in flight unless it was stopped),
        drop the scattered values and leave the cluster running for its next study."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            live, self._live = self._live, {}
            shared, self._shared = self._shared, {}
        try:
            pending = list(live.values()) + [h[1] for h in shared.values() if h[1] is not None]
            if pending:
                self.client.cancel(pending)
        finally:
            for outer in live:
                if outer.cancel():
                    outer.set_running_or_notify_cancel()
            self.client.close()


def _lost(exc: BaseException) -> str | None:
    """Why the cluster lost a task ("worker": its workers kept dying; "inputs": its scattered inputs
    died with their workers), or None when the task failed by its own error."""
    from distributed import KilledWorker

    if isinstance(exc, KilledWorker):
        return "worker"
    return "inputs" if isinstance(exc, CancelledError) else None
