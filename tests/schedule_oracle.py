"""An independent exact scheduler for small problems with integer latencies (test oracle).

It shares no code with phaze_opt.solve. With integer latencies some optimal schedule starts every
op at an integer time (shift any op left until it starts at 0 or at some op's end: the ops running
just before that start are a subset of those running at it, so no limit is broken), so a
breadth-first search over integer time steps is exact. The state at time t is the set of finished
ops and the running ops with their modes and remaining time; at each step every set of ready ops,
in every allowed mode, that fits beside the running ones may start. The first step at which a
state has every op finished is the optimal makespan. A state reached at an earlier step is not
expanded again: what is left to schedule from it is the same, only started later.

Resources as the schedule semantics define them: a single-mode "tc" op needs 1 TC, "vc" 1 VC,
"tc+vc" 1 TC and 1 VC; a split op needs every TC and every VC (nothing else computes beside it)
and exists only when its type has more than one core; a "net" op needs the one link; "none" ops
and zero-latency modes finish instantly.
"""

from __future__ import annotations

import itertools


def _modes(unit, single, split, num_tc, num_vc):
    """[(duration, tc, vc, link)] for each allowed mode of one op."""
    if unit == "none":
        return [(0, 0, 0, 0)]
    if unit == "net":
        return [(single, 0, 0, 1)]
    tc = 1 if unit in ("tc", "tc+vc") else 0
    vc = 1 if unit in ("vc", "tc+vc") else 0
    modes = [(single, tc, vc, 0)]
    more_than_one_core = (tc and num_tc > 1) or (vc and num_vc > 1)
    if more_than_one_core:
        modes.append((split, num_tc, num_vc, 0))
    return modes


def oracle_makespan(units, single, split, edges, num_tc, num_vc, max_steps=10_000) -> int:
    n = len(units)
    preds = [0] * n  # bit mask of each op's predecessors
    for a, b in edges:
        preds[b] |= 1 << a
    modes = [_modes(units[i], int(single[i]), int(split[i]), num_tc, num_vc) for i in range(n)]
    instant = [i for i in range(n) if any(m[0] == 0 for m in modes[i])]
    full = (1 << n) - 1

    def settle(done: int, started: int) -> tuple[int, int]:
        """Ops with a zero-time mode finish the moment they are ready (they occupy nothing)."""
        changed = True
        while changed:
            changed = False
            for i in instant:
                bit = 1 << i
                if not started & bit and preds[i] & done == preds[i]:
                    done |= bit
                    started |= bit
                    changed = True
        return done, started

    def starts(ready, j, tc, vc, link, picked):
        """Every set of ready ops, each in one mode, that fits beside the running ones (cores are
        only ever added, so a set that overflows a limit is cut as soon as it does)."""
        if j == len(ready):
            yield picked
            return
        yield from starts(ready, j + 1, tc, vc, link, picked)
        i = ready[j]
        for m in modes[i]:
            t, v, k = tc + m[1], vc + m[2], link + m[3]
            if t <= num_tc and v <= num_vc and k <= 1:
                yield from starts(ready, j + 1, t, v, k, picked + ((i, m),))

    done0, started0 = settle(0, 0)
    frontier = {(done0, started0, ())}
    seen = set(frontier)
    for t in range(max_steps):
        for done, _, _ in frontier:
            if done == full:
                return t
        nxt = set()
        for done, started, running in frontier:
            used = [0, 0, 0]
            for _, m, _ in running:
                for k in range(3):
                    used[k] += m[1 + k]
            ready = [i for i in range(n) if not (started >> i) & 1 and preds[i] & done == preds[i]]
            for pick in starts(ready, 0, *used, ()):
                if not pick and not running:
                    continue  # idle with nothing running never helps
                st = started
                d = done
                still = []
                for i, m, rem in running:
                    if rem - 1 <= 0:
                        d |= 1 << i
                    else:
                        still.append((i, m, rem - 1))
                for i, m in pick:
                    st |= 1 << i
                    if m[0] - 1 <= 0:
                        d |= 1 << i
                    else:
                        still.append((i, m, m[0] - 1))
                d, st = settle(d, st)
                state = (d, st, tuple(sorted(still)))
                if state not in seen:  # reached earlier: the same rest of the problem, started later
                    seen.add(state)
                    nxt.add(state)
        frontier = nxt
    raise RuntimeError("oracle did not finish")
