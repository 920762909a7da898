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
