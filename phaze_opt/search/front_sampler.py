"""`FrontSampler`: the bound-guided sampler for the throughput-area front (`--objectives throughput,area`).

Sampled multi-objective searchers (NSGA-II, multi-objective TPE) reach about 85-91% of the `phaze`
space's front hypervolume in 500 trials: they spend trials over the area budget, on repeats, and on
designs a smaller evaluated one already beats. This sampler proposes from `design.front_order`
instead: the point whose proven throughput bound could add the most hypervolume to the front the
study has found, never a point whose bound is at or below the best evaluated throughput at its area
or below (it cannot join the front), never an area-infeasible one, never one a trial holds. When no
point outside the study's trials can join its front, that front is the space's exact
throughput-area front (provided every trial was evaluated with proven schedules), and the study
stops (`bound_sampler.stop_when_settled`).

It inherits the single-objective sampler's rules for workers and determinism (`BoundSampler`): the
proposal for trial k depends on the seed, the trials numbered below k and the results of those below
k - (workers - 1), waited for, and every process replays every proposal in trial order.
"""

from __future__ import annotations

import numpy as np

from ..activity import phase
from ..design.front_order import FrontOrder
from .bound_sampler import BoundSampler, completed_feasible, held_keys, params_key


class FrontSampler(BoundSampler):
    """See the module docstring. `order` builds the process's `FrontOrder` when first needed."""

    order: FrontOrder

    def _step(self, number, earlier, propose=True):
        before = earlier[:number]
        held = held_keys(before)
        done = [t for t in before if t.number < number - self._lag]
        areas, scores = [], []
        for t in done:
            if t.params and completed_feasible(t):
                areas.append(float(self._space.area_check(self._codec.decode(t.params))[1]))
                scores.append(float(t.values[0]))
        order = self.order
        front = order.staircase(areas, scores)

        def taken(point: dict) -> bool:
            return params_key(self._codec.encode(point)) in held

        with phase(f"bounding the designs for trial {number}"):  # the first one bounds every cell (level 0)
            found = order.next_point(front, taken)
        if found is not None:
            return found[0]
        if self.settled_at is None:
            self.settled_at = number
        # nothing can join the front: this last trial (the study stops after it) takes a random point
        return self._random_point(taken, np.random.default_rng([self._seed, number])) if propose else None
