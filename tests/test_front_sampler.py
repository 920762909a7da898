"""The bound-guided sampler for the throughput-area front (`search/front_sampler.py`), its order
(`design/front_order.py`) and the proven ceiling on the front's hypervolume (`bound_front`), against
brute force: the staircase's gain is the hypervolume a vector adds; a study run until the sampler
settles holds exactly the brute-force front, evaluates nothing twice and nothing over the area
budget; a seed repeats itself, with one process or two; and the bound front's hypervolume is at
least the exact front's, which is at least any study's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import optuna
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from phaze_opt.design import front_order
from phaze_opt.design.front_order import FrontOrder, bound_front, level0_cells, refine_front_cells
from phaze_opt.design.pareto import Staircase, best_at_or_below, front, hypervolume
from phaze_opt.design.space import load_space, space_from_mapping
from phaze_opt.errors import PhazeError
from phaze_opt.search.config import StudyConfig
from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search.front_sampler import FrontSampler
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import is_feasible
from phaze_opt.search.setup import resolve_sampler
from test_bound_sampler import MODEL, SYSTEM, _brute_force, _subset, space_mapping, spaces
from test_upper_bound import TINY_SPACE

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _hv(rows, ref_area: float) -> float:
    """Hypervolume of (throughput, area) rows against (0, ref_area), by `design.pareto`."""
    rows = np.asarray(rows, dtype=float).reshape(-1, 2)
    return hypervolume(np.column_stack([-rows[:, 0], rows[:, 1]]), [0.0, ref_area])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), max_size=10), st.integers(0, 12),
       st.integers(0, 12), st.integers(1, 12))
def test_gain_is_the_hypervolume_a_vector_adds(rows, u, a, ref):
    areas = [float(x) for x, _ in rows]
    scores = [float(s) for _, s in rows]
    stairs = Staircase(areas, scores, ref)
    vectors = [(s, x) for x, s in rows]
    assert stairs.gain(u, a) == pytest.approx(_hv(vectors + [(u, a)], ref) - _hv(vectors, ref), abs=1e-9)
    if rows:
        assert stairs.at(a) == float(best_at_or_below(np.array(areas), np.array(scores))(a))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.lists(st.integers(0, 6), min_size=2, max_size=2)), max_size=12))
def test_the_bound_front_is_the_front_of_each_architectures_best_cell(rows):
    areas = np.array([a for a, _ in rows], dtype=float)
    cells = np.array([c for _, c in rows], dtype=float).reshape(len(rows), 2)
    best = cells.max(axis=1) if len(rows) else np.zeros(0)
    expect = front(np.column_stack([-best, areas])[best > 0]) if len(rows) else np.zeros((0, 2))
    got = bound_front(areas, cells)
    assert sorted(map(tuple, got)) == sorted((-t, a) for t, a in expect)


def _truth(space) -> dict:
    """A made-up throughput per point the order can offer: a point's level-1 bound times a factor in
    (0.3, 1] fixed by its values, so every bound the order proves holds. Keyed as `_brute_force`."""
    bounds, out = _brute_force(space), {}
    for point in space.grid_points("grid"):
        key = _key(point)
        if key in bounds:
            factor = 0.3 + 0.7 * (int.from_bytes(repr(key).encode()[-8:], "little") % 1000 + 1) / 1000
            out[key] = (bounds[key][0] * factor, space.area_check(point)[1])
    return out


def _key(point: dict) -> tuple:
    return tuple(sorted((k, str(v)) for k, v in point.items()))


def _run(space, truth, samplers, n=10_000, lag=0):
    """Ask/tell on one in-memory study shared by `samplers` (one per simulated process), trial k
    told after trial k + lag is asked, until the sampler settles (the study's stop) or n trials.
    Returns the proposals in trial order and the study."""
    storage = optuna.storages.InMemoryStorage()
    directions = ["maximize", "minimize"]
    studies = [optuna.create_study(study_name="s", storage=storage, directions=directions, sampler=samplers[0])]
    studies += [optuna.load_study(study_name="s", storage=storage, sampler=s) for s in samplers[1:]]
    codec = SpaceCodec(space.params)
    asked, points = [], []
    for k in range(n):
        trial = studies[k % len(studies)].ask()
        points.append(codec.suggest(trial))
        asked.append(trial)
        if k >= lag:
            p = points[k - lag]
            studies[0].tell(asked[k - lag], [truth.get(_key(p), (0.0,))[0], space.area_check(p)[1]])
        if any(s.settled_at is not None for s in samplers):
            break
    for j in range(max(0, len(asked) - lag), len(asked)):
        studies[0].tell(asked[j], [truth.get(_key(points[j]), (0.0,))[0], space.area_check(points[j])[1]])
    return points, studies[0]


def _sampler(space, seed=3, workers=1, order=None):
    return FrontSampler(space, order or (lambda: FrontOrder(MODEL, SYSTEM, space, seed=seed)), seed=seed,
                        workers=workers, wait_s=0.0)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spaces(), st.integers(0, 3), st.sampled_from([0, 1, front_order.EXPAND_PER_PROPOSAL]))
def test_a_settled_study_holds_the_exact_front_and_nothing_twice(space, seed, expand):
    """`expand` 0: every proposal past its first cell takes a recipe at its cell's level 0."""
    assume(SpaceCodec(space.params).distributions())  # a one-point space leaves Optuna nothing to ask a sampler
    truth = _truth(space)
    sampler = _sampler(space, seed)
    old, front_order.EXPAND_PER_PROPOSAL = front_order.EXPAND_PER_PROPOSAL, expand
    try:
        points, study = _run(space, truth, [sampler])
    finally:
        front_order.EXPAND_PER_PROPOSAL = old
    assert sampler.settled_at == len(points) - 1  # the study stops after the trial that found nothing left
    keys = [_key(p) for p in points]
    # no design evaluated twice; the last trial takes a random point no trial holds, while one is left
    feasible = sum(1 for p in space.grid_points("grid") if space.area_check(p)[0])
    assert len(set(keys)) == len(keys) if len(keys) <= feasible else len(set(keys)) == feasible
    assert all(space.area_check(p)[0] for p in points)  # none over the area budget
    exact = {tuple(r) for r in front(np.array([(-v, a) for v, a in truth.values()]).reshape(-1, 2))}
    seen = np.array([(-t.values[0], t.values[1]) for t in study.get_trials() if t.values[0] > 0]).reshape(-1, 2)
    assert {tuple(r) for r in front(seen)} == exact
    if expand:  # it skipped what cannot join the front: at most the points the sweep's rule leaves open
        assert len(points) <= len(truth) + 1
    # the proven ceiling: bound front >= exact front >= the study's front after any number of trials
    order = FrontOrder(MODEL, SYSTEM, space, seed=seed)
    ref = order.reference_area
    cells = level0_cells(order.base)
    ceiling = _hv(bound_front(order.areas, cells), ref)
    refined = _hv(bound_front(order.areas, refine_front_cells(order.base, order.areas, cells)[0]), ref)
    exact_hv = _hv([(-x, a) for x, a in exact], ref)
    assert ceiling >= refined >= exact_hv * (1 - 1e-12)
    # the points half the study evaluated, at their values: a tighter ceiling, still above the exact front
    known = {order.base.index_of(p): truth.get(_key(p), (0.0,))[0] for p in points[: len(points) // 2]}
    assert None not in known
    tighter = _hv(bound_front(order.areas, refine_front_cells(order.base, order.areas, cells, known=known)[0]), ref)
    assert refined >= tighter >= exact_hv * (1 - 1e-12)
    # every point evaluated: the ceiling is the exact front
    every = {order.base.index_of(p): truth.get(_key(p), (0.0,))[0] for p in space.grid_points("grid")
             if space.area_check(p)[0]}
    full = _hv(bound_front(order.areas, refine_front_cells(order.base, order.areas, cells, known=every)[0]), ref)
    assert full == pytest.approx(exact_hv, rel=1e-9, abs=1e-9)
    half = [t for t in study.get_trials() if t.number < len(points) // 2]
    assert exact_hv >= _hv([t.values for t in half], ref) * (1 - 1e-12)


@st.composite
def tight_spaces(draw):
    """Spaces whose HBM tiers (2-4 GiB) leave some recipes of gpt2-xl with no placement that fits."""
    params = {"num_tc": draw(_subset([2, 16])), "num_vc": draw(_subset([8, 64])), "tc_x": draw(_subset([64, 128])),
              "tc_y": [128], "glb_mib": [32], "hbm_gib": draw(_subset([2, 4, 80])), "mbs": draw(_subset([1, 2])),
              "recompute": draw(_subset(["none", "selective", "full"]))}
    mapping = space_mapping(params)
    mapping["hbm_bw_gbps"] = {2: 1200, 4: 1200, 80: 2048}
    return space_from_mapping(mapping, "tight.yaml")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tight_spaces(), st.integers(0, 3))
def test_past_the_cap_a_proposal_is_a_bounded_point_while_one_is_left(space, seed):
    """With one cell split per proposal, a proposal is a point with a positive level-1 bound (some
    placement fits its HBM) whenever the order holds such a point that could join the front; a
    recipe at its cell's level 0 (possibly one no placement fits) only when it holds none."""
    bounds = _brute_force(space)
    codec = SpaceCodec(space.params)
    order = FrontOrder(MODEL, SYSTEM, space, seed=seed)
    areas, scores, held = [], [], set()

    def taken(point):
        return _key(point) in held

    for _ in range(40):
        stairs = order.staircase(areas, scores)
        open_points = [e for e in order.points
                       if e[5] > stairs.at(float(order.areas[e[4][0]])) and not taken(order.point(*e[4]))]
        found = order.next_point(stairs, taken, expand=1)
        if found is None:
            break
        point, _ = found
        key = _key(codec.decode(codec.encode(point)))
        if open_points:
            assert bounds.get(key, (0.0,))[0] > 0, point
        held.add(_key(point))
        areas.append(float(space.area_check(point)[1]))
        scores.append(0.5 * bounds.get(key, (0.0,))[0])


def test_a_seed_repeats_itself_with_one_process_or_two():
    """Two sampler instances serving alternate trials, results told one trial late, propose what
    one instance proposes; another seed breaks ties otherwise."""
    space = load_space("small")
    truth = _truth(space)
    one, _ = _run(space, truth, [_sampler(space, 3, workers=2)], n=30, lag=1)
    two, _ = _run(space, truth, [_sampler(space, 3, workers=2), _sampler(space, 3, workers=2)], n=30, lag=1)
    assert one == two
    again, _ = _run(space, truth, [_sampler(space, 3, workers=2)], n=30, lag=1)
    assert again == one


def test_the_default_sampler_takes_throughput_and_area_but_not_energy():
    config = StudyConfig(models=("gpt2-xl",), space="small", objectives=("throughput", "area"), tracking_uri="off")
    assert resolve_sampler(config, None) == "bound"
    assert resolve_sampler(replace(config, objectives=("throughput", "area", "energy")), None) == "tpe"
    with pytest.raises(PhazeError, match="--sampler bound: energy has no proven lower bound"):
        resolve_sampler(replace(config, sampler="bound", objectives=("throughput", "energy")), None)


def _space_front(result) -> tuple[set, list]:
    """The front of a finished study's trials that the space proposed (the enqueued TPUv4
    baselines left out), and those trials."""
    trials = optuna.load_study(study_name=result["study"], storage=result["storage"]).get_trials()
    searched = [t for t in trials if "fixed_params" not in t.system_attrs]
    rows = np.array([(-t.values[0], t.values[1]) for t in searched if is_feasible(t)]).reshape(-1, 2)
    return {tuple(r) for r in front(rows)}, searched


def test_a_real_study_settles_on_the_grids_exact_front(tmp_path):
    """The default sampler with throughput and area on the real evaluator: it stops before
    `--trials` and holds the full grid's front, no design twice, none over the budget."""
    space_file = tmp_path / "tiny.yaml"
    space_file.write_text(TINY_SPACE)
    base = dict(models=("gpt2-xl",), space=str(space_file), objectives=("throughput", "area"), tracking_uri="off",
                output_dir=str(tmp_path), progress=False)
    full = run_study(StudyConfig(**base, strategy="grid", hysteresis="off"))
    sampled = run_study(StudyConfig(**base, trials=200))
    assert sampled["sampler"] == "bound"
    exact, _ = _space_front(full)
    found, searched = _space_front(sampled)
    assert found == exact and len(searched) < 200
    assert any("the space's exact front" in note for note in sampled["notes"])
    keys = [tuple(sorted(t.params.items())) for t in searched]
    assert len(keys) == len(set(keys))  # no design twice
    assert all(t.constraints.get("area", 0) <= 0 for t in searched)  # none over the area budget
