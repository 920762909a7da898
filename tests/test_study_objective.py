"""One trial's measurement: constraints, infeasibility, multi-model scores, baselines."""

import math

import pytest

from phaze_opt.errors import PhazeError
from phaze_opt.search.objective import (
    NO_EXPERT_FIT,
    Baseline,
    Context,
    FatalStudyError,
    compute_baselines,
    evaluate_point,
    parse_objectives,
)
from phaze_opt.search.report import baseline_lines
from phaze_opt.training import Training, recipe_points, recompute_mode
from test_study_fakes import (CALLS, EVERY_RECIPE, REFERENCE, FakeSpace, RecordingEvaluator, fake_evaluate, fake_no_energy,
                              fake_throughput)


def never_called(*args, **kwargs):
    raise AssertionError("the evaluator must not run for a design over the area budget")


def point(**kw):
    p = {"num_tc": 4, "tc_x": 16, "glb_mib": 4, "hbm_gib": 32, "mbs": 1, "recompute": False}
    p.update(kw)
    return p


def test_objectives_parse_and_reject():
    assert parse_objectives("throughput") == ("throughput",)
    assert parse_objectives("throughput, area,energy") == ("throughput", "area", "energy")
    assert parse_objectives(["throughput", "energy"]) == ("throughput", "energy")
    for bad, msg in [("area", "throughput must come first"), ("throughput,speed", "unknown objective 'speed'"),
                     ("throughput,,area", "empty"), ("throughput,area,area", "repeats"), ("", "empty")]:
        with pytest.raises(PhazeError, match=msg) as info:
            parse_objectives(bad)
        assert "\n" not in str(info.value)


def test_recompute_spellings_keep_the_mode():
    assert recompute_mode(True) == "full" and recompute_mode("off") == "none" and recompute_mode("on") == "full"
    assert recompute_mode("selective") == "selective" and recompute_mode(" Selective ") == "selective"
    assert Training(recompute="selective").recompute == "selective"
    with pytest.raises(PhazeError):
        recompute_mode("sometimes")


def test_over_budget_is_infeasible_without_running_the_solvers():
    space = FakeSpace(budget=50.0)
    p = point(num_tc=8, tc_x=32)  # area 128 + 8 = 136 mm^2
    out = evaluate_point(p, Context(("m-small",), "default", space, never_called, ("throughput", "area", "energy")))
    assert not out.feasible and out.results == {}
    assert out.constraints["area"] == pytest.approx((136 - 50) / 50)
    assert out.constraints["memory"] == 0.0
    assert out.values[0] == 0.0 and out.values[1] == 136 and math.isinf(out.values[2])
    assert "budget" in out.reason and "136" in out.reason
    assert out.result_attr()["feasible"] is False


def test_feasible_design_has_negative_area_slack_and_its_throughput():
    space = FakeSpace(budget=100.0)
    p = point()
    out = evaluate_point(p, Context(("m-small",), "default", space, fake_evaluate, ("throughput", "area")))
    assert out.feasible and out.reason == ""
    area = space.area(p)
    assert out.constraints == {"area": pytest.approx((area - 100) / 100), "memory": 0.0}
    expected = fake_throughput("m-small", space.accelerator(p), 1, False)
    assert out.values == [pytest.approx(expected), area]
    art = out.artifact()
    assert art["models"]["m-small"]["placement"]["pp"] == 2 and len(art["models"]["m-small"]["layers"]) == 8
    assert art["design"] == p


def test_no_memory_feasible_placement_is_infeasible_with_the_reason():
    space = FakeSpace()
    p = point(hbm_gib=16, recompute=False)
    ctx = Context(("m-big",), "default", space, fake_evaluate)
    out = evaluate_point(p, ctx)
    assert not out.feasible and out.values == [0.0]
    assert out.constraints["memory"] == 1.0 and out.constraints["area"] <= 0
    assert "16.0 GiB" in out.reason


def test_several_models_score_the_mean_ratio_to_their_baselines():
    space = FakeSpace()
    baselines = {"m-small": Baseline("m-small", True, 1000.0), "m-big": Baseline("m-big", True, 100.0)}
    p = point(tc_x=32)
    out = evaluate_point(p, Context(("m-small", "m-big"), "default", space, fake_evaluate, baselines=baselines))
    acc = space.accelerator(p)
    expected = (fake_throughput("m-small", acc, 1, False) / 1000 + fake_throughput("m-big", acc, 1, False) / 100) / 2
    assert out.score == pytest.approx(expected) and out.values == [pytest.approx(expected)]
    # one model without a placement makes the common design infeasible, naming that model
    out = evaluate_point(point(hbm_gib=16), Context(("m-small", "m-big"), "default", space, fake_evaluate,
                                                    baselines=baselines))
    assert not out.feasible and out.constraints["memory"] == 1.0 and out.reason.startswith("m-big:")


def test_energy_objective_without_energy_stops_the_study():
    ctx = Context(("m-small",), "default", FakeSpace(), fake_no_energy, ("throughput", "energy"))
    with pytest.raises(FatalStudyError, match="energy"):
        evaluate_point(point(), ctx)


def test_baseline_is_the_best_expert_setting_and_falls_back_to_optimal():
    CALLS.clear()
    params = {"mbs": [1, 2], "recompute": [False, True]}
    b = compute_baselines(["m-small"], fake_evaluate, REFERENCE, "default", params)["m-small"]
    # expert runs only (the fallback is not needed), best is mbs=2 without recompute
    assert {c[5] for c in CALLS} == {"expert"} and len(CALLS) == 4
    assert (b.feasible, b.mbs, b.recompute, b.placement, b.system) == (True, 2, False, "expert", "default")
    assert b.throughput == pytest.approx(fake_throughput("m-small", REFERENCE, 2, False, "expert"))

    def expert_never_fits(model, arch, training, system="default"):
        r = fake_evaluate(model, arch, training, system=system)
        if training.placement.spec() == "expert":
            r.feasible, r.reason, r.throughput = False, "expert placement needs 40 GiB", 0.0
        return r

    b = compute_baselines(["m-small"], expert_never_fits, REFERENCE, "default", {"mbs": [1, 2], "recompute": [False]})
    b = b["m-small"]
    assert b.feasible and b.placement == "optimal" and b.mbs == 2 and b.stand_in == NO_EXPERT_FIT
    assert Baseline.from_json(b.to_json()) == b


def test_a_summary_names_the_placement_its_baseline_ran():
    """A model without an expert placement is measured against TPUv4 with the optimal one; the
    summary must say so (it once read "x TPUv4 with the expert placement (...; optimal placement)")."""
    note = "m-small has no expert_placement in its config; the optimal placement stands in"

    def no_expert_placement(model, arch, training, system="default"):  # as the real evaluator does
        r = fake_evaluate(model, arch, training.with_placement("optimal"), system=system)
        r.note = note if training.placement.spec() == "expert" else ""
        return r

    b = compute_baselines(["m-small"], no_expert_placement, REFERENCE, "default", {"mbs": [1], "recompute": [False]})
    b = b["m-small"]
    assert (b.placement, b.stand_in) == ("optimal", note)
    text = "\n".join(baseline_lines(1.045, b.to_json()))
    assert "1.045x TPUv4 with the optimal placement" in text and "optimal placement, on system default" in text
    assert "with the expert placement" not in text and note in text
    expert = compute_baselines(["m-small"], fake_evaluate, REFERENCE, "default", {"mbs": [1], "recompute": [False]})
    text = "\n".join(baseline_lines(0.9, expert["m-small"].to_json()))
    assert text.count("\n") == 0 and "0.900x TPUv4 with the expert placement" in text and "expert placement, on" in text
    old = {k: v for k, v in b.to_json().items() if k != "stand_in"}  # a study stored before stand_in
    assert "the optimal placement stood in for the expert one" in "\n".join(baseline_lines(1.0, old))


@pytest.mark.parametrize("expert_fits", [True, False])
def test_baseline_tries_every_recipe_field_and_choice_and_keeps_the_whole_winner(expert_fits):
    rec = RecordingEvaluator(expert_fits)
    b = compute_baselines(["m-small"], rec, REFERENCE, "tpuv4-pod", EVERY_RECIPE)["m-small"]
    placement = "expert" if expert_fits else "optimal"
    grid = [Training.from_point(p, placement) for p in recipe_points(EVERY_RECIPE)]
    assert len(set(grid)) == 2 * 3 * 2 * 2 * 4 * 2 * 2 * 2 * 2 == len(grid)  # ... ZeRO 0-3 ... x precision x param gather
    # every recipe of the space was evaluated, whole, at the baseline's placement
    assert {t for t, _ in rec.seen if t.placement.spec() == placement} == set(grid)
    best = max(grid, key=RecordingEvaluator.score)
    assert b.training == best and b.placement == placement and b.system == "tpuv4-pod"
    assert b.throughput == pytest.approx(RecordingEvaluator.score(best) * (0.5 if expert_fits else 1.0))
    # the stored baseline rebuilds the same recipe (a resumed study divides by the same recipe)
    assert Baseline.from_json(b.to_json()).training == best


def test_baseline_recipe_selective_is_kept_selective():
    """A space whose best reference recipe is selective recompute must store and report selective
    with selective's throughput (a lossy on/off conversion once turned it into full)."""
    rec = RecordingEvaluator()
    params = {"mbs": [1], "recompute": ["none", "selective", "full"]}
    b = compute_baselines(["m-small"], rec, REFERENCE, "default", params)["m-small"]
    assert [t.recompute for t, _ in rec.seen] == ["none", "selective", "full"]
    best = max((t for t, _ in rec.seen), key=RecordingEvaluator.score)
    assert b.recompute == best.recompute and b.training.recompute == best.recompute


@pytest.mark.slow
def test_dominance_pruned_baseline_equals_the_full_grid_on_the_real_model():
    """The real evaluator's baseline skips recipes another provably matches or beats; its best must
    be the best of every recipe (fails if a rule were wrong for the expert placement)."""
    from phaze_opt.design.evaluate import design_evaluator
    from phaze_opt.hardware.arch import load_arch
    from phaze_opt.search.objective import baseline_points

    params = {"mbs": [1], "recompute": ["none", "selective", "full"], "sequence_parallel": [False, True],
              "zero": [0, 1], "overlap_grad_reduce": [False, True], "attention": ["unfused", "flash"]}
    evaluate, tpu = design_evaluator(), load_arch("tpuv4")
    kept = baseline_points(params, "gpt2-xl", "default", True)
    assert 0 < len(kept) < len(recipe_points(params)) == 48
    full = compute_baselines(["gpt2-xl"], evaluate, tpu, "default", params)["gpt2-xl"]
    pruned = compute_baselines(["gpt2-xl"], evaluate, tpu, "default", params, dominance=True)["gpt2-xl"]
    assert full.feasible and pruned.throughput == pytest.approx(full.throughput, rel=1e-12)
    for point in recipe_points(params):  # and no recipe beats it, whatever placement the baseline used
        r = evaluate("gpt2-xl", tpu, Training.from_point(point, pruned.placement))
        assert r.throughput <= pruned.throughput * (1 + 1e-12)
