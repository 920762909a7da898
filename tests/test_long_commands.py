"""Long commands speak up: a heartbeat line every 10 s, and a study with nothing to run says so at once."""

from __future__ import annotations

import threading
import time

import optuna

from phaze_opt import cli
from phaze_opt.runs.progress import Heartbeat
from phaze_opt.search.runner import run_study
from phaze_opt.search.setup import default_study_name
from test_study_fakes import backend, config, mlflow_uri


def test_heartbeat_line_names_the_work_and_the_time():
    now = [100.0]
    beat = Heartbeat("evaluate gpt3-175b on tpuv4", clock=lambda: now[0])
    now[0] = 145.0
    assert beat.line() == "[evaluate gpt3-175b on tpuv4] still working, 45s"


def test_heartbeat_prints_while_the_work_runs_and_stops_after():
    lines, seen = [], threading.Event()

    def out(text):
        lines.append(text)
        if len(lines) >= 2:
            seen.set()

    with Heartbeat("work", every_s=0.01, out=out):
        assert seen.wait(30)  # the work outlives two beats: two lines came
    count = len(lines)
    time.sleep(0.05)
    assert len(lines) == count and all(line.startswith("[work] still working, ") for line in lines)


def test_quick_work_prints_nothing():
    lines = []
    with Heartbeat("work", every_s=3600, out=lines.append):
        pass
    assert lines == []


def test_the_long_commands_have_a_heartbeat():
    parser = cli.build_parser()
    for name, argv in (("evaluate", []), ("schedule", ["--model", "gpt3-175b"]), ("validate", []),
                       ("measure", ["--model", "gpt3-175b"]), ("published", [])):
        args = parser.parse_args([name, *argv])
        assert args._module.heartbeat(args), name


def test_every_command_but_the_ui_server_has_a_heartbeat_and_no_progress_silences_a_study():
    parser = cli.build_parser()
    assert cli.heartbeat_label(*_module_args(parser, ["workload", "--model", "gpt2-xl"])) == "workload gpt2-xl"
    assert cli.heartbeat_label(*_module_args(parser, ["export", "some-study"])) == "export"
    assert cli.heartbeat_label(*_module_args(parser, ["study", "--model", "gpt2-xl"])) == "study gpt2-xl"
    assert cli.heartbeat_label(*_module_args(parser, ["study", "--no-progress"])) is None
    assert cli.heartbeat_label(*_module_args(parser, ["ui"])) is None


def _module_args(parser, argv):
    args = parser.parse_args(argv)
    return args._module, args


def test_a_line_shown_by_the_command_restarts_the_heartbeats_wait():
    from phaze_opt.activity import phase
    from phaze_opt.runs import progress

    lines = []
    with Heartbeat("work", every_s=2.0, out=lines.append):
        for _ in range(8):  # the command itself speaks every 0.1 s: the heartbeat stays quiet
            progress.spoke()
            time.sleep(0.1)
        assert lines == []
        with phase("tracing the graphs"):
            deadline = time.monotonic() + 30
            while not lines and time.monotonic() < deadline:
                time.sleep(0.05)
    assert lines and lines[0].startswith("[work] still tracing the graphs, ")


def test_a_study_asked_for_fewer_trials_than_it_holds_runs_nothing(tmp_path, capsys):
    uri = mlflow_uri(tmp_path)
    run_study(config(tmp_path, trials=6, tracking_uri=uri), backend())
    cfg = config(tmp_path, trials=4, tracking_uri=uri)
    study = optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage)
    attrs_before = dict(study.user_attrs)
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(default_study_name(cfg)).experiment_id
    runs_before = len(client.search_runs([exp], max_results=1000))
    capsys.readouterr()
    result = run_study(cfg, backend())
    err = capsys.readouterr().err
    assert result["nothing_to_run"] and result["held"] == 6
    assert result["trials"]["finished"] == 6 and result["best"] is not None  # the saved summary, for callers
    assert "already holds 6 finished trials" in err and "--trials 4" in err
    assert len(client.search_runs([exp], max_results=1000)) == runs_before  # no new parent run
    study = optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage)
    assert dict(study.user_attrs) == attrs_before  # wall time and workers untouched
    assert len(study.get_trials()) == 6


def test_a_study_whose_last_run_left_no_summary_still_reports_its_best(tmp_path):
    """The parent that finished the study was killed before writing its summary: a start that runs
    nothing still says the study's best (read from its trials), not nothing."""
    import glob
    import os

    first = run_study(config(tmp_path, trials=6, tracking_uri="off"), backend())
    for path in glob.glob(str(tmp_path / "**" / "*-summary.json"), recursive=True):
        os.remove(path)
    result = run_study(config(tmp_path, trials=6, tracking_uri="off"), backend())
    assert result["nothing_to_run"] and result["summary_file"] is None
    assert result["best"]["trial"] == first["best"]["trial"] and result["best"]["score"] == first["best"]["score"]


def test_a_study_at_its_total_still_reconciles_on_start(tmp_path, capsys):
    """A parent killed as its last trial finished: trials without an MLflow run, its own run left
    RUNNING. The same command again runs nothing, but logs the missing runs and closes the dead run
    (this process counts as gone to reconciliation, like a parent killed with SIGKILL)."""
    from mlflow import MlflowClient

    from phaze_opt.search.session import finished_trials

    uri = mlflow_uri(tmp_path)
    cfg = config(tmp_path, trials=6, tracking_uri=uri)
    run_study(cfg, backend())
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(default_study_name(cfg)).experiment_id
    runs = client.search_runs([exp], max_results=1000)
    parents = [r for r in runs if "optuna.trial_number" not in r.data.tags]
    trial_runs = [r for r in runs if "optuna.trial_number" in r.data.tags]
    for r in trial_runs[:2]:
        client.delete_run(r.info.run_id)
    client.update_run(parents[0].info.run_id, status="RUNNING")
    study = optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage)
    attrs_before = dict(study.user_attrs)
    capsys.readouterr()
    result = run_study(cfg, backend())
    err = capsys.readouterr().err
    assert result["nothing_to_run"] and "already holds 6 finished trials" in err
    assert "2 missing trial runs logged, 1 runs left RUNNING closed as KILLED" in err
    runs = client.search_runs([exp], max_results=1000)
    assert [r.info.status for r in runs if "optuna.trial_number" not in r.data.tags] == ["KILLED"]  # no new one
    done = finished_trials(optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage).get_trials())
    logged = sorted(int(r.data.tags["optuna.trial_number"]) for r in runs if "optuna.trial_number" in r.data.tags)
    assert logged == sorted(t.number for t in done) and len(done) == 6
    assert {r.info.status for r in runs} <= {"FINISHED", "FAILED", "KILLED"}
    assert dict(optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage).user_attrs) == attrs_before
