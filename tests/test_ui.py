"""`phaze-opt ui`: MLflow served on the store, on 127.0.0.1 and a free port, opened on the trials."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import mlflow
import pytest

import phaze_opt
from phaze_opt import cli
from phaze_opt.runs import ui_server


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlruns").mkdir()
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"  # absolute: MLflow keeps one store per URI in a process
    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    ids = {name: client.create_experiment(name) for name in ("study-a", "study-b")}
    return tmp_path, uri, ids


def test_free_port_is_bindable():
    import socket

    port = ui_server.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_every_printed_page_opens_the_model_training_layout(store):
    _, uri, ids = store
    target = ui_server.find_study(uri, "study-b")
    assert target.study == ("study-b", ids["study-b"])
    lines = ui_server.page_lines(target, "127.0.0.1", 5123)
    urls = [w for line in lines for w in line.split() if w.startswith("http") and "#" in w]
    assert len(urls) == 3  # the experiments list and both studies' trials
    for url in urls:
        query = parse_qs(url.split("?", 1)[1])
        assert query["workflowType"] == ["machine_learning"]
    opened = [line for line in lines if "opened" in line]
    assert len(opened) == 1 and f"/experiments/{ids['study-b']}/runs?" in opened[0]


def test_the_only_study_is_opened_without_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlruns").mkdir()
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    exp = mlflow.tracking.MlflowClient(tracking_uri=uri).create_experiment("alone")
    assert ui_server.find_study(uri, None).study == ("alone", exp)


@pytest.mark.parametrize("argv, words", [
    (["--study", "nope"], ["--study nope: no such experiment", "study-a, study-b"]),
    (["--tracking-uri", "sqlite:///elsewhere/mlflow.db"], ["no MLflow store at elsewhere/mlflow.db"]),
    (["--port", "70000"], ["--port must be at most 65,535"]),
])
def test_bad_input_is_one_line(store, capsys, argv, words):
    _, uri, _ = store
    assert cli.main(["ui", "--tracking-uri", uri, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


@contextmanager
def ui(root, *argv: str, lines: int, stop=signal.SIGINT):
    """`phaze-opt ui ARGV` started in `root`: yields (the first `lines` lines it printed, the process);
    at the end `stop` (Ctrl-C by default) and its exit."""
    here = str(Path(phaze_opt.__file__).resolve().parents[1])  # this checkout, not another install
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DISPLAY": "", "WAYLAND_DISPLAY": "",
           "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "phaze_opt", "ui", *argv], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield [proc.stdout.readline() for _ in range(lines)], proc
    finally:
        proc.send_signal(stop)
        proc.wait(timeout=60)


def test_ui_serves_the_store_and_prints_the_trials_page(store):
    root, uri, ids = store
    # stopped as `kill` would: the UI stops MLflow and its uvicorn child with it
    with ui(root, "--study", "study-a", "--tracking-uri", uri, lines=4, stop=signal.SIGTERM) as (printed, proc):
        first = printed[0]
        assert first.startswith("MLflow UI at http://127.0.0.1:"), first
        base = first.split()[3]
        opened = next(line for line in printed if "opened" in line).split()[1]
        assert urlsplit(opened).netloc == urlsplit(base).netloc
        assert f"#/experiments/{ids['study-a']}/runs?workflowType=machine_learning" in opened
        body = json.dumps({"max_results": 10}).encode()
        request = urllib.request.Request(f"{base}/ajax-api/2.0/mlflow/experiments/search", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            names = {e["name"] for e in json.load(r)["experiments"]}
        assert {"study-a", "study-b"} <= names  # the server reads the study's store
    assert proc.returncode == 0
    port = urlsplit(base).port
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


@pytest.fixture
def tiny_study(tmp_path, monkeypatch):
    """A finished six-trial study (the fake evaluator: seconds) alone in studies/, as a study leaves it."""
    pytest.importorskip("optuna_dashboard", reason="optuna-dashboard is not installed (make setup installs it)")
    from phaze_opt.search.runner import run_study
    from test_study_fakes import backend, config

    monkeypatch.chdir(tmp_path)
    run_study(config(tmp_path, trials=6, study_name="tiny", storage=f"sqlite:///{tmp_path}/studies/tiny.db"),
              backend())
    return tmp_path


@contextmanager
def optuna_dashboard(root):
    """`phaze-opt ui --optuna` started in `root` (no --study: the only storage in studies/ and the only
    study in it): yields (its address, the study's page it printed, the process); Ctrl-C at the end."""
    with ui(root, "--optuna", lines=2) as (printed, proc):
        first = printed[0]
        assert first.startswith("Optuna dashboard at http://127.0.0.1:"), first + proc.stderr.read()
        base = first.split()[3]
        name, page = printed[1].split()[:2]
        assert name == "tiny:" and page.startswith(f"{base}/dashboard/studies/")
        yield base, page, proc


def test_optuna_dashboard_serves_the_study_and_stops_on_ctrl_c(tiny_study):
    with optuna_dashboard(tiny_study) as (base, page, proc):
        with urllib.request.urlopen(page, timeout=30) as r:  # the page a browser opens: the dashboard's app
            assert r.status == 200 and "<title>Optuna Dashboard</title>" in r.read().decode()
        study_id = page.rsplit("/", 1)[1]
        with urllib.request.urlopen(f"{base}/api/studies/{study_id}", timeout=60) as r:  # what the page shows
            study = json.load(r)
        assert study["name"] == "tiny" and len(study["trials"]) >= 6 and study["directions"] == ["maximize"]
        assert study["objective_names"] == ["throughput (seq/s)"]  # not "Objective 0"
    err = proc.stderr.read()
    assert proc.returncode == 0 and err == "", err  # no traceback, no server log, no library warning
    with pytest.raises(OSError):  # the dashboard's server went with it
        urllib.request.urlopen(f"{base}/api/meta", timeout=5)


@pytest.fixture
def browser():
    """A headless Chromium: Debian's `chromium` (apt-get install chromium) driven by Playwright's client,
    which downloads no browser of its own. Without either the test skips, saying which. Each
    `browser.new_page()` is a fresh profile (its own localStorage), as a first visit is."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="no Playwright client (pip install playwright)")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium on PATH for the browser test (apt-get install chromium)")
    # as root Chromium refuses its sandbox (a container's usual user); elsewhere it keeps it
    args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=args)
        try:
            yield browser
        finally:
            browser.close()


def test_the_printed_optuna_page_shows_the_studys_history_in_a_browser(tiny_study, browser):
    browser_page = browser.new_page()
    with optuna_dashboard(tiny_study) as (_, page, _proc):
        browser_page.goto(page)
        # the page draws at once and fills in as the study's data arrives: each part is waited for
        browser_page.get_by_text("tiny (id=").first.wait_for(timeout=120_000)  # the study's page, not the list
        browser_page.locator(".main-svg").first.wait_for(timeout=120_000)  # a plot drawn (Plotly's svg)
        # the history's axis and selector, named with the objective's unit, and the importances
        browser_page.get_by_text("throughput (seq/s)").first.wait_for(timeout=120_000)
        browser_page.get_by_text("Hyperparameter Importance").first.wait_for(timeout=120_000)
        browser_page.get_by_text("Best Trial (number=").first.wait_for(timeout=120_000)


@pytest.mark.parametrize("argv, words", [
    (["--study", "nope"], ["no Optuna storage at studies/nope.db"]),
    (["--storage", "sqlite:///studies/tiny.db", "--study", "nope"], ["--study nope: no such study", "tiny"]),
    ([], None),
])
def test_optuna_dashboard_mistakes_are_one_line(tiny_study, capsys, argv, words):
    if words is None:  # a second storage: which one is no longer clear
        (tiny_study / "studies" / "other.db").write_bytes((tiny_study / "studies" / "tiny.db").read_bytes())
        words = ["2 study storages", "other, tiny"]
    assert cli.main(["ui", "--optuna", "--no-browser", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


@pytest.fixture
def logged_study(tmp_path, monkeypatch):
    """A six-trial study (the fake evaluator) logged to a fresh MLflow store in tmp_path: (folder, URI)."""
    from phaze_opt.search.runner import run_study
    from test_study_fakes import backend, config, mlflow_uri

    monkeypatch.chdir(tmp_path)
    uri = mlflow_uri(tmp_path)
    run_study(config(tmp_path, trials=6, study_name="tiny", tracking_uri=uri), backend())
    return tmp_path, uri


def mlflow_pages(printed) -> tuple[str, str]:
    """(the experiments list without MLflow's layout parameter, as MLflow's own links are; the study's
    printed trials link) from what `phaze-opt ui` printed."""
    base = printed[0].split()[3]
    trials = next(line for line in printed if line.strip().startswith("tiny:")).split()[1]
    return f"{base}/#/experiments", trials


def test_the_mlflow_pages_a_user_lands_on_show_the_runs_in_a_browser(logged_study, browser):
    """The printed trials link, and the study opened from MLflow's own list (whose links carry no
    layout parameter) after the README's one click on "Model training": both on the runs table,
    never MLflow's GenAI overview. One server for both; each page a first visit."""
    root, uri = logged_study
    with ui(root, "--tracking-uri", uri, "--no-browser", lines=3) as (printed, _):
        experiments, trials = mlflow_pages(printed)
        page = browser.new_page()
        page.goto(trials)
        # the trials (runs named "trial N"), best score first
        page.get_by_text("matching runs").first.wait_for(timeout=120_000)
        page.get_by_text("Sort: score").first.wait_for(timeout=120_000)
        page.get_by_role("link", name="trial 0", exact=True).first.wait_for(timeout=120_000)
        assert "Detect Issues" not in page.inner_text("body")

        page = browser.new_page()
        page.goto(experiments)
        page.get_by_text("Model training", exact=True).first.click(timeout=120_000)
        page.get_by_role("link", name="tiny", exact=True).first.click(timeout=120_000)
        page.get_by_text("matching runs").first.wait_for(timeout=120_000)
        page.get_by_role("link", name="tiny 20", exact=False).first.wait_for(timeout=120_000)  # its parent run
        assert "workflowType=machine_learning" in page.url
