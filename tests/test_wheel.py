"""A built wheel, installed outside the clone, runs the README's commands with the shipped configs.

The wheel is built from a copy of the tracked sources (so the build leaves nothing in the clone),
installed with `pip install --no-deps --target` into a temporary folder, and run from another
temporary folder with only that folder on PYTHONPATH for phaze_opt; the dependencies come from the
test's own environment. Uses the session's cache (`$PHAZE_OPT_CACHE`), so a second run is quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "pyproject.toml", "README.md", "phaze_opt"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((REPO / name).read_bytes())
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(src)],
                   check=True, capture_output=True)
    (wheel,) = (root / "dist").glob("phaze_opt-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheel)], check=True,
                   capture_output=True)
    work = root / "elsewhere"
    work.mkdir()
    return wheel, root / "site", work


def phaze_opt(installed, *args) -> subprocess.CompletedProcess:
    _, site, work = installed
    # the test session's PYTHONPATH carries the guard against reads beside the clone; the wheel goes first
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop(("PHAZE_OPT_CONFIGS"), None)
    return subprocess.run([sys.executable, "-m", "phaze_opt", *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=1200)


def test_the_wheel_carries_every_shipped_config(installed):
    wheel, _, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {p.relative_to(REPO).as_posix() for p in (REPO / "phaze_opt" / "presets").rglob("*") if p.is_file()}
    assert shipped and shipped <= names, sorted(shipped - names)


def test_the_installed_package_is_the_wheel_not_the_clone(installed):
    _, site, work = installed
    out = subprocess.run([sys.executable, "-c", "import phaze_opt.configs as c; print(c.__file__); print(c.shipped_dir())"],
                         cwd=work, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    module, shipped = out.stdout.split()
    assert Path(module).is_relative_to(site) and Path(shipped).is_relative_to(site)


def test_evaluate_runs_from_outside_the_clone(installed):
    run = phaze_opt(installed, "evaluate", "--model", "gpt2-xl", "--arch", "tpuv4", "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["throughput"] > 0


def test_a_short_study_runs_from_outside_the_clone(installed):
    run = phaze_opt(installed, "study", "--model", "gpt2-xl", "--space", "small", "--trials", "2",
                    "--tracking-uri", "off", "--no-progress", "--json")
    assert run.returncode == 0, run.stderr
    _, _, work = installed
    assert (work / "studies" / "gpt2-xl-small-bound-seed0.db").is_file()


def test_validate_runs_a_shipped_suite_from_outside_the_clone(installed):
    # tpuv4-pod is the quickest suite to run whole; the block suites' measured data files are read too
    # (their rows are what a validation of them schedules), without scheduling them here
    run = phaze_opt(installed, "validate", "--suite", "tpuv4-pod", "--out", "report", "--json")
    assert run.returncode == 0, run.stderr
    _, site, work = installed
    assert (work / "report" / "validation.json").is_file()
    rows = subprocess.run([sys.executable, "-c", "from phaze_opt.validation.suites import load_suite as s; "
                           "print([len(s(n).rows) for n in ('layers-h100', 'layers-h100-2026', 'layers-h200-2026')])"],
                          cwd=work, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert rows.returncode == 0, rows.stderr
    assert all(n > 0 for n in json.loads(rows.stdout)), rows.stdout


def test_user_configs_folder_works_with_the_wheel(installed, tmp_path):
    mine = tmp_path / "mine" / "archs"
    mine.mkdir(parents=True)
    _, site, _ = installed
    text = (site / "phaze_opt" / "presets" / "archs" / "tpuv4.yaml").read_text()
    (mine / "half-tpuv4.yaml").write_text(text.replace("name: tpuv4", "name: half-tpuv4").replace("num_tc: 8", "num_tc: 4"))
    run = phaze_opt(installed, "arch", "--arch", "half-tpuv4", "--configs", str(tmp_path / "mine"), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["num_tc"] == 4
