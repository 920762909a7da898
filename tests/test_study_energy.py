"""`--objectives throughput,energy` end to end with the real pipeline: a short gpt2-xl study on the
`small` space completes, every feasible trial has a finite energy objective equal to the model's
energy per batch, the Pareto front is saved as a PNG, and MLflow runs carry the energy_j metric."""

import json
import math
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from phaze_opt import cli
from phaze_opt.search.session import is_feasible
from test_study_fakes import mlflow_uri

NAME = "gpt2-xl-small-tpe-seed0-throughput+energy"


@pytest.mark.slow
def test_throughput_energy_study_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = mlflow_uri(tmp_path)
    code = cli.main(["study", "--model", "gpt2-xl", "--space", "small", "--trials", "6", "--objectives",
                     "throughput,energy", "--no-progress", "--tracking-uri", uri, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    summary = json.loads(out.out)
    assert summary["objectives"] == ["throughput", "energy"]
    assert summary["baselines"]["gpt2-xl"]["energy_j"] > 0  # TPUv4 with the expert placement

    trials = optuna.load_study(study_name=NAME, storage=f"sqlite:///studies/{NAME}.db").get_trials()
    assert len(trials) == 6 and all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    feasible = [t for t in trials if is_feasible(t)]
    assert feasible
    for t in feasible:
        energy = t.user_attrs["result"]["models"]["gpt2-xl"]["energy_j"]
        assert len(t.values) == 2 and math.isfinite(t.values[1]) and t.values[1] > 0
        assert t.values[1] == pytest.approx(energy)
    # the TPUv4 reference trials differ only in microbatch/recompute: their energies differ too
    assert len({round(t.values[1], 3) for t in feasible}) > 1

    pareto = summary["pareto"]
    assert pareto["trials"] and {p["trial"] for p in pareto["trials"]} <= {t.number for t in feasible}
    assert Path(pareto["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(NAME)
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=100) if "mlflow.parentRunId" in r.data.tags]
    by_trial = {int(r.data.tags["optuna.trial_number"]): r for r in runs}
    for t in feasible:
        metrics = by_trial[t.number].data.metrics
        assert metrics["energy_j"] == pytest.approx(t.values[1])
        assert metrics["objective.energy_j"] == pytest.approx(t.values[1])
