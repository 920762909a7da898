"""One design end to end: graphs -> latencies -> ILP -> placement DP, and the `evaluate` CLI."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest

from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.design.evaluate import evaluate, training_problem
from phaze_opt.training import Training
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.types import Placement
from conftest import error_lines

TPU = load_arch("tpuv4")


def _run_cli(*args):
    return subprocess.run([sys.executable, "-m", "phaze_opt", *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def gpt3_both():
    # The expert placement (tp 4, pp 32, dp 8) needs recompute to fit 32 GiB of HBM.
    return {p: evaluate("gpt3-175b", TPU, Training(1, True, p), "default") for p in ("optimal", "expert")}


def test_gpt3_on_tpuv4_optimal_is_feasible_and_never_slower_than_expert(gpt3_both):
    opt, exp = gpt3_both["optimal"], gpt3_both["expert"]
    assert opt.feasible and exp.feasible, (opt.reason, exp.reason)
    assert opt.throughput >= exp.throughput * (1 - 1e-9)
    assert (exp.placement["tp"], exp.placement["pp"], exp.placement["dp"]) == (4, 32, 8)
    # Throughput is the global batch over the time per batch; MFU is a fraction of peak.
    assert opt.throughput == pytest.approx(4096 / opt.time_per_batch_s, rel=1e-9)
    assert opt.tokens_per_s == pytest.approx(opt.throughput * 2048, rel=1e-9)
    assert 0 < opt.mfu < 1 and 0 < exp.mfu <= opt.mfu * (1 + 1e-9)
    assert len(opt.layers) == 98 and {"fwd_s", "bwd_s", "param_bytes", "activation_bytes", "boundary_bytes"} <= set(opt.layers[1])
    assert all(st["memory_bytes"] <= TPU.hbm_bytes for st in opt.placement["stages"])


def test_reported_placement_recomputes_to_the_same_time_with_the_evaluator(gpt3_both):
    opt = gpt3_both["optimal"]
    _, _, problem, _ = training_problem("gpt3-175b", TPU, Training(1, True), "default")
    stages = tuple(tuple(s["layers"]) for s in opt.placement["stages"])
    again = evaluate_placement(problem, Placement(opt.placement["tp"], opt.placement["dp"], stages))
    assert again.feasible and again.time_per_batch_s == pytest.approx(opt.time_per_batch_s, rel=1e-12)


def test_every_layer_schedule_was_proven_optimal(gpt3_both):
    for statuses in gpt3_both["optimal"].schedules.values():
        assert set(statuses) <= {"bound", "ilp", "search", "cache"}


def test_repeat_evaluation_reuses_the_layer_costs():
    first = evaluate("gpt2-xl", TPU, Training(2, True))
    again = evaluate("gpt2-xl", TPU, Training(2, True))
    assert again.throughput == first.throughput
    assert again.timings["ilp_s"] == 0.0 and again.timings["graph_s"] == 0.0


def test_hbm_too_small_is_an_infeasible_result_not_an_error():
    tiny = dataclasses.replace(TPU, hbm_bytes=2**30)
    r = evaluate("gpt3-175b", tiny, Training(1, False))
    assert not r.feasible and r.throughput == 0.0 and math.isinf(r.time_per_batch_s)
    assert "GiB" in r.reason and "HBM" in r.reason


def test_explicit_placement_and_bad_specs():
    r = evaluate("opt-1.3b", TPU, Training(1, False, "tp=2,pp=4,dp=64"), "default")
    assert r.feasible, r.reason
    assert (r.placement["tp"], r.placement["pp"], r.placement["dp"]) == (2, 4, 64)
    assert len(r.placement["stages"]) == 4
    best = evaluate("opt-1.3b", TPU, Training(1, False))
    assert best.throughput >= r.throughput * (1 - 1e-9)
    with pytest.raises(PhazeError, match="tp=T,pp=P,dp=D"):
        evaluate("opt-1.3b", TPU, Training(1, False, "tp=2,pp=4"), "default")
    with pytest.raises(PhazeError, match="TP width not allowed"):
        evaluate("gpt2-xl", TPU, Training(1, False, "tp=2,pp=4,dp=2"), "default")


def test_expert_placement_without_recompute_does_not_fit_tpuv4_and_says_why():
    r = evaluate("gpt3-175b", TPU, Training(1, False, "expert"), "default")
    assert not r.feasible and "GiB" in r.reason and "32.000 GiB of HBM" in r.reason


def test_cli_evaluate_json_and_errors():
    out = _run_cli("evaluate", "--model", "gpt2-xl", "--arch", "tpuv4", "--mbs", "1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("throughput", "tokens_per_s", "time_per_batch_s", "area_mm2", "mfu", "feasible", "reason",
                "placement", "timings", "layers"):
        assert key in data
    assert {"tp", "pp", "dp", "microbatches", "stages"} <= set(data["placement"])
    assert {"graph_s", "estimate_s", "ilp_s", "dp_s"} <= set(data["timings"])
    bad = _run_cli("evaluate", "--model", "no-such-model", "--json")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model 'no-such-model'")
    assert len(error_lines(bad.stderr)) == 1


def _stretch_block_backward(monkeypatch, factor: float, status: str):
    """Make every block/bwd schedule `factor` x longer, reported with `status` and the true optimum as bound."""
    from phaze_opt.design import evaluate as ev

    real = ev.schedule_graph

    def schedule(op_graph, single, split, accel, **kw):
        s = real(op_graph, single, split, accel, **kw)
        if op_graph.layer == "block" and op_graph.pass_name == "bwd":
            s = dataclasses.replace(s, makespan=s.makespan * factor, lower_bound=s.makespan, status=status)
        return s

    monkeypatch.setattr(ev, "_COSTS_MEMO", {})
    monkeypatch.setattr(ev, "_ENERGY_MEMO", {})
    monkeypatch.setattr(ev, "schedule_graph", schedule)


@pytest.mark.parametrize("placement", ["optimal", "expert"])
def test_time_limited_layer_schedule_gives_reached_throughput_and_proven_bound(monkeypatch, placement):
    """An unproven layer schedule is a result: throughput from the incumbent, bound from the lower bound.

    Checked against two independent evaluations: the same stretched times reported as proven (the
    throughput must match) and the untouched exact times (the bound must match, as the lower bound
    handed over is the exact optimum)."""
    args = ("gpt2-xl", TPU, Training(2, True, placement), "default")
    with monkeypatch.context() as m:
        _stretch_block_backward(m, 1.05, "optimal")
        stretched = evaluate(*args)
    with monkeypatch.context() as m:
        _stretch_block_backward(m, 1.0, "optimal")
        exact = evaluate(*args)
    with monkeypatch.context() as m:
        _stretch_block_backward(m, 1.05, "time_limit")
        open_ = evaluate(*args)
    assert stretched.proven and exact.proven and stretched.throughput_bound == stretched.throughput
    assert open_.feasible and not open_.proven
    assert open_.unproven and all("block/bwd" in u for u in open_.unproven)
    assert open_.throughput == pytest.approx(stretched.throughput, rel=1e-12)
    assert open_.throughput_bound == pytest.approx(exact.throughput, rel=1e-12)
    assert open_.throughput < open_.throughput_bound
    assert all("time_limit" in s for s in open_.schedules.values())
    from phaze_opt.commands.evaluate import render as render_evaluate

    text = render_evaluate({**open_.to_json(), "arch": "tpuv4", "mbs": 2, "recompute": True})
    assert "NOT proven optimal" in text and "block/bwd" in text and f"{open_.throughput_bound:.6g}" in text


def test_ilp_time_limit_reaches_every_layer_solve_and_keys_the_memo(monkeypatch):
    from phaze_opt.design import evaluate as ev

    seen = []
    real = ev.schedule_graph

    def schedule(*a, **kw):
        seen.append(kw.get("time_limit_s"))
        return real(*a, **kw)

    monkeypatch.setattr(ev, "schedule_graph", schedule)
    monkeypatch.setattr(ev, "_COSTS_MEMO", {})
    ev.evaluate("gpt2-xl", TPU, Training(2, True), "default", 7.5)
    assert seen and set(seen) == {7.5}
    seen.clear()
    ev.evaluate("gpt2-xl", TPU, Training(2, True))  # another limit: not served from the first call's memo
    assert seen and set(seen) == {ev.DEFAULT_ILP_TIME_LIMIT_S}
    with pytest.raises(PhazeError, match="--ilp-time-limit"):
        ev.evaluate("gpt2-xl", TPU, Training(2, True), "default", 0)


def test_study_config_time_limit_gives_a_prunable_design_evaluator():
    from phaze_opt.design import evaluate as ev
    from phaze_opt.search.setup import Backend, StudyConfig, validate

    from phaze_opt.design.protocols import BoundedEvaluator

    assert ev.design_evaluator(None) == ev.DesignEvaluator(ev.DEFAULT_ILP_TIME_LIMIT_S)
    partial = ev.design_evaluator(5)
    assert partial.ilp_time_limit_s == 5.0 and isinstance(partial, BoundedEvaluator)
    config = validate(StudyConfig(strategy="auto", hysteresis="off", ilp_time_limit_s=5, tracking_uri="off"))
    assert config.strategy == "branch-and-bound"
    assert Backend().resolved(config).evaluator.ilp_time_limit_s == 5.0
    with pytest.raises(PhazeError, match="--ilp-time-limit"):
        validate(StudyConfig(ilp_time_limit_s=-1.0))


def test_a_short_ilp_time_limit_leaves_a_hard_design_unproven_with_a_sound_bound(tmp_path, monkeypatch):
    """Real solves: backward blocks on 2 TCs / 512 VCs take the MIP seconds to prove (BENCHMARKS.md).
    The limit is a microsecond, spent before the first solver starts, so no search or MIP runs on a
    machine of any speed: a quiet machine proved TP 4's passes within the 0.2 s this test once used.
    What is left runs whatever the clock says (the list schedule, the lower bounds, one relaxation,
    which HiGHS never cuts below 0.01 s); with that relaxation solved to the end (HiGHS given 60 s)
    no TP width's backward block closes either, so each stays unproven however fast HiGHS is. The
    schedule memo starts empty, so proofs from earlier runs cannot stand in for these solves."""
    from phaze_opt.design import evaluate as ev
    from phaze_opt.solve.schedule import cache as schedule_cache, solver as schedule

    monkeypatch.setattr(schedule, "SEARCH_FIRST_S", 0.0)
    monkeypatch.setattr(schedule_cache, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(schedule_cache, "_memory", {})
    monkeypatch.setattr(ev, "_COSTS_MEMO", {})
    arch = dataclasses.replace(TPU, num_tc=2, tc_x=8, tc_y=16, num_vc=512, vc_width=8, name="tc2x8x16-vc512x8")
    r = evaluate("bert-large", arch, Training(1, False), "default", 1e-6)
    assert r.feasible and not r.proven
    for tp, statuses in r.schedules.items():
        assert f"tp{tp} block/bwd" in {u.split(":")[0] for u in r.unproven}
        # every pass left open is one the time limit stopped (and every such pass is listed)
        assert statuses.get("time_limit", 0) == sum(u.startswith(f"tp{tp} ") for u in r.unproven)
    assert 0 < r.throughput < r.throughput_bound


def test_open_passes_that_cannot_change_the_throughput_leave_it_proven(monkeypatch):
    """A pass that hit its time limit with a bound equal to its incumbent changes nothing: the
    placement on the lower bounds reaches exactly the throughput, which is therefore proven."""
    with monkeypatch.context() as m:
        _stretch_block_backward(m, 1.0, "time_limit")
        r = evaluate("gpt2-xl", TPU, Training(2, True))
    assert r.unproven and r.proven and r.throughput_bound == r.throughput


def test_a_placement_that_leaves_devices_idle_says_how_many_and_why(capsys):
    """`--placement tp=1,pp=2,dp=4` on the 1024 devices of the default system runs 8; the report
    says the other 1016 are idle and why, in one line, and the JSON carries the count."""
    from phaze_opt import cli
    from phaze_opt.commands.evaluate import idle_devices_line

    assert cli.main(["evaluate", "--model", "gpt2-xl", "--placement", "tp=1,pp=2,dp=4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"area [\d.]+ mm\^2", out) and re.search(r"MFU \d+\.\d%", out), out
    idle = [line for line in out.splitlines() if line.startswith("idle devices")]
    assert idle == ["idle devices: 1016 of the system's 1024 (8 used, tp 1 x pp 2 x dp 4: the placement given; "
                    "--placement optimal, or a larger dp, uses more)"]
    assert cli.main(["evaluate", "--model", "gpt2-xl", "--placement", "tp=1,pp=2,dp=512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["idle_devices"] == 0
    # the optimal placement and the model's own say whose choice it was
    base = {"devices": 64, "idle_devices": 32, "placement": {"tp": 2, "cp": 2, "pp": 4, "dp": 2, "devices_used": 32}}
    assert idle_devices_line({**base, "placement_spec": "optimal"}) == (
        "idle devices: 32 of the system's 64 (32 used, tp 2 x cp 2 x pp 4 x dp 2: the optimal placement: none using "
        "more devices is faster)")
    assert "the model config's expert placement" in idle_devices_line({**base, "placement_spec": "expert"})
    assert "the optimal placement" in idle_devices_line({**base, "placement_spec": "expert", "note": "no expert"})
    assert idle_devices_line({**base, "idle_devices": 0, "placement_spec": "optimal"}) == ""
