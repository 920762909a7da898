"""The content-addressed schedule memo: what it reuses and what it must not."""

from __future__ import annotations

import dataclasses

import pytest

from phaze_opt.solve import schedule_cache
from phaze_opt.solve.schedule import solve_schedule
from phaze_opt.solve.types import ScheduleProblem

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
