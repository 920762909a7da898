"""An independent exact scheduler for small problems with integer latencies (test oracle).

It shares no code with phaze_opt.solve. With integer latencies some optimal schedule starts every
op at an integer time (shift any op left until it starts at 0 or at some op's end: the ops running
just before that start are a subset of those running at it, so no limit is broken), so a
breadth-first search over integer time steps is exact. The state at time t is the set of finished
ops and the running ops with their modes and remaining time; at each step every set of ready ops,
in every allowed mode, that fits beside the running ones may start. The first step at which a
state has every op finished is the optimal makespan.

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
    preds = [set() for _ in range(n)]
    for a, b in edges:
        preds[b].add(a)
    modes = [_modes(units[i], int(single[i]), int(split[i]), num_tc, num_vc) for i in range(n)]
    full = (1 << n) - 1

    def settle(done: int, started: int) -> tuple[int, int]:
        """Ops with a zero-time mode finish the moment they are ready (they occupy nothing)."""
        changed = True
        while changed:
            changed = False
            for i in range(n):
                bit = 1 << i
                if started & bit or any(not (done >> p) & 1 for p in preds[i]):
                    continue
                if any(m[0] == 0 for m in modes[i]):
                    done |= bit
                    started |= bit
                    changed = True
        return done, started

    done0, started0 = settle(0, 0)
    frontier = {(done0, started0, ())}
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
            ready = [i for i in range(n) if not (started >> i) & 1 and all((done >> p) & 1 for p in preds[i])]
            choices = []
            for i in ready:
                choices.append([None] + list(modes[i]))
            for pick in itertools.product(*choices) if choices else [()]:
                u = list(used)
                new = list(running)
                st = started
                ok = True
                for i, m in zip(ready, pick):
                    if m is None:
                        continue
                    for k in range(3):
                        u[k] += m[1 + k]
                    new.append((i, m, m[0]))
                    st |= 1 << i
                if u[0] > num_tc or u[1] > num_vc or u[2] > 1 or not new:
                    continue
                d = done
                still = []
                for i, m, rem in new:
                    if rem - 1 <= 0:
                        d |= 1 << i
                    else:
                        still.append((i, m, rem - 1))
                d, st = settle(d, st)
                nxt.add((d, st, tuple(sorted(still))))
        frontier = nxt
    raise RuntimeError("oracle did not finish")
