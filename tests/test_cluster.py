"""The sweep and the sampled study on a Dask cluster (`--cluster`): the same answers as on this
machine, nothing lost or repeated when workers die, a stopped sweep resumed.

The cluster is a `distributed.LocalCluster` of two worker processes (one thread each), started by
the module's fixture. The oracle is the local sweep (itself checked against full enumeration in
tests/test_upper_bound.py): one task in flight on the cluster hands out the same tasks in the same
order as the local sweep with one worker, so everything must agree; with two in flight the order
may differ (a task still running cannot prune), so the optimum and the invariants must hold.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest

distributed = pytest.importorskip("distributed")
dask = pytest.importorskip("dask")

from phaze_opt.errors import PhazeError  # noqa: E402
from phaze_opt.runs.cluster import ClusterExecutor, check_address, connect  # noqa: E402
from phaze_opt.search import branch_bound  # noqa: E402
from phaze_opt.search.runner import run_study  # noqa: E402
from phaze_opt.search.setup import StudyConfig, validate  # noqa: E402

from cluster_faults import KillWorkers, Replenish, killed  # noqa: E402
from test_branch_bound_batches import slice_file  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

SPACES = {"small": ("gpt2-xl", "small"), "phaze-slice": ("gpt3-175b", None)}


@pytest.fixture(scope="module")
def cluster():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as c:
        yield c


@pytest.fixture(scope="module")
def spaces(tmp_path_factory):
    path = slice_file(tmp_path_factory.mktemp("spaces"))
    return {name: (model, space or path) for name, (model, space) in SPACES.items()}


def sweep_config(out: Path, model: str, space: str, **options) -> StudyConfig:
    return StudyConfig(models=(model,), space=space, hysteresis="off", strategy="branch-and-bound",
                       tracking_uri="off", output_dir=str(out), progress=False, **options)


@pytest.fixture(scope="module")
def local(spaces, tmp_path_factory):
    """Each space's sweep on this machine, one worker (the reference)."""
    out = {}
    for name, (model, space) in spaces.items():
        out[name] = run_study(sweep_config(tmp_path_factory.mktemp(f"local-{name}"), model, space))
    return out


def trials_of(summary) -> list:
    return optuna.load_study(study_name=summary["study"], storage=summary["storage"]).get_trials(deepcopy=False)


def point_keys(summary) -> Counter:
    return Counter(tuple(sorted((k, str(v)) for k, v in t.user_attrs["point"].items())) for t in trials_of(summary))


def assert_settled_once(summary, reference) -> None:
    """The optimum of the reference, every point settled, every evaluated point one trial."""
    ex = summary["exhaustive"]
    assert summary["best"]["score"] == reference["best"]["score"]
    assert ex["optimum_proven"]
    assert sum(ex["settled"].values()) == ex["points"] == reference["exhaustive"]["points"]
    keys = point_keys(summary)
    assert max(keys.values()) == 1  # no point evaluated twice
    assert sum(keys.values()) == ex["settled"]["evaluated"] == len(trials_of(summary))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPACES))
def test_the_cluster_sweep_settles_as_the_local_sweep(name, spaces, local, cluster, tmp_path):
    model, space = spaces[name]
    ref = local[name]
    one = run_study(sweep_config(tmp_path / "one", model, space, cluster=cluster.scheduler_address))
    for key in ("points", "settled", "evaluated", "cells_expanded", "level1_runs", "optimum", "optimum_proven"):
        assert one["exhaustive"][key] == ref["exhaustive"][key], key
    assert point_keys(one) == point_keys(ref)
    assert_settled_once(one, ref)
    two = run_study(sweep_config(tmp_path / "two", model, space, cluster=cluster.scheduler_address, workers=2))
    assert_settled_once(two, ref)


@pytest.mark.slow
def test_workers_killed_at_ten_moments_lose_nothing_and_repeat_nothing(spaces, local, tmp_path, monkeypatch):
    """A task of one cell at a time (the batch size decides nothing about exactness) and a kill after
    six task ends in ten, so the slice's few dozen tasks give ten kills whatever the machine's speed."""
    monkeypatch.setattr(branch_bound, "LEVEL1_TASK_S", 0.0)
    monkeypatch.setattr(branch_bound, "ENGINE_TASK_S", 0.0)
    model, space = spaces["phaze-slice"]
    folder = tmp_path / "kills"
    folder.mkdir()
    with (distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as c,
          distributed.Client(c) as client, Replenish(c)):
        client.register_plugin(KillWorkers(str(folder), kills=10, p=0.6))
        summary = run_study(sweep_config(tmp_path / "out", model, space, cluster=c.scheduler_address, workers=2))
    assert len(killed(str(folder))) == 10
    assert_settled_once(summary, local["phaze-slice"])


@pytest.mark.slow
def test_a_stopped_cluster_sweep_resumes_without_repeating(spaces, local, cluster, tmp_path, monkeypatch):
    model, space = spaces["phaze-slice"]
    config = sweep_config(tmp_path, model, space, cluster=cluster.scheduler_address, workers=2)
    add_trial = branch_bound.add_trial
    added = []

    def stop_after_three(study, trial):  # the parent records the third result, then is stopped
        added.append(add_trial(study, trial))
        if len(added) == 3:
            raise KeyboardInterrupt
        return added[-1]

    monkeypatch.setattr(branch_bound, "add_trial", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        run_study(config)
    monkeypatch.undo()
    resumed = run_study(config)
    assert resumed["exhaustive"]["resumed"] >= 1
    assert_settled_once(resumed, local["phaze-slice"])


@pytest.mark.slow
def test_a_sampled_study_runs_its_workers_on_the_cluster(cluster, tmp_path):
    config = StudyConfig(models=("gpt2-xl",), space="small", sampler="tpe", trials=6, workers=2,
                         cluster=cluster.scheduler_address, tracking_uri="off", output_dir=str(tmp_path),
                         progress=False)
    summary = run_study(config)
    trials = trials_of(summary)
    assert len([t for t in trials if t.state.name in ("COMPLETE", "FAIL")]) == 6
    owners = {t.system_attrs["phaze.owner"]["pid"] for t in trials}
    with distributed.Client(cluster) as client:
        assert owners <= set(client.run(os.getpid).values())  # run by the cluster's workers, not here


def test_executor_runs_the_initializer_once_per_worker_and_token(cluster):
    pool = ClusterExecutor(cluster.scheduler_address, _remember, ("a",))
    try:
        pids = {pool.submit(_seen).result()[0] for _ in range(8)}
        assert all(pool.submit(_seen).result()[1] == ["a"] for _ in range(4))  # once per worker, not per task
        big = list(range(50_000))  # scattered once (over SHARE_BYTES), passed by reference
        assert pool.submit(len, big).result() == len(big)
        assert pool.submit(len, big).result() == len(big)
        assert len(pool._shared) == 2  # the initializer's arguments and `big`
        assert pids <= set(pool.client.run(os.getpid).values())
    finally:
        pool.shutdown()
    again = ClusterExecutor(cluster.scheduler_address, _remember, ("b",))
    try:
        assert again.submit(_seen).result()[1][-1] == "b"  # a new token runs its own initializer
    finally:
        again.shutdown()


_CALLS: list = []


def _remember(tag):
    _CALLS.append(tag)


def _seen():
    return os.getpid(), list(_CALLS)


def test_bad_addresses_and_settings_are_one_line_errors(cluster, tmp_path):
    for bad in ("", "localhost", "tcp://:8786", "tcp://host:port"):
        with pytest.raises(PhazeError, match="--cluster"):
            check_address(bad)
    assert check_address(" tcp://10.0.0.1:8786 ") == "tcp://10.0.0.1:8786"
    with pytest.raises(PhazeError, match="--cluster: runs sampled studies and the pruned sweep"):
        validate(StudyConfig(models=("gpt2-xl",), space="small", hysteresis="off", strategy="grid",
                             cluster=cluster.scheduler_address, tracking_uri="off", output_dir=str(tmp_path)))
    with pytest.raises(PhazeError, match="no Dask scheduler answers"):
        connect("tcp://127.0.0.1:9", timeout_s=1)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address=":0") as c:
        with pytest.raises(PhazeError, match="one thread per worker process"):
            connect(c.scheduler_address)


def test_a_study_without_a_cluster_never_imports_the_engine():
    code = ("import sys, phaze_opt.cli, phaze_opt.search.runner, phaze_opt.search.branch_bound; "
            "sys.exit('distributed' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def _sleep(s):
    time.sleep(s)


def _die_until(folder: str, deaths: int) -> str:
    """Kill this worker process (as the OOM killer would) until `deaths` workers have died."""
    done = len(os.listdir(folder))
    if done < deaths:
        open(os.path.join(folder, f"death-{done}"), "w").close()
        os._exit(1)
    return "survived"


@pytest.mark.slow
def test_a_task_that_kills_the_only_worker_again_and_again_is_submitted_until_it_survives(tmp_path):
    """The only worker dies under a task four times in a row; each time the executor submits it
    again once the worker's nanny has restarted it, and the fifth run's result is the task's."""
    lc = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0")
    pool = ClusterExecutor(lc.scheduler_address)
    deaths = dask.config.get("distributed.scheduler.allowed-failures") + 1
    try:
        assert pool.submit(_die_until, str(tmp_path), deaths).result(timeout=600) == "survived"
        assert len(os.listdir(tmp_path)) == deaths and pool.stats["resubmitted"] >= 1
    finally:
        pool.shutdown()
        lc.close()


def test_a_cluster_that_goes_away_is_one_line():
    lc = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0")
    pool = ClusterExecutor(lc.scheduler_address)
    try:
        running = pool.submit(_sleep, 60)
        while not any(pool.client.processing().values()):  # until the worker holds the task
            time.sleep(0.05)
        lc.close()
        with pytest.raises(PhazeError, match="--cluster .*: the cluster is gone"):
            running.result(timeout=120)
    finally:
        pool.shutdown()


class _Shared:
    """A scattered value's Dask future, as the executor reads it."""

    def __init__(self, key: str):
        self.key, self.status = key, "finished"


class _Task:
    def __init__(self, outcome):
        self.outcome, self.callbacks = outcome, []

    def add_done_callback(self, fn):
        self.callbacks.append(fn)

    def result(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _NoWorkerClient:
    """A recording fake of the Dask client: the first scatter after a loss finds no worker (Dask
    raises TimeoutError), and `wait_for_workers` either sees a nanny bring one back or times out."""

    def __init__(self, returns: bool):
        self.returns, self.calls, self.workers = returns, [], True
        self.tasks: list[_Task] = []

    def scatter(self, values, broadcast, hash):
        self.calls.append("scatter")
        if not self.workers:
            raise TimeoutError("No valid workers found")
        return [_Shared(f"tuple-{len(self.calls)}")]

    def wait_for_workers(self, n, timeout):
        self.calls.append(("wait_for_workers", n, timeout))
        if not self.returns:
            raise TimeoutError(f"Only 0/{n} workers arrived after {timeout}")
        self.workers = True

    def submit(self, fn, *args, key):
        self.calls.append("submit")
        self.tasks.append(_Task(None))
        return self.tasks[-1]


def _offline_executor(client) -> ClusterExecutor:
    pool = ClusterExecutor.__new__(ClusterExecutor)
    pool.address, pool.client, pool.workers = "tcp://127.0.0.1:8786", client, 1
    pool._token, pool._initializer, pool._initargs = "t", None, ()
    pool._shared, pool._live, pool._lock, pool._closing = {}, {}, __import__("threading").Lock(), False
    pool.stats = {"tasks": 0, "resubmitted": 0, "workers": 1}
    return pool


@pytest.mark.parametrize("returns", [True, False])
def test_a_task_lost_with_every_worker_waits_for_one_to_come_back(returns):
    """The task's scattered inputs died with every worker; the resubmission's scatter finds none. The
    executor waits `WORKER_RETURN_S` for a worker and submits again, or, when none comes, settles the
    task with the one-line "cluster is gone" error."""
    from concurrent.futures import CancelledError

    from phaze_opt.runs import cluster as cluster_mod

    client = _NoWorkerClient(returns)
    pool = _offline_executor(client)
    outer = pool.submit(_sleep, 0)
    assert client.calls == ["scatter", "submit"]
    lost = client.tasks[0]
    lost.outcome = CancelledError()  # Dask cancels a task whose scattered inputs are lost
    client.workers = False
    lost.callbacks[0](lost)
    wait = ("wait_for_workers", 1, cluster_mod.WORKER_RETURN_S)
    if returns:
        assert client.calls[2:] == ["scatter", wait, "scatter", "submit"]
        assert not outer.done() and pool.stats["resubmitted"] == 1
        client.tasks[-1].outcome = "done"
        client.tasks[-1].callbacks[0](client.tasks[-1])
        assert outer.result(timeout=0) == "done"
    else:
        assert client.calls[2:] == ["scatter", wait]
        with pytest.raises(PhazeError, match="the cluster is gone .*resumes the study"):
            outer.result(timeout=0)
