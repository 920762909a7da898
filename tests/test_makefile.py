"""`make study PYTHON=...` with an interpreter that does not exist says so, and keeps the venv: it is
not a Python too old (whose advice would repeat the same command) nor another Python to rebuild for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _make(folder: Path, *args: str) -> subprocess.CompletedProcess:
    for name in ("Makefile", "pyproject.toml", "requirements.lock"):
        shutil.copy(REPO / name, folder / name)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=folder, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MAKEFLAGS": ""})


@pytest.mark.parametrize("with_venv", [False, True])
def test_a_missing_interpreter_is_named_and_the_venv_kept(tmp_path, with_venv):
    if with_venv:  # a working venv, as `make study` left it
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    out = _make(tmp_path, "study", "PYTHON=no-such-python3.99")
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: PYTHON=no-such-python3.99 was not found (no such interpreter on PATH, or it does not "
                      f"run). Install it, or name one that runs: make study PYTHON=/path/to/python3.11-or-newer"], out
    assert "3.11 or newer;" not in out.stderr and "rebuilding" not in out.stdout + out.stderr
    assert (tmp_path / ".venv" / "bin" / "python").exists() == with_venv
