"""Faults injected into a Dask cluster's workers (tests/test_cluster.py), importable by the workers.

`KillWorkers` is a worker plugin: on every worker, now and after each restart, it wraps the sweep's
task functions so that a task, after doing its work and before its result leaves the worker, kills
the worker process (os._exit, as the OOM killer would) with probability `p`, until `kills` workers
have died across the cluster. Each kill first takes a numbered slot file in `folder` (created
exclusively), so the count holds across worker processes.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time

from distributed import WorkerPlugin

TASKS = ("_level0", "_level1", "_evaluate")


def _take_slot(folder: str, kills: int) -> bool:
    for i in range(kills):
        try:
            fd = os.open(os.path.join(folder, f"kill-{i}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        return True
    return False


def _killing(fn, folder: str, kills: int, p: float, rng: random.Random):
    @functools.wraps(fn)
    def task(*args):
        result = fn(*args)
        if rng.random() < p and _take_slot(folder, kills):
            os._exit(1)  # the work is done, its result never leaves: the worst moment to die
        return result
    return task


class KillWorkers(WorkerPlugin):
    """See the module docstring."""

    name = "kill-workers"

    def __init__(self, folder: str, kills: int = 10, p: float = 0.2):
        self.folder, self.kills, self.p = folder, kills, p

    def setup(self, worker) -> None:
        from phaze_opt.search import branch_bound

        rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
        for name in TASKS:
            original = getattr(branch_bound, name)
            original = getattr(original, "__wrapped__", original)
            setattr(branch_bound, name, _killing(original, self.folder, self.kills, self.p, rng))


def killed(folder: str) -> list[int]:
    """The pids of the workers killed so far."""
    return sorted(int(open(os.path.join(folder, f)).read()) for f in os.listdir(folder) if f.startswith("kill-"))


class Replenish:
    """An operator (or an autoscaler) for a LocalCluster: whenever no worker has been running for
    `after_s`, it adds a fresh one, up to `most` in all.

    Why the tests need one: Dask's nanny restarts a killed worker, but a worker killed moments after a
    restart, on a loaded machine, is sometimes never brought back, with no error logged (seen in CI:
    no running worker for 210 s; reproduced with a bare `pow` task and no phaze_opt code). What the
    executor promises is to wait for a worker to come back (`WORKER_RETURN_S`), not that Dask's nanny
    brings it back, so the kill tests supply the operator who would."""

    def __init__(self, cluster, after_s: float = 10.0, most: int = 10):
        self.cluster, self.after_s, self.most = cluster, after_s, most
        self.added = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="replenish", daemon=True)

    def _running(self) -> int:
        return sum(ws.status.name == "running" for ws in list(self.cluster.scheduler.workers.values()))

    def _watch(self) -> None:
        empty_since = None
        while not self._stop.wait(0.5):
            if self._running():
                empty_since = None
                continue
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since >= self.after_s and self.added < self.most:
                self.added += 1
                self.cluster.scale(len(self.cluster.worker_spec) + 1)
                empty_since = None

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
