"""MLflow logging: what a trial's run holds, runs 1:1 with trials, and the store served over REST."""

import json
import os
import re
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
from phaze_opt.search.objective import Context, evaluate_point
from phaze_opt.search.report import render
from phaze_opt.runs.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, NOTE_TAG, redact, sqlite_path, trial_record
from test_study_fakes import FAKE_FEATURES, FakeSpace, backend, best_score_series, config, expected_best_series, mlflow_uri

OLD_METRIC_NAMES = {"throughput", "throughput_bound", "area", "energy", "objective.throughput", "objective.area",
                    "objective.energy", "best_throughput", "baseline_throughput"}


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
    assert rec.params == {"mbs": "2", "recompute": "True", "arch.num_tc": "8", "arch.name": "x",
                          # the whole training recipe, the unsampled fields at their defaults
                          "recipe.recompute": "full", "recipe.sequence_parallel": "False",
                          "recipe.virtual_stages": "1", "recipe.zero": "0", "recipe.overlap_grad_reduce": "False",
                          "recipe.attention": "None"}
    m = rec.metrics
    assert m["throughput_seq_per_s"] == 123.0 and m["tokens_per_s"] == 5e5 and m["mfu"] == 0.4
    assert m["area_mm2"] == 250.0 and m["time_per_batch_s"] == 33.3
    assert (m["tp"], m["pp"], m["dp"], m["microbatches"]) == (8, 4, 32, 64)
    assert (m["graph_s"], m["ilp_s"], m["elapsed_s"], m["objective.throughput_seq_per_s"]) == (1.0, 2.0, 4.5, 123.0)
    assert "energy_j" not in m  # not given by the hardware model: not logged
    assert not set(m) & OLD_METRIC_NAMES
    # params the whole space shares are the parent's, not the trial's
    rec = trial_record(frozen(result=result), study_name="s", sampler="tpe", models=["gpt"], mode="sampled",
                       constant=["recompute", "arch.name"])
    assert {k: v for k, v in rec.params.items() if not k.startswith("recipe.")} == {"mbs": "2", "arch.num_tc": "8"}
    assert rec.tags["trial_state"] == "COMPLETE" and rec.tags["feasible"] == "true"
    assert (rec.tags["sampler"], rec.tags["models"], rec.tags["optuna.trial_number"]) == ("tpe", "gpt", "7")
    assert rec.status == "FINISHED" and rec.step == 7


def test_trial_record_of_infeasible_failed_and_multi_model_trials():
    rec = trial_record(frozen(values=(0.0,), constraints=(0.2, 0.0),
                              result={"feasible": False, "reason": "area 300 mm^2 over budget", "models": {}}),
                       study_name="s", sampler="random", models=["a"], mode="exhaustive")
    assert rec.tags["trial_state"] == "INFEASIBLE" and rec.tags["infeasible_reason"] == "area 300 mm^2 over budget"
    assert rec.status == "FINISHED"
    rec = trial_record(frozen(state=TrialState.FAIL, values=None, result={"error": "ValueError: boom"}),
                       study_name="s", sampler="tpe", models=["a"], mode="sampled")
    assert rec.tags["trial_state"] == "FAIL" and rec.tags["error"] == "ValueError: boom" and rec.status == "FAILED"
    two = {"a": {"throughput": 1.0, "timings": {"ilp_s": 1.0}}, "b": {"throughput": 2.0, "timings": {"ilp_s": 3.0}}}
    rec = trial_record(frozen(result={"feasible": True, "models": two}), study_name="s", sampler="tpe",
                       models=["a", "b"], mode="sampled")
    assert rec.metrics["a.throughput_seq_per_s"] == 1.0 and rec.metrics["b.throughput_seq_per_s"] == 2.0
    assert rec.metrics["ilp_s"] == 4.0 and rec.metrics["b.ilp_s"] == 3.0
    assert rec.metrics["objective.throughput_ratio_to_tpuv4"] == 123.0


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
    first = run_study(cfg, backend())
    second = run_study(config(tmp, trials=12, tracking_uri=uri, models=("m-big",)), backend())  # resumed: a second parent
    LOGGED_SUMMARIES[:] = [first, second]
    return tmp, uri, cfg


LOGGED_SUMMARIES: list = []


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
        # the run lasts as long as the trial did, and says in one line what came out
        assert run.info.start_time == int(t.datetime_start.timestamp() * 1000)
        assert run.info.end_time == int(t.datetime_complete.timestamp() * 1000)
        note = run.data.tags["mlflow.note.content"]
        if t.state == TrialState.FAIL:
            assert run.info.status == "FAILED" and run.data.tags["error"]
            assert note == f"Failed: {run.data.tags['error']}."
            continue
        if is_feasible(t):
            assert note.startswith(f"Feasible: m-big: {t.values[0]:,.1f} sequences/s") and "placement TP " in note
        else:
            assert note == f"Infeasible: {t.user_attrs['result']['reason']}."
        assert run.data.tags["trial_state"] == ("COMPLETE" if is_feasible(t) else "INFEASIBLE")
        assert run.data.metrics["area_mm2"] == pytest.approx(t.user_attrs["result"]["area_mm2"])
        if is_feasible(t):
            assert run.data.metrics["throughput_seq_per_s"] == pytest.approx(t.values[0])
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


def test_experiment_opens_on_its_runs_and_describes_itself(logged_study):
    _, uri, cfg = logged_study
    from mlflow import MlflowClient

    exp = MlflowClient(uri).get_experiment_by_name(default_study_name(cfg))
    # MLflow 3's UI opens an experiment without this tag on its GenAI overview, with it on the runs table
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    # the trials view the printed link opens: trial runs, best score first, unit-bearing metric columns
    view = json.loads(exp.tags["mlflow.sharedViewState.trials"])
    assert view["orderByKey"] == "metrics.`score`" and view["orderByAsc"] is False
    assert view["searchFilter"] == "attributes.run_name LIKE 'trial %'"
    assert {"metrics.`throughput_seq_per_s`", "metrics.`area_mm2`", "metrics.`mfu`", "params.`num_tc`"} <= set(
        view["selectedColumns"])
    note = exp.tags[NOTE_TAG]
    for text in ("models: m-big", "space: fake", "system: default", "objectives: throughput (maximize)",
                 "sampler: tpe", "`throughput_seq_per_s`: training throughput, sequences per second",
                 "`mfu`: model FLOPs utilisation, a fraction", "`area_mm2`", "`time_per_batch_s`", "`energy_j`",
                 "`tokens_per_s`", "`graph_s, estimate_s, ilp_s, dp_s`", "`best_score`"):
        assert text in note, text


def test_parent_runs_have_unique_readable_names(logged_study):
    _, uri, cfg = logged_study
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parents, _ = runs_by_trial(client, client.get_experiment_by_name(default_study_name(cfg)).experiment_id)
    first, second = sorted(parents, key=lambda r: r.info.start_time)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(re.escape(default_study_name(cfg)) + " " + stamp, first.info.run_name)
    assert re.fullmatch(re.escape(default_study_name(cfg)) + " " + stamp + r" \(resumed\)", second.info.run_name)
    assert LOGGED_SUMMARIES[1]["mlflow"]["parent_run_name"] == second.info.run_name


def test_best_score_is_the_best_so_far_by_trial_number(logged_study):
    _, uri, cfg = logged_study
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parents, _ = runs_by_trial(client, client.get_experiment_by_name(default_study_name(cfg)).experiment_id)
    first, second = sorted(parents, key=lambda r: r.info.start_time)
    trials = optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage).get_trials()
    # each parent: one point per improvement at the trial's number, never re-logged (at step 0 or elsewhere);
    # the resumed invocation's parent holds the curve of the whole study
    assert best_score_series(client, first.info.run_id) == expected_best_series(trials[:8])
    series = best_score_series(client, second.info.run_id)
    assert series == expected_best_series(trials) and len(series) >= 2
    steps, values = zip(*series)
    assert list(steps) == sorted(set(steps)) and list(values) == sorted(set(values))
    assert values[-1] == LOGGED_SUMMARIES[1]["best"]["score"]


def test_metric_names_carry_units(logged_study):
    _, uri, cfg = logged_study
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parents, children = runs_by_trial(client, client.get_experiment_by_name(default_study_name(cfg)).experiment_id)
    feasible = [r for r in children.values() if r.data.tags.get("trial_state") == "COMPLETE"]
    assert feasible
    for run in feasible:
        assert {"throughput_seq_per_s", "throughput_bound_seq_per_s", "tokens_per_s", "time_per_batch_s", "area_mm2",
                "mfu", "graph_s", "ilp_s", "objective.throughput_seq_per_s"} <= set(run.data.metrics)
    for run in parents + list(children.values()):
        assert not set(run.data.metrics) & OLD_METRIC_NAMES, run.info.run_name
        assert not set(run.data.params) & OLD_METRIC_NAMES, run.info.run_name
    last = max(parents, key=lambda r: r.info.start_time)
    assert {"best_throughput_seq_per_s", "best_tokens_per_s", "best_mfu", "best_area_mm2"} <= set(last.data.metrics)
    assert "baseline_throughput_seq_per_s" in last.data.params


def test_every_run_carries_the_models_features(logged_study):
    from mlflow import MlflowClient

    tmp, uri, cfg = logged_study
    client = MlflowClient(uri)
    parents, children = runs_by_trial(client, client.get_experiment_by_name(default_study_name(cfg)).experiment_id)
    expected = {f"model.{k}": v for k, v in FAKE_FEATURES["m-big"].items()}
    for p in parents:
        assert {k: p.data.params.get(k) for k in expected} == expected
    assert children
    for run in children.values():
        assert {k: run.data.tags.get(k) for k in expected} == expected


def test_a_common_design_names_each_models_features_by_model():
    rec = trial_record(frozen(result={"feasible": True}), study_name="s", sampler="tpe", models=["m-big", "m-small"],
                       mode="sampled", model_tags={"m-big.model.attention": "gqa", "m-small.model.attention": "mha"})
    assert (rec.tags["m-big.model.attention"], rec.tags["m-small.model.attention"]) == ("gqa", "mha")


def test_params_the_space_fixes_are_on_the_parent_only(logged_study):
    _, uri, cfg = logged_study
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    parents, children = runs_by_trial(client, client.get_experiment_by_name(default_study_name(cfg)).experiment_id)
    constant = {"arch.num_vc": "2", "arch.glb_bw": "1000000000000.0", "arch.clock_hz": "1000000000.0"}
    for p in parents:
        assert {k: p.data.params[k] for k in constant} == constant
    for run in children.values():
        assert not set(constant) & set(run.data.params)
        assert {"arch.num_tc", "arch.tc_x", "arch.hbm_bw", "num_tc", "mbs"} <= set(run.data.params)


@pytest.fixture(scope="module")
def logged_sweep(tmp_path_factory):
    """An exhaustive sweep of 16 points in which glb_mib and hbm_gib have one choice each."""
    tmp = tmp_path_factory.mktemp("mlx")
    uri = mlflow_uri(tmp)
    space = FakeSpace(params={"num_tc": [2, 4], "tc_x": [8, 16], "glb_mib": [4], "hbm_gib": [32], "mbs": [1, 2],
                              "recompute": [False, True]})
    cfg = config(tmp, strategy="auto", tracking_uri=uri, storage=None)
    return uri, cfg, run_study(cfg, backend(space))


def test_exhaustive_sweep_logs_the_same_way(logged_sweep):
    uri, cfg, summary = logged_sweep
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    name = default_study_name(cfg)
    exp = client.get_experiment_by_name(name)
    assert exp.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND and "sampler: exhaustive" in exp.tags[NOTE_TAG]
    parents, children = runs_by_trial(client, exp.experiment_id)
    (parent,) = parents
    trials = optuna.load_study(study_name=name, storage=cfg.storage or f"sqlite:///{cfg.output_dir}/{name}.db").get_trials()
    assert len(children) == len(trials) == 16
    assert best_score_series(client, parent.info.run_id) == expected_best_series(trials)
    assert parent.data.params["glb_mib"] == "4" and parent.data.params["hbm_gib"] == "32"
    assert all("glb_mib" not in r.data.params and "hbm_gib" not in r.data.params for r in children.values())
    # the sweep's counterpart is the default TPE study
    assert summary["next"]["other_study"] == "m-small-fake-tpe-seed0" and "--exhaustive" not in summary["next"]["run_other"]


def test_the_end_of_a_study_says_how_to_look_at_it(logged_study):
    tmp, uri, cfg = logged_study
    summary = LOGGED_SUMMARIES[1]
    text = render(summary)
    ml = summary["mlflow"]
    name = default_study_name(cfg)
    mlflow_bin = Path(os.path.abspath(sys.executable)).parent / "mlflow"
    if mlflow_bin.is_relative_to(Path.cwd()):  # the study ran here: the command names the venv relatively
        mlflow_bin = mlflow_bin.relative_to(Path.cwd())
    assert ml["ui"] == (f"MLFLOW_DISABLE_TELEMETRY=true {mlflow_bin} ui --backend-store-uri {uri} "
                        "--host 127.0.0.1 --port 5000 --workers 1")
    # the model-training layout of MLflow 3.17's UI (it otherwise opens a GenAI layout, whatever the experiment's kind)
    assert ml["run_url"] == (f"http://127.0.0.1:5000/#/experiments/{ml['experiment_id']}/runs/{ml['parent_run_id']}"
                             "?workflowType=machine_learning")
    assert ml["trials_url"] == (f"http://127.0.0.1:5000/#/experiments/{ml['experiment_id']}/runs"
                                "?workflowType=machine_learning&viewStateShareKey=trials")
    summary_file = f"{cfg.output_dir}/{name}-summary.json"
    assert summary["summary_file"] == summary_file and Path(summary_file).is_file()
    nxt = summary["next"]
    assert nxt["other_study"] == "m-big-fake-exhaustive-area-hoff" and nxt["other_exists"] is None  # --storage given
    assert nxt["compare"].endswith(f"phaze-opt compare {name} m-big-fake-exhaustive-area-hoff --output-dir "
                                   f"{cfg.output_dir} --storage {cfg.storage} --tracking-uri {uri}")
    assert nxt["run_other"].endswith("phaze-opt study --model m-big --space fake --exhaustive --output-dir "
                                     f"{cfg.output_dir} --storage {cfg.storage} --tracking-uri {uri}")
    for line in (f"summary: {summary_file}", f"open the UI:  {ml['ui']}", f"this run:     {ml['run_url']}",
                 f"the trials:   {ml['trials_url']}",
                 f"then compare: {nxt['compare']}", nxt["run_other"], f"parent run '{ml['parent_run_name']}'"):
        assert line in text, line
    saved = json.loads(Path(summary_file).read_text())
    assert (saved["mlflow"]["ui"], saved["mlflow"]["run_url"], saved["next"]) == (ml["ui"], ml["run_url"], nxt)


def test_an_infeasible_reason_is_one_sentence():
    from phaze_opt.design.space import load_space

    space = load_space("small")
    point = dict(space.reference_point("tpuv4"), num_tc=16, tc_x=128, glb_mib=128)
    ctx = Context(models=("gpt2-xl",), system="default", space=space, evaluator=None, objectives=("throughput",),
                  baselines={})
    outcome = evaluate_point(point, ctx)  # over the area budget: rejected before any evaluation
    area = space.area_check(point)[1]
    assert not outcome.feasible
    assert outcome.reason == f"area {area:.1f} mm^2 exceeds the {space.area_budget_mm2:.1f} mm^2 budget (tpuv4)"


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
        assert metrics["throughput_seq_per_s"] == pytest.approx(trial.values[0])
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
