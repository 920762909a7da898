"""The study's acceptance flow, end to end with the real pipeline (graphs -> latencies -> ILP -> placement DP):

a 20-trial gpt2-xl study on the `small` space, an exhaustive sweep of the same space, then `compare`,
all through the CLI; checks the Optuna trials, the MLflow runs and artifacts, the table and the PNG.
Its time (about 3 minutes on a quiet 2-core machine) is asserted only when PHAZE_OPT_ACCEPTANCE_LIMIT_S
asks for it: on a shared machine, or beside another test process, a wall-clock limit fails for reasons
that are not the code's (the project's speed figures are benchmarks, BENCHMARKS.md).
"""

import csv
import json
import os
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import optuna
import pytest
from optuna.trial import TrialState

from phaze_opt import cli
from phaze_opt.design.space import load_space
from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.session import is_feasible

LIMIT_S = float(os.environ.get("PHAZE_OPT_ACCEPTANCE_LIMIT_S", "inf"))
SAMPLED = "gpt2-xl-small-bound-seed0"
EXHAUSTIVE = "gpt2-xl-small-exhaustive-area-hoff"


def run_cli(args, capsys) -> dict:
    code = cli.main(args + ["--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return json.loads(out.out)


@pytest.mark.slow
def test_sampled_exhaustive_compare_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    sampled = run_cli(["study", "--model", "gpt2-xl", "--space", "small", "--trials", "20", "--no-progress"], capsys)
    exhaustive = run_cli(["study", "--model", "gpt2-xl", "--space", "small", "--exhaustive", "--prune", "off",
                          "--no-progress"], capsys)
    compared = run_cli(["compare", SAMPLED, EXHAUSTIVE], capsys)
    wall = time.perf_counter() - start
    assert wall < LIMIT_S, f"end to end took {wall:.0f} s"

    space = load_space("small")
    codec = SpaceCodec(space.params)
    # Optuna: 20 finished trials, the TPUv4 reference first at every microbatch x recompute setting
    s_study = optuna.load_study(study_name=SAMPLED, storage=f"sqlite:///studies/{SAMPLED}.db")
    s_trials = s_study.get_trials()
    # the default (bound-guided) sampler stops once no point left can beat its best
    settled = "bound_settled" in s_study.user_attrs
    assert len(s_trials) == 20 or (settled and len(s_trials) < 20)
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in s_trials)
    refs = [space.reference_point("tpuv4", recipe={"mbs": m, "recompute": r}) for m in space.params["mbs"]
            for r in space.params["recompute"]]
    assert [codec.decode(t.params) for t in s_trials[:len(refs)]] == refs
    assert any(is_feasible(t) for t in s_trials)
    # every grid point once in the exhaustive study, and its best is the true optimum of the space
    e_trials = optuna.load_study(study_name=EXHAUSTIVE, storage=f"sqlite:///studies/{EXHAUSTIVE}.db").get_trials()
    grid = {tuple(sorted(p.items())) for p in space.grid_points("grid")}
    assert {tuple(sorted(codec.decode(t.params).items())) for t in e_trials} == grid and len(e_trials) == len(grid)
    e_best = max(t.values[0] for t in e_trials if is_feasible(t))
    s_best = max(t.values[0] for t in s_trials if is_feasible(t))
    assert e_best >= s_best
    if settled:  # it claimed the optimum: the exhaustive sweep's, to the last digit
        assert s_best == pytest.approx(e_best, rel=1e-12)
    assert exhaustive["best"]["score"] == pytest.approx(e_best) and sampled["best"]["score"] == pytest.approx(s_best)
    assert exhaustive["best"]["ratio_to_tpuv4_expert"] > 0 and sampled["best"]["models"]["gpt2-xl"]["placement"]["stages"]

    # MLflow: one nested run per trial with params, metrics, tags and placement.json
    from mlflow import MlflowClient

    client = MlflowClient("sqlite:///mlruns/mlflow.db")
    for name, trials in ((SAMPLED, s_trials), (EXHAUSTIVE, e_trials)):
        exp = client.get_experiment_by_name(name)
        runs = client.search_runs([exp.experiment_id], max_results=5000)
        children = {int(r.data.tags["optuna.trial_number"]): r for r in runs if "mlflow.parentRunId" in r.data.tags}
        parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags][0]
        assert parent.data.params["arch.clock_hz"] == "1050000000.0" and parent.data.params["tc_y"] == "128"
        assert sorted(children) == sorted(t.number for t in trials)
        for t in trials:
            run = children[t.number]
            assert run.data.params["num_tc"] == str(t.user_attrs["point"]["num_tc"])
            assert "arch.clock_hz" not in run.data.params and "tc_y" not in run.data.params  # fixed by the space
            assert run.data.tags["models"] == "gpt2-xl" and run.data.tags["trial_state"]
            if is_feasible(t):
                assert run.data.metrics["throughput_seq_per_s"] == pytest.approx(t.values[0])
                for k in ("tokens_per_s", "area_mm2", "mfu", "time_per_batch_s", "graph_s", "estimate_s", "ilp_s", "dp_s"):
                    assert k in run.data.metrics
            if t.state == TrialState.COMPLETE:
                local = Path(unquote(urlparse(run.info.artifact_uri).path)) / "placement.json"
                art = json.loads(local.read_text())
                assert art["design"] == t.user_attrs["point"]
                if is_feasible(t):
                    model = art["models"]["gpt2-xl"]
                    assert model["placement"]["stages"] and model["layers"]

    # compare: the table and the plot, logged to MLflow
    rows = list(csv.DictReader(open(compared["csv"])))
    assert [r["study"] for r in rows] == [SAMPLED, EXHAUSTIVE]
    assert float(rows[1]["best_score"]) == pytest.approx(e_best) and rows[1]["trials"] == str(len(grid))
    assert rows[1]["trials_to_99pct"] != ""
    assert open(compared["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    names = {a.path for a in client.list_artifacts(compared["mlflow"]["run_id"])}
    assert Path(compared["plot"]).name in names and Path(compared["csv"]).name in names
