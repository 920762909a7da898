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

Speed. The hardest benchmark blocks (llama2-7b backward, 44 timed ops) take 2-3 M nodes, most of
them cut by the memo rather than by the bound; in Python that was 13 us a node and up to 40 s a
block. The search is therefore compiled with numba (`_search`, the same algorithm node for node:
the compiled and the former Python search visit the same number of nodes and states on these
blocks), about 20 times faster. The memo key keeps up to MEMO_SLOTS running ops; a node with more
is not memoised, which costs speed only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from numba import njit, objmode, types
from numba.typed import Dict

from ... import interrupt
from .instance import BlockView, Instance, block_view, prepare
from .types import ScheduleProblem

REL_TOL = 1e-9  # a schedule must beat the incumbent by more than rounding to count
_CHECK_EVERY = 1024  # nodes between deadline checks
MEMO_MAX_STATES = 1_500_000  # past it states are still looked up but no longer stored
MEMO_SLOTS = 8  # running ops a memo key holds; a node with more running is not memoised
SEARCH_MAX_OPS = 62  # ops are bits of an int64
_KEY = types.UniTuple(types.int64, 3 + MEMO_SLOTS)  # done, running, running split, remaining times (bits)


@dataclass
class SearchResult:
    makespan: float  # of the best schedule known (the incumbent when the search found none better)
    start: dict  # op -> start, block-relative
    modes: dict  # op -> ran split
    complete: bool  # the search finished: `makespan` is optimal
    stats: dict = field(default_factory=dict)


class _Block:
    """The block's ops renumbered 0..k-1 in topological order, with the per-op facts the search reads."""

    def __init__(self, inst: Instance, view: BlockView, modes: dict | None = None):
        self.ops = list(view.ops)
        k = self.k = len(self.ops)
        local = {o: a for a, o in enumerate(self.ops)}
        self.T, self.V = inst.num_tc, inst.num_vc
        self.single = [inst.single[o] for o in self.ops]
        self.split = [inst.split[o] for o in self.ops]
        self.can_split = [inst.can_split[o] for o in self.ops]
        self.no_single = [False] * k
        if modes is not None:  # a restricted problem: op o only split (True), only single (False) or free (None)
            self.no_single = [self.can_split[a] and modes.get(o) is True for a, o in enumerate(self.ops)]
            self.can_split = [self.can_split[a] and modes.get(o) is not False for a, o in enumerate(self.ops)]
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
        if self.no_single[a]:
            return self.split[a]
        return min(single, self.split[a]) if self.can_split[a] else single


def search_block(inst: Instance, view: BlockView, incumbent, deadline: float, modes: dict | None = None,
                 target: float = 0.0) -> SearchResult:
    """Improve on or prove the incumbent (makespan, start, modes) of one block (module docstring).

    With `modes` (op -> split), only schedules that run every op in that mode are searched: a
    heuristic, whose `complete` proves nothing about the block. The search stops early once it
    finds a schedule no longer than `target` (then `complete` is False)."""
    t_begin = time.perf_counter()
    blk = _Block(inst, view, modes)
    if blk.k > SEARCH_MAX_OPS:
        raise ValueError(f"the search takes blocks of at most {SEARCH_MAX_OPS} ops, not {blk.k}")
    F = np.array([blk.single, blk.split, blk.tail, blk.tail_after, blk.work_tc, blk.work_vc], dtype=np.float64)
    I = np.array([blk.can_split, blk.uses_tc, blk.uses_vc, blk.net, blk.compute, blk.no_single], dtype=np.int64)
    pred_mask = np.array(blk.pred_mask, dtype=np.int64)
    with interrupt.polled() as stop:  # a stop request ends the search at its next deadline check
        ms, best_t, best_m, found, stopped, nodes, states = _search(
            F, I, pred_mask, blk.T, blk.V, float(incumbent[0]), float(deadline), int(MEMO_MAX_STATES), float(target),
            np.frombuffer(stop.flag, dtype=np.uint8))
    stats = {"nodes": int(nodes), "states": int(states), "search_s": time.perf_counter() - t_begin,
             "complete": not stopped, "improved": bool(found)}
    if not found:
        _, start, modes = incumbent
        return SearchResult(float(incumbent[0]), dict(start), dict(modes), not stopped, stats)
    start = {o: float(best_t[a]) for a, o in enumerate(blk.ops)}
    modes = {o: bool(best_m[a]) for a, o in enumerate(blk.ops)}
    return SearchResult(float(ms), start, modes, not stopped, stats)


_WARM = [False]


def ensure_warm() -> None:
    """Load the compiled kernel once per process (`warm_up`), so that a search's time limit is not
    spent loading it."""
    if not _WARM[0]:
        warm_up()


def warm_up() -> float:
    """Compile the kernel (or load it from numba's on-disk cache) now, so that the first real search
    is timed without it; returns the seconds it took."""
    t0 = time.perf_counter()
    inst = prepare(ScheduleProblem(units=("tc", "vc"), single=(2.0, 1.0), split=(1.0, 0.5), edges=(), num_tc=2, num_vc=2))
    view = block_view(inst, inst.blocks[0])
    search_block(inst, view, (3.0, {0: 0.0, 1: 2.0}, {0: False, 1: False}), float("inf"))
    _WARM[0] = True
    return time.perf_counter() - t0


# --- compiled kernel -------------------------------------------------------------------------------
# Everything below runs under numba (nopython, compiled once and cached on disk beside this file).
# Ops are bits of int64 masks, so a block has at most SEARCH_MAX_OPS ops. Static per-op facts come as
# rows of F (floats) and I (ints). The search is a loop over an explicit stack of frames rather than
# recursion: numba cannot reload a cached recursive function safely.

_F_SINGLE, _F_SPLIT, _F_TAIL, _F_TAIL_AFTER, _F_WORK_TC, _F_WORK_VC = range(6)
_I_CAN_SPLIT, _I_USES_TC, _I_USES_VC, _I_NET, _I_COMPUTE, _I_NO_SINGLE = range(6)
# per decision level of the subset enumeration: cores in use, split running, compute running, link busy,
# ops chosen so far, the option tried for this level's op (0 split, 1 single, 2 wait)
_L_TCU, _L_VCU, _L_SP, _L_CR, _L_LK, _L_NCH, _L_CHOICE = range(7)


@njit(cache=True)
def _now() -> float:
    with objmode(t="float64"):
        t = time.perf_counter()
    return t


@njit(cache=True)
def _fits_single(a, tcu, vcu, sp, uses_tc, uses_vc, T, V):
    return sp == 0 and (uses_tc[a] == 0 or tcu < T) and (uses_vc[a] == 0 or vcu < V)


@njit(cache=True)
def _search(F, I, pred_mask, T, V, incumbent, deadline, memo_max, target, stop):
    """The whole depth-first search, iterative: frame `depth` is one decision point, and its subset
    enumeration resumes at level `fr_j[depth]` when the child below it returns. It also ends when
    `stop[0]` turns 1 (a stop request, `interrupt.polled`; the signal's handler runs inside `_now`)."""
    single, split, tail, tail_after = F[_F_SINGLE], F[_F_SPLIT], F[_F_TAIL], F[_F_TAIL_AFTER]
    work_tc, work_vc = F[_F_WORK_TC], F[_F_WORK_VC]
    can_split, uses_tc, uses_vc, net, compute = I[_I_CAN_SPLIT], I[_I_USES_TC], I[_I_USES_VC], I[_I_NET], I[_I_COMPUTE]
    no_single = I[_I_NO_SINGLE]
    k = F.shape[1]
    full = (1 << k) - 1
    best_ms = incumbent
    cut = incumbent * (1.0 - REL_TOL)
    nodes = 0
    stopped = False
    found = False
    levels = k + 2
    # Frame d's running ops are run_*[d, :nrun[d]]; the ops its enumeration starts follow them, so
    # the next decision point reads one list.
    run_op = np.zeros((levels, k + 1), dtype=np.int64)
    run_mode = np.zeros((levels, k + 1), dtype=np.int64)
    run_end = np.zeros((levels, k + 1))
    nrun = np.zeros(levels, dtype=np.int64)
    elig = np.zeros((levels, k + 1), dtype=np.int64)
    lv_i = np.zeros((levels, k + 2, 7), dtype=np.int64)
    lv_f = np.zeros((levels, k + 2, 3))
    fr_t = np.zeros(levels)
    fr_done = np.zeros(levels, dtype=np.int64)
    fr_flo = np.zeros(levels, dtype=np.int64)
    fr_fhi = np.zeros(levels, dtype=np.int64)
    fr_m = np.zeros(levels, dtype=np.int64)
    fr_j = np.zeros(levels, dtype=np.int64)
    plan_t = np.zeros(k)
    plan_m = np.zeros(k, dtype=np.int64)
    best_t = np.zeros(k)
    best_m = np.zeros(k, dtype=np.int64)
    memo = Dict.empty(key_type=_KEY, value_type=types.int64)
    cap = 2 * memo_max + 16
    pool_t = np.empty(cap)
    pool_lo = np.empty(cap, dtype=np.int64)
    pool_hi = np.empty(cap, dtype=np.int64)
    pool_next = np.empty(cap, dtype=np.int64)
    n_pool = 0
    kf = np.zeros(MEMO_SLOTS)
    ki = kf.view(np.int64)
    rem_tc = 0.0
    rem_vc = 0.0
    rem_net = 0.0
    for a in range(k):
        rem_tc += work_tc[a]
        rem_vc += work_vc[a]
        if net[a]:
            rem_net += single[a]
    depth = 0
    entering = True
    # frame 0: time 0, nothing done, nothing running, nothing forbidden
    fr_t[0], fr_done[0], fr_flo[0], fr_fhi[0], nrun[0] = 0.0, 0, 0, 0, 0
    lv_f[0, 0, 0], lv_f[0, 0, 1], lv_f[0, 0, 2] = rem_tc, rem_vc, rem_net
    while depth >= 0:
        t, done, flo, fhi, nr = fr_t[depth], fr_done[depth], fr_flo[depth], fr_fhi[depth], nrun[depth]
        if entering:
            entering = False
            nodes += 1
            if nodes % _CHECK_EVERY == 1 and (_now() > deadline or stop[0] != 0):
                stopped = True
            if stopped:
                break
            # Memo. The key holds the running ops in op order; a node with more of them than the key
            # has slots is simply not memoised (the memo only prunes).
            if nr <= MEMO_SLOTS:
                rm = 0
                sm = 0
                for r in range(nr):
                    rm |= 1 << run_op[depth, r]
                for s in range(MEMO_SLOTS):
                    kf[s] = 0.0
                s = 0
                for a in range(k):
                    if (rm >> a) & 1:
                        for r in range(nr):
                            if run_op[depth, r] == a:
                                kf[s] = run_end[depth, r] - t
                                if run_mode[depth, r]:
                                    sm |= 1 << a
                        s += 1
                key = (done, rm, sm, ki[0], ki[1], ki[2], ki[3], ki[4], ki[5], ki[6], ki[7])
                head = memo[key] if key in memo else -1
                dominated = False
                if head >= 0:
                    r = head
                    while r >= 0:
                        if pool_t[r] <= t and (pool_lo[r] & ~flo) == 0 and (pool_hi[r] & ~fhi) == 0:
                            dominated = True
                            break
                        r = pool_next[r]
                    if not dominated and n_pool < cap:
                        pool_t[n_pool], pool_lo[n_pool], pool_hi[n_pool], pool_next[n_pool] = t, flo, fhi, head
                        memo[key] = n_pool
                        n_pool += 1
                elif len(memo) < memo_max and n_pool < cap:
                    pool_t[n_pool], pool_lo[n_pool], pool_hi[n_pool], pool_next[n_pool] = t, flo, fhi, -1
                    memo[key] = n_pool
                    n_pool += 1
                if dominated:
                    depth -= 1
                    continue
            started = done
            for r in range(nr):
                started |= 1 << run_op[depth, r]
            m = 0
            for a in range(k):
                if not (started >> a) & 1 and (pred_mask[a] & ~done) == 0:
                    elig[depth, m] = a
                    m += 1
            fr_m[depth] = m
            # bound
            lb = t
            busy_tc = 0.0
            busy_vc = 0.0
            link_free = t
            tcu = vcu = sp = cr = lk = 0
            for r in range(nr):
                a = run_op[depth, r]
                end = run_end[depth, r]
                if end + tail_after[a] > lb:
                    lb = end + tail_after[a]
                left = end - t
                if compute[a]:
                    cr = 1
                    if run_mode[depth, r]:
                        sp = 1
                        busy_tc += left
                        busy_vc += left
                    else:
                        tcu += uses_tc[a]
                        vcu += uses_vc[a]
                        if uses_tc[a]:
                            busy_tc += left / T
                        if uses_vc[a]:
                            busy_vc += left / V
                else:
                    lk = 1
                    if end > link_free:
                        link_free = end
            for j in range(m):
                a = elig[depth, j]
                if t + tail[a] > lb:
                    lb = t + tail[a]
            r_tc, r_vc, r_net = lv_f[depth, 0, 0], lv_f[depth, 0, 1], lv_f[depth, 0, 2]
            lb = max(lb, t + busy_tc + r_tc, t + busy_vc + r_vc, link_free + r_net)
            if lb >= cut:
                depth -= 1
                continue
            # Every subset of the eligible ops, each in every mode that fits, as the set starting
            # now: a depth-first walk over levels j = 0..m, level j deciding eligible op j.
            lv_i[depth, 0, _L_TCU], lv_i[depth, 0, _L_VCU], lv_i[depth, 0, _L_SP] = tcu, vcu, sp
            lv_i[depth, 0, _L_CR], lv_i[depth, 0, _L_LK], lv_i[depth, 0, _L_NCH] = cr, lk, 0
            lv_i[depth, 0, _L_CHOICE] = -1
            fr_j[depth] = 0
        m = fr_m[depth]
        j = fr_j[depth]
        descend = False
        while j >= 0:
            tcu, vcu, sp = lv_i[depth, j, _L_TCU], lv_i[depth, j, _L_VCU], lv_i[depth, j, _L_SP]
            cr, lk, nch = lv_i[depth, j, _L_CR], lv_i[depth, j, _L_LK], lv_i[depth, j, _L_NCH]
            if j == m:
                j -= 1
                if nr + nch == 0:
                    continue  # nothing runs and nothing starts: no later decision point
                chosen_mask = 0
                for c in range(nr, nr + nch):
                    chosen_mask |= 1 << run_op[depth, c]
                nlo = 0  # the left-shift rule for the next decision point
                nhi = 0
                for jj in range(m):
                    a = elig[depth, jj]
                    if (chosen_mask >> a) & 1:
                        continue
                    if net[a]:
                        if not lk:
                            nlo |= 1 << a
                        continue
                    if not no_single[a] and _fits_single(a, tcu, vcu, sp, uses_tc, uses_vc, T, V):
                        nlo |= 1 << a
                    if can_split[a] and not cr:
                        nhi |= 1 << a
                t_next = np.inf
                for r in range(nr + nch):
                    if run_end[depth, r] < t_next:
                        t_next = run_end[depth, r]
                finished = done
                n2 = 0
                for r in range(nr + nch):
                    if run_end[depth, r] == t_next:
                        finished |= 1 << run_op[depth, r]
                    else:
                        run_op[depth + 1, n2], run_mode[depth + 1, n2], run_end[depth + 1, n2] = (
                            run_op[depth, r], run_mode[depth, r], run_end[depth, r])
                        n2 += 1
                if finished == full:
                    if t_next < cut:
                        best_ms = t_next
                        cut = t_next * (1.0 - REL_TOL)
                        found = True
                        for a in range(k):
                            best_t[a], best_m[a] = plan_t[a], plan_m[a]
                        if best_ms <= target:
                            stopped = True
                    continue
                d = depth + 1
                fr_t[d], fr_done[d], fr_flo[d], fr_fhi[d], nrun[d] = t_next, finished, nlo, nhi, n2
                lv_f[d, 0, 0], lv_f[d, 0, 1], lv_f[d, 0, 2] = lv_f[depth, m, 0], lv_f[depth, m, 1], lv_f[depth, m, 2]
                descend = True
                break
            a = elig[depth, j]
            o = lv_i[depth, j, _L_CHOICE] + 1
            while o < 2:
                if o == 0:
                    if (not net[a] and can_split[a] and not cr and not (fhi >> a) & 1
                            and t + split[a] + tail_after[a] < cut):
                        break
                elif not (flo >> a) & 1 and not no_single[a] and t + single[a] + tail_after[a] < cut:
                    if net[a]:
                        if not lk:
                            break
                    elif _fits_single(a, tcu, vcu, sp, uses_tc, uses_vc, T, V):
                        break
                o += 1
            if o > 2:
                j -= 1  # every option of this op tried: back to the previous level
                continue
            lv_i[depth, j, _L_CHOICE] = o
            r_tc, r_vc, r_net = lv_f[depth, j, 0], lv_f[depth, j, 1], lv_f[depth, j, 2]
            if o == 0:
                run_op[depth, nr + nch], run_mode[depth, nr + nch], run_end[depth, nr + nch] = a, 1, t + split[a]
                plan_t[a], plan_m[a] = t, 1
                nch += 1
                sp = 1
                cr = 1
                r_tc -= work_tc[a]
                r_vc -= work_vc[a]
            elif o == 1:
                run_op[depth, nr + nch], run_mode[depth, nr + nch], run_end[depth, nr + nch] = a, 0, t + single[a]
                plan_t[a], plan_m[a] = t, 0
                nch += 1
                if net[a]:
                    lk = 1
                    r_net -= single[a]
                else:
                    tcu += uses_tc[a]
                    vcu += uses_vc[a]
                    cr = 1
                    r_tc -= work_tc[a]
                    r_vc -= work_vc[a]
            j += 1
            lv_i[depth, j, _L_TCU], lv_i[depth, j, _L_VCU], lv_i[depth, j, _L_SP] = tcu, vcu, sp
            lv_i[depth, j, _L_CR], lv_i[depth, j, _L_LK], lv_i[depth, j, _L_NCH] = cr, lk, nch
            lv_i[depth, j, _L_CHOICE] = -1
            lv_f[depth, j, 0], lv_f[depth, j, 1], lv_f[depth, j, 2] = r_tc, r_vc, r_net
        fr_j[depth] = j
        if descend:
            depth += 1
            entering = True
        else:
            depth -= 1
    return best_ms, best_t, best_m, found, stopped, nodes, len(memo)
