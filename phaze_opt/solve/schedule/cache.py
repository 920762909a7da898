"""Content-addressed memo of solved schedules: in memory, and on disk as one JSON file per key.

The key hashes everything a schedule depends on: op units, both latencies of every op (exact
float bits), the edges, and the core counts. Op names are left out (they change no decision), and
so is the solver: a proven optimum is the same makespan whichever solver proved it. A result that
is not proven optimal is reused only when it was solved with the same solver, at least as much
time as the caller now allows, and the same exact methods (`METHODS_VERSION`: raised when a new
method could close what an older one left open, e.g. the decision-point search).

Disk: `$PHAZE_OPT_CACHE/schedules/<key[:2]>/<key>.json`, the cache root defaulting to `.cache/phaze_opt`
beside the package. Writes go to a temporary file and are renamed into place, so concurrent
processes never read half a file.

A file on disk is data, not a proof: anyone who can write the folder can edit it. So a record read
from disk is used only after it has been checked against the problem being solved (`check_hit`):
its fields must have the right types, the independent verifier (`verify.verify_schedule`) must
replay its start times, modes and cores on the problem's own latencies, edges and core counts and
recompute its makespan, a proven-optimal record must have its lower bound equal to that makespan,
and the makespan may not undercut the problem's own lower bound (`bounds.lower_bound`). A file that
fails any of this (or is unreadable, or not a record at all) is a miss: it is logged, the problem
is solved again and the file overwritten. Records in memory were made by this process or have
passed these checks.

What no check can catch without solving again: a time-limited record whose claimed lower bound was
raised (still below its makespan), or a proven-optimal record whose legal schedule is slower than
the true optimum. Both only make results more pessimistic or their bounds tighter than proven;
neither can make a design look faster than a legal schedule makes it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

from ...cache import BoundedMemo, cache_root, write_atomic
from .bounds import lower_bound as problem_lower_bound
from .ilp import PROVEN_REL_GAP
from .types import Schedule, ScheduleProblem
from .verify import ScheduleViolation, verify_schedule

# 2: a partner cut split at a separator could cut off the optimum (ilp._add_partner_cover), so an
# "optimal" record of version 1 may hold a longer schedule than the optimum: not trusted.
CACHE_VERSION = 2
METHODS_VERSION = 4  # 2: MIP, then the decision-point search, then the MIP again; 3: the search gets 80% of the time;
# 4: the relaxation's partner-idle cuts and the hunt for a schedule meeting its bound (MoE blocks)
# Records of a few kB; the disk holds them all, memory the recently used (a design's passes are
# solved together, and the per-layer cost memo above keeps what a sweep revisits).
MEMO_MAX = 8192
_memory: BoundedMemo[dict] = BoundedMemo(MEMO_MAX)
# The largest relative gap between a proven-optimal schedule's makespan and its lower bound that
# the solver itself accepts (the MIP's realisation tolerance; the others are 1e-9).
OPTIMAL_REL_GAP = PROVEN_REL_GAP
STATUSES = ("optimal", "time_limit")
log = logging.getLogger(__name__)


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


class BadRecord(ValueError):
    """A cache record that is not a usable schedule for the problem; the message says why."""


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRecord(f"{what} is not a finite number: {value!r}")
    return float(value)


def _list(value, what: str) -> list:
    if not isinstance(value, list):
        raise BadRecord(f"{what} is not a list")
    return value


def _from_record(rec: dict) -> Schedule:
    """The schedule a record stores, with every field's type checked; BadRecord otherwise."""
    missing = [k for k in ("makespan", "lower_bound", "status", "method", "solve_s", "start", "split", "cores",
                           "duration") if k not in rec]
    if missing:
        raise BadRecord(f"missing fields {', '.join(missing)}")
    if rec["status"] not in STATUSES:
        raise BadRecord(f"status {rec['status']!r} is not one of {', '.join(STATUSES)}")
    if not isinstance(rec["method"], str):
        raise BadRecord(f"method {rec['method']!r} is not a string")
    split = _list(rec["split"], "split")
    if not all(isinstance(v, bool) for v in split):
        raise BadRecord("split holds something other than true/false")
    cores = _list(rec["cores"], "cores")
    if not all(isinstance(c, list) and all(isinstance(n, str) for n in c) for c in cores):
        raise BadRecord("cores is not a list of lists of core names")
    extra = rec.get("extra") or {}
    if not isinstance(extra, dict):
        raise BadRecord("extra is not a mapping")
    return Schedule(
        makespan=_number(rec["makespan"], "makespan"), lower_bound=_number(rec["lower_bound"], "lower_bound"),
        status=rec["status"], method=rec["method"], solve_s=_number(rec["solve_s"], "solve_s"),
        start=tuple(_number(v, "a start time") for v in _list(rec["start"], "start")), split=tuple(split),
        cores=tuple(tuple(c) for c in cores),
        duration=tuple(_number(v, "a duration") for v in _list(rec["duration"], "duration")), extra=dict(extra),
    )


def check_hit(problem: ScheduleProblem, schedule: Schedule) -> None:
    """Raise BadRecord unless `schedule` is a legal schedule of `problem` with an honest claim.

    The verifier replays it and recomputes the makespan; a proven optimum must have its lower
    bound equal to it (to OPTIMAL_REL_GAP), and no makespan may undercut the problem's lower bound.
    """
    try:
        makespan = verify_schedule(problem, schedule)
    except ScheduleViolation as exc:
        raise BadRecord(f"the schedule does not replay: {exc}") from None
    if schedule.status == "optimal" and schedule.lower_bound < makespan * (1.0 - OPTIMAL_REL_GAP):
        raise BadRecord(f"claims optimal but its lower bound {schedule.lower_bound!r} s is below its makespan "
                        f"{makespan!r} s")
    floor = problem_lower_bound(problem)
    if makespan < floor * (1.0 - OPTIMAL_REL_GAP):
        raise BadRecord(f"makespan {makespan!r} s is below the problem's lower bound {floor!r} s")


def _usable(rec: dict, solver: str, time_limit_s: float) -> bool:
    if not isinstance(rec, dict) or rec.get("version") != CACHE_VERSION:
        return False
    if rec.get("status") == "optimal":
        return True
    limit = rec.get("time_limit_s")
    return (rec.get("solver") == solver and isinstance(limit, (int, float)) and not isinstance(limit, bool)
            and limit >= time_limit_s and rec.get("methods") == METHODS_VERSION)


def _load(key: str, problem: ScheduleProblem, solver: str, time_limit_s: float) -> dict | None:
    """The disk record of `key` if it is usable and passes `check_hit`; anything else is a miss,
    logged when a file was there but could not be used."""
    path = _path(key)
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON, nested too deep
        log.warning("schedule cache %s: unreadable (%s); solving again", path, exc)
        return None
    try:
        if not isinstance(rec, dict):
            raise BadRecord(f"not a record but a JSON {type(rec).__name__}")
        if not _usable(rec, solver, time_limit_s):
            return None  # another version, solver or effort: a plain miss
        check_hit(problem, _from_record(rec))
    except BadRecord as exc:
        log.warning("schedule cache %s: rejected, %s; solving again", path, exc)
        return None
    return rec


def get(key: str, solver: str, time_limit_s: float, disk: bool = True,
        problem: ScheduleProblem | None = None) -> Schedule | None:
    """The memoised schedule of `key`, or None. The disk is read only when `problem` is given,
    so that what comes from it can be checked against the problem (`check_hit`)."""
    rec = _memory.get(key)
    if rec is None and disk and problem is not None:
        rec = _load(key, problem, solver, time_limit_s)
        if rec is not None:
            _memory[key] = rec
    if rec is None or not _usable(rec, solver, time_limit_s):
        return None
    try:
        return _from_record(rec)
    except BadRecord:
        return None


def put(key: str, schedule: Schedule, solver: str, time_limit_s: float, disk: bool = True) -> None:
    if schedule.status == "error":
        return
    rec = _to_record(schedule, solver, time_limit_s)
    _memory[key] = rec
    if not disk:
        return
    write_atomic(_path(key), json.dumps(rec))  # a refused write only costs a re-solve later


def clear_memory() -> None:
    _memory.clear()
