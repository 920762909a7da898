"""The published comparison table, on the fake space and evaluator of test_study_fakes."""

import json

import optuna
import pytest

from phaze_opt.errors import PhazeError
from phaze_opt.experiments.published import (
    ROWS,
    PublishedConfig,
    Row,
    check_relations,
    evaluate_fixed_placement,
    fixed_placement_evaluator,
    render,
    run_published,
    write_outputs,
)
from phaze_opt.training import Training
from test_study_fakes import (CALLS, EVERY_RECIPE, REFERENCE, FakeResult, RecordingEvaluator, backend, fake_evaluate,
                              fake_throughput)

MODELS = ("m-small", "m-big")
SETTINGS = [(m, r) for m in (1, 2) for r in (False, True)]


def expert_misfit(model, arch, training, system="default"):
    """m-big's expert placement never fits (on any design); everything else as fake_evaluate."""
    if model == "m-big" and training.placement.spec() == "expert":
        return FakeResult(False, "stage 0 needs 99.0 GiB per device, more than the 32.0 GiB of HBM", 0.0, 0.0,
                          float("inf"), 1.0, 0.0, {}, {}, [], model)
    return fake_evaluate(model, arch, training, system=system)


def cfg(tmp_path, **kw):
    base = dict(models=MODELS, systems=("default",), space="fake", trials=12, seed=0,
                output_dir=str(tmp_path / "published"), tracking_uri="off")
    base.update(kw)
    return PublishedConfig(**base)


def best_fake(model, placement):
    return max(fake_throughput(model, REFERENCE, m, r, placement) for m, r in SETTINGS)


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("table")
    config = cfg(tmp)
    return config, run_published(config, backend())


def test_tpuv4_rows_and_ratios_against_row_1(table):
    _, result = table
    sys_result = result["systems"]["default"]
    for m in MODELS:
        rows = sys_result["rows"][m]
        assert list(rows) == list(ROWS)
        r1, r2 = rows["tpuv4_expert"], rows["tpuv4_optimal"]
        assert r1.feasible and r2.feasible
        assert r1.throughput == best_fake(m, "expert")
        assert r2.throughput == best_fake(m, "optimal")
        assert r2.throughput >= r1.throughput  # optimal placement at least as good, same design
        assert r1.accelerator["num_tc"] == REFERENCE.num_tc and r1.placement["tp"] == 1
        assert r1.ratio == 1.0
        for k in ROWS:
            assert rows[k].feasible
            assert rows[k].ratio == pytest.approx(rows[k].throughput / r1.throughput, rel=1e-12)
        assert sys_result["baselines"][m]["throughput"] == r1.throughput


def test_search_rows_relations(table):
    _, result = table
    sys_result = result["systems"]["default"]
    assert sys_result["checks"] == []
    for m in MODELS:
        rows = sys_result["rows"][m]
        assert rows["expert_search"].throughput >= rows["tpuv4_expert"].throughput
        assert rows["co_optimised"].throughput >= rows["tpuv4_optimal"].throughput
        assert rows["co_optimised"].throughput >= rows["expert_search"].throughput
        assert rows["common"].throughput <= rows["co_optimised"].throughput
    # row 3 is scored with the expert placement, rows 4 and 5 with the optimal one
    for m in MODELS:
        for key, placement in (("expert_search", "expert"), ("co_optimised", "optimal"), ("common", "optimal")):
            r = sys_result["rows"][m][key]
            a = r.accelerator
            from phaze_opt.hardware.accelerator import Accelerator

            arch = Accelerator(**{k: v for k, v in a.items()})
            assert r.throughput == fake_throughput(m, arch, r.mbs, r.recompute, placement)
    # one common design for every model
    commons = [sys_result["rows"][m]["common"] for m in MODELS]
    assert len({json.dumps(c.accelerator, sort_keys=True) for c in commons}) == 1
    assert len({(c.mbs, c.recompute) for c in commons}) == 1
    means = sys_result["ratio_means"]
    assert means["tpuv4_expert"]["geomean"] == pytest.approx(1.0)
    ratios = [sys_result["rows"][m]["co_optimised"].ratio for m in MODELS]
    assert means["co_optimised"]["mean"] == pytest.approx(sum(ratios) / 2)
    assert means["co_optimised"]["geomean"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)


def test_coopt_study_is_seeded_after_tpuv4(table):
    config, result = table
    name = result["systems"]["default"]["studies"]["co_optimised:m-big"]
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{config.output_dir}/{name}.db")
    trials = study.get_trials()
    assert len(trials) == config.trials
    assert all(t.user_attrs.get("reference") == "tpuv4" for t in trials[:4])
    rows = result["systems"]["default"]["rows"]["m-big"]
    seeds = [t.user_attrs.get("seeded_from") for t in trials[4:6]]
    if rows["expert_search"].accelerator == rows["common"].accelerator and \
            (rows["expert_search"].mbs, rows["expert_search"].recompute) == (rows["common"].mbs, rows["common"].recompute):
        assert seeds[0] == "expert_search+common"  # one design, queued once
    else:
        assert seeds == ["expert_search", "common"]
    codec_points = [t.user_attrs["point"] for t in trials[4:6] if t.user_attrs.get("seeded_from")]
    assert codec_points[0]["mbs"] == rows["expert_search"].mbs


def test_render_and_outputs(table, tmp_path):
    _, result = table
    text = render(result)
    assert "3.6x" in text and "2.9x" in text and "12 trials per study" in text
    assert "| m-big |" in text and "TP/PP/DP" in text and "geomean ratio" in text
    assert "Relations violated" not in text
    files = write_outputs(result, tmp_path)
    data = json.loads(open(files["json"]).read())
    assert data["systems"]["default"]["rows"]["m-small"]["tpuv4_expert"]["ratio"] == 1.0
    assert open(files["markdown"]).read() == text


def test_infeasible_expert_placement_is_reported_not_raised(tmp_path):
    result = run_published(cfg(tmp_path), backend(evaluator=expert_misfit))
    rows = result["systems"]["default"]["rows"]["m-big"]
    r1 = rows["tpuv4_expert"]
    assert not r1.feasible and r1.ratio is None
    assert "does not fit" in r1.reason and "99.0 GiB" in r1.reason
    # the ratios of m-big fall back to the study's stand-in baseline, TPUv4 with the optimal placement
    assert rows["tpuv4_optimal"].feasible and rows["tpuv4_optimal"].ratio == 1.0
    assert not rows["expert_search"].feasible and "expert placement" in rows["expert_search"].reason
    assert rows["co_optimised"].feasible and rows["common"].feasible
    assert result["systems"]["default"]["checks"] == []
    assert result["systems"]["default"]["rows"]["m-small"]["tpuv4_expert"].feasible
    text = render(result)
    assert "| m-big * | infeasible |" in text and "ratios are to TPUv4 with the optimal placement" in text


def test_check_relations_reports_violations():
    def rows(**thr):
        return {"m": {k: Row(thr.get(k, 0) > 0, thr.get(k, 0.0)) for k in ROWS}}

    ok = rows(tpuv4_expert=1, tpuv4_optimal=2, expert_search=3, co_optimised=4, common=4)
    assert check_relations(ok) == []
    bad = rows(tpuv4_expert=3, tpuv4_optimal=2, expert_search=3, co_optimised=4, common=5)
    found = check_relations(bad)
    assert len(found) == 2
    assert any("2 TPUv4, optimal" in f and "1 TPUv4, expert" in f for f in found)
    assert any("5 common" in f for f in found)
    infeasible_coopt = rows(tpuv4_expert=1, tpuv4_optimal=1, expert_search=1, common=1)
    assert len(check_relations(infeasible_coopt)) == 3


def test_fixed_placement_evaluator_forces_the_placement():
    CALLS.clear()
    ev = fixed_placement_evaluator("expert", fake_evaluate)
    asked = Training(1, "selective", "optimal", sequence_parallel=True, zero=1, attention="flash")
    r = ev("m-small", REFERENCE, asked, system="default")
    assert CALLS[-1][5] == "expert" and CALLS[-1][6] == asked.with_placement("expert")
    assert r.throughput == fake_throughput("m-small", REFERENCE, 1, "selective", "expert", sequence_parallel=True,
                                           zero=1, attention="flash")
    import pickle

    assert pickle.loads(pickle.dumps(ev)).keywords["fixed"] == "expert"
    evaluate_fixed_placement("m-small", REFERENCE, Training(2, True, "expert"), fixed="optimal", evaluator=fake_evaluate)
    assert CALLS[-1][5] == "optimal" and CALLS[-1][6] == Training(2, True)


def test_too_few_trials_is_a_user_error(tmp_path):
    with pytest.raises(PhazeError, match="at least 8"):
        run_published(cfg(tmp_path, trials=7), backend())


def test_seeds_are_queued_behind_tpuv4_in_a_new_study(tmp_path):
    from phaze_opt.experiments.published import _run, _study_config

    config = cfg(tmp_path, trials=8)
    study_cfg = _study_config(config, "default", ("m-small",), "seeded")
    a = {"num_tc": 8, "tc_x": 8, "glb_mib": 2, "hbm_gib": 16, "mbs": 1, "recompute": True}
    b = {"num_tc": 1, "tc_x": 32, "glb_mib": 4, "hbm_gib": 32, "mbs": 2, "recompute": False}
    summary = _run(study_cfg, backend(), seeds=[("expert_search", a), ("common", b)])
    study = optuna.load_study(study_name="seeded", storage=study_cfg.storage)
    trials = study.get_trials()
    assert [t.user_attrs.get("seeded_from") for t in trials[:6]] == [None] * 4 + ["expert_search", "common"]
    assert [t.user_attrs["point"] for t in trials[4:6]] == [a, b]
    assert summary["trials"]["finished"] == 8


def solver_trouble(model, arch, training, system="default"):
    """m-big on the reference chip: every expert evaluation and the optimal one at mbs 2 raise."""
    if model == "m-big" and arch.num_tc == REFERENCE.num_tc and arch.tc_x == REFERENCE.tc_x and \
            arch.glb_bytes == REFERENCE.glb_bytes and (training.placement.spec() == "expert" or training.mbs == 2):
        raise RuntimeError("schedule not proven optimal: time_limit")
    return fake_evaluate(model, arch, training, system=system)


def test_evaluation_errors_are_told_apart_from_memory_misfits(tmp_path):
    result = run_published(cfg(tmp_path), backend(evaluator=solver_trouble))
    sys_result = result["systems"]["default"]
    rows = sys_result["rows"]["m-big"]
    r1, r2 = rows["tpuv4_expert"], rows["tpuv4_optimal"]
    assert not r1.feasible and "could not be evaluated" in r1.reason and "time_limit" in r1.reason
    assert "does not fit" not in r1.reason
    # row 2: the settings that raised are left out, and the row says so
    assert r2.feasible and r2.mbs == 1
    assert r2.throughput == max(fake_throughput("m-big", REFERENCE, 1, r, "optimal") for r in (False, True))
    assert r2.reason.startswith("2 of 4 recipes could not be evaluated")
    text = render(result)
    assert "note: 2 of 4" in text
    assert sys_result["rows"]["m-small"]["tpuv4_expert"].reason == ""


def no_baseline_for_big(model, arch, training, system="default"):
    """m-big cannot be evaluated on the reference chip at all (so it has no TPUv4 baseline)."""
    if model == "m-big" and arch.num_tc == REFERENCE.num_tc and arch.tc_x == REFERENCE.tc_x and \
            arch.glb_bytes == REFERENCE.glb_bytes:
        raise RuntimeError("schedule not proven optimal: time_limit")
    return fake_evaluate(model, arch, training, system=system)


def test_model_without_baseline_is_left_out_of_the_common_objective(tmp_path):
    result = run_published(cfg(tmp_path), backend(evaluator=no_baseline_for_big))
    sys_result = result["systems"]["default"]
    big, small = sys_result["rows"]["m-big"], sys_result["rows"]["m-small"]
    assert not big["tpuv4_expert"].feasible and not big["tpuv4_optimal"].feasible
    assert all(r.ratio is None for r in big.values())
    # the common design is chosen for m-small alone, then evaluated on m-big
    common = big["common"]
    assert common.feasible and "not part of the common objective" in common.reason
    assert common.accelerator == small["common"].accelerator and common.mbs == small["common"].mbs
    from phaze_opt.hardware.accelerator import Accelerator

    arch = Accelerator(**common.accelerator)
    assert common.throughput == fake_throughput("m-big", arch, common.mbs, common.recompute, "optimal")
    assert big["co_optimised"].throughput >= common.throughput
    assert sys_result["checks"] == []
    assert "| m-big * | infeasible | infeasible |" in render(result)


def test_unproven_throughputs_are_kept_and_flagged_with_their_bound(tmp_path):
    """A TPUv4 setting whose layer schedules hit the ILP time limit still counts, with a dagger and its bound."""

    def open_on_tpuv4(model, arch, training, system="default"):
        r = fake_evaluate(model, arch, training, system=system)
        if model == "m-small" and arch.compute_key == REFERENCE.compute_key and r.feasible:
            r.proven, r.throughput_bound, r.unproven = False, r.throughput * 1.25, ["tp1 block/bwd: gap 2.5e-01"]
        return r

    result = run_published(cfg(tmp_path), backend(evaluator=open_on_tpuv4))
    rows = result["systems"]["default"]["rows"]
    r1 = rows["m-small"]["tpuv4_expert"]
    assert r1.feasible and r1.throughput == best_fake("m-small", "expert")
    assert r1.bound == pytest.approx(r1.throughput * 1.25) and "block/bwd" in r1.reason and "at most" in r1.reason
    assert rows["m-big"]["tpuv4_expert"].bound is None and not rows["m-big"]["tpuv4_expert"].reason
    text = render(result)
    assert " †" in text and "not proven optimal" in text


# ---- the TPUv4 rows get every recipe a study gets, whole --------------------------------------------

@pytest.mark.parametrize("expert_fits", [True, False])
def test_tpuv4_rows_try_every_recipe_and_re_evaluate_the_winner_whole(expert_fits):
    from phaze_opt.experiments.published import least_memory_recipe, tpuv4_rows
    from phaze_opt.training import recipe_points

    rec = RecordingEvaluator(expert_fits)
    row1, row2, baselines = tpuv4_rows(["m-small"], rec, REFERENCE, "tpuv4-pod", EVERY_RECIPE)
    grid = {Training.from_point(p) for p in recipe_points(EVERY_RECIPE)}
    assert len(grid) == 1536  # every recipe field (ZeRO 0-3) x precision x overlapped parameter gather
    for placement in ("expert", "optimal"):
        assert {t.with_placement("optimal") for t, _ in rec.seen if t.placement.spec() == placement} == grid
    assert {s for _, s in rec.seen} == {"tpuv4-pod"}
    best_optimal = max(grid, key=RecordingEvaluator.score)
    r2 = row2["m-small"]
    assert r2.feasible and r2.throughput == pytest.approx(RecordingEvaluator.score(best_optimal))
    assert Training.from_point({"mbs": r2.mbs, "recompute": r2.recompute, **r2.recipe}) == best_optimal
    assert r2.system == "tpuv4-pod"
    if expert_fits:
        best_expert = max(grid, key=RecordingEvaluator.score).with_placement("expert")
        assert baselines["m-small"].training == best_expert
        # row 1 re-evaluated at exactly the baseline's recipe (for its placement details)
        assert rec.seen.count((best_expert, "tpuv4-pod")) == 2  # in the search, then for the row
    else:
        assert not row1["m-small"].feasible
        probe = Training.from_point(least_memory_recipe(EVERY_RECIPE), "expert")
        assert (probe.mbs, probe.recompute, probe.sequence_parallel, probe.zero, probe.virtual_stages,
                probe.attention) == (1, "full", True, 3, 1, "flash")
        assert (probe, "tpuv4-pod") in rec.seen
        assert "recompute full" in row1["m-small"].reason and "ZeRO-3" in row1["m-small"].reason


def test_common_design_row_evaluates_the_design_whole():
    from phaze_opt.experiments.published import common_design_row

    rec = RecordingEvaluator()
    design = {"num_tc": 4, "tc_x": 16, "glb_mib": 4, "hbm_gib": 32, "mbs": 2, "recompute": "selective",
              "sequence_parallel": True, "virtual_stages": 2, "zero": 1, "overlap_grad_reduce": True,
              "attention": "flash"}
    summary = {"study": "s", "best": {"design": design, "accelerator": {}, "area_mm2": 1.0, "trial": 3}}
    from test_study_fakes import FakeSpace

    row = common_design_row(summary, "m-big", rec, FakeSpace(), "default", "none")
    assert row.feasible and rec.seen == [(Training.from_point(design), "default")]
    assert row.recipe == {k: design[k] for k in ("sequence_parallel", "virtual_stages", "zero",
                                                 "overlap_grad_reduce", "attention")}


def test_published_rows_name_their_systems(tmp_path):
    result = run_published(cfg(tmp_path, reference_system="phaze"), backend())
    sys_result = result["systems"]["default"]
    assert sys_result["reference_system"] == "phaze"
    rows = sys_result["rows"]["m-small"]
    assert rows["tpuv4_expert"].system == "phaze" and rows["co_optimised"].system == "default"
    text = render(result)
    assert "ran on system `phaze`; rows 3 to 5 on `default`" in text
    assert sys_result["baselines"]["m-small"]["system"] == "phaze"
