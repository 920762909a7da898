"""The cluster as a search-space axis: parsing, point -> System, the frontier space, a study over it."""

from __future__ import annotations

import itertools

import optuna
import pytest

from phaze_opt.design import system_axes
from phaze_opt.design.space import load_space, space_from_mapping
from phaze_opt.errors import PhazeError
from phaze_opt.search.objective import Context, evaluate_point
from phaze_opt.search.runner import run_study
from phaze_opt.search.setup import bound_obstacle, default_study_name, resolve_sampler
from phaze_opt.system import Link, load_system, system_from_dict
from test_study_fakes import backend, config, fake_evaluate, mlflow_uri

# A tiny space of one chip and every system axis: 2 x 2 x 2 x 2 x 2 = 32 clusters.
TINY = {
    "params": {"num_tc": [4], "tc_x": [128], "tc_y": [128], "glb_mib": [32], "hbm_gib": [80],
               "mbs": [1], "recompute": [False],
               "accelerators": [144, 288], "devices_per_node": [8, 72], "intra_node_gbps": [450, 900],
               "nics_per_device": [0.5, 1], "nic_gbps": [50, 100]},
    "tied": {"vc_width": "tc_x", "num_vc": "num_tc"},
    "fixed": {"clock_ghz": 1.05},
    "hbm_bw_gbps": {80: 2048},
    "area": {"budget": "tpuv4", "min_fraction": 0.3, "floor_exempt_if_one": ["num_tc", "num_vc"]},
}


def tiny(**changes):
    data = {**TINY, "params": {**TINY["params"], **changes}}
    return space_from_mapping(data, "tiny.yaml")


@pytest.mark.parametrize("name, value, pattern", [
    ("devices_per_node", [8, 9.5], r"params.devices_per_node'.*positive integers, got 9.5"),
    ("accelerators", [0], r"params.accelerators'.*positive"),
    ("accelerators", [2**21], r"params.accelerators'.*at most 1,048,576"),
    ("nic_gbps", ["fast"], r"params.nic_gbps'.*positive numbers, got 'fast'"),
    ("intra_node_gbps", [True], r"params.intra_node_gbps'.*positive numbers"),
    ("nics_per_device", [16], r"params.nics_per_device'.*at most 8"),
])
def test_bad_system_axis_is_one_line_error(name, value, pattern):
    with pytest.raises(PhazeError, match=pattern) as info:
        tiny(**{name: value})
    assert "\n" not in str(info.value) and "tiny.yaml" in str(info.value)


def test_point_system_matches_a_system_file_of_the_same_cluster():
    """A point's cluster is what a system file with those values would load as (the efficiency
    fractions of the base applied to the axes' datasheet links), for every point of the tiny space."""
    space, base = tiny(), load_system("dgx-b200")
    for values in itertools.product(*(space.params[p] for p in system_axes.SYSTEM_FIELDS)):
        point = {**{p: c[0] for p, c in space.params.items()}, **dict(zip(system_axes.SYSTEM_FIELDS, values))}
        v = dict(zip(system_axes.SYSTEM_FIELDS, values))
        got = space.system(point, base)
        nics = round(v["nics_per_device"] * v["devices_per_node"])
        expected = system_from_dict({
            "name": "x", "accelerators": v["accelerators"], "devices_per_node": v["devices_per_node"],
            "nics_per_node": nics, "global_batch": base.global_batch,
            "intra_node": {"bandwidth": v["intra_node_gbps"] * 1e9, "latency": base.intra_node.latency},
            "inter_node": {"bandwidth": v["nic_gbps"] * 1e9, "latency": base.inter_node.latency},
            "efficiency": {"intra_node_bandwidth": base.efficiency.intra_node_bandwidth,
                           "inter_node_bandwidth": base.efficiency.inter_node_bandwidth}})
        for f in ("accelerators", "devices_per_node", "nics", "global_batch", "precision", "efficiency"):
            assert getattr(got, f) == getattr(expected, f), f
        for f in ("intra_node", "inter_node"):
            assert getattr(got, f).bandwidth == pytest.approx(getattr(expected, f).bandwidth, rel=1e-12)
            assert getattr(got, f).latency == getattr(expected, f).latency
        assert system_axes.base_values(got) == pytest.approx(v)  # and back


def test_base_values_round_trip_on_every_shipped_node_system():
    for name in ("dgx-a100", "dgx-h100", "dgx-b200", "dgx-b200-16k"):
        base = load_system(name)
        again = system_axes.system_for(system_axes.base_values(base), base)
        assert again.intra_node == base.intra_node and again.nics == base.nics
        assert again.inter_node.bandwidth == pytest.approx(base.inter_node.bandwidth, rel=1e-12)


def test_axes_that_name_no_cluster_are_infeasible_points_with_the_rule():
    space = tiny(nics_per_device=[0.3, 1], nic_gbps=[50, 1000], devices_per_node=[8, 200])
    ctx = Context(models=("m-small",), system="dgx-b200", space=space, evaluator=fake_evaluate)
    first = {p: c[0] for p, c in space.params.items()}
    cases = [({"nics_per_device": 0.3, "devices_per_node": 8}, "not a whole number"),
             ({"nic_gbps": 1000, "nics_per_device": 1}, "exceeds its intra_node_gbps"),
             ({"devices_per_node": 200, "nics_per_device": 1}, "exceeds the 144 accelerators")]
    for change, why in cases:
        out = evaluate_point({**first, **change}, ctx)
        assert not out.feasible and why in out.reason, out.reason
    ok = evaluate_point({**first, "nics_per_device": 1}, ctx)
    assert ok.feasible and ok.system["devices_per_node"] == 8 and ok.system["nics_per_device"] == 1


def test_a_torus_base_is_refused_for_the_study():
    ctx = Context(models=("m-small",), system="tpuv4-pod", space=tiny(), evaluator=fake_evaluate)
    with pytest.raises(PhazeError, match="is a torus"):
        evaluate_point({p: c[0] for p, c in tiny().params.items()}, ctx)


def test_evaluator_gets_the_points_own_system():
    seen = []

    def evaluator(model, arch, training, system="default"):
        seen.append(system)
        return fake_evaluate(model, arch, training, system=system)

    space = tiny()
    ctx = Context(models=("m-small",), system="dgx-b200", space=space, evaluator=evaluator)
    point = {**{p: c[0] for p, c in space.params.items()}, "devices_per_node": 72, "intra_node_gbps": 900}
    evaluate_point(point, ctx)
    assert seen[0].devices_per_node == 72 and seen[0].nics == 36 and seen[0].accelerators == 144
    assert seen[0].intra_node.bandwidth == pytest.approx(900e9 * 0.82)


def test_frontier_space_size_and_reference():
    space = load_space("frontier")
    assert space.size() >= 10**9
    assert set(space.system_params) == set(system_axes.SYSTEM_FIELDS)
    # its reference design is a DGX B200 cluster of B200s with NVIDIA's published Llama 3 405B recipe
    point = space.reference_point("b200", recipe=space.reference_recipes["llama3-405b"], system="dgx-b200-16k")
    assert point["num_tc"] == 148 and point["devices_per_node"] == 8 and point["precision"] == "fp8"
    assert space.system(point, "dgx-b200-16k") == load_system("dgx-b200-16k").__class__(
        **{**load_system("dgx-b200-16k").__dict__, "name": space.system(point, "dgx-b200-16k").name, "path": ""})
    assert space.area_check(point)[0]
    with pytest.raises(PhazeError, match="needs the reference system"):
        space.reference_point("b200")
    with pytest.raises(PhazeError, match="cannot express system 'dgx-h100'.*accelerators 1024"):
        space.reference_point("b200", system="dgx-h100")


def test_reference_recipes_are_checked():
    data = {**TINY, "reference_recipes": {"m-small": {"mbs": 2}}}
    with pytest.raises(PhazeError, match=r"reference_recipes.m-small.mbs'.*one of the space's choices \[1\]"):
        space_from_mapping(data, "tiny.yaml")
    data = {**TINY, "reference_recipes": {"m-small": {"zero": 1}}}
    with pytest.raises(PhazeError, match=r"reference_recipes.m-small.zero'.*not a recipe field the space samples"):
        space_from_mapping(data, "tiny.yaml")


def test_bounds_refused_for_a_space_with_system_axes(tmp_path):
    """The proven bounds are built for one system: a space that varies it sweeps by evaluating, and
    `--sampler auto` takes TPE; the same space without the axes would be bounded."""
    cfg = config(tmp_path, sampler="auto", system="dgx-b200")
    from phaze_opt.design.evaluate import DesignEvaluator

    real = backend(space=tiny(), evaluator=DesignEvaluator())
    why = bound_obstacle(cfg, real)
    assert why and "samples the cluster" in why and "devices_per_node" in why
    assert resolve_sampler(cfg, real) == "tpe"
    fixed = {k: v for k, v in TINY["params"].items() if k not in system_axes.SYSTEM_FIELDS}
    assert bound_obstacle(cfg, backend(space=space_from_mapping({**TINY, "params": fixed}, "t.yaml"),
                                       evaluator=DesignEvaluator())) is None


def test_sampled_study_over_system_axes_logs_the_cluster(tmp_path):
    uri = mlflow_uri(tmp_path)
    cfg = config(tmp_path, trials=6, tracking_uri=uri, system="dgx-b200")
    run_study(cfg, backend(space=tiny()))
    name = default_study_name(cfg)
    trials = optuna.load_study(study_name=name, storage=cfg.storage).get_trials()
    done = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(done) == 6
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name.startswith("trial ")]
    assert len(runs) == 6
    for run in runs:
        p = run.data.params
        assert p["system.devices_per_node"] == p["devices_per_node"]
        assert p["system.nic_gbps"] == p["nic_gbps"] and p["system.accelerators"] == p["accelerators"]
        assert p["system.name"].startswith("dgx-b200[")


def test_list_choices_round_trip_through_the_codec():
    """A list-valued recipe axis (recompute_modules) is a categorical of text labels in Optuna and
    decodes back to the space's own choice, a JSON list too."""
    from phaze_opt.search.encoding import coding_for

    choices = load_space("frontier").params["recompute_modules"]
    coding = coding_for("recompute_modules", choices)
    assert all(c is None or isinstance(c, str) for c in coding.distribution().choices)
    for c in choices:
        assert coding.decode(coding.encode(c)) == c
        if c is not None:
            assert coding.decode(coding.encode(list(c))) == c


def test_reference_point_takes_a_baseline_recipe_read_back_from_json():
    """A stored baseline's recipe holds its module list as JSON wrote it (a list, in any order); the
    reference point still finds the space's choice."""
    space = load_space("frontier")
    recipe = {**space.reference_recipes["deepseek-v3"], "recompute_modules": ["mla_up_proj", "mlp"]}
    point = space.reference_point("b200", recipe=recipe, system="dgx-b200-16k")
    assert point["recompute_modules"] in space.params["recompute_modules"]


def test_grid_of_a_space_with_system_axes_is_the_feasible_product():
    """Area depends on the die alone: the grid is every product point whose die passes the area rule,
    in file order, and size() counts it (brute force over a space with two dies and every system axis)."""
    space = tiny(num_tc=[1, 4], tc_x=[64, 128])
    names = list(space.params)
    expected = [p for p in (dict(zip(names, v)) for v in itertools.product(*space.params.values()))
                if space.area_check(p)[0]]
    assert space.grid_points(order="grid") == expected
    assert space.size() == len(expected) and 0 < space.count() < 4
    by_area = space.grid_points(order="area")
    areas = [space.area_check(p)[1] for p in by_area]
    assert areas == sorted(areas, reverse=True) and sorted(map(repr, by_area)) == sorted(map(repr, expected))


def test_frontier_space_builds_the_b200_it_is_referenced_to():
    """The space's B200 point is the b200 preset in every field a trial's evaluation reads (its FP8
    operand layout too), so trial 0 and the baseline price the same chip."""
    from phaze_opt.hardware.arch import load_arch

    space = load_space("frontier")
    point = space.reference_point("b200", recipe=space.reference_recipes["llama3-405b"], system="dgx-b200-16k")
    built, preset = space.accelerator(point), load_arch("b200")
    assert built.compute_key == preset.compute_key
    assert (built.hbm_bytes, built.hbm_bw, built.tc_fp8_any_layout) == (preset.hbm_bytes, preset.hbm_bw, True)
    assert "tc_fp8_any_layout" in space.constant_arch_fields()
