"""List scheduling of one series block: a quick legal schedule, the ILP's warm start and upper bound.

The serial schedule-generation scheme (Kelley 1963; Kolisch, EJOR 1996) takes ops one at a time in
a priority order that respects precedence and starts each at the earliest time its predecessors
have finished and its resources are free for its whole duration. Resources are cumulative: TC
(num_tc units), VC (num_vc units) and the link (1 unit). A single-mode op needs one unit of each
core type it uses, a collective the link, and a split op every TC and every VC unit, which is
exactly "nothing else computes beside it".

We run a few priority rules (longest remaining path, in a few duration metrics) crossed with a few
mode policies (fastest mode, single everywhere, and per op the mode that finishes first), keep the
best, then try flipping single ops' modes one at a time. None of this needs to be optimal: the
result is only an incumbent for the bound test and the ILP.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right

from .instance import BlockView, Instance, longest_tails


class Profile:
    """Resource usage over time as a step function: use[p] holds on [times[p], times[p + 1])."""

    __slots__ = ("caps", "times", "use")

    def __init__(self, caps: tuple[int, int, int]):
        self.caps = caps
        self.times = [0.0]
        self.use = [(0, 0, 0)]

    def earliest(self, t0: float, dur: float, dem: tuple[int, int, int]) -> float:
        times, use, caps = self.times, self.use, self.caps
        q = bisect_right(times, t0) - 1
        t = t0
        n = len(times)
        while q < n and times[q] < t + dur:
            u = use[q]
            if u[0] + dem[0] > caps[0] or u[1] + dem[1] > caps[1] or u[2] + dem[2] > caps[2]:
                q += 1
                t = times[q]  # the last segment is always empty, so q stays in range
            else:
                q += 1
        return t

    def _cut(self, t: float) -> int:
        k = bisect_left(self.times, t)
        if k == len(self.times) or self.times[k] != t:
            self.times.insert(k, t)
            self.use.insert(k, self.use[k - 1])
        return k

    def add(self, s: float, e: float, dem: tuple[int, int, int]) -> None:
        if e <= s:
            return
        a = self._cut(s)
        b = self._cut(e)
        use = self.use
        for p in range(a, b):
            u = use[p]
            use[p] = (u[0] + dem[0], u[1] + dem[1], u[2] + dem[2])


def demand(inst: Instance, i: int, split: bool) -> tuple[int, int, int]:
    if inst.net[i]:
        return (0, 0, 1)
    if split:
        return (inst.num_tc, inst.num_vc, 0)
    return (int(inst.uses_tc[i]), int(inst.uses_vc[i]), 0)


def duration(inst: Instance, i: int, split: bool) -> float:
    return inst.split[i] if split else inst.single[i]


def serial_sgs(inst: Instance, view: BlockView, priority: dict, modes: dict | None, greedy: bool = False):
    """One pass of the serial scheme. `modes[i]` True = split; with `greedy`, ops that may split take
    whichever mode finishes first (ties: single, which leaves cores free). Returns (starts, modes)."""
    caps = (inst.num_tc, inst.num_vc, 1)
    prof = Profile(caps)
    remaining = {i: len(view.preds[i]) for i in view.ops}
    finish: dict[int, float] = {}
    start: dict[int, float] = {}
    chosen: dict[int, bool] = {}
    heap = [(priority[i], i) for i in view.ops if remaining[i] == 0]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        est = max((finish[p] for p in view.preds[i]), default=0.0)
        if greedy and inst.can_split[i]:
            d0, d1 = inst.single[i], inst.split[i]
            s0 = prof.earliest(est, d0, demand(inst, i, False))
            s1 = prof.earliest(est, d1, demand(inst, i, True))
            mode = s1 + d1 < s0 + d0
        else:
            mode = bool(modes[i]) if modes is not None else False
        d = duration(inst, i, mode)
        dem = demand(inst, i, mode)
        s = prof.earliest(est, d, dem)
        prof.add(s, s + d, dem)
        start[i], finish[i], chosen[i] = s, s + d, mode
        for j in view.succs[i]:
            remaining[j] -= 1
            if remaining[j] == 0:
                heapq.heappush(heap, (priority[j], j))
    return start, chosen


def parallel_sgs(inst: Instance, view: BlockView, priority: dict, modes: dict):
    """The parallel scheme: step through time, and at each instant start every ready op (in
    priority order) whose resources are free now. It never leaves a core idle when some ready op
    could use it, which fills the idle time around collectives that the serial scheme can miss."""
    caps = (inst.num_tc, inst.num_vc, 1)
    prof = Profile(caps)
    remaining = {i: len(view.preds[i]) for i in view.ops}
    ready_at: dict[int, float] = {i: 0.0 for i in view.ops if remaining[i] == 0}
    start: dict[int, float] = {}
    finish: dict[int, float] = {}
    events = [0.0]
    t = 0.0
    while ready_at:
        for i in sorted((i for i, r in ready_at.items() if r <= t), key=priority.__getitem__):
            d = duration(inst, i, modes[i])
            dem = demand(inst, i, modes[i])
            if prof.earliest(t, d, dem) == t:
                prof.add(t, t + d, dem)
                start[i], finish[i] = t, t + d
                del ready_at[i]
                heapq.heappush(events, t + d)
                for j in view.succs[i]:
                    remaining[j] -= 1
                    if remaining[j] == 0:
                        ready_at[j] = max(finish[p] for p in view.preds[j])
                        heapq.heappush(events, ready_at[j])
        while events and events[0] <= t:
            heapq.heappop(events)
        if not events:
            break
        t = heapq.heappop(events)
    return start, dict(modes)


def justify(inst: Instance, view: BlockView, start: dict, modes: dict):
    """Forward-backward improvement (Valls, Ballestin and Quintanilla, EJOR 2005): schedule the
    reversed problem with ops taken by latest finish, then the forward one with ops taken by the
    resulting earliest start. Neither pass can end later than the schedule it starts from."""
    fin = {i: start[i] + duration(inst, i, modes[i]) for i in view.ops}
    rev = BlockView(ops=tuple(reversed(view.ops)), mask=view.mask, preds=view.succs, succs=view.preds)
    pos = {i: k for k, i in enumerate(view.ops)}
    back, _ = serial_sgs(inst, rev, {i: (-fin[i], -pos[i]) for i in view.ops}, modes)
    back_fin = {i: back[i] + duration(inst, i, modes[i]) for i in view.ops}
    horizon = max(back_fin.values(), default=0.0)
    # In the reversed schedule op i occupies [back_i, back_fin_i); in forward time it starts at horizon - back_fin_i.
    fwd, _ = serial_sgs(inst, view, {i: (horizon - back_fin[i], pos[i]) for i in view.ops}, modes)
    return fwd


def makespan_of(inst: Instance, start: dict, modes: dict) -> float:
    return max((start[i] + duration(inst, i, modes[i]) for i in start), default=0.0)


def _priority_from_tails(inst: Instance, view: BlockView, dur) -> dict:
    tail = longest_tails(view, dur)
    # Larger remaining path first; ties by topological position (heapq pops the smallest key).
    pos = {i: k for k, i in enumerate(view.ops)}
    return {i: (-(tail[i] + dur[i]), pos[i]) for i in view.ops}


def list_schedule(inst: Instance, view: BlockView, target: float = 0.0, improve: bool = True):
    """Best (makespan, starts, modes) over the rules above; stops early once `target` is met."""
    best_dur = [inst.best(i) for i in range(inst.n)]
    single_dur = list(inst.single)
    priorities = [_priority_from_tails(inst, view, best_dur), _priority_from_tails(inst, view, single_dur)]
    pos = {i: k for k, i in enumerate(view.ops)}
    priorities.append({i: (pos[i],) for i in view.ops})
    fastest = {i: inst.can_split[i] for i in view.ops}
    singles = {i: False for i in view.ops}
    best = None

    def consider(start, chosen, prio):
        nonlocal best
        ms = makespan_of(inst, start, chosen)
        if best is None or ms < best[0]:
            best = (ms, start, chosen, prio)
        return best[0] <= target

    for prio in priorities:
        for modes, greedy in ((fastest, False), (None, True), (singles, False)):
            start, chosen = serial_sgs(inst, view, prio, modes, greedy)
            if consider(start, chosen, prio):
                return best[:3]
            start, chosen = parallel_sgs(inst, view, prio, chosen)
            if consider(start, chosen, prio):
                return best[:3]
    if improve:
        best = _flip_modes(inst, view, best, target)
        if best[0] > target:
            start = justify(inst, view, best[1], best[2])
            consider(start, best[2], best[3])
    return best[:3]


def _flip_modes(inst: Instance, view: BlockView, best, target: float):
    """First-improvement local search: flip one op's mode, re-run the scheme, keep if shorter."""
    improved = True
    rounds = 0
    while improved and rounds < 3 and best[0] > target:
        improved = False
        rounds += 1
        for i in view.ops:
            if not inst.can_split[i]:
                continue
            modes = dict(best[2])
            modes[i] = not modes[i]
            start, chosen = serial_sgs(inst, view, best[3], modes)
            ms = makespan_of(inst, start, chosen)
            if ms < best[0]:
                best = (ms, start, chosen, best[3])
                improved = True
                if ms <= target:
                    return best
    return best


def schedule_from_hint(inst: Instance, view: BlockView, hint_start: dict, hint_modes: dict, target: float = 0.0):
    """A legal schedule that follows a relaxation's answer: its modes, its start times as the
    priority (serial and parallel schemes), then mode flips and justification as in
    `list_schedule`. Returns (makespan, starts, modes); any legal schedule will do."""
    pos = {i: k for k, i in enumerate(view.ops)}
    modes = {i: bool(hint_modes[i]) and inst.can_split[i] for i in view.ops}
    best = None
    for prio in ({i: (hint_start[i], pos[i]) for i in view.ops},
                 {i: (hint_start[i] + duration(inst, i, modes[i]), pos[i]) for i in view.ops}):
        for start, chosen in (serial_sgs(inst, view, prio, modes), parallel_sgs(inst, view, prio, modes)):
            ms = makespan_of(inst, start, chosen)
            if best is None or ms < best[0]:
                best = (ms, start, chosen, prio)
            if best[0] <= target:
                return best[:3]
    best = _flip_modes(inst, view, best, target)
    if best[0] > target:
        start = justify(inst, view, best[1], best[2])
        ms = makespan_of(inst, start, best[2])
        if ms < best[0]:
            best = (ms, start, best[2], best[3])
    return best[:3]
