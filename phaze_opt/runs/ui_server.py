"""`phaze-opt ui`: the MLflow UI on a study's store, started on a free local port and opened on the trials.

MLflow 3.17.2's UI chooses between its GenAI layout (an experiment opens on "Overview / Traces") and
its model-training layout (an experiment opens on its runs table) from the page's `workflowType`
URL parameter, else from the browser's remembered choice (the sidebar's "GenAI | Model training"
switch, kept in localStorage as `mlflow.workflowType_v1`), GenAI at first. The experiment's
`mlflow.experimentKind` tag (set by `tracking`) is read only when that switch is disabled, and
3.17.2's bundle enables it for good (`main.*.js`: the flag `R=()=>!0` before `mlflow.experimentKind`
is consulted). No experiment tag or server setting changes it, so every address printed or opened
here carries `workflowType=machine_learning`; the experiments list's own links do not keep it, and a
click there opens the runs table once the browser has been switched to "Model training".

`phaze-opt ui --optuna` starts Optuna's own dashboard (the `optuna-dashboard` package) on a study's
storage instead, on the same terms (127.0.0.1, a free port, Ctrl-C stops it), and prints the
study's page: its optimization history, Pareto front, parameter importances and trials.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass


from ..errors import PhazeError
from .tracking import UI_HOST, UI_QUERY, driver_url, sqlite_path, trials_url
from .urls import redact

START_TIMEOUT_S = 120.0  # MLflow's first start on a store migrates its schema: tens of seconds


def free_port(host: str = UI_HOST) -> int:
    """A port nothing listens on now (the OS picks it; another program may take it before MLflow
    binds it, which then fails with MLflow's own message)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def experiments_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/#/experiments?{UI_QUERY}"


@dataclass(frozen=True)
class Target:
    """What to open: the experiments that are studies (name, id) and the one asked for, if any."""

    experiments: tuple[tuple[str, str], ...]
    study: tuple[str, str] | None


def find_study(tracking_uri: str, study: str | None) -> Target:
    """The store's experiments, and `study`'s (None: the only one, or None when there are several).
    A missing store or study is a one-line error naming what there is."""
    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        raise PhazeError(f"no MLflow store at {db} (from {os.getcwd()}): run a study first, from this folder, "
                         "or give --tracking-uri")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=driver_url(tracking_uri))
    found = tuple((e.name, e.experiment_id) for e in client.search_experiments() if e.name != "Default")
    if study is not None:
        match = [e for e in found if e[0] == study]
        if not match:
            names = ", ".join(sorted(n for n, _ in found)) or "(none)"
            raise PhazeError(f"--study {study}: no such experiment in {redact(tracking_uri)}; there are: {names}")
        return Target(found, match[0])
    return Target(found, found[0] if len(found) == 1 else None)


def server_command(tracking_uri: str, host: str, port: int) -> list[str]:
    """One worker: a SQLite store is not for concurrent servers."""
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", driver_url(tracking_uri),
            "--host", host, "--port", str(port), "--workers", "1"]


def wait_until_up(proc: subprocess.Popen, host: str, port: int, timeout_s: float = START_TIMEOUT_S,
                  path: str = "/health", what: str = "the MLflow server") -> None:
    """Until the server answers `path` (its health check); its exit or the time limit is a one-line error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PhazeError(f"{what} stopped at start (exit status {proc.returncode}); its messages are above")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise PhazeError(f"{what} did not answer on {host}:{port} within {timeout_s:.0f} s")


def has_desktop() -> bool:
    """A browser can be shown: macOS, Windows, or a Linux session with a display."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def page_lines(target: Target, host: str, port: int) -> list[str]:
    lines = [f"MLflow UI at http://{host}:{port} (Ctrl-C stops it)",
             f"  experiments:  {experiments_url(host, port)}"]
    for name, exp_id in target.experiments:
        mark = "  <- opened" if target.study == (name, exp_id) else ""
        lines.append(f"  {name}: {trials_url(exp_id, host, port)}{mark}")
    return lines


def serve(tracking_uri: str, study: str | None, *, port: int | None = None, open_browser: bool | None = None,
          out=sys.stdout) -> int:
    """Start MLflow, print where, open the study's trials (or the experiments list), wait for Ctrl-C."""
    target = find_study(tracking_uri, study)
    host = UI_HOST
    port = port or free_port(host)
    page = trials_url(target.study[1], host, port) if target.study else experiments_url(host, port)
    return _run_server(server_command(tracking_uri, host, port), {"MLFLOW_DISABLE_TELEMETRY": "true"},
                       lambda proc: wait_until_up(proc, host, port), page_lines(target, host, port), page,
                       open_browser, out)


def _run_server(command: list[str], env: dict, wait, lines: list[str], page: str, open_browser: bool | None,
                out) -> int:
    """Start a UI server, wait until it answers, print `lines`, open `page` (on a desktop, or as told),
    serve until Ctrl-C or a kill, then stop the server and all it started."""
    # the server's log goes to stderr, so stdout carries only the addresses (for a script to read)
    # its own process group: MLflow runs uvicorn as a child, and stopping the UI stops both
    proc = subprocess.Popen(command, stdout=sys.stderr, start_new_session=True, env={**os.environ, **env})
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        wait(proc)
        print("\n".join(lines), file=out, flush=True)
        if has_desktop() if open_browser is None else open_browser:
            import webbrowser

            webbrowser.open(page)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(proc)


# -- Optuna's dashboard ---------------------------------------------------------------------------

STORAGE_ENV = "PHAZE_OPT_DASHBOARD_STORAGE"  # the storage URL reaches the server here, not on its command
# line, where `ps` would show a database password to every user of the machine

# The dashboard's own server (`optuna_dashboard.run_server`, bottle's) prints a banner and a line per
# request; this one serves the same WSGI app (`optuna_dashboard.wsgi`) in threads, quietly.
DASHBOARD_PROGRAM = """
import os, sys, warnings
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
import optuna
import optuna_dashboard

class Handler(WSGIRequestHandler):
    def log_message(self, *args):
        pass

class Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

optuna.logging.set_verbosity(optuna.logging.ERROR)
warnings.simplefilter("ignore")  # the importance estimators warn on small studies, on the UI's stderr
app = optuna_dashboard.wsgi(os.environ.pop(%r))
server = make_server(sys.argv[1], int(sys.argv[2]), app, server_class=Server, handler_class=Handler)
try:
    server.serve_forever()
except KeyboardInterrupt:
    pass
""" % STORAGE_ENV


def dashboard_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-c", DASHBOARD_PROGRAM, host, str(port)]


def dashboard_url(host: str, port: int, study_id: int) -> str:
    return f"http://{host}:{port}/dashboard/studies/{study_id}"


def optuna_study(storage_url: str, study: str | None) -> tuple[str, int]:
    """(name, the storage's id for it) of `study`, or of the only study in the storage. A missing
    SQLite file, study or choice is a one-line error naming what there is."""
    db = sqlite_path(storage_url)
    if db is not None and not db.is_file():  # opening it would create an empty database
        raise PhazeError(f"no Optuna storage at {db} (from {os.getcwd()}): run the study first, from this folder, "
                         "or give --storage")
    try:
        import optuna_dashboard  # noqa: F401  # said here, before a server starts without it
    except ImportError:
        raise PhazeError("the Optuna dashboard needs the optuna-dashboard package (a dependency of phaze-opt): "
                         "make setup, or pip install optuna-dashboard") from None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.get_storage(driver_url(storage_url))
    try:
        names = [s.study_name for s in storage.get_all_studies()]
        if study is None:
            if len(names) != 1:
                raise PhazeError(f"{redact(storage_url)} holds {len(names)} studies; give --study, one of: "
                                 f"{', '.join(sorted(names)) or '(none)'}")
            study = names[0]
        if study not in names:
            raise PhazeError(f"--study {study}: no such study in {redact(storage_url)}; there are: "
                             f"{', '.join(sorted(names)) or '(none)'}")
        return study, storage.get_study_id_from_name(study)
    finally:
        engine = getattr(storage, "engine", None)
        if engine is not None:
            engine.dispose()


def serve_optuna(storage_url: str, study: str | None, *, port: int | None = None, open_browser: bool | None = None,
                 out=sys.stdout) -> int:
    """Start Optuna's dashboard on the study's storage, print the study's page, open it, wait for Ctrl-C."""
    name, study_id = optuna_study(storage_url, study)
    host = UI_HOST
    port = port or free_port(host)
    page = dashboard_url(host, port, study_id)
    lines = [f"Optuna dashboard at http://{host}:{port} (Ctrl-C stops it)",
             f"  {name}: {page}  (history, Pareto front, parameter importances, trials)"]
    return _run_server(dashboard_command(host, port), {STORAGE_ENV: driver_url(storage_url)},
                       lambda proc: wait_until_up(proc, host, port, path="/api/meta", what="the Optuna dashboard"),
                       lines, page, open_browser, out)


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # a `kill` stops the server as Ctrl-C does


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group; SIGKILL to whatever is left of it after 10 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc.poll()  # reap the server itself, so only live members keep the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
