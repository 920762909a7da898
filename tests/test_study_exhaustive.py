"""The exhaustive sweep: every point once, reuse-friendly order, the published hysteresis rule, resume."""

import math

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.trial import TrialState

from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.exhaustive import best_history, hysteresis_stop, plan
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import finished_trials, is_feasible
from phaze_opt.search.setup import default_study_name
from test_study_fakes import CALLS, InterruptAfter, backend, config, small_space


def load(cfg):
    return optuna.load_study(study_name=cfg.study_name or default_study_name(cfg), storage=cfg.storage)


def key(p):
    return tuple(sorted(p.items()))


def optimal_calls():
    return [c for c in CALLS if c[5] == "optimal"]


def exhaustive(tmp_path, name, **kw):
    return config(tmp_path, strategy="auto", study_name=name, **kw)


def bk(evaluator=None):
    return backend(small_space()) if evaluator is None else backend(small_space(), evaluator)


@pytest.fixture(scope="module")
def full_sweep(tmp_path_factory):
    """One complete sweep in area order, shared by the tests that need its results."""
    tmp = tmp_path_factory.mktemp("full")
    cfg = exhaustive(tmp, "full")
    CALLS.clear()
    summary = run_study(cfg, bk())
    return cfg, summary, list(CALLS), load(cfg).get_trials()


def test_every_grid_point_is_one_trial_evaluated_once(full_sweep):
    cfg, summary, calls, trials = full_sweep
    space = small_space()
    grid = space.grid_points("grid")
    codec = SpaceCodec(space.params)
    assert len(trials) == len(grid) == summary["exhaustive"]["points"] == summary["exhaustive"]["evaluated"]
    assert sorted(key(codec.decode(t.params)) for t in trials) == sorted(key(p) for p in grid)
    assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    optimal = [c for c in calls if c[5] == "optimal"]
    assert len(optimal) == len(grid)  # each point reached the evaluator exactly once
    # exhaustive trials look like sampled ones: point, result, constraints
    t = next(t for t in trials if is_feasible(t))
    assert t.user_attrs["point"] == codec.decode(t.params) and "area" in t.constraints
    assert t.user_attrs["result"]["models"]["m-small"]["placement"]["pp"] == 2


def test_area_order_and_reuse_clusters(full_sweep):
    _, _, calls, trials = full_sweep
    space = small_space()
    areas = [space.area(t.user_attrs["point"]) for t in trials]
    assert areas == sorted(areas, reverse=True)  # decreasing area, trial by trial
    # the points sharing a compute architecture and microbatch (same ILPs) are evaluated back to back
    order = [(c[1], c[3]) for c in calls if c[5] == "optimal"]
    seen, last = set(), None
    for k in order:
        if k != last:
            assert k not in seen, "a reuse cluster was split"
            seen.add(k)
            last = k
    # wall-clock is recorded per trial and grows
    elapsed = [t.user_attrs["result"]["elapsed_s"] for t in trials]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0


def test_best_history_matches_brute_force(full_sweep):
    _, summary, _, trials = full_sweep
    history = summary["exhaustive"]["best_history"]
    expected, best = [], -math.inf
    for t in sorted(trials, key=lambda t: t.user_attrs["result"]["elapsed_s"]):
        if is_feasible(t) and t.values[0] > best:
            best = t.values[0]
            expected.append(t.number)
    assert [h["trial"] for h in history] == expected
    assert history[-1]["score"] == summary["best"]["score"] == max(t.values[0] for t in trials if is_feasible(t))
    flagged = [t.number for t in trials if (t.user_attrs.get("result") or {}).get("new_best")]
    assert flagged == expected


@pytest.mark.parametrize("k", [2, 3, 6])
def test_hysteresis_stops_where_the_published_rule_says(tmp_path, full_sweep, k):
    _, _, _, full = full_sweep
    space = small_space()
    # oracle from the complete sweep: area groups of 0.01 mm^2 by decreasing area, each group's best
    score = {key(t.user_attrs["point"]): (t.values[0] if is_feasible(t) else 0.0) for t in full}
    groups = {}
    for p in space.grid_points("area"):
        groups.setdefault(math.floor(space.area(p) / 0.01 + 1e-9), []).append(p)
    bins = sorted(groups, reverse=True)
    maxima, stop_after = [], len(bins) - 1
    for i, b in enumerate(bins):
        maxima.append(max(score[key(p)] for p in groups[b]))
        w = maxima[-k:]
        if len(maxima) >= k and all(w[j] >= w[j + 1] for j in range(k - 1)):
            stop_after = i
            break
    expected = {key(p) for b in bins[:stop_after + 1] for p in groups[b]}
    cfg = exhaustive(tmp_path, f"h{k}", hysteresis=k)
    summary = run_study(cfg, bk())
    got = {key(t.user_attrs["point"]) for t in load(cfg).get_trials()}
    assert got == expected
    assert summary["exhaustive"]["stopped_early"] == (stop_after < len(bins) - 1)
    assert summary["exhaustive"]["groups_done"] == stop_after + 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=0, max_size=12), st.integers(1, 6))
def test_hysteresis_rule_against_its_definition(maxima, k):
    expected = len(maxima) >= k and all(maxima[-k + j] >= maxima[-k + j + 1] for j in range(k - 1))
    assert hysteresis_stop(maxima, k) == expected
    assert hysteresis_stop(maxima, None) is False


def test_grid_order_keeps_reuse_clusters_together():
    space = small_space()
    clusters = plan(space, "grid", 0.01)
    flat = [p for c in clusters for p in c["points"]]
    assert sorted(map(key, flat)) == sorted(map(key, space.grid_points("grid")))
    for c in clusters:
        ks = {(space.accelerator(p).compute_key, p["mbs"]) for p in c["points"]}
        assert ks == {c["key"]}
    assert len({c["key"] for c in clusters}) == len(clusters)


def test_interrupted_sweep_resumes_without_repeating(tmp_path, full_sweep):
    _, _, _, full = full_sweep
    cfg = exhaustive(tmp_path, "resume")
    CALLS.clear()
    with pytest.raises(KeyboardInterrupt):
        run_study(cfg, bk(InterruptAfter(30)))
    assert len(load(cfg).get_trials()) == 29
    run_study(cfg, bk())
    trials = load(cfg).get_trials()
    assert len(finished_trials(trials)) == len(full)
    assert len({key(t.user_attrs["point"]) for t in trials}) == len(full)
    assert len(optimal_calls()) == len(full)  # 29 before the cut, the rest after: each point once


def test_resumed_hysteresis_replays_the_stored_scores(tmp_path, full_sweep):
    expected = {key(t.user_attrs["point"]) for t in full_sweep[3]}
    cfg = exhaustive(tmp_path / "b", "h3", hysteresis=3)
    with pytest.raises(KeyboardInterrupt):
        run_study(cfg, bk(InterruptAfter(5)))
    run_study(cfg, bk())
    cfg_straight = exhaustive(tmp_path / "c", "h3", hysteresis=3)
    run_study(cfg_straight, bk())
    got = {key(t.user_attrs["point"]) for t in load(cfg).get_trials()}
    assert got == {key(t.user_attrs["point"]) for t in load(cfg_straight).get_trials()}
    assert got < expected


def test_best_history_orders_by_wall_clock():
    class T:
        def __init__(self, n, v, e, ok=True):
            self.number, self.values, self.state = n, [v], TrialState.COMPLETE
            self.constraints = {"area": -1.0 if ok else 1.0}
            self.user_attrs = {"result": {"elapsed_s": e}}

    trials = [T(0, 5.0, 3.0), T(1, 7.0, 1.0), T(2, 9.0, 2.0, ok=False), T(3, 8.0, 4.0)]
    assert [(h["trial"], h["score"]) for h in best_history(trials)] == [(1, 7.0), (3, 8.0)]
