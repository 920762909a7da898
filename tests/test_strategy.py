"""The strategy seam: the settings the CLI has always taken name the same strategy, and each
strategy gives the study the names, attributes and checks the `--exhaustive` flag used to."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from phaze_opt.design.space import load_space
from phaze_opt.errors import PhazeError
from phaze_opt.search.config import StudyConfig
from phaze_opt.search.setup import default_study_name
from phaze_opt.search.strategy import BRANCH_AND_BOUND, GRID, SAMPLED, Strategy, strategy_for

STRATEGIES = (SAMPLED, GRID, BRANCH_AND_BOUND)


def test_the_flags_name_the_strategy():
    assert strategy_for(StudyConfig()) is SAMPLED
    assert strategy_for(StudyConfig(prune="bound")) is SAMPLED  # --prune only shapes a sweep
    assert strategy_for(StudyConfig(exhaustive=True, prune="off")) is GRID
    assert strategy_for(StudyConfig(exhaustive=True, prune="auto")) is GRID  # until validate resolves it
    assert strategy_for(StudyConfig(exhaustive=True, prune="bound")) is BRANCH_AND_BOUND
    assert [s.mode for s in STRATEGIES] == ["sampled", "exhaustive", "exhaustive"]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_every_strategy_keeps_the_contract(strategy):
    members = [m for m in Strategy.__dict__ if not m.startswith("_")] + list(Strategy.__annotations__)
    assert all(hasattr(strategy, m) for m in members)
    config = StudyConfig(exhaustive=strategy is not SAMPLED, prune="bound" if strategy is BRANCH_AND_BOUND else "off",
                         sampler="bound")
    assert isinstance(strategy.optuna_sampler(config, load_space(config.space)), optuna.samplers.BaseSampler)
    other, words, flags = strategy.counterpart(config)
    assert strategy_for(other).mode != strategy.mode and words and other.study_name is None
    assert flags == ([] if strategy.mode == "exhaustive" else ["--exhaustive"])


def test_study_names_and_attributes_are_those_of_the_flag():
    base = StudyConfig(models=("gpt2-xl",), space="phaze")
    assert default_study_name(replace(base, sampler="random", seed=3)) == "gpt2-xl-phaze-random-seed3"
    assert default_study_name(replace(base, exhaustive=True, prune="off", hysteresis=2)) == "gpt2-xl-phaze-exhaustive-area-h2"
    assert default_study_name(replace(base, exhaustive=True, prune="bound")) == "gpt2-xl-phaze-exhaustive-bound"
    assert SAMPLED.settings(base) == {} and SAMPLED.sampler_label(replace(base, sampler="tpe")) == "tpe"
    sweep = replace(base, exhaustive=True, order="grid")
    assert GRID.settings(sweep) == {"order": "grid", "hysteresis": None}
    assert GRID.sampler_label(sweep) == BRANCH_AND_BOUND.sampler_label(sweep) == "exhaustive"
    assert SAMPLED.counts_trials and not GRID.counts_trials and not SAMPLED.can_prune and GRID.can_prune


def test_each_strategy_checks_its_own_settings():
    two = ("throughput", "area")
    with pytest.raises(PhazeError, match="--sampler cmaes optimises one objective"):
        SAMPLED.check(StudyConfig(sampler="cmaes", objectives=two))
    GRID.check(StudyConfig(sampler="cmaes", objectives=two, exhaustive=True))  # a sweep samples nothing
    with pytest.raises(PhazeError, match="needs --order area"):
        GRID.check(StudyConfig(exhaustive=True, hysteresis=2, order="grid"))
    with pytest.raises(PhazeError, match="--workers 1"):
        BRANCH_AND_BOUND.check(StudyConfig(exhaustive=True, hysteresis=2, workers=2))
    SAMPLED.check(StudyConfig(hysteresis=2, order="grid", workers=2))  # hysteresis shapes a sweep only
    assert SAMPLED.notes(StudyConfig(sampler="cmaes")) and not GRID.notes(StudyConfig(sampler="cmaes"))
