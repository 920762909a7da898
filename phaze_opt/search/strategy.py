"""How a study chooses the designs it evaluates: the `Strategy` seam.

Three strategies exist. `SAMPLED`: an Optuna sampler proposes points until the study holds
`--trials` finished trials. `GRID`: every grid point of the space, by area groups (with optional
hysteresis), in any number of runs. `BRANCH_AND_BOUND`: every grid point too, but settled
best-first, by evaluation or by a proven throughput bound. `strategy_for(config)` picks one from
the settings the CLI has always taken (`--exhaustive`, `--prune`), so the flags do not change.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Protocol

import optuna

from ..design.best_first import BoundOrder
from ..errors import PhazeError, unknown_choice
from ..system import load_system
from ..workload.models import load_model
from .bound_sampler import EXPLORE, BoundSampler

# `StudyConfig` in the annotations is `config.StudyConfig`, which imports this module (to name its
# strategy), so it is not imported here.

SAMPLERS = ("bound", "tpe", "random", "cmaes", "qmc", "gp", "nsga2")
SINGLE_OBJECTIVE_SAMPLERS = ("cmaes", "bound")
# `--sampler auto` (the default): the bound-guided sampler where the proven bounds apply
# (`setup.bound_obstacle`), TPE elsewhere.
AUTO = "auto"


class Strategy(Protocol):
    """The contract between a strategy and the study that runs it.

    Attributes:
        name: what a person calls it ("sampled", "grid", "branch-and-bound").
        mode: the study's identity ("sampled" or "exhaustive"): stored with the study and checked
            on every resume, so a study is never continued by a strategy of another mode. Two
            strategies may share a mode when they visit the same points (grid and branch and bound
            both settle the whole grid, so one may resume the other).
        counts_trials: whether `--trials` is the budget it spends (a sampled study stops at that
            many finished trials; a sweep settles every point whatever the number).
        can_prune: whether proven throughput bounds may settle its points (`setup.resolve_prune`);
            only a strategy that visits every point can skip one by a bound and stay exact.

    Methods (each pure: it reads the config, never the study or the storage):
        sampler_label(config): the sampler the study and its MLflow runs record.
        optuna_sampler(config, space, worker): the Optuna sampler the study is opened with in this
            process (`worker` 0 is the parent), for the space the study searches. A strategy that
            chooses its points itself still opens the study with a seeded sampler, so Optuna never
            falls back to an unseeded default.
        check(config): raise a `PhazeError` naming the flag when a setting contradicts the
            strategy (called from `setup.validate` with the normalised values).
        name_parts(config): the parts of the default study name that tell its runs apart.
        settings(config): the settings stored with the study and logged as MLflow params, beyond
            the common ones.
        notes(config): lines for the summary about how the strategy treats these settings.
        counterpart(config): the study worth comparing this one with (`phaze-opt compare`), the
            words that name it and the extra CLI flags that run it.
    """

    name: str
    mode: str
    counts_trials: bool
    can_prune: bool

    def sampler_label(self, config: StudyConfig) -> str: ...

    def optuna_sampler(self, config: StudyConfig, space, worker: int = 0) -> optuna.samplers.BaseSampler: ...

    def check(self, config: StudyConfig) -> None: ...

    def name_parts(self, config: StudyConfig) -> list[str]: ...

    def settings(self, config: StudyConfig) -> dict: ...

    def notes(self, config: StudyConfig) -> list[str]: ...

    def counterpart(self, config: StudyConfig) -> tuple[StudyConfig, str, list[str]]: ...


def _bound_order(config: StudyConfig, space) -> BoundOrder:
    return BoundOrder(load_model(config.models[0]), load_system(config.system), space, seed=config.seed)


def make_sampler(config: StudyConfig, space, worker: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler for one process. Optuna's own samplers: worker k > 0 gets seed + k so workers do
    not propose the same points. The bound-guided sampler: every worker the same seed, since its
    proposal for a trial is a function of the trial's number (see `bound_sampler`)."""
    name, seed = config.sampler, config.seed
    s = seed + worker
    if name == "bound":
        return BoundSampler(space, partial(_bound_order, config, space), seed=seed, workers=config.workers)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=s)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=s)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=s, warn_independent_sampling=False)
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=s, scramble=True, warn_independent_sampling=False,
                                          warn_asynchronous_seeding=False)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=s, warn_independent_sampling=False)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=s)
    raise PhazeError(unknown_choice("sampler", name, SAMPLERS))


class Sampled:
    name = "sampled"
    mode = "sampled"
    counts_trials = True
    can_prune = False

    def sampler_label(self, config):
        return config.sampler

    def optuna_sampler(self, config, space, worker=0):
        return make_sampler(config, space, worker)

    def check(self, config):
        if len(config.objectives) > 1 and config.sampler in SINGLE_OBJECTIVE_SAMPLERS:
            raise PhazeError(f"--sampler {config.sampler} optimises one objective; use tpe, random, qmc, gp or nsga2 "
                             f"with --objectives {','.join(config.objectives)}")

    def name_parts(self, config):
        return [config.sampler, f"seed{config.seed}"]

    def settings(self, config):
        return {}

    def notes(self, config):
        if config.sampler == "cmaes":
            return ["cmaes ignores Optuna constraints; it learns infeasible designs from their 0 throughput"]
        if config.sampler == "bound":
            return ["bound: area-feasible points only, each design once, in the order of their proven throughput bounds "
                    f"({round(100 * EXPLORE)}% of trials explore around the best design)"]
        return []

    def counterpart(self, config):
        other = replace(config, exhaustive=True, prune="auto", hysteresis=None, order="area", study_name=None)
        return other, "the exhaustive sweep", ["--exhaustive"]


class Grid:
    name = "grid"
    mode = "exhaustive"
    counts_trials = False
    can_prune = True

    def sampler_label(self, config):
        return "exhaustive"

    def optuna_sampler(self, config, space, worker=0):
        return optuna.samplers.RandomSampler(seed=config.seed)

    def check(self, config):
        if config.hysteresis is not None and config.order != "area":
            raise PhazeError("--hysteresis stops a sweep by decreasing area; it needs --order area (or --hysteresis off)")
        if config.hysteresis is not None and config.workers > 1:
            raise PhazeError("--hysteresis needs the area groups in order; use --workers 1 or --hysteresis off")

    def name_parts(self, config):
        hyst = "off" if config.hysteresis is None else str(config.hysteresis)
        return ["exhaustive", config.order, f"h{hyst}"]

    def settings(self, config):
        return {"order": config.order, "hysteresis": config.hysteresis}

    def notes(self, config):
        return []

    def counterpart(self, config):
        other = replace(config, exhaustive=False, sampler=AUTO, seed=0, study_name=None, prune="off")
        return other, "the default sampled study", []


class BranchAndBound(Grid):
    """The grid's points, settled best-first by evaluation or by a proven bound: the same mode as
    the grid (the same points, the same optimum)."""

    name = "branch-and-bound"

    def name_parts(self, config):
        return ["exhaustive", "bound"]


SAMPLED, GRID, BRANCH_AND_BOUND = Sampled(), Grid(), BranchAndBound()


def strategy_for(config: StudyConfig) -> Strategy:
    """The strategy the settings name: `--exhaustive` sweeps the grid, and with `--prune bound`
    (after `setup.validate` resolves `auto`) by branch and bound; otherwise a sampler proposes."""
    if not config.exhaustive:
        return SAMPLED
    return BRANCH_AND_BOUND if config.prune == "bound" else GRID
