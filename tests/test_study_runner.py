"""The sampled study: reference first, constraints, failures, resume, determinism, bad input."""

import json
import re

import optuna
import pytest
from optuna.trial import TrialState

from phaze_opt.errors import PhazeError
from phaze_opt.search.encoding import SpaceCodec
from phaze_opt.search import sampled
from phaze_opt.search.objective import FatalStudyError
from phaze_opt.search.report import pareto_front
from phaze_opt.search.runner import run_study
from phaze_opt.search.session import finished_trials, is_feasible, split_quota
from phaze_opt.search.setup import StudyConfig, default_study_name, validate
from test_study_fakes import CALLS, FakeSpace, InterruptAfter, backend, config, fake_no_energy, fake_throughput, mlflow_uri


def load(cfg):
    return optuna.load_study(study_name=default_study_name(cfg) if cfg.study_name is None else cfg.study_name,
                             storage=cfg.storage)


def optimal_calls():
    return [c for c in CALLS if c[5] == "optimal"]


def test_study_runs_reference_first_and_records_every_kind_of_trial(tmp_path):
    space = FakeSpace(budget=60.0)  # several sampled designs will be over budget
    cfg = config(tmp_path, trials=30, models=("m-big",), sampler="random")
    CALLS.clear()
    summary = run_study(cfg, backend(space))
    study = load(cfg)
    trials = study.get_trials()
    assert len(trials) == 30 and all(t.state in (TrialState.COMPLETE, TrialState.FAIL) for t in trials)
    codec = SpaceCodec(space.params)
    # the reference design at every microbatch x recompute choice comes first
    refs = [codec.decode(t.params) for t in trials[:4]]
    assert refs == [space.reference_point(recipe={"mbs": m, "recompute": r}) for m in (1, 2) for r in (False, True)]
    assert all(t.user_attrs.get("reference") == "tpuv4" for t in trials[:4])
    by_kind = {"area": 0, "memory": 0, "fail": 0, "ok": 0}
    for t in trials:
        point = t.user_attrs["point"]
        assert codec.decode(t.params) == point
        res = t.user_attrs["result"]
        if t.state == TrialState.FAIL:
            by_kind["fail"] += 1
            assert res["error"] == "ValueError: solver exploded on this design"
            continue
        ok, area, _ = space.area_check(point)
        if not ok:
            by_kind["area"] += 1
            assert t.constraints["area"] > 0 and t.values == [0.0] and "budget" in res["reason"]
            assert res["models"] == {}
        elif point["hbm_gib"] == 16 and not point["recompute"]:
            by_kind["memory"] += 1
            assert t.constraints["memory"] == 1 and t.values == [0.0] and "GiB" in res["reason"]
        else:
            by_kind["ok"] += 1
            assert is_feasible(t)
            assert t.values[0] == pytest.approx(fake_throughput("m-big", space.accelerator(point), point["mbs"],
                                                                point["recompute"]))
    assert min(by_kind.values()) > 0, by_kind  # every case happened at least once
    # designs over the area budget never reached the evaluator
    evaluated = {(c[1], c[2], c[3], c[4]) for c in optimal_calls()}
    for t in trials:
        p = t.user_attrs["point"]
        if not space.area_check(p)[0]:
            a = space.accelerator(p)
            assert (a.compute_key, a.hbm_bytes, p["mbs"], p["recompute"]) not in evaluated
    s = summary["trials"]
    assert (s["finished"], s["failed"]) == (30, by_kind["fail"])
    assert s["infeasible"] == by_kind["area"] + by_kind["memory"]
    best = max((t for t in trials if is_feasible(t)), key=lambda t: t.values[0])
    assert summary["best"]["trial"] == best.number and summary["best"]["design"] == best.user_attrs["point"]
    ratio = summary["best"]["models"]["m-big"]["ratio_to_tpuv4_expert"]
    assert ratio == pytest.approx(best.values[0] / summary["baselines"]["m-big"]["throughput"])


def test_same_seed_same_study(tmp_path):
    runs = []
    for i in range(2):
        cfg = config(tmp_path / str(i), trials=12, seed=3)
        run_study(cfg, backend())
        runs.append([t.params for t in load(cfg).get_trials()])
    assert runs[0] == runs[1]
    cfg = config(tmp_path / "other", trials=12, seed=4)
    run_study(cfg, backend())
    assert [t.params for t in load(cfg).get_trials()] != runs[0]


def test_one_worker_on_the_sessions_sampler_proposes_what_a_worker_opening_the_study_would(tmp_path, monkeypatch):
    # One worker runs in the parent on the session's open study and sampler; a worker process opens
    # the study itself with a sampler of its own (the first at seed + 0). Past TPE's random start
    # (ten trials), and on resume, the two must still propose the same designs.
    runs = []
    for own_study in (False, True):
        if own_study:
            run_worker = sampled.run_worker
            monkeypatch.setattr(sampled, "run_worker", lambda *args, study=None, **kw: run_worker(*args, **kw))
        for trials in (14, 22):
            cfg = config(tmp_path / str(own_study), trials=trials, seed=3)
            run_study(cfg, backend())
        runs.append([(t.params, t.values) for t in load(cfg).get_trials()])
    assert len(runs[0]) == 22 and runs[0] == runs[1]


def test_resume_continues_and_repeats_nothing(tmp_path):
    cfg = config(tmp_path, trials=7)
    CALLS.clear()
    run_study(cfg, backend())
    first = {t.number: (t.params, t.values, t.state) for t in load(cfg).get_trials()}
    calls_first = len(optimal_calls())
    assert len(first) == 7
    summary = run_study(config(tmp_path, trials=12), backend())
    trials = load(cfg).get_trials()
    assert len(trials) == 12 and len(finished_trials(trials)) == 12
    for t in trials[:7]:  # finished trials are untouched
        assert (t.params, t.values, t.state) == first[t.number]
    # only the new trials were evaluated (those within the area budget reach the evaluator)
    new = [t.user_attrs["point"] for t in trials[7:]]
    assert len(optimal_calls()) - calls_first == sum(FakeSpace().area_check(p)[0] for p in new)
    assert summary["resumed"] and summary["trials"]["this_run"] == 5
    # a study already at its target does nothing
    CALLS.clear()
    run_study(config(tmp_path, trials=12), backend())
    assert optimal_calls() == [] and len(load(cfg).get_trials()) == 12


def test_interrupted_trial_is_retried_on_resume_and_not_counted(tmp_path):
    cfg = config(tmp_path, trials=9)
    with pytest.raises(KeyboardInterrupt):
        run_study(cfg, backend(evaluator=InterruptAfter(6)))
    trials = load(cfg).get_trials()
    cut = [t for t in trials if t.user_attrs.get("interrupted")]
    assert len(cut) == 1 and cut[0].state == TrialState.FAIL
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    retry = [t for t in waiting if t.user_attrs.get("retry_of") == cut[0].number]
    assert len(retry) == 1 and retry[0].system_attrs["fixed_params"] == cut[0].params
    done_before = {t.number for t in finished_trials(trials)}
    assert done_before == set(range(cut[0].number))  # everything before the cut finished
    CALLS.clear()
    run_study(cfg, backend())
    trials = load(cfg).get_trials()
    assert len(finished_trials(trials)) == 9
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]
    assert trials[retry[0].number].state == TrialState.COMPLETE
    assert trials[retry[0].number].user_attrs["point"] == cut[0].user_attrs["point"]
    # the retried point and three new ones ran; nothing finished re-ran
    ran = [t.user_attrs["point"] for t in trials if t.number not in done_before and t.number != cut[0].number]
    assert len(ran) == 9 - len(done_before)
    assert len(optimal_calls()) == sum(FakeSpace().area_check(p)[0] for p in ran)


def test_several_models_search_one_common_design(tmp_path):
    cfg = config(tmp_path, trials=10, models=("m-small", "m-big"))
    summary = run_study(cfg, backend())
    base = summary["baselines"]
    assert set(base) == {"m-small", "m-big"} and all(b["placement"] == "expert" for b in base.values())
    for t in load(cfg).get_trials():
        if not is_feasible(t):
            continue
        models = t.user_attrs["result"]["models"]
        expected = sum(models[m]["throughput"] / base[m]["throughput"] for m in models) / 2
        assert t.values[0] == pytest.approx(expected)
    best = summary["best"]
    assert best["ratio_to_tpuv4_expert"] == pytest.approx(best["score"])
    # the baselines are stored with the study, so a resumed study normalises by the same numbers
    assert load(cfg).user_attrs["baselines"]["m-big"]["throughput"] == base["m-big"]["throughput"]


def test_multi_objective_saves_a_pareto_plot(tmp_path):
    cfg = config(tmp_path, trials=12, objectives=("throughput", "area", "energy"), sampler="nsga2")
    summary = run_study(cfg, backend())
    trials = load(cfg).get_trials()
    front = {t.number for t in pareto_front(trials, ["maximize", "minimize", "minimize"])}
    assert {p["trial"] for p in summary["pareto"]["trials"]} == front
    feasible = [t for t in trials if is_feasible(t)]
    # brute force: a front member is dominated by nobody, every other feasible trial by someone
    def dominates(a, b):
        ka, kb = (a.values[0], -a.values[1], -a.values[2]), (b.values[0], -b.values[1], -b.values[2])
        return all(x >= y for x, y in zip(ka, kb)) and ka != kb
    for t in feasible:
        assert (t.number in front) == (not any(dominates(u, t) for u in feasible))
    png = summary["pareto"]["plot"]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_energy_without_energy_model_is_one_line_error(tmp_path):
    cfg = config(tmp_path, trials=3, objectives=("throughput", "energy"))
    with pytest.raises(FatalStudyError, match="energy"):
        run_study(cfg, backend(evaluator=fake_no_energy))


@pytest.mark.parametrize("changes, message", [
    ({"sampler": "annealing"}, "unknown sampler 'annealing'"),
    ({"objectives": "throughput,speed"}, "unknown objective 'speed'"),
    ({"objectives": "area"}, "throughput must come first"),
    ({"sampler": "cmaes", "objectives": "throughput,area"}, "optimises one objective"),
    ({"models": ("m-small", "gpt5")}, "unknown model 'gpt5'"),
    ({"models": ()}, "at least one model"),
    ({"trials": 0}, "--trials"),
    ({"workers": 0}, "--workers"),
    ({"order": "random"}, "unknown order"),
    ({"hysteresis": "soon"}, "--hysteresis"),
    ({"strategy": "auto", "hysteresis": 5, "order": "grid"}, "needs --order area"),
    ({"storage": "studies/x.db"}, "database URL"),
    ({"system": "no-such-system"}, "unknown system 'no-such-system'"),
])
def test_bad_settings_are_one_line_errors(tmp_path, changes, message):
    cfg = config(tmp_path, **changes)
    with pytest.raises(PhazeError, match=message) as info:
        run_study(cfg, backend())
    assert "\n" not in str(info.value)


def test_empty_space_is_a_one_line_error(tmp_path):
    space = FakeSpace(params={"num_tc": [], "tc_x": [8], "glb_mib": [2], "hbm_gib": [16], "mbs": [1],
                              "recompute": [False]})
    with pytest.raises(PhazeError, match="'num_tc' has no choices"):
        run_study(config(tmp_path), backend(space))
    with pytest.raises(PhazeError, match="no grid point"):
        run_study(config(tmp_path, strategy="auto"), backend(FakeSpace(budget=1.0)))


def test_reusing_a_study_name_with_other_settings_is_refused(tmp_path):
    run_study(config(tmp_path, trials=2, study_name="s"), backend())
    with pytest.raises(PhazeError, match="was run with models"):
        run_study(config(tmp_path, trials=2, study_name="s", models=("m-big",)), backend())


def test_default_names_and_quota():
    cfg = validate(StudyConfig(models=("m-small",), space="fake"), backend())
    assert default_study_name(cfg) == "m-small-fake-tpe-seed0"
    ex = validate(StudyConfig(models=("m-small", "m-big"), space="fake", strategy="auto", hysteresis="5",
                              objectives="throughput,area"), backend())
    assert ex.hysteresis == 5 and default_study_name(ex) == "m-small+m-big-fake-exhaustive-area-h5-throughput+area"
    assert split_quota(10, 3) == [4, 3, 3] and sum(split_quota(7, 4)) == 7


def test_summary_is_json_and_saved(tmp_path):
    cfg = config(tmp_path, trials=5, tracking_uri=mlflow_uri(tmp_path))
    summary = run_study(cfg, backend())
    saved = json.loads((tmp_path / "studies" / f"{default_study_name(cfg)}-summary.json").read_text())
    assert saved["best"]["trial"] == summary["best"]["trial"]
    from phaze_opt.search.report import render
    text = render(summary)
    assert "best design" in text and "TPUv4 with the expert placement" in text and "mlflow ui" in text
    # one spelling per unit: area in mm^2, MFU as a percentage (the summary JSON keeps the fraction)
    assert re.search(r"area [\d.,]+ mm\^2", text) and re.search(r"MFU \d+\.\d%", text), text
    assert saved["mlflow"]["ui"] in text and saved["mlflow"]["run_url"] in text and saved["next"]["compare"] in text


@pytest.mark.parametrize("sampler, objectives", [  # random: above; nsga2 with three objectives: above
    ("cmaes", "throughput"), ("gp", "throughput"), ("tpe", "throughput,area"), ("qmc", "throughput,area"),
])
def test_every_sampler_runs(tmp_path, sampler, objectives):
    from test_study_fakes import small_space

    space = small_space()
    cfg = config(tmp_path, trials=11, sampler=sampler, objectives=objectives)
    summary = run_study(cfg, backend(space))
    trials = optuna.load_study(study_name=summary["study"], storage=cfg.storage).get_trials()
    assert len(finished_trials(trials)) == 11 == summary["trials"]["finished"]
    codec = SpaceCodec(space.params)
    for t in trials:
        point = codec.decode(t.params)
        assert all(point[k] in v for k, v in space.params.items())
    assert optuna.load_study(study_name=summary["study"], storage=cfg.storage).user_attrs["sampler"] == sampler
    if "," in objectives:
        assert summary["pareto"]["trials"]


def test_trial_of_a_killed_process_is_failed_and_retried(tmp_path, monkeypatch):
    """A process killed mid-trial leaves it RUNNING; its stale heartbeat fails it and its point is re-queued."""
    import time

    from phaze_opt.search import setup

    monkeypatch.setattr(setup, "HEARTBEAT_S", 1)
    monkeypatch.setattr(setup, "GRACE_S", 1)
    cfg = config(tmp_path, trials=5)
    run_study(cfg, backend())
    storage = setup.make_storage(cfg.storage)
    study = optuna.load_study(study_name=default_study_name(cfg), storage=storage)
    codec = SpaceCodec(FakeSpace().params)
    study.enqueue_trial(codec.encode({"num_tc": 8, "tc_x": 8, "glb_mib": 2, "hbm_gib": 32, "mbs": 1, "recompute": False}))
    with pytest.warns(UserWarning, match="Heartbeat"):
        dead = study.ask()  # what a killed worker leaves behind: a RUNNING trial whose heartbeat stopped
    point = codec.suggest(dead)
    storage.record_heartbeat(dead._trial_id)
    time.sleep(2.5)
    CALLS.clear()
    run_study(config(tmp_path, trials=7), backend())
    trials = load(cfg).get_trials()
    assert trials[dead.number].state == TrialState.FAIL
    retry = [t for t in trials if dead.number in t.system_attrs.get("retry_history", [])]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and retry[0].user_attrs["point"] == point
    assert len(finished_trials(trials)) == 7  # the stale trial does not count; its retry does
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_best_trial_is_the_first_to_reach_the_best_score():
    import optuna

    from phaze_opt.search.report import best_trial

    def trial(number, value, area):
        t = optuna.trial.create_trial(values=[value], user_attrs={"result": {"area_mm2": area}},
                                      params={}, distributions={})
        t.number = number
        return t

    # equal throughput: the lowest trial number, whatever the list order or the chips' areas
    assert best_trial([trial(0, 10.0, 300.0), trial(1, 10.0, 250.0), trial(2, 9.0, 100.0)]).number == 0
    assert best_trial([trial(3, 10.0, 250.0), trial(1, 10.0, 300.0)]).number == 1
    # a higher throughput beats any earlier trial
    assert best_trial([trial(0, 10.0, 100.0), trial(1, 10.5, 400.0)]).number == 1


def test_baseline_gets_the_whole_recipe_space_on_its_own_system_and_the_study_evaluates_it(tmp_path):
    """A space sampling every recipe field: the baseline is the best reference recipe over all of
    them (on the reference system), the summary names that recipe and system, and the study
    enqueues the reference at that recipe, so its ratio's denominator is a design it evaluated."""
    from phaze_opt.search.report import render
    from phaze_opt.training import Training

    params = {"num_tc": [1, 4], "tc_x": [16], "glb_mib": [4], "hbm_gib": [32], "mbs": [1, 2],
              "recompute": ["none", "selective"], "sequence_parallel": [False, True], "zero": [0, 3],
              "attention": ["unfused", "flash"]}
    space = FakeSpace(params=params)
    cfg = config(tmp_path, trials=20, reference_system="phaze")
    CALLS.clear()
    summary = run_study(cfg, backend(space))
    base = summary["baselines"]["m-small"]
    # the fake's best reference recipe: mbs 2, no recompute, SP on, ZeRO 0, flash, expert placement
    assert (base["mbs"], base["recompute"], base["placement"], base["system"]) == (2, "none", "expert", "phaze")
    assert base["recipe"] == {"sequence_parallel": True, "zero": 0, "attention": "flash"}
    baseline_calls = [c for c in CALLS if c[5] == "expert"]
    assert {c[7] for c in baseline_calls} == {"phaze"} and len(baseline_calls) == 2 * 2 * 2 * 2 * 2
    assert len({c[6] for c in baseline_calls}) == 32
    text = render(summary)
    assert "sequence_parallel=True, zero=0, attention=flash, expert placement, on system phaze" in text
    study = load(cfg)
    codec = SpaceCodec(space.params)
    queued = [codec.decode(t.params) for t in study.get_trials() if t.user_attrs.get("reference")]
    assert space.reference_point(recipe={"mbs": 2, "recompute": "none", **base["recipe"]}) in queued
    assert Training.from_point(queued[-1]) == Training(2, "none", sequence_parallel=True, zero=0, attention="flash")


@pytest.mark.parametrize("with_trials", [True, False], ids=["with-trials", "empty"])
def test_another_programs_study_of_the_same_name_is_refused(tmp_path, monkeypatch, with_trials):
    """Same name, same direction, made by plain Optuna: refused in one line, never adopted (it was:
    its best became the summary's, its trials MLflow's "missing" runs); nothing is added to it."""
    from phaze_opt.search import setup

    monkeypatch.setattr(setup, "IDENTITY_WAIT_S", 0.2)  # an empty one is looked at again this long
    cfg = config(tmp_path, trials=3, study_name="s")
    (tmp_path / "studies").mkdir(exist_ok=True)
    foreign = optuna.create_study(study_name="s", storage=cfg.storage, direction="maximize")
    if with_trials:
        foreign.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1_000_011.9))
    with pytest.raises(PhazeError, match="was not made by phaze-opt") as info:
        run_study(cfg, backend())
    assert "\n" not in str(info.value)
    again = optuna.load_study(study_name="s", storage=cfg.storage)
    assert again.user_attrs == {} and len(again.get_trials()) == int(with_trials)


def test_a_worker_killed_as_by_the_oom_killer_costs_its_trial_not_the_study(tmp_path, capsys):
    """SIGKILL of one of two workers mid-trial broke the pool: a 29-line BrokenProcessPool traceback and
    exit 1. Now its trial is failed as interrupted, its point queued again, and the study reaches its
    total; the summary's notes say which trial."""
    from test_study_fakes import KillOnce

    marker = tmp_path / "killed"
    cfg = config(tmp_path, trials=8, workers=2)
    summary = run_study(cfg, backend(evaluator=KillOnce(str(marker))))
    assert marker.exists()  # a worker was killed
    err = capsys.readouterr().err
    assert "a worker process died" in err and "Traceback" not in err
    trials = load(cfg).get_trials()
    assert len(finished_trials(trials)) == 8 and not [t for t in trials if t.state == TrialState.RUNNING]
    lost = [t for t in trials if t.user_attrs.get("interrupted")]
    assert lost and all(t.state == TrialState.FAIL for t in lost)
    assert any("left by a process that is gone" in n for n in summary["notes"])
