"""Facts about processes on this host that the stop and reconcile logic share: whether a process
is alive, and when it started (so a reused pid is not taken for the process that had it)."""

from __future__ import annotations

import os
from pathlib import Path


def proc_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None where unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(text.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, start: int | None = None) -> bool:
    """Process `pid` exists (and, when `start` is given and known, is the same process, not a reuse)."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    except OSError:
        return False
    if start is not None:
        now = proc_start(pid)
        if now is not None and now != start:
            return False
    if Path(f"/proc/{pid}/stat").exists():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":  # exited, not yet reaped
                return False
        except (OSError, IndexError):
            pass
    return True
