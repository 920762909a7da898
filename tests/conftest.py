"""Test-session set-up: nothing beside the repository may be read (see outside_guard/sitecustomize.py)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GUARD_DIR = Path(__file__).resolve().parent / "outside_guard"

os.environ["PHAZE_OPT_REPO_ROOT"] = str(REPO)
os.environ.setdefault("PHAZE_OPT_OUTSIDE_LOG", os.path.join(tempfile.mkdtemp(prefix="phaze-outside-"), "reads.log"))
os.environ["PYTHONPATH"] = os.pathsep.join([str(GUARD_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
sys.path.insert(0, str(GUARD_DIR))
import sitecustomize as outside_guard  # noqa: E402  (installs the audit hook in this process)

outside_guard.install()
OUTSIDE_LOG = os.environ["PHAZE_OPT_OUTSIDE_LOG"]


def pytest_sessionfinish(session, exitstatus):
    log = Path(OUTSIDE_LOG)
    reads = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    if reads:
        sys.stderr.write("\nread outside the repository (a user's clone has nothing beside it):\n")
        sys.stderr.write("".join(f"  {r}\n" for r in sorted(set(reads))))
        session.exitstatus = 1
