"""The fault-injection run (tests/fault_injection.py) at a small size: a 2-worker study SIGKILLed at 4
moments (Optuna schema creation, MLflow database creation, then random; parent alone or the whole
process group), resumed each time, then checked. `python tests/fault_injection.py --kills 20` is the
full run."""

import pytest
from fault_injection import run, storm


def test_a_killed_and_resumed_study_is_consistent(tmp_path):
    counts = run(kills=4, trials=24, workers=2, seed=1, work=tmp_path)
    assert counts["problems"] == [], counts
    assert counts["runs_without_placement"] == 0  # the orphans' spools were logged at the next start
    assert counts["open_trials"] == 0 and counts["running_runs"] == 0
    assert counts["mlflow_trial_runs"] == counts["finished_trials"]
    assert counts["best"] == counts["uninterrupted_best"]


@pytest.mark.parametrize("workers", [1, 2])
def test_every_signal_stops_the_study_cleanly(tmp_path, workers):
    """A short signal storm (SIGINT, SIGTERM, SIGHUP, two of them into the trials): exit 130, no
    traceback, parent runs KILLED, no finished evaluation redone, every run with its placement.json.
    The stop time is bounded loosely here (a loaded CI machine); `python tests/fault_injection.py
    --storm 50` holds it to 10 s."""
    counts = storm(rounds=4, workers=workers, trials=32, seed=workers, work=tmp_path, stop_limit_s=30.0)
    assert counts["problems"] == [], counts
    assert counts["rounds"] >= 3 and counts["runs_without_placement"] == 0
