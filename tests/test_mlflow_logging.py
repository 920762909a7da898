"""MLflow logging: what a trial's run holds, runs 1:1 with trials, and the store served over REST."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import FrozenTrial, TrialState

from phaze_opt.search.runner import run_study
from phaze_opt.search.session import is_feasible
from phaze_opt.search.setup import default_study_name
from phaze_opt.search.tracking import redact, sqlite_path, trial_record
from test_study_fakes import backend, config, mlflow_uri


def frozen(state=TrialState.COMPLETE, values=(123.0,), constraints=(-0.1, 0.0), result=None, number=7):
    return FrozenTrial(number=number, state=state, value=None, values=list(values) if values else None,
                       datetime_start=datetime.now(), datetime_complete=datetime.now(), params={"log2_mbs": 1},
                       distributions={"log2_mbs": IntDistribution(0, 3)},
                       user_attrs={"point": {"mbs": 2, "recompute": True}, "result": result or {}},
                       system_attrs={"constraints:area": constraints[0], "constraints:memory": constraints[1]},
                       intermediate_values={}, trial_id=1)


def test_trial_record_of_a_feasible_single_model_trial():
    result = {"feasible": True, "reason": "", "area_mm2": 250.0, "score": 123.0, "elapsed_s": 4.5, "trial_s": 0.5,
              "accelerator": {"num_tc": 8, "name": "x"},
              "models": {"gpt": {"throughput": 123.0, "tokens_per_s": 5e5, "mfu": 0.4, "time_per_batch_s": 33.3,
                                 "energy_j": None, "placement": {"tp": 8, "pp": 4, "dp": 32, "microbatches": 64},
                                 "timings": {"graph_s": 1.0, "estimate_s": 0.1, "ilp_s": 2.0, "dp_s": 0.01}}}}
    rec = trial_record(frozen(result=result), study_name="s", sampler="tpe", models=["gpt"], mode="sampled")
    assert rec.params == {"mbs": "2", "recompute": "True", "arch.num_tc": "8", "arch.name": "x"}
    m = rec.metrics
    assert m["throughput"] == 123.0 and m["tokens_per_s"] == 5e5 and m["mfu"] == 0.4 and m["area_mm2"] == 250.0
    assert (m["tp"], m["pp"], m["dp"], m["microbatches"]) == (8, 4, 32, 64)
    assert (m["graph_s"], m["ilp_s"], m["elapsed_s"], m["objective.throughput"]) == (1.0, 2.0, 4.5, 123.0)
    assert "energy_j" not in m  # not given by the hardware model: not logged
    assert rec.tags["trial_state"] == "COMPLETE" and rec.tags["feasible"] == "true"
    assert (rec.tags["sampler"], rec.tags["models"], rec.tags["optuna.trial_number"]) == ("tpe", "gpt", "7")
    assert rec.status == "FINISHED" and rec.step == 7


def test_trial_record_of_infeasible_failed_and_multi_model_trials():
    rec = trial_record(frozen(values=(0.0,), constraints=(0.2, 0.0),
                              result={"feasible": False, "reason": "area 300 mm2 over budget", "models": {}}),
                       study_name="s", sampler="random", models=["a"], mode="exhaustive")
    assert rec.tags["trial_state"] == "INFEASIBLE" and rec.tags["infeasible_reason"] == "area 300 mm2 over budget"
    assert rec.status == "FINISHED"
    rec = trial_record(frozen(state=TrialState.FAIL, values=None, result={"error": "ValueError: boom"}),
                       study_name="s", sampler="tpe", models=["a"], mode="sampled")
    assert rec.tags["trial_state"] == "FAIL" and rec.tags["error"] == "ValueError: boom" and rec.status == "FAILED"
    two = {"a": {"throughput": 1.0, "timings": {"ilp_s": 1.0}}, "b": {"throughput": 2.0, "timings": {"ilp_s": 3.0}}}
    rec = trial_record(frozen(result={"feasible": True, "models": two}), study_name="s", sampler="tpe",
                       models=["a", "b"], mode="sampled")
    assert rec.metrics["a.throughput"] == 1.0 and rec.metrics["b.throughput"] == 2.0
    assert rec.metrics["ilp_s"] == 4.0 and rec.metrics["b.ilp_s"] == 3.0


def test_urls():
    assert redact("postgresql://me:secret@127.0.0.1:5432/db") == "postgresql://me:***@127.0.0.1:5432/db"
    assert redact("sqlite:///studies/x.db") == "sqlite:///studies/x.db"
    assert sqlite_path("sqlite:///mlruns/mlflow.db") == Path("mlruns/mlflow.db")
    assert sqlite_path("sqlite:////abs/m.db") == Path("/abs/m.db") and sqlite_path("http://x") is None


def runs_by_trial(client, experiment_id):
    runs = client.search_runs([experiment_id], max_results=5000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, {int(r.data.tags["optuna.trial_number"]): r for r in children}


@pytest.fixture(scope="module")
def logged_study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ml")
    uri = mlflow_uri(tmp)
    cfg = config(tmp, trials=8, tracking_uri=uri, models=("m-big",))
    run_study(cfg, backend())
    run_study(config(tmp, trials=12, tracking_uri=uri, models=("m-big",)), backend())  # resumed: a second parent
    return tmp, uri, cfg


def test_runs_match_trials_one_to_one(logged_study):
    _, uri, cfg = logged_study
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    name = default_study_name(cfg)
    exp = client.get_experiment_by_name(name)
    parents, children = runs_by_trial(client, exp.experiment_id)
    trials = optuna.load_study(study_name=name, storage=cfg.storage).get_trials()
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    assert sorted(children) == [t.number for t in trials] and len(children) == len(trials) == 12
    parent_ids = {p.info.run_id for p in parents}
    assert {r.data.tags["mlflow.parentRunId"] for r in children.values()} == parent_ids
    for t in trials:
        run = children[t.number]
        assert {k: run.data.params[k] for k in t.user_attrs["point"]} == {k: str(v) for k, v in t.user_attrs["point"].items()}
        assert run.data.params["arch.num_tc"] == str(t.user_attrs["point"]["num_tc"])
        assert run.data.tags["sampler"] == "tpe" and run.data.tags["models"] == "m-big"
        if t.state == TrialState.FAIL:
            assert run.info.status == "FAILED" and run.data.tags["error"]
            continue
        assert run.data.tags["trial_state"] == ("COMPLETE" if is_feasible(t) else "INFEASIBLE")
        assert run.data.metrics["area_mm2"] == pytest.approx(t.user_attrs["result"]["area_mm2"])
        if is_feasible(t):
            assert run.data.metrics["throughput"] == pytest.approx(t.values[0])
            for k in ("tokens_per_s", "mfu", "time_per_batch_s", "graph_s", "estimate_s", "ilp_s", "dp_s", "tp", "pp", "dp"):
                assert k in run.data.metrics, k
        else:
            assert run.data.tags["infeasible_reason"] == t.user_attrs["result"]["reason"]
        local = client.download_artifacts(run.info.run_id, "placement.json")
        art = json.loads(Path(local).read_text())
        assert art["design"] == t.user_attrs["point"] and art["feasible"] == is_feasible(t)
        if is_feasible(t):
            m = art["models"]["m-big"]
            assert m["placement"]["stages"][0]["devices"] == 4 and len(m["layers"]) == 8


def test_parent_run_has_the_summary(logged_study):
    tmp, uri, cfg = logged_study
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parents, _ = runs_by_trial(client, client.get_experiment_by_name(default_study_name(cfg)).experiment_id)
    last = max(parents, key=lambda r: r.info.start_time)
    assert last.data.tags["resumed"] == "true" and last.data.params["sampler"] == "tpe"
    assert last.data.metrics["trials"] == 12 and "best_score" in last.data.metrics
    assert "ratio_to_tpuv4_expert" in last.data.metrics
    names = {a.path for a in client.list_artifacts(last.info.run_id)}
    assert f"{default_study_name(cfg)}-summary.json" in names
    # artifacts live under the store's folder, as `mlruns/` promises
    assert last.info.artifact_uri.startswith((tmp / "mlruns").resolve().as_uri())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url, data=None):
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_mlflow_server_serves_runs_params_metrics_and_artifact(logged_study):
    """End to end: `mlflow server` on loopback over the study's store, queried over its REST API."""
    tmp, uri, cfg = logged_study
    port = free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen([str(mlflow_bin), "server", "--backend-store-uri", uri, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], cwd=tmp, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.time() < deadline, "mlflow server did not come up"
            time.sleep(0.5)
        name = default_study_name(cfg)
        exp = get_json(f"{base}/api/2.0/mlflow/experiments/get-by-name?" + urllib.parse.urlencode({"experiment_name": name}))
        exp_id = exp["experiment"]["experiment_id"]
        runs = get_json(f"{base}/api/2.0/mlflow/runs/search", {"experiment_ids": [exp_id], "max_results": 1000})["runs"]
        trials = {t.number: t for t in optuna.load_study(study_name=name, storage=cfg.storage).get_trials()}
        children = [r for r in runs if any(t["key"] == "mlflow.parentRunId" for t in r["data"].get("tags", []))]
        assert len(children) == len(trials)
        feasible = [r for r in children
                    if any(t["key"] == "trial_state" and t["value"] == "COMPLETE" for t in r["data"]["tags"])]
        assert feasible
        run = feasible[0]
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        metrics = {m["key"]: m["value"] for m in run["data"]["metrics"]}
        trial = trials[int(tags["optuna.trial_number"])]
        assert params["mbs"] == str(trial.user_attrs["point"]["mbs"])
        assert metrics["throughput"] == pytest.approx(trial.values[0])
        assert tags["sampler"] == "tpe" and tags["models"] == "m-big"
        run_id = run["info"]["run_id"]
        listing = get_json(f"{base}/api/2.0/mlflow/artifacts/list?" + urllib.parse.urlencode({"run_id": run_id}))
        assert [f["path"] for f in listing["files"]] == ["placement.json"]
        with urllib.request.urlopen(f"{base}/get-artifact?" + urllib.parse.urlencode(
                {"path": "placement.json", "run_uuid": run_id}), timeout=30) as r:
            art = json.loads(r.read())
        assert art["design"] == trial.user_attrs["point"]
        assert art["models"]["m-big"]["throughput"] == pytest.approx(trial.values[0])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the workers it started, by its process group id
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
