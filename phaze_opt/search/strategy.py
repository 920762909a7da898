"""How a study chooses the designs it evaluates: the `Strategy` seam.

A study's `StudyConfig.strategy` names one of these, and `runner.run_study` calls its `run`:

- `sampled`: an Optuna sampler proposes points until the study holds `--trials` finished trials;
- `grid`: every grid point of the space, by area groups (with optional hysteresis), in any number
  of runs;
- `branch-and-bound`: every grid point too, but settled best-first, by evaluation or by a proven
  throughput bound;
- `auto`: the exhaustive sweep the CLI's `--exhaustive` asks for by default: branch and bound where
  the proven bounds apply (`setup.resolve_strategy`), else the grid.

This module holds each strategy's rules (pure functions of the config: names, checks, samplers);
the module that visits a strategy's points subclasses them with its `run` and `register`s the one
instance (`sampled.SAMPLED`, `exhaustive.GRID`, `exhaustive.AUTO_SWEEP`,
`branch_bound.BRANCH_AND_BOUND`), since those modules open sessions and the settings below them
read these rules. `strategy_for(config)` looks the name up. `strategy_from_flags` maps the flags
the CLI has always taken (`--exhaustive`, `--prune`) onto a name, so the flags do not change.
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
from ..design.front_order import FrontOrder
from .bound_sampler import EXPLORE, BoundSampler
from .front_sampler import FrontSampler

# `StudyConfig` in the annotations is `config.StudyConfig`, which imports this module (to look its
# strategy up), so it is not imported here.

SAMPLERS = ("bound", "tpe", "random", "cmaes", "qmc", "gp", "nsga2")
SINGLE_OBJECTIVE_SAMPLERS = ("cmaes",)
# `--sampler auto` (the default): the bound-guided sampler where the proven bounds apply
# (`setup.bound_obstacle`), TPE elsewhere.
AUTO = "auto"


# The names `StudyConfig.strategy` takes. `auto` is resolved during validation (`setup.validate`), so
# a validated config names one of the other three.
SAMPLED_NAME, GRID_NAME, BRANCH_AND_BOUND_NAME, AUTO_SWEEP_NAME = "sampled", "grid", "branch-and-bound", "auto"
STRATEGY_NAMES = (SAMPLED_NAME, GRID_NAME, BRANCH_AND_BOUND_NAME, AUTO_SWEEP_NAME)
PRUNES = ("auto", "bound", "off")
_SWEEP_OF_PRUNE = {"auto": AUTO_SWEEP_NAME, "bound": BRANCH_AND_BOUND_NAME, "off": GRID_NAME}


class Strategy(Protocol):
    """The contract between a strategy and the study that runs it.

    Attributes:
        name: what `StudyConfig.strategy` calls it ("sampled", "grid", "branch-and-bound", "auto").
        mode: the study's identity ("sampled" or "exhaustive"): stored with the study and checked
            on every resume, so a study is never continued by a strategy of another mode. Two
            strategies may share a mode when they visit the same points (grid and branch and bound
            both settle the whole grid, so one may resume the other).
        counts_trials: whether `--trials` is the budget it spends (a sampled study stops at that
            many finished trials; a sweep settles every point whatever the number).

    Running:
        run(config, backend): run (or resume) the study and return its summary (`report.finish`).
            It opens a `session.Session` (which validates the config and evaluates nothing), calls
            `Session.begin` (the TPUv4 baselines and the MLflow parent run) unless the study has
            nothing left to do, visits its points inside `Session.running()` and ends with
            `report.finish`. The settings it reads are the session's (validated) config, not the
            argument's. Every point it evaluates becomes a finished Optuna trial with the attributes
            a sampled trial has, so `compare`, the summary and MLflow treat every strategy alike.

    Rules (each pure: it reads the config, never the study or the storage):
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

    def sampler_label(self, config: StudyConfig) -> str: ...

    def optuna_sampler(self, config: StudyConfig, space, worker: int = 0) -> optuna.samplers.BaseSampler: ...

    def check(self, config: StudyConfig) -> None: ...

    def name_parts(self, config: StudyConfig) -> list[str]: ...

    def settings(self, config: StudyConfig) -> dict: ...

    def notes(self, config: StudyConfig) -> list[str]: ...

    def counterpart(self, config: StudyConfig) -> tuple[StudyConfig, str, list[str]]: ...

    def run(self, config: StudyConfig, backend=None) -> dict: ...


def _bound_order(config: StudyConfig, space) -> BoundOrder:
    return BoundOrder(load_model(config.models[0]), load_system(config.system), space, seed=config.seed)


def _front_order(config: StudyConfig, space) -> FrontOrder:
    return FrontOrder(load_model(config.models[0]), load_system(config.system), space, seed=config.seed)


def make_sampler(config: StudyConfig, space, worker: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler for one process. Optuna's own samplers: worker k > 0 gets seed + k so workers do
    not propose the same points. The bound-guided sampler: every worker the same seed, since its
    proposal for a trial is a function of the trial's number (see `bound_sampler`); with throughput
    and area, its front version (`front_sampler`)."""
    name, seed = config.sampler, config.seed
    s = seed + worker
    if name == "bound" and len(config.objectives) > 1:
        return FrontSampler(space, partial(_front_order, config, space), seed=seed, workers=config.workers)
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
    """The sampled strategy's rules (`sampled.SampledStrategy` runs it)."""

    name = SAMPLED_NAME
    mode = "sampled"
    counts_trials = True

    def sampler_label(self, config):
        return config.sampler

    def optuna_sampler(self, config, space, worker=0):
        return make_sampler(config, space, worker)

    def check(self, config):
        if len(config.objectives) > 1 and config.sampler in SINGLE_OBJECTIVE_SAMPLERS:
            raise PhazeError(f"--sampler {config.sampler} optimises one objective; use bound, tpe, random, qmc, gp "
                             f"or nsga2 with --objectives {','.join(config.objectives)}")

    def name_parts(self, config):
        return [config.sampler, f"seed{config.seed}"]

    def settings(self, config):
        return {}

    def notes(self, config):
        if config.sampler == "cmaes":
            return ["cmaes ignores Optuna constraints; it learns infeasible designs from their 0 throughput"]
        if config.sampler == "bound" and len(config.objectives) > 1:
            return ["bound: area-feasible points only, each design once, by the hypervolume their proven throughput "
                    "bound could add to the front; none that a smaller evaluated design already matches"]
        if config.sampler == "bound":
            return ["bound: area-feasible points only, each design once, in the order of their proven throughput bounds "
                    f"({round(100 * EXPLORE)}% of trials explore around the best design)"]
        return []

    def counterpart(self, config):
        other = replace(config, strategy=AUTO_SWEEP_NAME, hysteresis=None, order="area", study_name=None)
        return other, "the exhaustive sweep", ["--exhaustive"]


class Grid:
    """The grid sweep's rules (`exhaustive.GridStrategy` runs it)."""

    name = GRID_NAME
    mode = "exhaustive"
    counts_trials = False

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
        other = replace(config, strategy=SAMPLED_NAME, sampler=AUTO, seed=0, study_name=None)
        return other, "the default sampled study", []


class BranchAndBound(Grid):
    """The grid's points, settled best-first by evaluation or by a proven bound: the same mode as
    the grid (the same points, the same optimum). `branch_bound.BranchAndBoundStrategy` runs it."""

    name = BRANCH_AND_BOUND_NAME

    def name_parts(self, config):
        return ["exhaustive", "bound"]


class AutoSweep(Grid):
    """`--exhaustive` with `--prune auto`: branch and bound where the proven bounds apply, else the
    grid. Validation resolves it to one of the two (`setup.resolve_strategy`); until then its rules
    are the grid's, which branch and bound shares but for the study's name."""

    name = AUTO_SWEEP_NAME


_REGISTERED: dict[str, Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` the one `strategy_for` returns for its name (each name is registered once,
    by the module that runs it, at its import)."""
    if strategy.name in _REGISTERED:
        raise ValueError(f"strategy '{strategy.name}' is registered twice")
    _REGISTERED[strategy.name] = strategy
    return strategy


def strategy_for(config: StudyConfig) -> Strategy:
    """The strategy `config.strategy` names."""
    name = config.strategy
    if name not in STRATEGY_NAMES:
        raise PhazeError(unknown_choice("strategy", name, STRATEGY_NAMES))
    return _REGISTERED[name]


def strategy_from_flags(exhaustive: bool, prune: str) -> str:
    """The strategy the CLI's flags name: without `--exhaustive` a sampler proposes (`--prune` only
    shapes a sweep, but a value it does not know is refused either way); with it, `--prune bound`
    is branch and bound, `off` the grid, `auto` the choice validation makes."""
    choice = str(prune).strip().lower()
    if choice not in PRUNES:
        raise PhazeError(f"--prune: unknown value '{prune}'; choose bound, off or auto")
    return _SWEEP_OF_PRUNE[choice] if exhaustive else SAMPLED_NAME
