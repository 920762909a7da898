"""Lower bounds on the makespan of a per-layer schedule.

All are sound for the semantics of `phaze_opt.solve.schedule.solver` (see its docstring). Each is taken
per series block (`instance`): blocks run one after another, so the bound of a problem is
the sum of its blocks' bounds, which is never below the bound of the whole graph at once.

- critical path: the longest path with every op at its fastest allowed latency;
- the link: collectives are serialised on one link, so the earliest any of them can start, plus
  all of their durations, plus the least time after the last one;
- the timeline bound. A split op excludes all other compute, so split intervals are disjoint from
  each other and from every single-mode compute interval. With x_i = 1 for split ops and T_ns the
  time no split op runs, C >= sum(x_i split_i) + T_ns, and T_ns >= (single-mode TC work) / num_tc,
  T_ns >= (single-mode VC work) / num_vc. For any weight lam in [0, 1],
  T_ns >= lam * TC-work / num_tc + (1 - lam) * VC-work / num_vc, so
      C >= sum_i min(split_i, lam * a_i + (1 - lam) * b_i)
  with a_i = single_i / num_tc for TC users (else 0) and b_i = single_i / num_vc for VC users (else
  0); the minimum picks the cheaper mode of each op and stays valid whatever modes the optimum
  uses. The right side is concave in lam, so its maximum lies at lam = 0, 1 or a point where some
  op's two terms are equal; we evaluate all of them. (lam = 1 alone is "TC work over TC cores".)
- the idle-chain bound (`idle_chain_bound`): core time over cores plus the idle time that a chain
  of ops forces when too few ops can run beside them.
"""

from __future__ import annotations

import math

from .instance import BlockView, Instance, block_view, longest_heads, longest_tails, max_antichain, prepare
from .types import ScheduleProblem


def _best_durations(inst: Instance) -> list[float]:
    return [inst.best(i) for i in range(inst.n)]


def critical_path(inst: Instance, view: BlockView, dur) -> float:
    head = longest_heads(view, dur)
    return max((head[i] + dur[i] for i in view.ops), default=0.0)


def link_bound(inst: Instance, view: BlockView, dur) -> float:
    nets = [i for i in view.ops if inst.net[i]]
    if not nets:
        return 0.0
    head = longest_heads(view, dur)
    tail = longest_tails(view, dur)
    return min(head[i] for i in nets) + sum(dur[i] for i in nets) + min(tail[i] for i in nets)


def timeline_bound(inst: Instance, view: BlockView) -> float:
    terms = []  # (split or None, a_i, b_i)
    for i in view.ops:
        if not inst.compute[i]:
            continue
        a = inst.single[i] / inst.num_tc if inst.uses_tc[i] else 0.0
        b = inst.single[i] / inst.num_vc if inst.uses_vc[i] else 0.0
        terms.append((inst.split[i] if inst.can_split[i] else None, a, b))
    if not terms:
        return 0.0
    lams = {0.0, 1.0}
    for s, a, b in terms:
        # s = lam * a + (1 - lam) * b  <=>  lam = (s - b) / (a - b)
        if s is not None and a != b:
            lam = (s - b) / (a - b)
            if 0.0 < lam < 1.0:
                lams.add(lam)

    def value(lam: float) -> float:
        total = 0.0
        for s, a, b in terms:
            w = lam * a + (1.0 - lam) * b
            total += w if s is None else min(s, w)
        return total

    return max(value(lam) for lam in sorted(lams))


def idle_width(inst: Instance, i: int, uses, cap: int) -> int:
    """Cores of one resource (num `cap`, users `uses`) that must idle while op i runs in single
    mode: only users incomparable with i can run beside it, and at one instant those form an
    antichain. A collective overlaps split ops, which occupy every core, so it counts only when no
    op incomparable with it can split. 0 when nothing is forced."""
    if inst.net[i]:
        if any(inst.compute[j] and inst.can_split[j] and inst.unordered(i, j) for j in inst.real):
            return 0
        u = 0
    elif inst.compute[i]:
        u = int(uses[i])
    else:
        return 0
    others = [j for j in inst.real if inst.compute[j] and uses[j] and inst.unordered(i, j)]
    width = max_antichain(others, inst.desc) if len(others) > cap - u else len(others)
    return max(0, cap - u - width)


def idle_chain_bound(inst: Instance, view: BlockView) -> float:
    """Core time over cores, plus the idle time a chain of ops forces (see `idle_width`): for each
    resource with k cores, k C >= sum_i min over modes of (core time of i [+ forced idle if i is
    on the chain P]); ops of a chain run at disjoint times, so their idle times add. P is the
    chain with the largest gain: the critical path with the gains as durations."""
    best = 0.0
    for cap, uses in ((inst.num_tc, inst.uses_tc), (inst.num_vc, inst.uses_vc)):
        if cap < 1 or not any(inst.compute[i] and uses[i] for i in view.ops):
            continue
        base, gain = 0.0, {}
        for i in view.ops:
            if not (inst.compute[i] or inst.net[i]):
                continue
            split_cost = inst.split[i] if inst.compute[i] and inst.can_split[i] else math.inf
            u = int(inst.compute[i] and uses[i])
            plain = min(split_cost, u * inst.single[i] / cap) if inst.compute[i] else 0.0
            base += plain
            g = idle_width(inst, i, uses, cap)
            if g:
                gain[i] = min(split_cost, (u + g) * inst.single[i] / cap) - plain
        best = max(best, base + critical_path(inst, view, {i: gain.get(i, 0.0) for i in view.ops}))
    return best


def block_bounds(inst: Instance, view: BlockView) -> dict:
    """Every bound of one block, by name, in seconds."""
    dur = _best_durations(inst)
    return {
        "critical_path": critical_path(inst, view, dur),
        "link": link_bound(inst, view, dur),
        "timeline": timeline_bound(inst, view),
        "idle_chain": idle_chain_bound(inst, view),
    }


def block_lower_bound(inst: Instance, view: BlockView) -> float:
    return max(block_bounds(inst, view).values())


def lower_bound(problem: ScheduleProblem) -> float:
    """The best of the bounds above, summed over series blocks, in seconds."""
    inst = prepare(problem)
    return sum(block_lower_bound(inst, block_view(inst, b)) for b in inst.blocks)
