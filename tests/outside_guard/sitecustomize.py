"""Make every read beside the repository fail, in the test process and in the processes it starts.

A user's clone has nothing next to it, so a test run that reads a sibling folder (say `../shared`)
passes here and fails there. The tests' conftest puts this folder first on PYTHONPATH, so Python
imports this module at start-up in every subprocess too, and installs the same audit hook in the
pytest process itself. An `open` of a path inside the repository's parent folder but outside the
repository raises PermissionError, exactly as if the file were absent, and is appended to the file
named by PHAZE_OPT_OUTSIDE_LOG so the session can fail and name it even when the code under test
swallows the error.
"""

from __future__ import annotations

import os
import sys

_REPO = os.environ.get("PHAZE_OPT_REPO_ROOT")


def outside(path: str, repo: str) -> bool:
    """True when `path` lies beside the repository: under its parent folder, not inside it."""
    real = os.path.realpath(path)
    parent = os.path.dirname(repo)
    return (real == parent or real.startswith(parent + os.sep)) and not (real == repo or real.startswith(repo + os.sep))


def _hook(event: str, args: tuple) -> None:
    if event not in ("open", "os.listdir", "os.scandir"):
        return
    path = args[0] if args else None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, (str, os.PathLike)):
        return  # a file descriptor: its path was checked when it was opened
    if outside(os.fspath(path), _REPO):
        log_path = os.environ.get("PHAZE_OPT_OUTSIDE_LOG")
        if log_path:
            with open(log_path, "a", encoding="utf-8") as log:  # the log itself sits in a temp folder
                log.write(f"{os.getpid()} {event} {os.fspath(path)}\n")
        raise PermissionError(f"read outside the repository: {os.fspath(path)}")


def install() -> None:
    if _REPO and not getattr(sys, "_phaze_outside_guard", False):
        sys._phaze_outside_guard = True
        sys.addaudithook(_hook)


install()
