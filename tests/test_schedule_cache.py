"""The content-addressed schedule memo: what it reuses and what it must not."""

from __future__ import annotations

import dataclasses

import pytest

from phaze_opt.solve.schedule import cache as schedule_cache
from phaze_opt.solve.schedule.solver import solve_schedule
from phaze_opt.solve.schedule.types import ScheduleProblem

P = ScheduleProblem(units=("tc", "vc", "tc"), single=(2.0, 1.0, 3.0), split=(1.0, 0.6, 1.5), edges=((0, 1),),
                    num_tc=2, num_vc=2, names=("a", "b", "c"))


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    schedule_cache.clear_memory()
    yield tmp_path
    schedule_cache.clear_memory()


def test_a_proven_schedule_is_reused_from_disk_by_content(cache_dir):
    first = solve_schedule(P)
    assert first.status == "optimal" and first.method != "cache"
    schedule_cache.clear_memory()  # a new process: only the disk copy is left
    renamed = dataclasses.replace(P, names=("x", "y", "z"))  # names change no decision
    again = solve_schedule(renamed, solver="cbc", time_limit_s=1.0)  # a proof holds for any solver and limit
    assert again.method == "cache" and again.makespan == first.makespan and again.start == first.start
    other = dataclasses.replace(P, single=(2.0, 1.0, 3.0000001))
    assert solve_schedule(other).method != "cache"


def _unproven(key):
    s = solve_schedule(P, cache=False)
    open_ = dataclasses.replace(s, status="time_limit", lower_bound=s.makespan * 0.9)
    schedule_cache.put(key, open_, "highs", 10.0)
    return open_


def test_an_unproven_schedule_is_reused_only_for_the_same_effort(cache_dir, monkeypatch):
    key = schedule_cache.problem_key(P)
    _unproven(key)
    assert schedule_cache.get(key, "highs", 10.0).status == "time_limit"
    assert schedule_cache.get(key, "highs", 5.0) is not None  # less time would not do better
    assert schedule_cache.get(key, "highs", 20.0) is None  # more time might close it
    assert schedule_cache.get(key, "cbc", 10.0) is None  # another solver might close it
    monkeypatch.setattr(schedule_cache, "METHODS_VERSION", schedule_cache.METHODS_VERSION + 1)
    assert schedule_cache.get(key, "highs", 10.0) is None  # newer exact methods might close it
    assert solve_schedule(P, time_limit_s=10.0).status == "optimal"  # re-solved, and now proven


# --- a file on disk is data: every hit is replayed against the problem --------------------------

# Two ops must share the one TC, so the optimum (3 s) is not the critical path (2 s).
Q = ScheduleProblem(units=("tc", "tc", "vc"), single=(1.0, 2.0, 1.0), split=(1.0, 2.0, 1.0), edges=((0, 2),),
                    num_tc=1, num_vc=1, names=("a", "b", "c"))


def _edit_on_disk(problem, edit):
    """Solve, then rewrite the disk record with `edit(record)` and forget the memory copy."""
    import json

    true = solve_schedule(problem)
    path = schedule_cache._path(schedule_cache.problem_key(problem))
    rec = json.loads(path.read_text())
    edited = edit(rec)
    path.write_text(edited if isinstance(edited, str) else json.dumps(edited))
    schedule_cache.clear_memory()
    return true, path


def _divide(rec, factor=100.0, fields=("makespan", "lower_bound", "start", "duration")):
    for f in fields:
        rec[f] = [v / factor for v in rec[f]] if isinstance(rec[f], list) else rec[f] / factor
    return rec


EDITS = {
    "makespan / 100": lambda rec: _divide(rec, fields=("makespan", "lower_bound")),
    "all times / 100": _divide,
    "all starts at 0": lambda rec: dict(rec, start=[0.0] * len(rec["start"]),
                                        makespan=max(rec["duration"]), lower_bound=max(rec["duration"])),
    "lower bound below an optimal makespan": lambda rec: dict(rec, lower_bound=rec["makespan"] / 2),
    "fewer ops": lambda rec: dict(rec, start=rec["start"][:-1]),
    "a list": lambda rec: "[]",
    "a number": lambda rec: "3.5",
    "missing fields": lambda rec: {k: v for k, v in rec.items() if k not in ("start", "cores")},
    "strings for numbers": lambda rec: dict(rec, start=[str(v) for v in rec["start"]]),
    "a string for cores": lambda rec: dict(rec, cores=["tc0" for _ in rec["cores"]]),
    "null makespan": lambda rec: dict(rec, makespan=None),
    "a bool for a time": lambda rec: dict(rec, makespan=True),
    "another status": lambda rec: dict(rec, status="proven"),
    "extra not a mapping": lambda rec: dict(rec, extra=[1, 2]),
    "truncated": lambda rec: '{"version": 1, "status": "optim',
    "nested too deep": lambda rec: "[" * 100_000 + "]" * 100_000,
    "not utf-8": None,  # written as bytes below
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_or_malformed_disk_record_is_a_logged_miss_and_is_solved_again(cache_dir, caplog, edit):
    problem = Q if edit != "fewer ops" else P
    if edit == "not utf-8":
        true, path = _edit_on_disk(problem, lambda rec: rec)
        path.write_bytes(b"\xff" + path.read_bytes())
    else:
        true, path = _edit_on_disk(problem, EDITS[edit])
    with caplog.at_level("WARNING", logger="phaze_opt.solve.schedule.cache"):
        again = solve_schedule(problem)
    assert again.method != "cache" and again.status == "optimal"
    assert again.makespan == true.makespan
    assert any(str(path) in r.getMessage() for r in caplog.records), edit
    schedule_cache.clear_memory()
    assert solve_schedule(problem).method == "cache"  # the file was rewritten with the true optimum


def test_an_optimal_record_below_the_problems_lower_bound_is_rejected_even_if_it_replays(cache_dir, monkeypatch):
    """Defence in depth: were the verifier ever to pass a too-short schedule, the cheap lower bound
    still refuses an 'optimal' makespan below it."""
    true, path = _edit_on_disk(Q, lambda rec: dict(rec, makespan=2.0, lower_bound=2.0))
    monkeypatch.setattr(schedule_cache, "verify_schedule", lambda problem, s: s.makespan)  # a blind verifier
    again = solve_schedule(Q)
    assert again.method != "cache" and again.makespan == true.makespan == 3.0


def test_a_hit_from_disk_is_checked_against_the_problem_asked_not_the_one_stored(cache_dir):
    """The key is a hash of the problem; a record copied under another problem's key is replayed
    on the latencies of the problem being solved and rejected."""
    import shutil

    solve_schedule(P)
    slower = dataclasses.replace(P, single=(4.0, 2.0, 6.0), split=(2.0, 1.2, 3.0))
    shutil.copy(schedule_cache._path(schedule_cache.problem_key(P)), cache_dir / "p.json")
    target = schedule_cache._path(schedule_cache.problem_key(slower))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(cache_dir / "p.json", target)
    schedule_cache.clear_memory()
    s = solve_schedule(slower)
    assert s.method != "cache" and s.makespan == pytest.approx(2 * solve_schedule(P).makespan)


def test_the_disk_is_read_only_to_check_a_hit_against_its_problem(cache_dir):
    key = schedule_cache.problem_key(P)
    solve_schedule(P)
    schedule_cache.clear_memory()
    assert schedule_cache.get(key, "highs", 10.0) is None  # no problem to check it against: not read
    assert schedule_cache.get(key, "highs", 10.0, problem=P).status == "optimal"
