"""The front and hypervolume of design/pareto.py against brute force on small sets."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from phaze_opt.design.pareto import best_at_or_below, front, front_mask, hypervolume, minimised
from phaze_opt.errors import PhazeError
from phaze_opt.search.config import StudyConfig
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import is_feasible
from phaze_opt.search.setup import resolve_strategy
from test_upper_bound import TINY_SPACE


def _subset(choices):
    return st.lists(st.sampled_from(choices), min_size=1, max_size=len(choices), unique=True).map(
        lambda xs: sorted(xs, key=choices.index))


@st.composite
def spaces_params(draw):
    """A few dozen points: architectures of several areas, both HBM sizes, microbatches, recomputes."""
    return {"num_tc": draw(_subset([2, 4, 16])), "num_vc": draw(_subset([8, 64])), "tc_x": draw(_subset([64, 128])),
            "tc_y": [128], "glb_mib": draw(_subset([16, 32])), "hbm_gib": draw(_subset([32, 80])),
            "mbs": draw(_subset([1, 2])), "recompute": draw(_subset([False, True]))}


def _points(dim: int):
    # few distinct coordinates, so ties and duplicates (the hard cases) are common
    return st.lists(st.tuples(*[st.integers(0, 6)] * dim), min_size=0, max_size=12).map(
        lambda rows: np.array(rows, dtype=float).reshape(-1, dim))


def _brute_front(pts: np.ndarray) -> set:
    """Distinct rows no other row strictly dominates (all <=, one <)."""
    out = set()
    for p in pts:
        if not any(np.all(q <= p) and np.any(q < p) for q in pts):
            out.add(tuple(p))
    return out


def _brute_hv(pts: np.ndarray, ref: np.ndarray) -> float:
    """The dominated region on the grid of every coordinate: a cell counts when some point is at or
    below its lower corner (exact, since the region is a union of such cells)."""
    pts = pts[np.all(pts < ref, axis=1)]
    axes = [np.unique(np.append(pts[:, k], ref[k])) for k in range(ref.size)]
    total = 0.0
    for idx in itertools.product(*[range(len(a) - 1) for a in axes]):
        lo = np.array([axes[k][i] for k, i in enumerate(idx)])
        if any(np.all(p <= lo) for p in pts):
            total += float(np.prod([axes[k][i + 1] - axes[k][i] for k, i in enumerate(idx)]))
    return total


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([2, 3]).flatmap(_points))
def test_front_is_the_set_no_point_dominates(pts):
    assert {tuple(p) for p in front(pts)} == _brute_front(pts)
    assert int(front_mask(pts).sum()) == len(_brute_front(pts))  # one row per distinct vector


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([2, 3]).flatmap(_points), st.integers(3, 7))
def test_hypervolume_matches_the_grid_count(pts, r):
    ref = np.full(pts.shape[1], float(r))
    assert hypervolume(pts, ref) == pytest.approx(_brute_hv(pts, ref), abs=1e-9)


def test_hypervolume_of_known_fronts():
    assert hypervolume([[1, 2], [2, 1]], [3, 3]) == 3.0  # 2x1 + 1x2 - 1x1 overlap
    assert hypervolume([[1, 1, 1]], [2, 3, 4]) == 6.0
    assert hypervolume([[5, 0]], [3, 3]) == 0.0  # beyond the reference: nothing
    with pytest.raises(ValueError, match="two or three"):
        hypervolume([[0, 0, 0, 0]], [1, 1, 1, 1])


def test_minimised_negates_the_maximised_objectives():
    assert minimised([[10.0, 3.0]], ["maximize", "minimize"]).tolist() == [[-10.0, 3.0]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 9)), min_size=1, max_size=10), st.integers(0, 10))
def test_best_at_or_below_is_the_staircase(rows, a):
    areas, scores = np.array(rows, dtype=float).T
    expect = max([s for x, s in rows if x <= a], default=0.0)
    assert float(best_at_or_below(areas, scores)(a)) == expect


# -- the pruned sweep's throughput-area front against the full grid's -----------------------------------

def _vectors(result) -> list[tuple[float, float, dict]]:
    """(throughput, area, point) of every feasible trial of a finished study."""
    study = optuna.load_study(study_name=result["study"], storage=result["storage"])
    return [(t.values[0], t.values[1], t.user_attrs["point"]) for t in study.get_trials(deepcopy=False)
            if is_feasible(t)]


def _front_set(rows) -> set:
    pts = np.array([(-thr, area) for thr, area, _ in rows]).reshape(-1, 2)
    return {tuple(p) for p in front(pts)}


def _both_sweeps(tmp_path, mapping: dict):
    space_file = tmp_path / "space.yaml"
    space_file.write_text(yaml.safe_dump(mapping))
    base = dict(models=("gpt2-xl",), space=str(space_file), hysteresis="off", objectives=("throughput", "area"),
                tracking_uri="off", output_dir=str(tmp_path), progress=False)
    full = run_study(StudyConfig(**base, strategy="grid"))
    pruned = run_study(StudyConfig(**base, strategy="auto"))
    return full, pruned


def _check_exact(full, pruned) -> None:
    """The pruned sweep's front is the full grid's, every point is settled, and every point it did
    not evaluate is weakly dominated by one it did (the pruning rule, checked on the true values)."""
    ex = pruned["exhaustive"]
    assert ex["prune"] == "bound" and ex["front_proven"] is True
    assert ex["settled"]["evaluated"] + ex["evaluated_by_bound"] == ex["points"] == full["exhaustive"]["evaluated"]
    truth, seen = _vectors(full), _vectors(pruned)
    assert _front_set(seen) == _front_set(truth)
    evaluated = {json.dumps(p, sort_keys=True) for _, _, p in seen}
    for thr, area, point in truth:
        if json.dumps(point, sort_keys=True) not in evaluated:
            assert any(t >= thr and a <= area for t, a, _ in seen), point


def test_pruned_sweep_finds_the_exact_throughput_area_front(tmp_path):
    full, pruned = _both_sweeps(tmp_path, yaml.safe_load(TINY_SPACE))
    _check_exact(full, pruned)
    assert pruned["exhaustive"]["evaluated_by_bound"] > 0  # it did prune
    # run again on the same storage: the resumed scores enter area group by area group, so nothing is
    # evaluated again and the front is the same
    again = run_study(StudyConfig(models=("gpt2-xl",), space=str(tmp_path / "space.yaml"), hysteresis="off",
                                  objectives=("throughput", "area"), tracking_uri="off", output_dir=str(tmp_path),
                                  progress=False, strategy="auto"))
    assert again["exhaustive"]["evaluated_this_run"] == 0
    assert _front_set(_vectors(again)) == _front_set(_vectors(full))
    # compare measures both on the exact front: the same front, all of its hypervolume
    from phaze_opt.experiments.convergence import compare

    fronts = compare([full["study"], pruned["study"]], out_dir=str(tmp_path), tracking_uri="off")["fronts"]
    assert fronts["reference_front"] == f"the exact front of {pruned['study']}"
    assert [r["fraction"] for r in fronts["rows"]] == [pytest.approx(1.0)] * 2
    assert fronts["rows"][0]["front_size"] == fronts["rows"][1]["front_size"] == len(_front_set(_vectors(full)))
    assert Path(fronts["plot"]).is_file()


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=spaces_params())
def test_pruned_front_matches_brute_force_on_drawn_spaces(tmp_path_factory, params):
    mapping = {**yaml.safe_load(TINY_SPACE), "params": params}
    full, pruned = _both_sweeps(tmp_path_factory.mktemp("drawn"), mapping)
    _check_exact(full, pruned)


def test_energy_objective_sweeps_the_grid():
    """No proven lower bound on energy: `auto` falls back to the grid, and asking for bound pruning
    says why in one line."""
    config = StudyConfig(models=("gpt2-xl",), space="small", objectives=("throughput", "energy"), hysteresis=None,
                         tracking_uri="off", strategy="auto")
    assert resolve_strategy(config, None) == "grid"
    assert resolve_strategy(replace(config, objectives=("throughput", "area")), None) == "branch-and-bound"
    with pytest.raises(PhazeError, match="energy has no proven lower bound"):
        resolve_strategy(replace(config, strategy="branch-and-bound"), None)


def test_front_trials_are_tagged_in_mlflow(tmp_path):
    """At the end of a multi-objective study every trial run of its Pareto front carries
    `pareto_front=true`, and no other run does."""
    from mlflow import MlflowClient
    from test_study_fakes import backend, config, mlflow_uri

    from phaze_opt.search.report import pareto_front
    from phaze_opt.search.setup import default_study_name

    uri = mlflow_uri(tmp_path)
    cfg = config(tmp_path, trials=12, tracking_uri=uri, sampler="nsga2", objectives=("throughput", "area"))
    run_study(cfg, backend())
    name = default_study_name(cfg)
    trials = optuna.load_study(study_name=name, storage=cfg.storage).get_trials()
    on_front = {t.number for t in pareto_front(trials, ["maximize", "minimize"])}
    assert on_front
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(name).experiment_id], max_results=1000)
    tagged = {int(r.data.tags["optuna.trial_number"]) for r in runs if r.data.tags.get("pareto_front") == "true"}
    assert tagged == on_front
