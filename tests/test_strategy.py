"""The strategy seam: the settings the CLI has always taken name the same strategy, each
strategy's `run` is what a study of its name runs, and each strategy gives the study the names,
attributes and checks the `--exhaustive` flag used to."""

from __future__ import annotations

import argparse
from dataclasses import replace

import optuna
import pytest

from phaze_opt.commands.study import add_arguments, config_from_args
from phaze_opt.design.space import load_space
from phaze_opt.errors import PhazeError
from phaze_opt.search import run_study
from phaze_opt.search import setup as study_setup
from phaze_opt.search.config import StudyConfig
from phaze_opt.search.session import Session
from phaze_opt.search.setup import default_study_name
from phaze_opt.search.strategy import STRATEGY_NAMES, Strategy, strategy_for
from test_study_fakes import backend, config as fake_config, fake_evaluate

SAMPLED, GRID, BRANCH_AND_BOUND, AUTO_SWEEP = (strategy_for(StudyConfig(strategy=n)) for n in STRATEGY_NAMES)
STRATEGIES = (SAMPLED, GRID, BRANCH_AND_BOUND)


def _args(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize("flags, name", [
    ((), "sampled"),
    (("--prune", "bound"), "sampled"),  # --prune only shapes a sweep
    (("--exhaustive",), "auto"),  # resolved by validation
    (("--exhaustive", "--prune", "off"), "grid"),
    (("--exhaustive", "--prune", " Bound "), "branch-and-bound"),
    (("--exhaustive", "--prune", "auto"), "auto"),
])
def test_the_flags_name_the_strategy(flags, name):
    assert config_from_args(_args(*flags)).strategy == name
    assert [s.mode for s in (SAMPLED, GRID, BRANCH_AND_BOUND, AUTO_SWEEP)] == ["sampled", *["exhaustive"] * 3]


def test_an_unknown_prune_or_strategy_is_one_line():
    for flags in (("--prune", "sometimes"), ("--exhaustive", "--prune", "sometimes")):
        with pytest.raises(PhazeError, match="--prune: unknown value 'sometimes'; choose bound, off or auto"):
            config_from_args(_args(*flags))
    with pytest.raises(PhazeError, match="unknown strategy 'exhaustive'"):
        study_setup.validate(StudyConfig(strategy="exhaustive"))


@pytest.mark.parametrize("flags, ran", [
    ((), "sampled"),
    (("--exhaustive", "--prune", "off"), "grid"),
    (("--exhaustive", "--prune", "bound"), "branch-and-bound"),
    (("--exhaustive",), "grid"),  # the fake evaluator has no proven bound: auto is the grid
])
def test_each_strategys_run_is_what_its_flags_run(monkeypatch, tmp_path, flags, ran):
    calls = []
    for strategy in STRATEGIES:
        def record(self, config, backend=None):
            calls.append((self.name, config.strategy))
            return {"ran": self.name}
        monkeypatch.setattr(type(strategy), "run", record)
    args = _args(*flags, "--space", "fake", "--model", "m-small", "--tracking-uri", "off",
                 "--output-dir", str(tmp_path))
    assert run_study(config_from_args(args), backend()) == {"ran": ran}
    assert calls == [(ran, ran)]  # once, with the strategy already chosen


def test_auto_is_branch_and_bound_where_the_bounds_apply(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(type(BRANCH_AND_BOUND), "run", lambda self, config, backend=None: calls.append(config) or {})
    monkeypatch.setattr(study_setup, "bound_obstacle", lambda config, backend, objectives=None: None)
    run_study(fake_config(tmp_path, strategy="auto", hysteresis="off"), backend())
    assert [c.strategy for c in calls] == ["branch-and-bound"]
    assert calls[0].hysteresis == "off"  # the run gets the caller's settings; its session validates them


def test_opening_a_session_evaluates_nothing(tmp_path):
    calls = []

    def recording(*args, **kwargs):
        calls.append(args)
        return fake_evaluate(*args, **kwargs)

    session = Session(fake_config(tmp_path), backend(evaluator=recording))
    try:
        assert calls == [] and "baselines" not in session.study.user_attrs
        assert session.study.user_attrs.get("workers_per_run") is None  # nor counts a run
    finally:
        session.release()
    session = Session(fake_config(tmp_path), backend(evaluator=recording))
    session.begin()  # the baselines are the strategies' explicit step
    with session.running():
        assert calls and set(session.baselines) == {"m-small"}
        assert session.study.user_attrs["workers_per_run"] == [1]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_every_strategy_keeps_the_contract(strategy):
    members = [m for m in Strategy.__dict__ if not m.startswith("_")] + list(Strategy.__annotations__)
    assert all(hasattr(strategy, m) for m in members) and "run" in members
    config = StudyConfig(strategy=strategy.name, sampler="bound")
    assert isinstance(strategy.optuna_sampler(config, load_space(config.space)), optuna.samplers.BaseSampler)
    other, words, flags = strategy.counterpart(config)
    assert strategy_for(other).mode != strategy.mode and words and other.study_name is None
    assert flags == ([] if strategy.mode == "exhaustive" else ["--exhaustive"])


def test_study_names_and_attributes_are_those_of_the_flag():
    base = StudyConfig(models=("gpt2-xl",), space="phaze")
    assert default_study_name(replace(base, sampler="random", seed=3)) == "gpt2-xl-phaze-random-seed3"
    assert default_study_name(replace(base, strategy="grid", hysteresis=2)) == "gpt2-xl-phaze-exhaustive-area-h2"
    assert default_study_name(replace(base, strategy="branch-and-bound")) == "gpt2-xl-phaze-exhaustive-bound"
    assert SAMPLED.settings(base) == {} and SAMPLED.sampler_label(replace(base, sampler="tpe")) == "tpe"
    sweep = replace(base, strategy="grid", order="grid")
    assert GRID.settings(sweep) == {"order": "grid", "hysteresis": None}
    assert GRID.sampler_label(sweep) == BRANCH_AND_BOUND.sampler_label(sweep) == "exhaustive"
    assert SAMPLED.counts_trials and not GRID.counts_trials and not BRANCH_AND_BOUND.counts_trials


def test_each_strategy_checks_its_own_settings():
    two = ("throughput", "area")
    with pytest.raises(PhazeError, match="--sampler cmaes optimises one objective"):
        SAMPLED.check(StudyConfig(sampler="cmaes", objectives=two))
    GRID.check(StudyConfig(sampler="cmaes", objectives=two, strategy="grid"))  # a sweep samples nothing
    with pytest.raises(PhazeError, match="needs --order area"):
        GRID.check(StudyConfig(strategy="grid", hysteresis=2, order="grid"))
    with pytest.raises(PhazeError, match="--workers 1"):
        BRANCH_AND_BOUND.check(StudyConfig(strategy="branch-and-bound", hysteresis=2, workers=2))
    SAMPLED.check(StudyConfig(hysteresis=2, order="grid", workers=2))  # hysteresis shapes a sweep only
    assert SAMPLED.notes(StudyConfig(sampler="cmaes")) and not GRID.notes(StudyConfig(sampler="cmaes"))
