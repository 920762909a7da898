"""The cost objective (`hardware/cost.py`, `configs/cost.yaml`): one device's share of the cluster by
hand, the die's pieces against a brute-force wafer map, the fat tree against Al-Fares et al.'s switch
counts, monotone in everything it prices and blind to the recipe, bad constants as one-line errors,
and `--objectives throughput,cost` through the study, the summary and MLflow."""

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from phaze_opt import cli
from phaze_opt.design import system_axes
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.area import area_mm2
from phaze_opt.hardware.cost import (CostConstants, cluster_cost_usd, constants_path, device_cost, die_usd,
                                     dies_per_wafer, die_yield, fat_tree_tiers, load_constants)
from phaze_opt.search.objective import Context, evaluate_point, metric_names, parse_objectives
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import is_feasible
from phaze_opt.search.setup import StudyConfig, default_study_name, resolve_sampler, resolve_strategy
from phaze_opt.system import load_system
from test_study_fakes import FakeSpace, backend, config, fake_evaluate, mlflow_uri

GIB = 2**30
# The shipped values, written out so the hand computations below do not move with the file.
C = CostConstants(wafer_usd=16988, wafer_diameter_mm=300, defect_density_per_cm2=0.1, package_usd=1000,
                  hbm_usd_per_gib=15, host_usd_per_device=5000, nic_usd_per_gbps=40, switch_ports=64,
                  switch_port_gbps=50, switch_usd=20000, link_usd=1000, scaleup_link_gbps=50,
                  scaleup_switch_ports=72, scaleup_switch_usd=3000, scaleup_board_devices=8,
                  scaleup_cable_usd_per_link=100)
B200 = load_arch("b200")
DGX = load_system("dgx-b200-16k")


def test_shipped_constants_load_and_match_the_hand_values():
    assert load_constants() == C


# ---- by hand -------------------------------------------------------------------------------------------

def test_die_of_800_mm2_by_hand():
    # pi 150^2 / 800 - pi 300 / sqrt(1600) = 88.36 - 23.56 = 64.8 -> 64 whole dies
    assert dies_per_wafer(800, C) == 64
    # Murphy at A D0 = 8 cm^2 x 0.1 = 0.8: ((1 - e^-0.8) / 0.8)^2 = (0.55067 / 0.8)^2 = 0.47381
    assert die_yield(800, C) == pytest.approx(0.47381, abs=1e-5)
    assert die_usd(800, C) == pytest.approx(16988 / (64 * 0.47381), rel=1e-4)  # $560.2


def test_b200_in_dgx_b200_nodes_by_hand():
    """16,384 devices, 8 a node, 900 GB/s NVLink, one 400 Gbit/s NIC each."""
    d = device_cost(B200, DGX, C)
    assert d.die == pytest.approx(die_usd(area_mm2(B200), C))
    assert d.package == 1000 and d.host == 5000
    assert d.hbm == pytest.approx(180 * 15)  # 180 GiB
    assert d.nics == pytest.approx(50 * 40)
    # 16,384 NIC ports: 2 x 32^2 = 2,048 < 16,384 <= 2 x 32^3, so 3 tiers: 5 switch ports and 3 links a NIC
    assert d.scale_out == pytest.approx(5 * 20000 / 64 + 3 * 1000)
    # 18 NVLink 5 links on 72-port chips, one tier, board traces: a quarter chip, as HGX B200's 2 per 8
    assert d.scale_up == pytest.approx(18 / 72 * 3000)
    assert cluster_cost_usd(B200, DGX, C) == pytest.approx(16384 * d.total)


@pytest.mark.parametrize("domain, chips, cables", [(8, 18 / 72, 0), (36, 18 / 72, 18), (72, 18 / 72, 18),
                                                   (576, 3 * 18 / 72, 2 * 18)])
def test_scale_up_domains_by_hand(domain, chips, cables):
    """NVL72 uses the same switch silicon per GPU as HGX B200 and cables every link; beyond 72
    devices a second tier triples the chip ports and doubles the links."""
    system = system_axes.system_for({"devices_per_node": domain}, DGX)
    assert device_cost(B200, system, C).scale_up == pytest.approx(chips * 3000 + cables * 100)


def test_no_scale_up_network_for_one_device_domains_or_a_torus():
    one = system_axes.system_for({"devices_per_node": 1, "intra_node_gbps": 900}, DGX)
    assert device_cost(B200, one, C).scale_up == 0
    assert device_cost(load_arch("tpuv4"), load_system("tpuv4-pod"), C).scale_up == 0


@pytest.mark.parametrize("tiers, k", [(2, 64), (3, 64), (2, 8), (3, 8)])
def test_fat_tree_matches_al_fares_switch_counts(tiers, k):
    """A cluster that exactly fills a k-port fat tree pays its published switch count: two tiers,
    k^2/2 hosts on 3k/2 switches; three (Al-Fares et al., SIGCOMM 2008), k^3/4 hosts on 5k^2/4
    switches; and one link per host per tier."""
    hosts, switches = {2: (k * k // 2, 3 * k // 2), 3: (k**3 // 4, 5 * k * k // 4)}[tiers]
    c = replace(C, switch_ports=k)
    system = replace(DGX, accelerators=hosts)
    expected = switches * c.switch_usd / hosts + tiers * c.link_usd
    assert device_cost(B200, system, c).scale_out == pytest.approx(expected)
    # one more host needs another tier
    assert device_cost(B200, replace(system, accelerators=hosts + 8), c).scale_out > expected


@given(k=st.integers(2, 64).map(lambda h: 2 * h), endpoints=st.integers(1, 10**8))
def test_fat_tree_tiers_are_the_fewest_that_reach(k, endpoints):
    t = fat_tree_tiers(endpoints, k)
    reach = [2 * (k // 2) ** n for n in range(1, t + 1)]
    assert reach[-1] >= endpoints and all(r < endpoints for r in reach[:-1])


def _wafer_map(area: float, diameter: float = 300.0, steps: int = 4) -> int:
    """Square dies of `area` wholly inside the wafer, best of a grid of offsets: a brute-force count."""
    s, r = math.sqrt(area), diameter / 2
    n = int(diameter / s) + 3
    best = 0
    for ox in range(steps):
        for oy in range(steps):
            x0, y0 = -r - s + ox * s / steps, -r - s + oy * s / steps
            inside = sum(all((x0 + (i + a) * s) ** 2 + (y0 + (j + b) * s) ** 2 <= r * r for a in (0, 1) for b in (0, 1))
                         for i in range(n) for j in range(n))
            best = max(best, inside)
    return best


@settings(max_examples=15, deadline=None)
@given(area=st.floats(50, 1000))
def test_dies_per_wafer_against_a_wafer_map(area):
    """The formula's edge loss is conservative: never more dies than a brute-force map places,
    and within 15% of it up to 1,000 mm^2."""
    mapped = _wafer_map(area)
    assert 0.85 * mapped <= dies_per_wafer(area, C) <= mapped


# ---- monotone, and blind to the recipe -------------------------------------------------------------------

@given(a=st.floats(1, 20000), b=st.floats(1, 20000))
def test_a_larger_die_never_costs_less(a, b):
    lo, hi = sorted((a, b))
    assert die_usd(lo, C) <= die_usd(hi, C)


def test_a_die_no_wafer_holds_costs_infinity():
    assert die_usd(80000, C) == math.inf and math.isfinite(die_usd(5000, C))


@given(a=st.integers(1, 1024), b=st.integers(1, 1024), tc=st.sampled_from([16, 64, 148, 256]))
def test_more_hbm_and_more_cores_never_cost_less(a, b, tc):
    lo, hi = sorted((a, b))
    small = replace(B200, hbm_bytes=lo * GIB, num_tc=tc)
    assert device_cost(small, DGX, C).total <= device_cost(replace(small, hbm_bytes=hi * GIB), DGX, C).total
    assert device_cost(small, DGX, C).total <= device_cost(replace(small, num_tc=tc + 8), DGX, C).total


AXES = {"accelerators": [1024, 2048, 8192, 16384, 65536], "devices_per_node": [1, 2, 8, 16, 36, 72, 144, 576],
        "intra_node_gbps": [900, 1800, 3600], "nics_per_device": [1, 2, 4], "nic_gbps": [12.5, 25, 50, 100]}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_system_axis_is_non_decreasing(data):
    """Two clusters, one at least as large on every axis: it never costs less, per device or in all."""
    lo, hi = {}, {}
    for name, choices in AXES.items():
        i = data.draw(st.integers(0, len(choices) - 1))
        j = data.draw(st.integers(i, len(choices) - 1))
        lo[name], hi[name] = choices[i], choices[j]
    systems = [system_axes.system_for(v, DGX) for v in (lo, hi)]
    small, large = (device_cost(B200, s, C).total for s in systems)
    assert small <= large
    assert cluster_cost_usd(B200, systems[0], C) <= cluster_cost_usd(B200, systems[1], C)


def _ctx(space, objectives=("throughput", "cost")):
    return Context(models=("m-small",), system="default", space=space, evaluator=fake_evaluate,
                   objectives=parse_objectives(",".join(objectives)))


def test_the_recipe_never_changes_the_cost():
    space = FakeSpace()
    arch = {"num_tc": 4, "tc_x": 16, "glb_mib": 4, "hbm_gib": 32}
    costs = {evaluate_point({**arch, "mbs": m, "recompute": r}, _ctx(space)).values[1]
             for m in (1, 2) for r in (False, True)}
    assert costs == {cluster_cost_usd(space.accelerator({**arch}), load_system("default"))}


def test_infeasible_points_cost():
    space = FakeSpace()
    over = evaluate_point({"num_tc": 8, "tc_x": 32, "glb_mib": 4, "hbm_gib": 32, "mbs": 1, "recompute": False}, _ctx(space))
    assert not over.feasible and over.values[1] == math.inf and over.cost_usd is None  # the area rule, first
    # no placement fits: the cluster is known, so is its cost
    memory = evaluate_point({"num_tc": 1, "tc_x": 8, "glb_mib": 2, "hbm_gib": 16, "mbs": 1, "recompute": False},
                            replace(_ctx(space), models=("m-big",)))
    assert not memory.feasible and memory.values[1] == memory.cost_usd > 0


# ---- the constants file ----------------------------------------------------------------------------------

GOOD = constants_path().read_text()


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("wafer_usd: 16988", "wafer_usd: lots"), "field 'wafer_usd': must be a number, got 'lots'"),
    (lambda t: t.replace("link_usd: 1000", "link_usd: -1"), "field 'link_usd': must be >= 0"),
    (lambda t: t.replace("switch_ports: 64", "switch_ports: 2"), "field 'switch_ports': must be a whole number >= 4"),
    (lambda t: t.replace("scaleup_board_devices: 8", "scaleup_board_devices: 2.5"),
     "field 'scaleup_board_devices': must be a whole number >= 1"),
    (lambda t: t.replace("wafer_diameter_mm: 300", "wafer_diameter_mm: 0"), "field 'wafer_diameter_mm': must be > 0"),
    (lambda t: t.replace("package_usd: 1000", "package_usd: .inf"), "field 'package_usd': must be a number"),
    (lambda t: t + "\nmarkup: 2\n", "field 'markup': unknown field"),
    (lambda t: t.replace("hbm_usd_per_gib: 15", ""), "field 'hbm_usd_per_gib': missing required field"),
    (lambda t: t + "\n  - [unclosed", "malformed YAML"),
    (lambda t: "- 1\n", "expected a mapping"),
])
def test_bad_cost_yaml_is_one_line_error(tmp_path, edit, message):
    p = tmp_path / "cost.yaml"
    p.write_text(edit(GOOD))
    with pytest.raises(PhazeError) as info:
        load_constants(p)
    text = str(info.value)
    assert message in text and "\n" not in text and str(p) in text


def _user_configs(tmp_path, monkeypatch, text):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "cost.yaml").write_text(text)
    monkeypatch.setenv("PHAZE_OPT_CONFIGS", str(folder))
    return folder


def test_a_user_cost_yaml_overrides_and_a_bad_one_stops_the_cli(tmp_path, monkeypatch, capsys):
    _user_configs(tmp_path, monkeypatch, GOOD.replace("host_usd_per_device: 5000", "host_usd_per_device: 6000"))
    assert load_constants().host_usd_per_device == 6000
    (tmp_path / "configs" / "cost.yaml").write_text(GOOD.replace("switch_usd: 20000", "switch_usd: [1]"))
    code = cli.main(["arch", "--arch", "b200", "--system", "dgx-b200"])
    err = capsys.readouterr().err
    assert code == 2 and "cost.yaml: field 'switch_usd': must be a number" in err and err.count("\n") == 1


def test_a_bad_cost_yaml_stops_a_cost_study_before_any_trial(tmp_path, monkeypatch):
    _user_configs(tmp_path, monkeypatch, GOOD.replace("switch_usd: 20000", "switch_usd: cheap"))
    with pytest.raises(PhazeError, match="cost.yaml: field 'switch_usd'"):
        run_study(config(tmp_path, trials=3, objectives=("throughput", "cost")), backend())


def test_arch_prints_the_cluster_cost(capsys):
    assert cli.main(["arch", "--arch", "b200", "--system", "dgx-b200-16k", "--system-axis", "devices_per_node=72",
                     "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    system = system_axes.system_for({"devices_per_node": 72}, DGX)
    assert cost["cluster_usd"] == pytest.approx(cluster_cost_usd(B200, system))
    assert cost["axes"]["devices_per_node"] == 72
    assert cli.main(["arch", "--arch", "b200", "--system", "dgx-b200", "--system-axis", "nic_gbps=fast"]) == 2
    assert "--system-axis nic_gbps=fast: VALUE must be a number" in capsys.readouterr().err


# ---- through the study -----------------------------------------------------------------------------------

def test_the_bounds_refuse_cost_as_they_refuse_energy():
    cfg = StudyConfig(models=("gpt2-xl",), space="small", objectives=("throughput", "cost"), hysteresis=None,
                      tracking_uri="off", strategy="auto")
    assert resolve_strategy(cfg, None) == "grid"
    with pytest.raises(PhazeError, match="--prune bound: its fronts are throughput-area fronts; with cost"):
        resolve_strategy(replace(cfg, strategy="branch-and-bound"), None)
    sampled = replace(cfg, strategy="sampled", sampler="auto")
    assert resolve_sampler(sampled, None) == "tpe"
    with pytest.raises(PhazeError, match="--sampler bound: its fronts are throughput-area fronts"):
        resolve_sampler(replace(sampled, sampler="bound"), None)
    assert metric_names(("throughput", "area", "energy", "cost"), 1)[-1] == "cluster cost (US$)"


@pytest.mark.parametrize("sampler, objectives", [("tpe", ("throughput", "cost")), ("nsga2", ("throughput", "cost")),
                                                 ("random", ("throughput", "area", "cost")),
                                                 ("gp", ("throughput", "energy", "cost"))])
def test_cost_study_with_each_multi_objective_sampler(tmp_path, sampler, objectives):
    cfg = config(tmp_path, trials=8, objectives=objectives, sampler=sampler)
    summary = run_study(cfg, backend())
    space, system = FakeSpace(), load_system("default")
    trials = optuna.load_study(study_name=default_study_name(cfg), storage=cfg.storage).get_trials()
    feasible = [t for t in trials if is_feasible(t)]
    assert feasible and summary["objectives"] == list(objectives)
    k = objectives.index("cost")
    for t in feasible:
        expected = cluster_cost_usd(space.accelerator(t.user_attrs["point"]), system)
        assert t.values[k] == pytest.approx(expected) == t.user_attrs["result"]["cost_usd"]
    assert Path(summary["pareto"]["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_throughput_cost_study_end_to_end(tmp_path, monkeypatch, capsys):
    """The real pipeline: gpt2-xl on `small`, every feasible trial's cost is `hardware/cost.py`'s for
    its accelerator on the study's system, in the trial, the summary and MLflow."""
    monkeypatch.chdir(tmp_path)
    uri = mlflow_uri(tmp_path)
    code = cli.main(["study", "--model", "gpt2-xl", "--space", "small", "--trials", "5", "--objectives",
                     "throughput,cost", "--no-progress", "--tracking-uri", uri, "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    summary = json.loads(out.out)
    name = summary["study"]
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///studies/{name}.db").get_trials()
    feasible = [t for t in trials if is_feasible(t)]
    assert feasible
    from phaze_opt.design.space import load_space

    space, system = load_space("small"), load_system("default")
    for t in feasible:
        assert t.values[1] == pytest.approx(cluster_cost_usd(space.accelerator(t.user_attrs["point"]), system))
    assert summary["best"]["cost_usd"] == pytest.approx(
        next(t.values[1] for t in trials if t.number == summary["best"]["trial"]))

    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    runs = [r for r in client.search_runs([exp.experiment_id], max_results=100) if "mlflow.parentRunId" in r.data.tags]
    by_trial = {int(r.data.tags["optuna.trial_number"]): r for r in runs}
    for t in feasible:
        metrics = by_trial[t.number].data.metrics
        assert metrics["cost_usd"] == pytest.approx(t.values[1]) == metrics["objective.cost_usd"]


def test_a_space_with_system_axes_prices_each_point_on_its_own_cluster():
    """The frontier space samples the cluster: a point's cost is its die on the base system with the
    point's axes (`system_axes.system_for`), and a larger domain costs more."""
    from phaze_opt.design.space import load_space

    space = load_space("frontier")
    ctx = Context(models=("m-small",), system="dgx-b200-16k", space=space, evaluator=fake_evaluate,
                  objectives=("throughput", "cost"))
    point = space.reference_point("b200", system="dgx-b200-16k")
    costs = {}
    for domain in (8, 72):
        out = evaluate_point({**point, "devices_per_node": domain}, ctx)
        system = system_axes.system_for({k: out.point[k] for k in space.system_params}, DGX)
        assert out.cost_usd == out.values[1] == pytest.approx(cluster_cost_usd(space.accelerator(out.point), system))
        costs[domain] = out.cost_usd
    assert costs[8] < costs[72]
    assert costs[8] == pytest.approx(cluster_cost_usd(B200, DGX))  # the reference: docs/frontier.md's $271.5 M


def test_the_exhaustive_sweep_with_cost_evaluates_the_grid(tmp_path):
    """As with energy: no bound pruning, every grid point a trial, each with its cost."""
    from test_study_fakes import small_space

    space = small_space()
    cfg = config(tmp_path, strategy="auto", study_name="grid-cost", objectives=("throughput", "cost"))
    summary = run_study(cfg, backend(space))
    trials = optuna.load_study(study_name="grid-cost", storage=cfg.storage).get_trials()
    assert len(trials) == len(space.grid_points("grid")) == summary["exhaustive"]["evaluated"]
    system = load_system("default")
    for t in filter(is_feasible, trials):
        assert t.values[1] == pytest.approx(cluster_cost_usd(space.accelerator(t.user_attrs["point"]), system))
