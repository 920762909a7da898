"""The bound-guided sampler (`search/bound_sampler.py`) and the lazy best-first order it follows
(`design/best_first.py`): every feasible point offered once, in bound order, the exact optimum
reached, and the same study whatever the machine's load or the number of processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import optuna
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt.design import best_first
from phaze_opt.design.best_first import BoundOrder, level0_throughput, recipe_bounds
from phaze_opt.design.dominance import model_dominators
from phaze_opt.design.evaluate import tp_widths
from phaze_opt.design.space import load_space, space_from_mapping
from phaze_opt.design.upper_bound import layer_lower_bounds
from phaze_opt.hardware.latency import DesignArrays
from phaze_opt.search import bound_sampler
from phaze_opt.search.bound_sampler import SETTLED_ATTR, BoundSampler, held_keys
from phaze_opt.search.config import StudyConfig
from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import is_feasible
from phaze_opt.system import load_system
from phaze_opt.training import recipe_choices
from phaze_opt.workload.models import load_model
from test_upper_bound import TINY_SPACE as TINY

MODEL, SYSTEM = load_model("gpt2-xl"), load_system("default")



def space_mapping(params: dict) -> dict:
    """A drawn space as its YAML file holds it (a sweep takes the file)."""
    fixed = {} if "clock_ghz" in params else {"clock_ghz": 1.05}
    return {"name": "drawn", "params": params, "tied": {"vc_width": "tc_x"}, "fixed": fixed,
            "hbm_bw_gbps": {32: 1200, 80: 2048},
            "area": {"budget": "tpuv4", "min_fraction": 0.05, "floor_exempt_if_one": ["num_tc", "num_vc"]}}


def _space(params: dict):
    return space_from_mapping(space_mapping(params), "drawn.yaml")


def _subset(choices):
    return st.lists(st.sampled_from(choices), min_size=1, max_size=len(choices), unique=True).map(
        lambda xs: sorted(xs, key=choices.index))


@st.composite
def spaces(draw):
    """A few dozen points: two or three architectures' worth of choices and at most two recipe fields."""
    params = {"num_tc": draw(_subset([2, 4, 16])), "num_vc": draw(_subset([8, 64])),
              "tc_x": draw(_subset([64, 128])), "tc_y": [128], "glb_mib": [32],
              "hbm_gib": draw(_subset([32, 80])), "mbs": draw(_subset([1, 2])),
              "recompute": draw(_subset(["none", "selective", "full"]))}
    optional = {"sequence_parallel": [False, True], "zero": [0, 1, 3], "overlap_grad_reduce": [False, True],
                "attention": ["unfused", "flash"]}
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=2, unique=True)):
        params[name] = draw(_subset(optional[name]))
    if draw(st.booleans()):  # a chip field that costs no area: each die at each clock (`SearchSpace.dies`)
        params["clock_ghz"] = draw(_subset([0.7, 1.05]))
    return _space(params)


def _brute_force(space) -> dict:
    """Every feasible point whose recipe no other recipe of its design dominates, with its level-1
    bound computed on its own (one design at a time, no batches, no tree), keyed by its values."""
    out, cells, doms = {}, {}, {}
    rcs = recipe_choices(space.params)
    attns = list(space.params.get("attention", [None]))
    v_max = max([1] + [int(v) for v in space.params.get("virtual_stages", [1])])
    for point in space.grid_points("grid"):
        mbs = int(point["mbs"])
        dom = doms.setdefault(mbs, model_dominators(rcs, MODEL, SYSTEM, mbs))
        recipe = {k: point[k] for k in rcs[0]}
        if dom[rcs.index(recipe)] != rcs.index(recipe):
            continue
        acc = space.accelerator(point)
        cell = (tuple(sorted(space.arch_values(point).items())), mbs)  # the name leaves the clock out
        if cell not in cells:
            designs = DesignArrays.from_accelerators([acc])
            widths = [[layer_lower_bounds(MODEL, designs, mbs, SYSTEM, tp, a) for tp in tp_widths(MODEL, SYSTEM)]
                      for a in attns]
            cells[cell] = widths, float(level0_throughput(widths, mbs, SYSTEM, v_max)[0])
        widths, level0 = cells[cell]
        bound = recipe_bounds(MODEL, SYSTEM, widths, mbs, float(acc.hbm_bytes), float(acc.peak_flops), [recipe],
                              attns)[0]
        if bound > 0:
            out[tuple(sorted((k, str(v)) for k, v in point.items()))] = (bound, level0)
    return out


def _walk(order, incumbent=0.0):
    points = []
    while (found := order.next_point(incumbent, lambda p: False)) is not None:
        points.append(found)
    return points


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spaces(), st.integers(0, 3))
def test_best_first_offers_every_undominated_feasible_point_once_in_bound_order(space, seed):
    truth = _brute_force(space)
    old = best_first.DIVE_AFTER
    best_first.DIVE_AFTER = 10**9  # no dives: the order must then be exactly best-first
    try:
        walked = _walk(BoundOrder(MODEL, SYSTEM, space, seed=seed))
    finally:
        best_first.DIVE_AFTER = old
    keys = [tuple(sorted((k, str(v)) for k, v in p.items())) for p, _ in walked]
    assert len(keys) == len(set(keys))  # once each
    assert set(keys) == set(truth)  # every point that can be feasible, and no other
    for key, (_, bound) in zip(keys, walked):
        assert bound == pytest.approx(truth[key][0], rel=1e-9)
        assert bound <= truth[key][1] * (1 + 1e-9)  # level 1 under its cell's level 0
    bounds = [b for _, b in walked]
    # best-first: non-increasing; an invalid tree (a roofline under a cell's level 0, say) breaks it
    assert all(a >= b * (1 - 1e-12) for a, b in zip(bounds, bounds[1:]))


def test_the_order_with_dives_still_offers_every_point_once_and_stops_at_the_incumbent():
    space = load_space("small")
    walked = _walk(BoundOrder(MODEL, SYSTEM, space, seed=1))
    keys = [tuple(sorted(p.items())) for p, _ in walked]
    assert len(keys) == len(set(keys)) == len(_brute_force(space))
    cut = sorted(b for _, b in walked)[len(walked) // 2]
    above = _walk(BoundOrder(MODEL, SYSTEM, space, seed=1), incumbent=cut)
    assert {tuple(sorted(p.items())) for p, _ in above} == {k for k, (_, b) in zip(keys, walked) if b > cut}


def test_seeds_break_ties_differently_and_a_seed_repeats_itself():
    space = load_space("small")
    first = [p for p, _ in _walk(BoundOrder(MODEL, SYSTEM, space, seed=0))]
    assert first == [p for p, _ in _walk(BoundOrder(MODEL, SYSTEM, space, seed=0))]
    assert first != [p for p, _ in _walk(BoundOrder(MODEL, SYSTEM, space, seed=5))]


def _fake_value(order, point):
    return 0.5 * order.cell_bound(point) * (1 + (hash(tuple(sorted(map(str, point.values())))) % 7) / 100)


def _ask_tell(space, samplers, pattern, n):
    """Serve `n` trials of one in-memory study with `samplers` (one per simulated worker process,
    each with its own `optuna.Study` on the shared storage); `pattern(k)` is the trial told after
    trial k is asked (None: none). Returns the decoded proposals in trial order."""
    storage = optuna.storages.InMemoryStorage()
    studies = [optuna.create_study(study_name="s", storage=storage, direction="maximize", sampler=samplers[0])]
    studies += [optuna.load_study(study_name="s", storage=storage, sampler=s) for s in samplers[1:]]
    codec = SpaceCodec(space.params)
    order = BoundOrder(MODEL, SYSTEM, space, seed=99)
    asked, points = {}, {}
    for k in range(n):
        trial = studies[k % len(studies)].ask()
        points[trial.number] = codec.suggest(trial)
        asked[trial.number] = trial
        told = pattern(k)
        for number in ([told] if told is not None else []):
            studies[0].tell(asked.pop(number), _fake_value(order, points[number]))
    return [points[k] for k in sorted(points)]


def _sampler(space, workers, seed=3, explore=0.3):
    # a tiny bounding budget, so trials also take the best point bounded so far instead of waiting
    return BoundSampler(space, lambda: BoundOrder(MODEL, SYSTEM, space, seed=seed), seed=seed, workers=workers,
                        explore=explore, wait_s=0.0, work_per_trial=2, work_at_start=4)


def test_several_processes_propose_what_one_would_whatever_finishes_first():
    """With workers = 2 a trial's proposal waits for the results of trials two back: two sampler
    instances (two processes) serving alternate trials, with results arriving in either order,
    propose exactly what one instance proposes; and never a repeat or an area-infeasible point."""
    space = load_space("small")
    n = 40

    def lag_one(k):
        return k - 1 if k >= 1 else None

    one = _ask_tell(space, [_sampler(space, 2)], lag_one, n)
    two = _ask_tell(space, [_sampler(space, 2), _sampler(space, 2)], lag_one, n)
    assert one == two
    keys = [tuple(sorted(p.items())) for p in one]
    assert len(set(keys)) == n
    assert all(space.area_check(p)[0] for p in one)


def test_the_sampler_waits_for_the_results_it_depends_on():
    """A proposal made before an earlier trial it depends on has finished would depend on timing;
    the sampler waits (here: its whole wait_s) and then proposes anyway rather than hang."""
    space = load_space("small")
    storage = optuna.storages.InMemoryStorage()
    sampler = BoundSampler(space, lambda: BoundOrder(MODEL, SYSTEM, space, seed=0), seed=0, workers=1, wait_s=0.3)
    study = optuna.create_study(storage=storage, direction="maximize", sampler=sampler)
    codec = SpaceCodec(space.params)
    codec.suggest(study.ask())
    second = study.ask()
    t0 = time.monotonic()
    codec.suggest(second)  # Optuna samples on the first suggest; trial 0 is still running and workers = 1 needs it
    assert time.monotonic() - t0 >= 0.3
    assert len(held_keys(study.get_trials())) == 2


def _one_beating_trial(tmp_path, grace_s: int):
    """A study on a storage with heartbeats whose trial 0 is running and has beaten once."""
    space = load_space("small")
    sampler = BoundSampler(space, lambda: BoundOrder(MODEL, SYSTEM, space, seed=0), seed=0, workers=1, wait_s=0.05)
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'beat.db'}", heartbeat_interval=1,
                                         grace_period=grace_s)
    study = optuna.create_study(storage=storage, direction="maximize", sampler=sampler)
    codec = SpaceCodec(space.params)
    first = study.ask()
    codec.suggest(first)
    storage.record_heartbeat(first._trial_id)
    return study, codec, first


def test_with_heartbeats_a_proposal_waits_for_a_live_trial_however_long_it_runs(tmp_path):
    """A trial that runs longer than `wait_s` (a slow evaluation on a loaded machine) but whose
    process lives is waited for: the next proposal sees its result, as on a quiet machine."""
    study, codec, first = _one_beating_trial(tmp_path, grace_s=60)

    def finish_later():
        time.sleep(0.5)  # ten times wait_s
        study.tell(first, 1.0)

    worker = threading.Thread(target=finish_later)
    worker.start()
    codec.suggest(study.ask())
    state_when_proposed = study.get_trials(deepcopy=False)[0].state
    worker.join()
    assert state_when_proposed == optuna.trial.TrialState.COMPLETE


def test_with_heartbeats_a_dead_workers_trial_is_failed_and_not_waited_on(tmp_path, monkeypatch):
    """A trial whose process stopped beating (one beat, then gone) is failed by the heartbeat rule
    while the next proposal waits for it (and queued again by the storage's retry callback, where
    one is set)."""
    monkeypatch.setattr(bound_sampler, "STALE_CHECK_S", 0.1)
    study, codec, _ = _one_beating_trial(tmp_path, grace_s=1)
    codec.suggest(study.ask())
    assert study.get_trials(deepcopy=False)[0].state == optuna.trial.TrialState.FAIL


def _tiny_study(tmp_path, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    space_file = tmp_path / "tiny.yaml"
    space_file.write_text(TINY)
    return StudyConfig(models=("gpt2-xl",), space=str(space_file), tracking_uri="off", output_dir=str(tmp_path),
                       progress=False, **kw)


@pytest.mark.slow
def test_the_sampled_study_reaches_the_exhaustive_optimum_and_stops_when_nothing_can_beat_it(tmp_path):
    full = run_study(_tiny_study(tmp_path, strategy="grid", hysteresis="off"))
    summary = run_study(_tiny_study(tmp_path, trials=200))
    assert summary["best"]["score"] == pytest.approx(full["best"]["score"], rel=1e-12)
    study = optuna.load_study(study_name=summary["study"], storage=summary["storage"])
    trials = study.get_trials()
    assert SETTLED_ATTR in study.user_attrs and len(trials) < 200
    keys = [tuple(sorted(t.params.items())) for t in trials]
    assert len(keys) == len(set(keys))  # no design evaluated twice
    assert all(t.constraints.get("area", 0) <= 0 for t in trials)  # no trial over the area budget
    assert max(t.values[0] for t in trials if is_feasible(t)) == summary["best"]["score"]
    again = run_study(_tiny_study(tmp_path, trials=200))  # resumed: settled, so nothing more runs
    assert len(optuna.load_study(study_name=again["study"], storage=again["storage"]).get_trials()) == len(trials)


@pytest.mark.slow
def test_a_seed_gives_the_same_study_on_a_loaded_machine(tmp_path):
    """The same short study twice, the second with two busy processes beside it: the same designs
    in the same order, the same values."""
    quiet = run_study(_tiny_study(tmp_path / "quiet", trials=12))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        loaded = run_study(_tiny_study(tmp_path / "loaded", trials=12))
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    a = optuna.load_study(study_name=quiet["study"], storage=quiet["storage"]).get_trials()
    b = optuna.load_study(study_name=loaded["study"], storage=loaded["storage"]).get_trials()
    assert [t.params for t in a] == [t.params for t in b]
    assert [t.values for t in a] == [t.values for t in b]
