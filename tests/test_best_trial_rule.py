"""One best trial everywhere: ties go to the first trial to reach the best score; repeats are flagged.

A study whose evaluator caps the throughput, so that many designs tie at the best, is run with MLflow
on; the summary, the parent run's tags and metric, the best_score chart, compare's curve and Optuna's
own `best_trial` must all name the same trial, the lowest-numbered of the tied ones.
"""

from __future__ import annotations

import optuna
import pytest

from phaze_opt.experiments.convergence import curve_from_trials
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import REPEAT_ATTR, best_trial, is_feasible
from phaze_opt.search.setup import default_study_name
from test_study_fakes import backend, best_score_series, config, fake_evaluate, mlflow_uri, small_space

CAP = 600.0


def capped_evaluate(model, arch, training, system="default"):
    """fake_evaluate with the throughput capped: every design above the cap ties with the others."""
    r = fake_evaluate(model, arch, training, system=system)
    if r.feasible and training.placement.spec() == "optimal" and r.throughput > CAP:
        r.throughput = r.throughput_bound = CAP
    return r


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tied")
    uri = mlflow_uri(tmp)
    cfg = config(tmp, trials=40, tracking_uri=uri, sampler="random")
    summary = run_study(cfg, backend(small_space(), evaluator=capped_evaluate))
    study = optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage)
    return cfg, uri, summary, study


def test_the_study_has_ties_at_the_best(tied):
    _, _, _, study = tied
    feasible = [t for t in study.get_trials() if is_feasible(t)]
    best = max(t.values[0] for t in feasible)
    assert sum(t.values[0] == best for t in feasible) >= 3  # else this file tests nothing


def test_every_view_names_the_first_trial_to_reach_the_best(tied):
    cfg, uri, summary, study = tied
    trials = study.get_trials()
    best = max(t.values[0] for t in trials if is_feasible(t))
    first = min(t.number for t in trials if is_feasible(t) and t.values[0] == best)
    assert best_trial(trials).number == first
    assert summary["best"]["trial"] == first
    assert study.best_trial.number == first  # Optuna's view (and optuna-dashboard's)
    assert curve_from_trials("s", cfg.storage, trials, study.user_attrs).best_trial == first  # compare
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(default_study_name(cfg))
    parent = [r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags][0]
    assert parent.data.tags["best_trial"] == str(first)
    assert parent.data.metrics["best_trial"] == first
    steps = best_score_series(client, parent.info.run_id)
    assert steps[-1] == (first, best)  # the chart reaches the best at that trial


def test_repeated_designs_are_flagged_and_counted(tied):
    _, _, summary, study = tied
    trials = study.get_trials()
    repeats = [t for t in trials if REPEAT_ATTR in t.user_attrs]
    assert repeats  # 40 random draws from 88 points repeat some
    by_number = {t.number: t for t in trials}
    for t in trials:
        earlier = [u.number for u in trials if u.number < t.number and u.params == t.params]
        if earlier:
            assert t.user_attrs[REPEAT_ATTR] == min(earlier)
            assert by_number[min(earlier)].user_attrs["point"] == t.user_attrs["point"]
        else:
            assert REPEAT_ATTR not in t.user_attrs
    assert summary["trials"]["repeated_designs"] == len(repeats)


def test_optuna_shows_the_decoded_design(tied):
    _, _, _, study = tied
    frame = study.trials_dataframe()
    for t in study.get_trials():
        for key, value in t.user_attrs["point"].items():
            assert t.user_attrs[f"design.{key}"] == value
    assert "user_attrs_design.num_tc" in frame.columns
    assert set(frame["user_attrs_design.num_tc"]) <= {1, 2, 4, 8}  # values, not log2 indices
