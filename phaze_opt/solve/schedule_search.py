"""An exact depth-first branch and bound over decision points, for blocks the MIP cannot close.

Why a second exact method. On some chips the MIP's relaxation is far from the optimum in the
one place that matters: with two tensor cores whose split GEMMs are exactly twice as fast and
hundreds of vector cores whose split ops take microseconds, the optimum is decided by which vector
ops hide beside pairs of equal-length single-mode GEMMs, a matter of 1e-4 of the makespan that the
big-M relaxation cannot see (BENCHMARKS.md, "Per-layer scheduling"). Enumerating schedules directly,
with the MIP's incumbent as upper bound, proves many of these in seconds.

The search (a classic scheme for resource-constrained scheduling, e.g. Demeulemeester and
Herroelen, Management Science 38(12), 1992, adapted to our two modes and the one link):

- Semi-active schedules suffice. Shifting an op earlier while the schedule stays legal never
  lengthens it, and in a schedule where no op can shift, every op starts at 0 or when some op
  ends: a predecessor, or an op whose end frees the core, the split exclusivity or the link.
- Decision points are therefore time 0 and every end of an op. At each, every subset of the
  eligible ops (all predecessors done) is tried as the set that starts now, each op in each of its
  modes that fits beside the running ops and the subset: a split op only when no other compute
  op runs, a single-mode op only within the core counts and when no split op runs, a collective
  only when the link is free. Then time moves to the next end.
- Left-shift rule: an eligible op that would fit now, beside the chosen subset, in some mode, is
  not started in that mode at the next decision point. Nothing happens in between, so starting it
  now instead is legal and ends no later. An optimal schedule with the least sum of start times
  breaks no such rule, so the rule keeps an optimum.
- Bounds at a node (and, for the op alone, before trying a start: its end plus the longest tail
  after it): the latest end of a running op plus the longest tail after it; now plus the
  longest tail (fastest modes) of every eligible op; for each resource, now plus the core time still
  to come (running ops' remainders, and per op its cheaper mode: single-mode work over cores, or
  the split time during which every core is taken) over the cores; the link's remaining
  collectives. A node whose bound is not below the incumbent by more than 1e-9 (rounding) is cut.
- Memo: the remainder of the problem depends only on which ops are done, which run, in which mode
  and for how much longer, and which (op, mode) starts the left-shift rule forbids next. A node
  whose state was already explored at an earlier or equal time, under the same or fewer forbidden
  starts, is cut: everything below it is a later copy of what was searched.

A search that finishes proves its best schedule optimal (to 1e-9). One that runs out of time
proves nothing, but its incumbent is legal and may beat the MIP's.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from .schedule_instance import BlockView, Instance

REL_TOL = 1e-9  # a schedule must beat the incumbent by more than rounding to count
_CHECK_EVERY = 1024  # nodes between deadline checks
MEMO_MAX_STATES = 1_500_000  # ~0.5 GB; past it states are still looked up but no longer stored


@dataclass
class SearchResult:
    makespan: float  # of the best schedule known (the incumbent when the search found none better)
    start: dict  # op -> start, block-relative
    modes: dict  # op -> ran split
    complete: bool  # the search finished: `makespan` is optimal
    stats: dict = field(default_factory=dict)


class _Block:
    """The block's ops renumbered 0..k-1 in topological order, with the per-op facts the search reads."""

    def __init__(self, inst: Instance, view: BlockView):
        self.ops = list(view.ops)
        k = self.k = len(self.ops)
        local = {o: a for a, o in enumerate(self.ops)}
        self.T, self.V = inst.num_tc, inst.num_vc
        self.single = [inst.single[o] for o in self.ops]
        self.split = [inst.split[o] for o in self.ops]
        self.can_split = [inst.can_split[o] for o in self.ops]
        self.uses_tc = [inst.uses_tc[o] for o in self.ops]
        self.uses_vc = [inst.uses_vc[o] for o in self.ops]
        self.net = [inst.net[o] for o in self.ops]
        self.compute = [inst.compute[o] for o in self.ops]
        self.pred_mask = [0] * k
        succs: list[list[int]] = [[] for _ in range(k)]
        for o in self.ops:
            for p in view.preds[o]:
                self.pred_mask[local[o]] |= 1 << local[p]
                succs[local[p]].append(local[o])
        fastest = [min(self.single[a], self.split[a]) if self.can_split[a] else self.single[a] for a in range(k)]
        self.tail = [0.0] * k  # longest path from the start of a to the block's end, fastest modes
        for a in reversed(range(k)):
            self.tail[a] = fastest[a] + max((self.tail[b] for b in succs[a]), default=0.0)
        self.tail_after = [max((self.tail[b] for b in succs[a]), default=0.0) for a in range(k)]
        # Per op and resource, the least core time over cores its cheaper mode takes (in seconds).
        self.work_tc = [self._work(a, self.uses_tc[a], self.T) for a in range(k)]
        self.work_vc = [self._work(a, self.uses_vc[a], self.V) for a in range(k)]

    def _work(self, a: int, uses: bool, cores: int) -> float:
        if not self.compute[a]:
            return 0.0
        single = self.single[a] / cores if uses else 0.0
        return min(single, self.split[a]) if self.can_split[a] else single


def search_block(inst: Instance, view: BlockView, incumbent, deadline: float) -> SearchResult:
    """Improve on or prove the incumbent (makespan, start, modes) of one block (module docstring)."""
    t_begin = time.perf_counter()
    blk = _Block(inst, view)
    k, T, V = blk.k, blk.T, blk.V
    single, split, can_split = blk.single, blk.split, blk.can_split
    uses_tc, uses_vc, net, compute = blk.uses_tc, blk.uses_vc, blk.net, blk.compute
    pred_mask, tail, tail_after = blk.pred_mask, blk.tail, blk.tail_after
    work_tc, work_vc = blk.work_tc, blk.work_vc
    full = (1 << k) - 1
    best = {"ms": float(incumbent[0]), "plan": None}
    cut = [best["ms"] * (1.0 - REL_TOL)]
    counters = {"nodes": 0, "stopped": False}
    memo: dict = {}
    plan: dict = {}  # local op -> (start, split) along the current path

    def bound(t, running, eligible, rem_tc, rem_vc, rem_net) -> float:
        lb = t
        busy_tc = busy_vc = 0.0
        link_free = t
        for a, is_split, end in running:
            if end + tail_after[a] > lb:
                lb = end + tail_after[a]
            left = end - t
            if compute[a]:
                if is_split:
                    busy_tc += left
                    busy_vc += left
                else:
                    if uses_tc[a]:
                        busy_tc += left / T
                    if uses_vc[a]:
                        busy_vc += left / V
            elif end > link_free:
                link_free = end
        for a in eligible:
            if t + tail[a] > lb:
                lb = t + tail[a]
        return max(lb, t + busy_tc + rem_tc, t + busy_vc + rem_vc, link_free + rem_net)

    def node(t, done, running, forbid, rem_tc, rem_vc, rem_net):
        counters["nodes"] += 1
        if counters["nodes"] % _CHECK_EVERY == 1 and time.perf_counter() > deadline:
            counters["stopped"] = True
        if counters["stopped"]:
            return
        key = (done, tuple(sorted((a, s, end - t) for a, s, end in running)))
        seen = memo.get(key)
        if seen is not None:
            for t_seen, forbid_seen in seen:
                if t_seen <= t and forbid_seen & ~forbid == 0:
                    return
            seen.append((t, forbid))
        elif len(memo) < MEMO_MAX_STATES:  # the memo only prunes; a full one costs speed, not exactness
            memo[key] = [(t, forbid)]
        started = done
        for a, _, _ in running:
            started |= 1 << a
        eligible = [a for a in range(k) if not (started >> a) & 1 and pred_mask[a] & ~done == 0]
        if bound(t, running, eligible, rem_tc, rem_vc, rem_net) >= cut[0]:
            return
        tc_used = sum(1 for a, s, _ in running if compute[a] and not s and uses_tc[a])
        vc_used = sum(1 for a, s, _ in running if compute[a] and not s and uses_vc[a])
        split_on = any(compute[a] and s for a, s, _ in running)
        compute_on = any(compute[a] for a, _, _ in running)
        link_on = any(net[a] for a, _, _ in running)

        def fits_single(a, tcu, vcu, sp):
            return not sp and (not uses_tc[a] or tcu < T) and (not uses_vc[a] or vcu < V)

        def choose(idx, chosen, tcu, vcu, sp, cr, lk, r_tc, r_vc, r_net):
            if counters["stopped"]:
                return
            if idx == len(eligible):
                now_running = running + chosen
                if not now_running:
                    return  # nothing runs and nothing starts: no later decision point
                chosen_mask = 0
                for a, _, _ in chosen:
                    chosen_mask |= 1 << a
                nf = 0  # the left-shift rule for the next decision point
                for a in eligible:
                    if (chosen_mask >> a) & 1:
                        continue
                    if net[a]:
                        if not lk:
                            nf |= 1 << (2 * a)
                        continue
                    if fits_single(a, tcu, vcu, sp):
                        nf |= 1 << (2 * a)
                    if can_split[a] and not cr:
                        nf |= 1 << (2 * a + 1)
                t_next = min(end for _, _, end in now_running)
                finished = done
                rest = []
                for item in now_running:
                    if item[2] == t_next:
                        finished |= 1 << item[0]
                    else:
                        rest.append(item)
                if finished == full:
                    if t_next < cut[0]:
                        best["ms"] = t_next
                        best["plan"] = dict(plan)
                        cut[0] = t_next * (1.0 - REL_TOL)
                    return
                node(t_next, finished, rest, nf, r_tc, r_vc, r_net)
                return
            a = eligible[idx]
            if net[a]:
                if not lk and not (forbid >> (2 * a)) & 1 and t + single[a] + tail_after[a] < cut[0]:
                    plan[a] = (t, False)
                    choose(idx + 1, chosen + [(a, False, t + single[a])], tcu, vcu, sp, cr, True,
                           r_tc, r_vc, r_net - single[a])
                    del plan[a]
            else:
                if (can_split[a] and not cr and not (forbid >> (2 * a + 1)) & 1
                        and t + split[a] + tail_after[a] < cut[0]):
                    plan[a] = (t, True)
                    choose(idx + 1, chosen + [(a, True, t + split[a])], tcu, vcu, True, True, lk,
                           r_tc - work_tc[a], r_vc - work_vc[a], r_net)
                    del plan[a]
                if (fits_single(a, tcu, vcu, sp) and not (forbid >> (2 * a)) & 1
                        and t + single[a] + tail_after[a] < cut[0]):
                    plan[a] = (t, False)
                    choose(idx + 1, chosen + [(a, False, t + single[a])], tcu + uses_tc[a], vcu + uses_vc[a],
                           sp, True, lk, r_tc - work_tc[a], r_vc - work_vc[a], r_net)
                    del plan[a]
            choose(idx + 1, chosen, tcu, vcu, sp, cr, lk, r_tc, r_vc, r_net)  # a waits

        choose(0, [], tc_used, vc_used, split_on, compute_on, link_on, rem_tc, rem_vc, rem_net)

    # Recursion depth: at most 2k decision points, each nesting at most k + 1 subset choices.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 2 * k * (k + 2) + 200))
    try:
        node(0.0, 0, [], 0, sum(work_tc), sum(work_vc), sum(single[a] for a in range(k) if net[a]))
    finally:
        sys.setrecursionlimit(limit)
    stats = {"nodes": counters["nodes"], "states": len(memo), "search_s": time.perf_counter() - t_begin,
             "complete": not counters["stopped"], "improved": best["plan"] is not None}
    if best["plan"] is None:
        _, start, modes = incumbent
        return SearchResult(float(incumbent[0]), dict(start), dict(modes), not counters["stopped"], stats)
    start = {blk.ops[a]: s for a, (s, _) in best["plan"].items()}
    modes = {blk.ops[a]: bool(m) for a, (_, m) in best["plan"].items()}
    return SearchResult(best["ms"], start, modes, not counters["stopped"], stats)
