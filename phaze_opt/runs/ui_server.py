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


def wait_until_up(proc: subprocess.Popen, host: str, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until MLflow answers its health check; its exit or the time limit is a one-line error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PhazeError(f"the MLflow server stopped at start (exit status {proc.returncode}); its messages are above")
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise PhazeError(f"the MLflow server did not answer on {host}:{port} within {timeout_s:.0f} s")


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
    # MLflow's log goes to stderr, so stdout carries only the addresses (for a script to read)
    # its own process group: MLflow runs uvicorn as a child, and stopping the UI stops both
    proc = subprocess.Popen(server_command(tracking_uri, host, port), stdout=sys.stderr, start_new_session=True,
                            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        wait_until_up(proc, host, port)
        print("\n".join(page_lines(target, host, port)), file=out, flush=True)
        page = trials_url(target.study[1], host, port) if target.study else experiments_url(host, port)
        if has_desktop() if open_browser is None else open_browser:
            import webbrowser

            webbrowser.open(page)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(proc)


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
