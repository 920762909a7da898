"""The fault-injection run (tests/fault_injection.py) at a small size: a 2-worker study SIGKILLed at 4
moments (Optuna schema creation, MLflow database creation, then random; parent alone or the whole
process group), resumed each time, then checked. `python tests/fault_injection.py --kills 20` is the
full run."""

from fault_injection import run


def test_a_killed_and_resumed_study_is_consistent(tmp_path):
    counts = run(kills=4, trials=24, workers=2, seed=1, work=tmp_path)
    assert counts["problems"] == [], counts
    assert counts["open_trials"] == 0 and counts["running_runs"] == 0
    assert counts["mlflow_trial_runs"] == counts["finished_trials"]
    assert counts["best"] == counts["uninterrupted_best"]
