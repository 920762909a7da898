"""Exact placement with expert parallelism (EP) and context parallelism (CP) as further dimensions.

The cost model is `placement_eval`'s (its docstring, "Expert parallelism e and context parallelism
c"); this module finds the placement minimising it over every TP width t, CP width c, EP width e,
stage count S, data-parallel degree d (a multiple of e, t c S d <= accelerators) and split into
stages, and re-checks the answer with that independent evaluator, as `placement.optimal_placement`
does for TP/PP/DP alone. Problems without EP, CP or a load imbalance go to that DP unchanged.

How. For a fixed (c, e) every layer's time and memory terms are fixed numbers
(`effective_costs`: the all-to-alls, the extra ring-attention blocks and their exposed K/V
transfers, the routed experts' parameters over e, the c - 1 further attention cores), so the stage
costs are those of `placement`'s stacks over these per-layer arrays; what (c, e) adds is
per-stage: the gradient reduction of the dense parameters over d c ranks and of the routed experts
over d c / e, and ZeRO-1's sharding of each over its own group. As in `placement._search_general`,
each (t, d, pipeline link, ring link) is a group in which memory at position k is monotone in k
(kmax), and the per-batch tail of a stage (exposed reduction + optimizer step) is a per-stage
number whose maximum adds to the pipeline time: an epsilon-constraint on it is exact. Groups are
visited by a lower bound (the memory-free bottleneck x the pipeline multiplier) and skipped once it
cannot beat the best found.

Which d. Without ZeRO only the smallest multiple of e giving each distinct microbatch count m can
be optimal: memory does not depend on d, and a larger d only lengthens the rings (more ranks, a
link no faster). With ZeRO-1 memory falls as d grows, so every multiple of e is tried.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ..errors import PhazeError
from .placement import (
    _KMAX_CAP,
    INF,
    RTOL,
    _Best,
    _kmax,
    _stack,
    _start,
    _sweep,
    _walk,
    min_memory_needed,
)
from .placement import optimal_placement as dense_optimal_placement
from .placement_eval import evaluate_placement, format_bytes
from .placement_types import LayerCosts, Placement, PlacementProblem, PlacementResult, infeasible_result, state_split


def effective_costs(problem: PlacementProblem, lc: LayerCosts, e: int, c: int) -> LayerCosts:
    """The per-layer costs at EP width e and CP width c, vectorised (the evaluator adds the same
    terms layer by layer): times with the all-to-alls, the load imbalance and the ring attention,
    parameters with the routed experts over e, activations with the c - 1 further attention cores."""
    system = problem.system
    imb = problem.load_imbalance
    fwd = lc.fwd_s.copy()
    bwd = lc.bwd_s.copy()
    moe = (lc.expert_params > 0) | (lc.expert_fwd_s > 0)
    expert = lc.expert_params.copy()
    if np.any(moe):
        sizes, where = np.unique(lc.dispatch_bytes, return_inverse=True)
        a2a = np.array([system.alltoall_s(imb * b, e, lc.tp * c) for b in sizes])[where]
        fwd = np.where(moe, fwd + (imb - 1.0) * lc.expert_fwd_s + 2.0 * a2a, fwd)
        bwd = np.where(moe, bwd + (imb - 1.0) * lc.expert_bwd_s + 2.0 * a2a, bwd)
        expert = np.where(moe, np.ceil(expert / e), expert)
    core_bytes = lc.activation_bytes - lc.selective_bytes
    extra = np.zeros(lc.n_layers)
    if c > 1:
        link = system.cp_link(lc.tp, c)
        fwd = fwd + (c - 1) * lc.core_fwd_s
        bwd = bwd + (c - 1) * lc.core_bwd_s
        send = lc.kv_bytes > 0
        fwd = fwd + np.where(send, (c - 1) * np.maximum(0.0, link.latency + lc.kv_bytes / link.bandwidth - lc.core_fwd_s), 0.0)
        bwd = bwd + np.where(send, (c - 1) * np.maximum(0.0, link.latency + 2.0 * lc.kv_bytes / link.bandwidth - lc.core_bwd_s), 0.0)
        extra = (c - 1) * core_bytes
    zeros = np.zeros(lc.n_layers)
    # Every array below is finite, non-negative and whole where it must be (built from validated
    # ones by sums, ceilings and integer factors), so the copy skips LayerCosts' checks (speed).
    out = object.__new__(LayerCosts)
    out.__dict__.update(lc.__dict__)
    out.__dict__.update(
        fwd_s=fwd,
        bwd_s=bwd,
        params=lc.params - lc.expert_params + expert,
        expert_params=expert,
        activation_bytes=lc.activation_bytes + extra,
        full_work_bytes=lc.full_work_bytes + extra,
        selective_work_bytes=c * lc.selective_work_bytes,
        selective_s=c * lc.selective_s,
        # the arrays below only feed `effective_costs` itself; zero so nothing is added twice
        dispatch_bytes=zeros, expert_fwd_s=zeros, expert_bwd_s=zeros, core_fwd_s=zeros, core_bwd_s=zeros, kv_bytes=zeros,
        cp=1,
    )
    return out


def _stage_sums(st, per_layer: np.ndarray) -> np.ndarray:
    """[T, R, W] sums of a [T, L] per-layer array over each candidate stage of the stack."""
    T = per_layer.shape[0]
    R, W = st.dst.shape
    out = np.zeros((T, R, W))
    if st.masks is None:  # chain: stage (row r, column a) is layers r .. dst[r, a] - 1
        prefix = np.concatenate([np.zeros((T, 1)), np.cumsum(per_layer, axis=1)], axis=1)
        ends = np.minimum(st.dst, R - 1)
        out = prefix[:, ends] - prefix[:, np.arange(R)][:, :, None]
    else:
        for r in range(R):
            for a in range(W):
                if st.dst[r, a] < R:
                    out[:, r, a] = per_layer[:, list(st.members(r, a))].sum(axis=1)
    return np.where(np.isfinite(st.grad), out, 0.0)


def _ring_allreduce(nbytes, n: int, link):
    if n <= 1:
        return np.zeros_like(nbytes)
    steps = 2 * (n - 1)
    return steps * link.latency + steps / n * nbytes / link.bandwidth


def _ring_half(nbytes, n: int, link):
    if n <= 1:
        return np.zeros_like(nbytes)
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def _degrees(problem: PlacementProblem, top: int, e: int) -> list[int]:
    """The data-parallel degrees worth trying (the module docstring: "Which d")."""
    multiples = range(e, top + 1, e)
    if problem.zero:
        return list(multiples)
    out, seen = [], set()
    for d in multiples:
        m = problem.microbatches(d)
        if m not in seen:
            seen.add(m)
            out.append(d)
    return out


@dataclass
class _Prepared:
    """One (e, c): the stage stack of its effective costs, per-stage expert parameters, stage times
    per pipeline link, and every (width, d, S) with its lower bound, grouped."""

    e: int
    c: int
    costs: list
    st: object
    experts: np.ndarray
    times: dict
    groups: list  # [(min lower bound, (b, d, h, ring, S_only), (lbs, Ss, mults)), ...]
    free: dict = None  # the memory-free bounds it used


def _prepare(problem: PlacementProblem, costs: list, e: int, c: int, force_dag: bool, free=None) -> _Prepared | None:
    """The stack and the groups of one (e, c); the (width, d, S) items are enumerated with arrays.
    `free`: memory-free least bottlenecks [S - 1, width] per pipeline link to bound the groups with;
    those of (1, c) serve every e (EP only adds all-to-alls, so its stage times are no shorter) whose
    candidate stages they cover (`free["width"]`)."""
    system = problem.system
    N = system.accelerators
    dpn = system.devices_per_node
    v = problem.virtual_stages
    L = costs[0].n_layers
    T = len(costs)
    tops = [min(L, N // (lc.tp * c)) for lc in costs]
    if max(tops) < 1:
        return None
    st = _stack(problem, costs, force_dag)
    experts = _stage_sums(st, np.stack([lc.expert_params for lc in costs]))
    links = {0: system.inter_node, 1: system.intra_node}
    times = {h: st.stage_time(links[h], v)[1] for h in (0, 1)}
    # (1, c)'s bounds hold only if its candidate stages include these: a chain's stages are cut to
    # the longest that fits HBM, and EP, with fewer expert parameters per device, may fit longer ones.
    if free is None or free["width"] < st.dst.shape[1]:
        free = {h: _sweep(st, np.arange(T), lambda k, cut, cols, h=h: times[h][:, :cut, :cols], 1, max(tops),
                          *_start(st, T)).f[:, :, 0] for h in (0, 1)}  # [S - 1, b]
        free["width"] = st.dst.shape[1]
    n_seq = -(-system.global_batch // problem.mbs)
    groups = []
    for b, lc in enumerate(costs):
        w = lc.tp * c  # devices per stage and replica
        if N // w < 1:
            continue
        ds = np.array(_degrees(problem, N // w, e), dtype=np.int64)
        counts = np.minimum(L, N // (w * ds))
        keep = counts >= 1
        ds, counts = ds[keep], counts[keep]
        if ds.size == 0:
            continue
        d = np.repeat(ds, counts)
        S = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + 1
        m = -(-n_seq // d)
        if v > 1:  # Megatron's interleaving constraint (PlacementProblem.interleaves), vectorised
            ok = (S == 1) | ((problem.interleave_layers % (S * v) == 0) & (m % S == 0))
            d, S, m = d[ok], S[ok], m[ok]
        h = (dpn % (S * w) == 0).astype(np.int64)
        ring = (S * w * d <= dpn).astype(np.int64)
        mult = m + (S - 1) / v
        lb = np.where(h == 1, free[1][S - 1, b], free[0][S - 1, b]) * mult
        fin = np.isfinite(lb)
        d, S, h, ring, mult, lb = d[fin], S[fin], h[fin], ring[fin], mult[fin], lb[fin]
        s_only = np.where((v > 1) & (S > 1), S, 0)
        order = np.lexsort((lb, s_only, ring, h, d))
        keys = np.stack([d, h, ring, s_only], axis=1)[order]
        cut = np.flatnonzero(np.any(keys[1:] != keys[:-1], axis=1)) + 1
        for lo, hi in zip(np.concatenate([[0], cut]), np.concatenate([cut, [len(order)]])):
            if hi <= lo:
                continue
            idx = order[lo:hi]  # ascending lower bound within the group
            key = (b, int(d[idx[0]]), int(h[idx[0]]), int(ring[idx[0]]), int(s_only[idx[0]]))
            groups.append((float(lb[idx[0]]), key, (lb[idx], S[idx], mult[idx])))
    return _Prepared(e, c, costs, st, experts, times, groups, free)


def _search_all(problem: PlacementProblem, prepared: list, best: _Best, stats: dict) -> None:
    """Every group of every (e, c), least lower bound first, until none can beat the best."""
    order = sorted(((g[0], i, j) for i, prep in enumerate(prepared) for j, g in enumerate(prep.groups)))
    for lb, i, j in order:
        if lb >= best.time:
            break
        prep = prepared[i]
        _, key, (lbs, Ss, mults) = prep.groups[j]
        items = [(float(x), int(y), float(z)) for x, y, z in zip(lbs, Ss, mults) if x < best.time]
        _search_group(problem, prep, key, items, best, stats)


def _search_group(problem: PlacementProblem, prep: _Prepared, key: tuple, items: list, best: _Best, stats: dict):
    """One (width, d, links, S_only) group at fixed (e, c): the epsilon-constraint on the stage tail."""
    system = problem.system
    v = problem.virtual_stages
    w_b, g_b, o_b = state_split(system)
    e, c, st, experts, costs = prep.e, prep.c, prep.st, prep.experts, prep.costs
    valid = np.isfinite(st.grad)
    b, d, h, ring_intra, S_only = key
    items = [x for x in items if x[0] < best.time]
    if not items:
        return
    stats["groups"] = stats.get("groups", 0) + 1
    m = problem.microbatches(d)
    ring = system.intra_node if ring_intra else system.inter_node
    ranks, expert_ranks = d * c, max(1, d * c // e)
    sl = slice(b, b + 1)
    ok = valid[sl]
    params0 = np.where(ok, st.params[sl], 0.0)
    expert0 = experts[sl]
    dense0 = params0 - expert0
    acts, workmax, bwdwin = st.acts[sl], st.workmax[sl], st.bwdwin[sl]
    parts = [(dense0, ranks), (expert0, expert_ranks)] if e > 1 else [(params0, ranks)]
    reduce = np.zeros(params0.shape)
    for n_params, n_ranks in parts:
        if problem.zero == 0:
            r = _ring_allreduce(n_params * g_b, n_ranks, ring)
        else:
            r = _ring_half(n_params * g_b, n_ranks, ring) + _ring_half(n_params * w_b, n_ranks, ring)
        reduce = reduce + (np.where(n_params > 0, r, 0.0) if e > 1 else r)
    if problem.overlap_grad_reduce:  # wholly hidden in the bound's lower-bound mode (PlacementProblem.reduction_hidden)
        reduce = np.zeros_like(reduce) if problem.reduction_hidden else np.maximum(0.0, reduce - np.where(ok, bwdwin, 0.0))
    tail = reduce
    if problem.hbm_bandwidth > 0:
        per = w_b + g_b + 2 * o_b
        if problem.zero and e > 1:
            step = (dense0 / ranks + expert0 / expert_ranks) * per
        elif problem.zero:
            step = params0 * per / ranks
        else:
            step = params0 * per
        tail = tail + step / problem.hbm_bandwidth
    tail = np.where(ok, tail, INF)
    if problem.zero == 0:
        state = params0 * (w_b + g_b + o_b)
    elif e > 1:
        state = params0 * (w_b + g_b) + np.ceil(dense0 * o_b / ranks) + np.ceil(expert0 * o_b / expert_ranks)
    else:
        state = params0 * (w_b + g_b) + np.ceil(params0 * o_b / ranks)
    if S_only:  # interleaved: Megatron's in-flight chunk count at each position (placement_eval)
        fits = np.zeros(params0.shape, dtype=np.int64)
        for k in range(1, S_only + 1):
            chunks = min(2 * (k - 1) + (v - 1) * S_only + 1, m * v)
            mem = state + np.ceil(chunks * np.where(ok, acts, 0.0) / v) + np.where(ok, workmax, 0.0)
            fits += (mem <= problem.hbm_bytes) & (fits == k - 1)
        kmax = np.where(ok, fits, 0)
        kmax = np.where(kmax >= S_only, _KMAX_CAP, kmax)
    else:
        base = np.where(ok, state + acts + workmax, INF)
        kmax = _kmax(base, np.where(ok, acts, INF), problem.hbm_bytes)
        kmax = np.where(kmax >= m, _KMAX_CAP, kmax)
    time_g = np.where(ok & (kmax >= 1), prep.times[h][sl], INF)
    st_g = replace(st, grad=tail)
    active = {S: mult for _, S, mult in items}
    x = INF
    while active:
        stats["sweeps"] = stats.get("sweeps", 0) + 1
        allowed = tail < x

        def cost_at(k, cut, cols, allowed=allowed):
            return np.where(allowed[:, :cut, :cols] & (kmax[:, :cut, :cols] >= k), time_g[:, :cut, :cols], INF)

        sw = _sweep(st_g, np.array([0]), cost_at, 1, max(active), *_start(st, 1))
        nxt = {}
        for S, mult in active.items():
            C = float(sw.f[S - 1, 0, 0])
            G = float(sw.g[S - 1, 0, 0])
            if not math.isfinite(C):
                continue
            total = C * mult + G
            if total < best.time:
                best.time = total
                best.tp = costs[b].tp
                best.dp = d
                best.stages = _walk(st, lambda k, sw=sw: sw.arg[k - 1, 0], S)
                best.ep, best.cp = e, c
            if C * mult < best.time and G > 0:
                nxt[S] = (mult, G)
        active = {S: mg[0] for S, mg in nxt.items()}
        if active:
            x = max(mg[1] for mg in nxt.values())


def optimal_placement(problem: PlacementProblem, *, force_dag: bool = False) -> PlacementResult:
    """The placement with the least time per batch over TP, CP, EP, PP, DP and the stage split,
    checked by the independent evaluator; `placement.optimal_placement` when there is no EP/CP."""
    if not problem.parallel_dims:
        return dense_optimal_placement(problem, force_dag=force_dag)
    start = time.perf_counter()
    system = problem.system
    N = system.accelerators
    stats: dict = {}
    method = "dp-ep-cp"
    has_experts = any(np.any(lc.expert_params > 0) for lc in problem.costs)
    best = _Best()
    best.ep, best.cp = 1, 1
    if problem.zero == 3:  # only e = c = 1 (the evaluator refuses the rest): the dense DP on the effective costs
        plain = replace(problem, costs=tuple(effective_costs(problem, lc, 1, 1) for lc in problem.costs),
                        ep_widths=(1,), cp_widths=(1,), cp_costs=(), load_imbalance=1.0, training=None)
        found = dense_optimal_placement(plain, force_dag=force_dag)
        if found.feasible:
            best.time, best.tp, best.dp, best.stages = found.time_per_batch_s, found.tp, found.dp, found.placement().stages
    # Each (e, c), least ideal time first (every device busy, no bubble, no communication beyond the
    # layers' own: time per batch >= ceil(B / mbs) x t x c x W / N, W the layers' forward + backward
    # time per microbatch at (t, e, c)), prepared only while that bound can still beat the best.
    n_seq = -(-system.global_batch // problem.mbs)
    combos = []
    for c in problem.cp_widths if problem.zero != 3 else ():
        costs = [problem.costs_at(lc.tp, c) for lc in problem.costs if lc.tp * c <= N]
        for e in problem.ep_widths if costs else ():
            if e > 1 and not has_experts:
                continue
            eff = [effective_costs(problem, lc, e, c) for lc in costs]
            ideal = min(n_seq * lc.tp * c * float(np.sum(lc.fwd_s) + np.sum(lc.bwd_s)) / N for lc in eff)
            combos.append((ideal, c, e, eff))
    free_of: dict = {}  # c -> the memory-free bounds of (1, c), which come first in this order
    for ideal, c, e, eff in sorted(combos, key=lambda x: x[:3]):
        if ideal >= best.time:
            break
        prep = _prepare(problem, eff, e, c, force_dag, free_of.get(c))
        if prep is not None:
            free_of.setdefault(c, prep.free)
            _search_all(problem, [prep], best, stats)
    if not math.isfinite(best.time):
        need, where = min_memory_needed(problem, force_dag)
        reason = (
            f"no placement fits in HBM (expert and context parallelism searched too): without them the "
            f"smallest memory any placement needs is {format_bytes(need)} per device (tp {where.get('tp')}, "
            f"pp {where.get('pp')}, dp {where.get('dp')}), more than the {format_bytes(problem.hbm_bytes)} of HBM"
        )
        return infeasible_result(problem, reason, method=method, min_memory_bytes=need,
                                 solve_s=time.perf_counter() - start, info={"sweeps": stats.get("sweeps", 0)})
    placement = Placement(best.tp, best.dp, best.stages, best.ep, best.cp)
    result = evaluate_placement(problem, placement, method=method)
    if not result.feasible or abs(result.time_per_batch_s - best.time) > RTOL * best.time:
        raise RuntimeError(
            f"EP/CP placement DP disagrees with the evaluator: DP {best.time!r} s, evaluator "
            f"{result.time_per_batch_s!r} s ({result.reason or 'feasible'}) for {placement}"
        )
    result.solve_s = time.perf_counter() - start
    result.info = {"sweeps": stats.get("sweeps", 0), "groups": stats.get("groups", 0), "dp_time_per_batch_s": best.time}
    return result


def check_widths(name: str, value: int, allowed: tuple) -> int:
    """A fixed placement's ep or cp among the widths the model allows, or a one-line error."""
    if value not in allowed:
        raise PhazeError(f"placement {name}={value}: not allowed here; allowed: {', '.join(map(str, allowed))}")
    return value
