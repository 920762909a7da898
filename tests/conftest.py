"""Test-session set-up: nothing beside the repository may be read (see outside_guard/sitecustomize.py)."""

from __future__ import annotations

import os
import re
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


def error_lines(stderr: str) -> list[str]:
    """A command's stderr without its "still working" heartbeat lines: a command that takes longer
    than the heartbeat's interval (a torch import on a loaded machine) prints them before its one
    error line, and that is the command working as meant, not a second line of error."""
    return [line for line in stderr.strip().splitlines() if not re.match(r"\[.*\] .*still [a-z ]+, \d", line)]


# The longest tests, longest first (230-300 s each on CI's two pytest-xdist workers; 43-123 s once a
# study's processes stopped importing PyTorch). They run first, so the many short tests fill in beside
# them instead of one of them starting last and running alone while the other worker idles. Single
# tests only: a module's tests stay together (a module fixture split in two is built twice).
LONGEST = (
    "tests/test_upper_bound.py::test_pruned_sweep_is_exact_over_every_recipe_field",
    "tests/test_fault_injection.py::test_a_killed_and_resumed_study_is_consistent",
    "tests/test_workload_modern.py::test_featured_models_evaluate_and_the_bounds_hold",
    "tests/test_fault_injection.py::test_every_signal_stops_the_study_cleanly",
    "tests/test_fault_injection.py::test_processes_sharing_a_postgres_study_survive_kills",
    "tests/test_crash_safety.py::test_two_processes_stop_at_the_total_and_count_their_own",
)


def _longest_rank(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST) if item.nodeid.startswith(prefix)), len(LONGEST))


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_longest_rank)  # stable: everything else keeps its order


def pytest_sessionfinish(session, exitstatus):
    log = Path(OUTSIDE_LOG)
    reads = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    if reads:
        sys.stderr.write("\nread outside the repository (a user's clone has nothing beside it):\n")
        sys.stderr.write("".join(f"  {r}\n" for r in sorted(set(reads))))
        session.exitstatus = 1
