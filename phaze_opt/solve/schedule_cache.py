"""Content-addressed memo of solved schedules: in memory, and on disk as one JSON file per key.

The key hashes everything a schedule depends on: op units, both latencies of every op (exact
float bits), the edges, and the core counts. Op names are left out (they change no decision), and
so is the solver: a proven optimum is the same makespan whichever solver proved it. A result that
is not proven optimal is reused only when it was solved with the same solver, at least as much
time as the caller now allows, and the same exact methods (`METHODS_VERSION`: raised when a new
method could close what an older one left open, e.g. the decision-point search).

Disk: `$PHAZE_OPT_CACHE/schedules/<key[:2]>/<key>.json`, the cache root defaulting to `.cache/phaze_opt`
beside the package. Writes go to a temporary file and are renamed into place, so concurrent
processes never read half a file; an unreadable file counts as a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from ..cache import BoundedMemo, cache_root
from .types import Schedule, ScheduleProblem

CACHE_VERSION = 1
METHODS_VERSION = 3  # 2: MIP, then the decision-point search, then the MIP again; 3: the search gets 80% of the time
# Records of a few kB; the disk holds them all, memory the recently used (a design's passes are
# solved together, and the per-layer cost memo above keeps what a sweep revisits).
MEMO_MAX = 8192
_memory: BoundedMemo[dict] = BoundedMemo(MEMO_MAX)


def problem_key(problem: ScheduleProblem) -> str:
    payload = {
        "v": CACHE_VERSION,
        "units": list(problem.units),
        "single": [float(v).hex() for v in problem.single],
        "split": [float(v).hex() for v in problem.split],
        "edges": sorted([int(a), int(b)] for a, b in set(problem.edges)),
        "num_tc": int(problem.num_tc),
        "num_vc": int(problem.num_vc),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:40]


def _path(key: str) -> Path:
    return cache_root() / "schedules" / key[:2] / f"{key}.json"


def _to_record(schedule: Schedule, solver: str, time_limit_s: float) -> dict:
    return {
        "version": CACHE_VERSION, "methods": METHODS_VERSION, "solver": solver, "time_limit_s": float(time_limit_s),
        "makespan": schedule.makespan, "lower_bound": schedule.lower_bound, "status": schedule.status,
        "method": schedule.method, "solve_s": schedule.solve_s, "start": list(schedule.start),
        "split": list(schedule.split), "cores": [list(c) for c in schedule.cores],
        "duration": list(schedule.duration), "extra": schedule.extra,
    }


def _from_record(rec: dict) -> Schedule:
    return Schedule(
        makespan=float(rec["makespan"]), lower_bound=float(rec["lower_bound"]), status=rec["status"],
        method=rec["method"], solve_s=float(rec["solve_s"]), start=tuple(float(v) for v in rec["start"]),
        split=tuple(bool(v) for v in rec["split"]), cores=tuple(tuple(c) for c in rec["cores"]),
        duration=tuple(float(v) for v in rec["duration"]), extra=dict(rec.get("extra") or {}),
    )


def _usable(rec: dict, solver: str, time_limit_s: float) -> bool:
    if rec.get("version") != CACHE_VERSION:
        return False
    if rec.get("status") == "optimal":
        return True
    return (rec.get("solver") == solver and float(rec.get("time_limit_s", 0.0)) >= time_limit_s
            and rec.get("methods") == METHODS_VERSION)


def get(key: str, solver: str, time_limit_s: float, disk: bool = True) -> Schedule | None:
    rec = _memory.get(key)
    if rec is None and disk:
        try:
            rec = json.loads(_path(key).read_text())
        except (OSError, ValueError):
            rec = None
        if rec is not None:
            _memory[key] = rec
    if rec is None or not _usable(rec, solver, time_limit_s):
        return None
    try:
        return _from_record(rec)
    except (KeyError, TypeError, ValueError):
        return None


def put(key: str, schedule: Schedule, solver: str, time_limit_s: float, disk: bool = True) -> None:
    if schedule.status == "error":
        return
    rec = _to_record(schedule, solver, time_limit_s)
    _memory[key] = rec
    if not disk:
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only or full disk only costs a re-solve later


def clear_memory() -> None:
    _memory.clear()
