"""Independent replay of a per-layer schedule: is it legal, and what is its makespan?

This module shares no code with the scheduler (`solver.py` and its helpers) on purpose: every
schedule the solver returns, and every schedule in the tests, is replayed here from the problem
alone. It checks, for every op i of a `ScheduleProblem` and a `Schedule`:

- duration: "none" ops take 0; "net" ops take `single[i]` and are never split; a compute op takes
  `split[i]` when it ran split and `single[i]` otherwise. A split mode exists only when the op's
  type has more than one core (for "tc+vc": more than one TC or more than one VC); with one core
  the op simply runs on it.
- precedence: every edge (a, b) has start[b] >= start[a] + duration[a].
- per-instant core counts: at no instant do more than `num_tc` single-mode ops that use a TC
  ("tc", "tc+vc") run, nor more than `num_vc` that use a VC ("vc", "tc+vc").
- split exclusivity: no other compute op ("tc", "vc", "tc+vc") overlaps a split op.
- net serialisation: no two "net" ops overlap (one link).
- concrete cores: each op names the cores it occupied ("tc0".."tcN-1", "vc0".."vcM-1", "net"), as
  many as its mode needs (a split op names all cores of its type), and no two overlapping ops
  share a core. `assign_cores` produces such names for a legal timing (greedy interval colouring,
  which needs no more cores than the largest number of ops running at one instant).

Two ops overlap when their intervals share more than `tol` of time (zero-length ops overlap
nothing); `tol` is relative to the schedule's time scale so that floating-point rounding in a
correct solver never reads as a violation.
"""

from __future__ import annotations

import math

from .types import Schedule, ScheduleProblem

REL_TOL = 1e-9


class ScheduleViolation(ValueError):
    """A schedule breaks a rule of the problem; the message names the ops and the rule."""


def _uses(unit: str) -> tuple[bool, bool]:
    return unit in ("tc", "tc+vc"), unit in ("vc", "tc+vc")


def has_split_mode(unit: str, num_tc: int, num_vc: int) -> bool:
    """Whether an op of this unit can run split: only when its type has more than one core."""
    if unit == "tc":
        return num_tc > 1
    if unit == "vc":
        return num_vc > 1
    if unit == "tc+vc":
        return num_tc > 1 or num_vc > 1
    return False


def expected_duration(problem: ScheduleProblem, i: int, split: bool) -> float:
    unit = problem.units[i]
    if unit == "none":
        return 0.0
    if unit == "net":
        return float(problem.single[i])
    return float(problem.split[i] if split else problem.single[i])


def _tolerance(problem: ScheduleProblem, ends) -> float:
    scale = max([0.0, *ends, *(float(v) for v in problem.single), *(float(v) for v in problem.split)])
    return REL_TOL * scale + 1e-15


def _name(problem: ScheduleProblem, i: int) -> str:
    return f"op {i} ({problem.names[i]})" if len(problem.names) == len(problem.units) else f"op {i}"


def _check_modes(problem: ScheduleProblem, split, duration, tol) -> None:
    for i, unit in enumerate(problem.units):
        if split[i] and not has_split_mode(unit, problem.num_tc, problem.num_vc):
            raise ScheduleViolation(f"{_name(problem, i)}: unit {unit!r} cannot run split on "
                                    f"{problem.num_tc} TC / {problem.num_vc} VC")
        want = expected_duration(problem, i, bool(split[i]))
        if not (math.isfinite(duration[i]) and abs(duration[i] - want) <= tol):
            mode = "split" if split[i] else "single"
            raise ScheduleViolation(f"{_name(problem, i)}: duration {duration[i]!r} but its {mode} latency is {want!r}")


def _overlap(sa, fa, sb, fb, tol) -> bool:
    return min(fa, fb) - max(sa, sb) > tol


def _check_capacity(problem: ScheduleProblem, start, finish, split, tol) -> None:
    n = len(problem.units)
    compute = [u in ("tc", "vc", "tc+vc") for u in problem.units]
    for i in range(n):
        if finish[i] - start[i] <= tol:
            continue
        for j in range(i + 1, n):
            if finish[j] - start[j] <= tol or not _overlap(start[i], finish[i], start[j], finish[j], tol):
                continue
            if problem.units[i] == "net" and problem.units[j] == "net":
                raise ScheduleViolation(f"{_name(problem, i)} and {_name(problem, j)}: two collectives overlap on the one link")
            if compute[i] and compute[j] and (split[i] or split[j]):
                who = i if split[i] else j
                other = j if who == i else i
                raise ScheduleViolation(f"{_name(problem, who)} runs split but {_name(problem, other)} overlaps it")
    # Per-instant counts: the most ops run at once just after some op starts.
    for resource, cap in (("tc", problem.num_tc), ("vc", problem.num_vc)):
        users = [i for i in range(n) if compute[i] and not split[i] and _uses(problem.units[i])[resource == "vc"]
                 and finish[i] - start[i] > tol]
        for i in users:
            t = start[i]
            running = [j for j in users if start[j] <= t + tol and finish[j] > t + tol]
            if len(running) > cap:
                raise ScheduleViolation(f"{len(running)} single-mode ops use a {resource.upper()} at t={t!r} s "
                                        f"but there are {cap}: ops {sorted(running)}")


def core_names(resource: str, count: int) -> tuple[str, ...]:
    return tuple(f"{resource}{k}" for k in range(count))


def _needed(problem: ScheduleProblem, i: int, split: bool) -> tuple[int, int, bool]:
    """(TCs, VCs, link) that op i occupies in its mode."""
    unit = problem.units[i]
    if unit == "net":
        return 0, 0, True
    if unit == "none":
        return 0, 0, False
    tc, vc = _uses(unit)
    if split:  # split: all cores of its type; nothing else computes meanwhile
        return (problem.num_tc if tc else 0), (problem.num_vc if vc else 0), False
    return int(tc), int(vc), False


def assign_cores(problem: ScheduleProblem, start, duration, split) -> tuple[tuple[str, ...], ...]:
    """Concrete cores for a timing: ops in start order take the lowest-numbered free cores.

    Greedy colouring of intervals in start order never needs more colours than the largest
    clique, i.e. the most ops running at one instant, so it fails only on an over-full timing.
    """
    n = len(problem.units)
    ends = [float(start[i]) + float(duration[i]) for i in range(n)]
    tol = _tolerance(problem, ends)
    free_at = {"tc": [0.0] * problem.num_tc, "vc": [0.0] * problem.num_vc, "net": [0.0]}
    out: list[tuple[str, ...]] = [()] * n
    order = sorted(range(n), key=lambda i: (float(start[i]), ends[i], i))
    for i in order:
        n_tc, n_vc, link = _needed(problem, i, bool(split[i]))
        cores: list[str] = []
        for resource, count in (("tc", n_tc), ("vc", n_vc), ("net", int(link))):
            if count == 0:
                continue
            slots = free_at[resource]
            if duration[i] <= tol:  # a zero-length op blocks nothing; name the first core
                cores.extend(f"{resource}{k}" if resource != "net" else "net" for k in range(count))
                continue
            free = [k for k, t in enumerate(slots) if t <= float(start[i]) + tol]
            if len(free) < count:
                raise ScheduleViolation(f"{_name(problem, i)} needs {count} free {resource.upper()} at "
                                        f"t={float(start[i])!r} s but only {len(free)} of {len(slots)} are free")
            for k in free[:count]:
                slots[k] = ends[i]
                cores.append("net" if resource == "net" else f"{resource}{k}")
        out[i] = tuple(cores)
    return tuple(out)


def _check_cores(problem: ScheduleProblem, start, finish, split, cores, tol) -> None:
    n = len(problem.units)
    valid = {"net", *core_names("tc", problem.num_tc), *core_names("vc", problem.num_vc)}
    for i in range(n):
        n_tc, n_vc, link = _needed(problem, i, bool(split[i]))
        names = tuple(cores[i])
        if len(set(names)) != len(names) or any(c not in valid for c in names):
            raise ScheduleViolation(f"{_name(problem, i)}: cores {names} are not distinct cores of this chip")
        got = (sum(c.startswith("tc") for c in names), sum(c.startswith("vc") for c in names), "net" in names)
        if got != (n_tc, n_vc, link):
            raise ScheduleViolation(f"{_name(problem, i)}: occupies cores {names} but its mode needs "
                                    f"{n_tc} TC, {n_vc} VC{' and the link' if link else ''}")
    for i in range(n):
        for j in range(i + 1, n):
            shared = set(cores[i]) & set(cores[j])
            if shared and _overlap(start[i], finish[i], start[j], finish[j], tol):
                raise ScheduleViolation(f"{_name(problem, i)} and {_name(problem, j)} overlap on {sorted(shared)}")


def verify_schedule(problem: ScheduleProblem, schedule: Schedule) -> float:
    """Replay `schedule` against `problem`; return its makespan or raise `ScheduleViolation`.

    Empty `schedule.cores` means "no cores named": they are then assigned (which itself proves
    the per-instant counts); otherwise the named cores are checked.
    """
    n = len(problem.units)
    for field in ("start", "split", "duration"):
        if len(getattr(schedule, field)) != n:
            raise ScheduleViolation(f"schedule.{field} has {len(getattr(schedule, field))} entries for {n} ops")
    if len(schedule.cores) not in (0, n):
        raise ScheduleViolation(f"schedule.cores has {len(schedule.cores)} entries for {n} ops")
    start = [float(s) for s in schedule.start]
    duration = [float(d) for d in schedule.duration]
    split = [bool(s) for s in schedule.split]
    finish = [s + d for s, d in zip(start, duration)]
    tol = _tolerance(problem, finish)
    for i in range(n):
        if not (math.isfinite(start[i]) and start[i] >= -tol):
            raise ScheduleViolation(f"{_name(problem, i)}: start {start[i]!r} is not a time >= 0")
    _check_modes(problem, split, duration, tol)
    for a, b in problem.edges:
        if start[b] < finish[a] - tol:
            raise ScheduleViolation(f"{_name(problem, b)} starts at {start[b]!r} s before its predecessor "
                                    f"{_name(problem, a)} ends at {finish[a]!r} s")
    _check_capacity(problem, start, finish, split, tol)
    cores = schedule.cores if len(schedule.cores) == n else assign_cores(problem, start, duration, split)
    _check_cores(problem, start, finish, split, cores, tol)
    makespan = max(finish, default=0.0)
    if not abs(float(schedule.makespan) - makespan) <= tol:
        raise ScheduleViolation(f"schedule.makespan {schedule.makespan!r} s but its ops end at {makespan!r} s")
    if float(schedule.lower_bound) > makespan + tol:
        raise ScheduleViolation(f"lower bound {schedule.lower_bound!r} s exceeds the makespan {makespan!r} s")
    return makespan
