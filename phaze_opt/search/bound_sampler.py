"""`BoundSampler`: an Optuna sampler that proposes designs in the order of their proven bounds.

Optuna's samplers treat the objective as a black box. Ours is not: a cheap formula decides a design's
area before any solver runs, and the proven throughput bounds of `design.upper_bound` say which
designs can still beat the best one found. Plain TPE on the `phaze` space spends a third of its 500
trials over the area budget or on designs it already evaluated, and stops at 87.5% of the optimum
that the exhaustive sweep proves. This sampler uses the structure instead:

- Every proposal is an area-feasible point of the space that no earlier trial of the study holds
  (running, waiting or finished), so no trial is spent over the budget or on a repeat.
- Most trials take the next point of `design.best_first.BoundOrder`: the highest level-1 bound not
  yet proposed, found lazily (A*-style) without bounding the whole grid, and only while that bound
  is above the best throughput found so far (a point bounded below the incumbent cannot win). Each
  trial may add a fixed amount of bounding work (`WORK_PER_TRIAL`); one that runs out takes the best
  point bounded so far instead.
  Recipes another recipe of the same design provably matches or beats are never proposed.
- A seeded share of the trials (`explore`), and every trial once no bounded point can beat the
  incumbent, mutates the best design found (one or two parameters one step along their ordered
  choices: local search) and keeps a mutant whose level-0 bound beats the incumbent, else the best
  of its tries; failing that, a seeded random feasible point no trial holds.

Once no point outside the study's trials has a bound above the best throughput found, no further
trial can improve on it, and the study stops (`stop_when_settled`) before `--trials`, saying so.

Deterministic: the proposal for trial k depends only on the seed, the study's trials numbered
below k, and the results of those numbered below k - (workers - 1). Before proposing, a trial waits
until those trials have finished (however long they take: a dead worker's trial is failed by
Optuna's heartbeat) and every earlier trial has its parameters, so a study with a given seed and
worker count proposes the same designs in the same order on a quiet and on a loaded machine. Every
random draw comes from a generator seeded by (seed, trial number), and each process replays, in
trial order, the proposal step of every trial another process proposed, so its `BoundOrder` is
where a single process's would be.

It is an ordinary `optuna.samplers.BaseSampler`: it works with every Optuna storage, in several
processes, and beside enqueued trials (it proposes nothing for a trial whose parameters are fixed).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.storages import fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from .. import interrupt
from ..activity import phase
from ..design.best_first import BoundOrder
from ..design.pareto import Staircase
from .encoding import SpaceCodec

EXPLORE = 0.1  # share of the trials that explore around the best design instead of following the bounds
MUTATION_TRIES = 8  # mutants drawn per exploring trial; the first whose bound beats the incumbent wins
# Bounding work a trial may add to the order (`BoundOrder.work`: placement DPs on lower-bound layer
# times, 10-50 ms each, and vectorised batches of architectures), so a trial never waits long on
# bounds: a trial that runs out takes the best point bounded so far, and the order goes on at the next.
WORK_PER_TRIAL = 64
# ...and the allowance of the first proposals: the architectures' level 0 and the first cells
# (about 150 units on `phaze`) come before any point, so the order's best points are not delayed.
WORK_AT_START = 256
WAIT_S = 120.0  # without heartbeats (in-memory storage): how long a trial waits for earlier ones
# with heartbeats: a dead worker's trial is failed within the storage's grace period (minutes); this
# deadline only covers a process that died before its trial's first heartbeat
WAIT_BEATING_S = 1800.0
POLL_S = 0.05
STALE_CHECK_S = 5.0  # how often a waiting trial checks the heartbeats of the trials it waits for


def params_key(params: Mapping[str, Any]) -> tuple:
    return tuple(sorted(params.items()))


def held_keys(trials) -> set:
    """The encoded points the study holds in any state: proposed, waiting (enqueued) or finished."""
    keys = set()
    for t in trials:
        params = t.params or t.system_attrs.get("fixed_params") or {}
        if params:
            keys.add(params_key(params))
    return keys


def completed_feasible(t: FrozenTrial) -> bool:
    """A finished trial with values and every constraint met (an infeasible design counts nothing)."""
    return t.state == TrialState.COMPLETE and bool(t.values) and not any(v > 0 for v in t.constraints.values())


def incumbent_of(trials) -> tuple[float, FrozenTrial | None]:
    """The best feasible single-objective value among finished trials, and its trial."""
    best, where = 0.0, None
    for t in trials:
        if not completed_feasible(t):
            continue
        if t.values[0] > best:
            best, where = float(t.values[0]), t
    return best, where


def _beats(storage) -> bool:
    """Whether the storage records heartbeats (Optuna's RDB and gRPC storages when a heartbeat
    interval is set). Optuna's own test for this is private; its public contract is the heartbeat
    storage's `get_heartbeat_interval`."""
    interval = getattr(storage, "get_heartbeat_interval", None)
    return callable(interval) and interval() is not None


class BoundSampler(optuna.samplers.BaseSampler):
    """See the module docstring. `order` builds the process's `BoundOrder` when first needed (it
    traces the model and bounds architectures: seconds), so opening a study costs nothing."""

    def __init__(self, space, order: Callable[[], BoundOrder], seed: int = 0, workers: int = 1,
                 explore: float = EXPLORE, wait_s: float = WAIT_S, work_per_trial: float = WORK_PER_TRIAL,
                 work_at_start: float = WORK_AT_START):
        self._space = space
        self._codec = SpaceCodec(space.params)
        self._make_order = order
        self._order: BoundOrder | None = None
        self._seed = int(seed)
        self._lag = max(1, int(workers)) - 1
        self._explore = float(explore)
        self._wait_s = float(wait_s)
        self._work_per_trial = float(work_per_trial)
        self._work_at_start = float(work_at_start)
        self._cursor = 0  # trials (by position) whose proposals this process's order has replayed
        self.settled_at: int | None = None  # the first trial that found no point left above its incumbent

    @property
    def order(self) -> BoundOrder:
        if self._order is None:
            with phase("tracing the model and bounding the architectures"):
                self._order = self._make_order()
        return self._order

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return self._codec.distributions()

    def sample_relative(self, study, trial: FrozenTrial, search_space) -> dict[str, Any]:
        if not search_space or "fixed_params" in trial.system_attrs:
            return {}  # an enqueued point: Optuna uses its fixed parameters
        earlier = sorted(self._wait_for_earlier(study, trial.number), key=lambda t: t.number)
        for t in earlier[self._cursor:]:  # what the trials this process did not propose did to the order
            if not t.system_attrs.get("fixed_params"):
                self._step(t.number, earlier, propose=False)
        point = self._step(trial.number, earlier)
        self._cursor = trial.number + 1
        return self._codec.encode(point) if point is not None else {}

    def _step(self, number: int, earlier: list[FrozenTrial], propose: bool = True) -> dict | None:
        """The proposal for trial `number` given the trials before it (`earlier`: trials 0, 1, ...);
        every process takes this step for every proposed trial, in order, so their orders stay in
        step (`propose=False`: only what the step does to the order)."""
        before = earlier[:number]
        held = held_keys(before)
        incumbent, best = incumbent_of([t for t in before if t.number < number - self._lag])
        rng = np.random.default_rng([self._seed, number])

        def taken(point: dict) -> bool:
            return params_key(self._codec.encode(point)) in held

        order = self.order
        point = None
        if rng.random() >= self._explore:
            with phase(f"bounding the designs for trial {number}"):  # the first one traces and bounds
                found = order.next_point(incumbent, taken, budget=self._budget(number))
                if found is None and not order.exhausted(incumbent):  # out of budget: the best bounded point
                    found = order.best_point(incumbent, taken)
            if found is not None:
                point = found[0]
            elif incumbent > 0 and order.exhausted(incumbent) and self.settled_at is None:
                self.settled_at = number
        if not propose:
            return point
        if point is None and best is not None:
            point = self._mutant(best, incumbent, taken, rng)
        if point is None:
            point = self._random_point(taken, rng)
        return point

    def _budget(self, number: int) -> float:
        """The bounding work (`BoundOrder.work`) the proposals up to trial `number` may have done in
        all: a trial's share is fixed, so no proposal waits long on bounding, and where the order
        stops is a function of the trial number (the same in every process)."""
        return self._work_at_start + self._work_per_trial * (number + 1)

    def sample_independent(self, study, trial, param_name, param_distribution):
        # Only for a parameter outside the space (none in a study of ours): a draw seeded by the trial.
        sampler = optuna.samplers.RandomSampler(seed=(self._seed * 1_000_003 + trial.number) % 2**32)
        return sampler.sample_independent(study, trial, param_name, param_distribution)

    # -- the parts --------------------------------------------------------------------------------

    def _wait_for_earlier(self, study, number: int) -> list[FrozenTrial]:
        """The trials numbered below `number`, once those below number - lag have finished and every
        one has its parameters. On a storage with heartbeats (every storage several processes share)
        a dead worker's trial is failed by the heartbeat rule, checked here too, which goes by whether
        its process lives, not by how long an evaluation takes; the deadline is then `WAIT_BEATING_S`,
        far beyond any evaluation, for a trial whose process died before its first heartbeat. So a
        slow evaluation on a loaded machine never changes a proposal. Without heartbeats (one
        process, in memory) it waits `wait_s` at most."""
        beating = _beats(study._storage)
        deadline = time.monotonic() + (max(self._wait_s, WAIT_BEATING_S) if beating else self._wait_s)
        next_check = time.monotonic() + STALE_CHECK_S
        while True:
            earlier = [t for t in study.get_trials(deepcopy=False) if t.number < number]
            ready = all((t.state.is_finished() if t.number < number - self._lag
                         else (t.params or t.state.is_finished() or "fixed_params" in t.system_attrs))
                        for t in earlier)
            if ready or interrupt.stop_requested() or time.monotonic() >= deadline:
                return earlier
            if beating and time.monotonic() >= next_check:
                fail_stale_trials(study)  # a trial whose process died: failed (and queued again) by its heartbeat
                next_check = time.monotonic() + STALE_CHECK_S
            time.sleep(POLL_S)

    def _feasible(self, point: dict) -> bool:
        return bool(self._space.area_check(point)[0])

    def _mutant(self, best: FrozenTrial, incumbent: float, taken, rng) -> dict | None:
        """A neighbour of the best design: one or two parameters moved one step along their choices."""
        base = self._codec.decode(best.params) if best.params else None
        if base is None:
            return None
        names = [c for c in self._codec.codings if len(c.choices) > 1]
        fallback, fallback_bound = None, -math.inf
        for _ in range(MUTATION_TRIES):
            point = dict(base)
            for coding in rng.choice(len(names), size=min(len(names), 1 + int(rng.integers(2))), replace=False):
                c = names[int(coding)]
                i = c.choices.index(point[c.name]) if point[c.name] in c.choices else 0
                j = min(max(i + (1 if rng.random() < 0.5 else -1), 0), len(c.choices) - 1)
                point[c.name] = c.choices[j]
            if not self._feasible(point) or taken(point):
                continue
            bound = self.order.cell_bound(point)
            if bound > incumbent:
                return point
            if bound > fallback_bound:
                fallback, fallback_bound = point, bound
        return fallback

    def _random_point(self, taken, rng) -> dict | None:
        """A random area-feasible point no trial holds (a few hundred draws, then none)."""
        order = self.order
        for _ in range(512):
            a, h = int(rng.integers(len(order.archs))), int(rng.integers(len(order.hbms)))
            m, r = int(rng.integers(len(order.mbss))), int(rng.integers(len(order.rcs)))
            point = order.point(a, h, m, r)
            if not taken(point):
                return point
        return None


SETTLED_ATTR = "bound_settled"


def stop_when_settled(study, frozen) -> None:
    """An Optuna callback: stop the study once its bound-guided sampler found no point left whose
    bound beats the best trial (`BoundSampler.settled_at`), recording when in the study's attributes."""
    sampler = study.sampler
    if isinstance(sampler, BoundSampler) and sampler.settled_at is not None:
        if SETTLED_ATTR not in study.user_attrs:
            study.set_user_attr(SETTLED_ATTR, {"trial": sampler.settled_at, "best": incumbent_of(study.get_trials(
                deepcopy=False))[0]})
        study.stop()


def settled_note(study) -> str | None:
    """The summary's line for a study the sampler settled, or None."""
    info = study.user_attrs.get(SETTLED_ATTR)
    if not info:
        return None
    trials = study.get_trials(deepcopy=False)
    best = incumbent_of(trials)[0]
    front = len(study.directions) > 1
    floor = (lambda t: best)
    if front:  # what an unproven trial's bound must beat: the best throughput at or below its area
        done = [t for t in trials if completed_feasible(t)]
        stairs = Staircase([t.values[1] for t in done], [t.values[0] for t in done], math.inf)
        floor = (lambda t: stairs.at(t.values[1]) if t.values else 0.0)
    open_trials = [t.number for t in trials if t.state == TrialState.FAIL and not t.user_attrs.get("interrupted")
                   or (t.user_attrs.get("result") or {}).get("proven") is False
                   and (t.user_attrs.get("result") or {}).get("score_bound", 0) > floor(t)]
    line = (f"bound: stopped after trial {info['trial']}: no point outside the study's trials has a proven bound "
            + ("above the best throughput evaluated at or below its area" if front else f"above its best ({best:.6g})"))
    what = ("its throughput-area front", "the space's exact front") if front else ("that best", "the space's optimum")
    if open_trials:
        return line + f"; trials {', '.join(map(str, open_trials[:5]))} failed or were not proven, so {what[0]} is not proven"
    return line + f", so {what[0]} is {what[1]}"
