"""Optuna's distributed mode on a real PostgreSQL server on loopback: `--workers N` share one study.

The server is created in a temporary directory, listens on 127.0.0.1 only, and is stopped at the end.
`make test` (and so `.ci/run`) installs PostgreSQL when it is missing. Without it this test fails
with a hint; set PHAZE_OPT_SKIP_POSTGRES=1 to skip it on a machine that cannot have it.
"""

import os
import subprocess
import sys
import time
from collections import Counter

import optuna
import pytest
from optuna.trial import TrialState

from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import finished_trials
from phaze_opt.search.setup import default_study_name
from phaze_opt.runs.tracking import driver_url
import pg_server
from test_study_fakes import backend, best_score_series, config, expected_best_series, mlflow_uri, small_space

DATABASES = ("optuna", "optuna_ex", "mlflow", "mlflow_tags", "theirs")  # theirs: another program's database


@pytest.fixture(scope="module")
def postgres():
    pg_server.required()
    with pg_server.throwaway(DATABASES) as urls:
        yield urls


def test_workers_share_one_study_on_postgres(tmp_path, postgres):
    # MLflow in the default kind of store, SQLite, written by both workers at once (locks are retried)
    uri = mlflow_uri(tmp_path)
    cfg = config(tmp_path, trials=16, workers=2, storage=postgres["optuna"], tracking_uri=uri)
    summary = run_study(cfg, backend(small_space()))
    name = default_study_name(cfg)
    trials = optuna.load_study(study_name=name, storage=driver_url(postgres["optuna"])).get_trials()
    # unique and complete: exactly the requested trials, numbered once each, none left running or waiting
    assert len(trials) == 16 and sorted(t.number for t in trials) == list(range(16))
    assert len({t._trial_id for t in trials}) == 16
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    assert len(finished_trials(trials)) == 16 == summary["trials"]["finished"]
    # both processes took part, and the enqueued reference points ran once each, not once per worker
    assert {t.user_attrs["result"]["worker"] for t in trials} == {0, 1}
    codec = SpaceCodec(small_space().params)
    refs = Counter(tuple(sorted(codec.decode(t.params).items())) for t in trials if t.user_attrs.get("reference"))
    assert len(refs) == 4 and set(refs.values()) == {1}
    # MLflow: one parent, one nested run per trial
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1
    numbers = Counter(int(r.data.tags["optuna.trial_number"]) for r in children)
    assert numbers == Counter(range(16))
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    # best_score: the best-so-far by trial number although the workers finish trials out of order
    assert best_score_series(client, parents[0].info.run_id) == expected_best_series(trials)


def test_exhaustive_workers_split_the_grid_on_postgres(tmp_path, postgres):
    cfg = config(tmp_path, strategy="auto", workers=2, storage=postgres["optuna_ex"], tracking_uri="off")
    summary = run_study(cfg, backend(small_space()))
    trials = optuna.load_study(study_name=default_study_name(cfg), storage=driver_url(postgres["optuna_ex"])).get_trials()
    points = Counter(tuple(sorted(t.user_attrs["point"].items())) for t in trials)
    grid = small_space().grid_points("grid")
    assert set(points.values()) == {1} and len(points) == len(grid) == summary["exhaustive"]["evaluated"]
    assert summary["best"]["score"] == max(t.values[0] for t in trials
                                           if t.state == TrialState.COMPLETE and max(t.constraints.values()) <= 0)


def test_three_processes_create_mlflows_schema_on_a_new_postgres_database(postgres):
    """MLflow's schema on a fresh server database, created by three processes at once: none fails
    (without the lock and retries, one or two died with UniqueViolation pg_type_typname_nsp_index)."""
    import sys

    code = ("import sys; from phaze_opt.runs.tracking import MlflowTracker; "
            "print(MlflowTracker.prepare(sys.argv[1], 'e'))")
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    procs = [subprocess.Popen([sys.executable, "-c", code, postgres["mlflow"]], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-1500:] for o in outs]
    assert len({o[0].strip() for o in outs}) == 1  # one experiment, the same for all


_TAGGER = r"""
import sys, time

import sqlalchemy.orm

from phaze_opt.runs.tracking import MlflowTracker

url, start_at = sys.argv[1], float(sys.argv[2])
merge = sqlalchemy.orm.Session.merge


def slow_merge(self, instance, *args, **kwargs):  # MLflow's upsert reads, then inserts at commit: the gap
    found = merge(self, instance, *args, **kwargs)  # widened past the schema lock each start holds in turn
    if type(instance).__name__ == "SqlExperimentTag":
        time.sleep(5.0)
    return found


sqlalchemy.orm.Session.merge = slow_merge
time.sleep(max(0.0, start_at - time.time()))  # every process past its imports, then all at once
tracker = MlflowTracker.start(url, "tags-race", run_name="r", params={}, tags={}, context={}, background=False)
print(tracker.experiment_id)
"""


def test_processes_starting_together_tag_the_experiment(postgres):
    """Each start tags its experiment (the UI's kind, the saved view); MLflow sets a tag by reading,
    then inserting, so processes starting together on PostgreSQL collided and all but one died with
    UniqueViolation experiment_tag_pk (seen in the PostgreSQL crash storm)."""
    url = postgres["mlflow_tags"]
    from phaze_opt.runs.tracking import MlflowTracker

    MlflowTracker.prepare(url, "tags-race")  # the experiment exists, untagged: the starts meet at its tags
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true")
    start_at = time.time() + 25  # past the imports of every process on a loaded machine
    procs = [subprocess.Popen([sys.executable, "-c", _TAGGER, url, str(start_at)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-1500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1


def test_compare_and_export_leave_another_programs_postgres_database_unwritten(tmp_path, postgres, capsys):
    """Both read-only commands refuse a database without Optuna's tables in one line; Optuna's
    RDBStorage had created its 13 tables beside the other program's."""
    import psycopg2

    from phaze_opt import cli
    from phaze_opt.errors import PhazeError
    from phaze_opt.experiments.convergence import compare

    url = postgres["theirs"]

    def tables():
        conn = psycopg2.connect(url)
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
                return {r[0] for r in cur.fetchall()}
        finally:
            conn.close()

    conn = psycopg2.connect(url)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE orders (a int)")
    conn.close()
    with pytest.raises(PhazeError, match="not an Optuna storage"):
        compare(["x", "y"], storage=url, out_dir=str(tmp_path / "o"), tracking_uri="off")
    assert cli.main(["export", "x", "--storage", url, "--out", str(tmp_path / "x.csv")]) != 0
    assert "not an Optuna storage" in capsys.readouterr().err
    assert tables() == {"orders"}


_ENQUEUER = r"""
import sys, time
from types import SimpleNamespace

import optuna

from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.session import Session
from phaze_opt.search.setup import make_storage
from test_study_fakes import small_space

url, name, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
if sys.argv[4] == "hosts":  # processes of several machines: no file lock reaches across them
    import contextlib

    from phaze_opt.runs import locks

    locks.file_lock = lambda *a, **k: contextlib.nullcontext()
storage = make_storage(url)
study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True)
read = optuna.Study._should_skip_enqueue


def slow_read(self, params):  # the gap between Optuna's read and its insert, widened
    found = read(self, params)
    time.sleep(0.3)
    return found


optuna.Study._should_skip_enqueue = slow_read
space = small_space()
session = SimpleNamespace(space=space, codec=SpaceCodec(space.params), config=SimpleNamespace(reference_arch="tpuv4", baseline_system="default"),
                          baselines={}, notes=[], study=study, url=url, storage=storage, name=name)
time.sleep(max(0.0, start_at - time.time()))  # every process past its imports, then all at once
print(Session.enqueue_references(session))
"""


@pytest.mark.parametrize("where", ["one-host", "hosts"])
def test_processes_starting_together_enqueue_the_reference_designs_once(postgres, where):
    """Optuna's `enqueue_trial(skip_if_exists=True)` reads, then inserts: processes starting together
    on PostgreSQL each found the references absent and each queued them (6-8 evaluations, not 4)."""
    url, name = postgres["optuna"], f"references-race-{where}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    start_at = time.time() + 25  # past the imports of every process on a loaded machine
    procs = [subprocess.Popen([sys.executable, "-c", _ENQUEUER, url, name, str(start_at), where], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    trials = optuna.load_study(study_name=name, storage=driver_url(url)).get_trials()
    codec = SpaceCodec(small_space().params)
    refs = Counter(tuple(sorted(codec.decode(t.system_attrs["fixed_params"]).items()))
                   for t in trials if t.user_attrs.get("reference"))
    assert len(refs) == 4 and set(refs.values()) == {1}, refs


@pytest.mark.parametrize("option", ["storage", "tracking_uri"])
def test_a_missing_database_is_one_line_within_seconds(tmp_path, postgres, option):
    """A server that answers with no such database: MLflow retried its engine for two minutes (114 s)."""
    from phaze_opt.errors import PhazeError

    url = postgres["optuna"].rsplit("/", 1)[0] + "/nosuchdb"
    start = time.monotonic()
    with pytest.raises(PhazeError, match=f"--{option.replace('_', '-')} .*nosuchdb.*does not exist"):
        run_study(config(tmp_path, trials=3, **{option: url}), backend())
    assert time.monotonic() - start < 10
