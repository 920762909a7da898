"""Exact device placement: pipeline stages, TP width and data-parallel degree for one design.

The cost model is defined once, in `placement.evaluate` (read its docstring first); this module finds
the placement that minimises its time per batch, and every answer is re-evaluated by that
independent evaluator before it is returned.

Search space: every allowed TP width t; every number of stages S (1 <= S <= layers); every data-
parallel degree d with S*t*d <= accelerators; every split of the layer DAG into S stages that are
differences of downsets D_0 = {} < D_1 < ... < D_S = all layers (for a chain: contiguous ranges).
Each stage uses exactly t devices per replica, so unlike the published DP (Wang et al., ICML 2024)
we carry no device dimension: a stage count S already fixes the devices a pipeline uses.

The DP. Rows are the downsets D (layers placed in earlier stages), ordered by size. With k the
position from the end, f_k(D) is the least bottleneck with which the layers outside D can be split
into k stages, the first of them at position k:

    f_0(all) = 0,   f_k(D) = min over downsets D' > D of max(c_k(D, D'), f_{k-1}(D')),

where c_k is the stage time (recompute's extra forward for k > 1, receives on the pipeline link) and
infinite when the stage does not fit HBM at position k. One sweep k = 1..K gives the best split for
every S at once: f_S({}). All TP widths share the rows (the layer graph is the same), so they
are swept together as one batch.

Memory makes the position matter: the stage at position k holds min(k, m) microbatches, and m
depends on d. Only the smallest d of each distinct m can be optimal (the same pipeline, and the
least all-reduce, since the system configs guarantee the intra-node link is not the slower one),
or the smallest whose ring has more members per node and so a faster link (`kernel.ring_degrees`);
on a torus, whose rings can grow faster with d (`System.dp_ring_link`), every d is tried.
For S <= m the cap never binds, so one uncapped sweep serves all those (S, d) pairs. A pair with
S > m needs a capped sweep (continued from row k = m of the uncapped one); its value lies between
the uncapped sweep's and the "loosest" sweep's (one microbatch per stage), so where those two
agree, or where the loosest cannot beat the best time found so far, no capped sweep is run.
The pipeline link depends on S only through "does one replica fit in a node" (see
`phaze_opt.system`), so there are at most two sweeps, one per link.

Exactness with two max-terms. Time per batch = (m + S - 1) * C + AR(d) * G + AR0(d), with C the
bottleneck stage time and G the largest stage's gradient bytes. Minimising C alone is not exact: a
split with a slightly slower bottleneck but a smaller largest stage can win on the all-reduce. We
use epsilon-constraints on G: sweep with stages restricted to gradient bytes < x, get for every
(S, d) pair the least C and the G of that split, then lower x to the largest G still of interest.
Any split whose largest stage lies in [G_i, x_i) is dominated by the one found at step i (C no
smaller, G no smaller), so every Pareto-optimal (C, G) of every pair is met on the way. A pair
drops out when its C is infinite, when its G equals the least any S-stage split can have
(max(largest layer, total / S)), or when even that least G cannot beat the best time found so far
(C only grows as x falls). The tests check this against brute force over every placement.

Costs: per sweep step one gather, one max and one argmin over widths x rows x candidate stages; a
chain's candidate stages are limited to the longest one that fits HBM and to the rows and lengths
that leave a layer for every later stage, so a 98-layer GPT-3 on 1024 devices with 4 TP widths
takes about ten milliseconds (benchmarks/bench_placement.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from ...errors import PhazeError
from .evaluate import format_bytes, fsdp_exposed_s, ring_allreduce_s
from .kernel import (
    INF,
    Best,
    StageStack,
    checked_by_evaluator,
    epsilon_sweeps,
    layer_terms,
    min_memory_needed,
    p2p_exposed_share,
    node_divisors,
    ring_links,
    stage_fit,
    stage_stack,
    state_bytes,
    sweep,
    sweep_start,
    walk,
)
from .types import (Placement, PlacementProblem, PlacementResult, gather_bytes, infeasible_result,
                    optimizer_pass_bytes, reduce_bytes, state_split, weight_copies)

NO_FIT_CHECK = 8  # groups the general search sweeps without a fitting placement before it asks whether any fits


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------


def _dp_degrees(problem: PlacementProblem, t: int) -> tuple[np.ndarray, np.ndarray]:
    """(d, m) for the smallest d of each distinct microbatch count m, d <= accelerators // t.

    m(d) = ceil(B / (mbs d)) = ceil(n / d) with n = ceil(B / mbs) takes at most 2 sqrt(n) values, and
    the next smaller one starts at d = ceil(n / (m - 1)); walking those never touches the other d, so
    the cost does not grow with the accelerator count. The smallest d wins because a larger one
    only lengthens the ring on a link no faster (`System.dp_link`), unless it has more ring members
    per node: the first multiple in the run of each divisor of a node's devices is kept too
    (`kernel.ring_degrees`' rule, applied here to each run's bounds so no d in between is listed).
    On a torus a larger ring can span more torus lines and run faster (`System.dp_ring_link`), so
    there every d is tried.
    """
    top = problem.system.accelerators // t
    n = -(-problem.system.global_batch // problem.training.mbs)
    if problem.system.torus is not None:
        ds = np.arange(1, top + 1, dtype=np.int64)
        return ds, -(-n // ds)
    ds, ms = [], []
    d = 1
    while d <= top:
        m = -(-n // d)
        ds.append(d)
        ms.append(m)
        if m == 1:
            break
        d = -(-n // (m - 1))
    # each run [d_i, d_{i+1}) of one m: its first d and the first multiple of each divisor of a node
    ends = ds[1:] + [top + 1]
    divisors = node_divisors(problem.system.devices_per_node)
    runs = [(sorted({lo, *(-(-lo // k) * k for k in divisors)}), end, m) for lo, end, m in zip(ds, ends, ms)]
    ds = [d for found, end, _ in runs for d in found if d < end]
    ms = [m for found, end, m in runs for d in found if d < end]
    return np.array(ds, dtype=np.int64), np.array(ms, dtype=np.int64)


@dataclass
class _Pairs:
    """Every (TP width, stages S, replicas d) worth scoring, as flat arrays."""

    block: np.ndarray  # index into the stack's widths
    S: np.ndarray
    d: np.ndarray
    m: np.ndarray
    hop: np.ndarray  # 1: the pipeline uses the intra-node link
    cap: np.ndarray  # m when m < S (memory caps at m in flight), else 0
    multiplier: np.ndarray  # m + S - 1
    ring_bw: np.ndarray
    ring_lat: np.ndarray
    g_floor: np.ndarray  # least largest-stage gradient bytes of any S-stage split
    step_rate: float = 0.0  # optimizer step seconds per gradient byte of a stage

    def allreduce(self, G: np.ndarray) -> np.ndarray:
        """The per-batch tail of the stage with the largest gradient G: its all-reduce plus its
        optimizer step (both grow with the stage's parameters, so the largest stage is slowest)."""
        steps = 2.0 * (self.d - 1)
        with np.errstate(invalid="ignore"):
            ar = np.where(self.d > 1, steps * self.ring_lat + steps / self.d * G / self.ring_bw, 0.0)
            return ar + G * self.step_rate if self.step_rate else ar


def _pairs(problem: PlacementProblem, costs) -> _Pairs:
    system = problem.system
    N = system.accelerators
    dpn = system.devices_per_node
    parts = {k: [] for k in ("block", "S", "d", "m", "g_floor")}
    for b, c in enumerate(costs):
        t = c.tp
        ds, ms = _dp_degrees(problem, t)
        counts = np.minimum(c.n_layers, N // (t * ds))
        S = np.concatenate([np.arange(1, n + 1) for n in counts]).astype(np.int64)
        total = float(np.sum(c.params)) * reduce_bytes(problem)  # the bytes the all-reduce moves
        largest = float(np.max(c.params)) * reduce_bytes(problem)
        parts["block"].append(np.full(S.shape, b, dtype=np.int64))
        parts["S"].append(S)
        parts["d"].append(np.repeat(ds, counts))
        parts["m"].append(np.repeat(ms, counts))
        parts["g_floor"].append(np.maximum(largest, total / S))
    block, S, d, m, g_floor = (np.concatenate(parts[k]) for k in ("block", "S", "d", "m", "g_floor"))
    t = np.array([c.tp for c in costs], dtype=np.int64)[block]
    # The link rules of phaze_opt.system, vectorised (the evaluator calls the methods themselves).
    rings = ring_links(system, t, S, d, problem.training.shard_group)
    return _Pairs(
        block=block,
        S=S,
        d=d,
        m=m,
        hop=(dpn % (S * t) == 0).astype(np.int64),
        cap=np.where(m < S, m, 0),
        multiplier=(m + S - 1).astype(np.float64),
        ring_bw=rings.bandwidth(),
        ring_lat=rings.latency(),
        g_floor=g_floor,
        step_rate=_step_rate(problem),
    )


def step_per_param(problem: PlacementProblem, d):
    """HBM bytes per parameter of a stage's per-batch optimizer work over d replicas with no expert
    split (`types.optimizer_pass_bytes`: the step sharded from ZeRO-1 on, the gradient zeroing
    from ZeRO-2 on)."""
    step_b, zero_b = optimizer_pass_bytes(problem)
    zero = problem.training.zero
    d = problem.training.shard_ranks(d)  # HSDP: each replica steps its group's shard
    return step_b / (d if zero else 1) + zero_b / (d if zero >= 2 else 1)


def _step_rate(problem: PlacementProblem) -> float:
    """Optimizer step seconds per reduced gradient byte (fast path, no ZeRO; `stage_stack`'s `grad`
    holds the bytes the all-reduce moves, `types.reduce_bytes`): the per-batch HBM traffic of
    every parameter of the stage (`types.optimizer_pass_bytes`, both parts whole) over the HBM bandwidth."""
    if problem.hbm_bandwidth <= 0:
        return 0.0
    return sum(optimizer_pass_bytes(problem)) / reduce_bytes(problem) / problem.hbm_bandwidth


def _search(problem: PlacementProblem, costs, force_dag: bool, stats: dict) -> Best:
    system = problem.system
    best = Best()
    st = stage_stack(problem, costs, force_dag)
    pairs = _pairs(problem, costs)
    links = {0: system.inter_node, 1: system.intra_node}
    fixed = system.efficiency.microbatch_overhead_s
    times = {h: st.stage_time(links[h], 1, fixed) for h in (0, 1) if np.any(pairs.hop == h)}
    x = np.full(len(costs), INF)  # per width: candidate stages must have gradient bytes < x
    active = np.ones(pairs.S.shape[0], dtype=bool)
    floor_allreduce = pairs.allreduce(pairs.g_floor)
    while np.any(active):
        stats["sweeps"] = stats.get("sweeps", 0) + 1
        C = np.full(active.shape[0], INF)  # least bottleneck with largest-stage gradient < x
        G = np.full(active.shape[0], INF)  # the largest-stage gradient of that split
        drop = np.zeros(active.shape[0], dtype=bool)  # pairs proven unable to win
        walkers: dict = {}  # pair group -> arg_at(k) for rebuilding its split

        def consider(idx: np.ndarray) -> None:
            """Score the pairs idx (C and G known) and keep the best as the incumbent."""
            if idx.size == 0:
                return
            with np.errstate(invalid="ignore"):
                total = C[idx] * pairs.multiplier[idx] + pairs.allreduce(G)[idx]
            i = int(np.argmin(total))
            if total[i] < best.time:
                pair = int(idx[i])
                b = int(pairs.block[pair])
                key = (int(pairs.hop[pair]), b, int(pairs.cap[pair]))
                best.time = float(total[i])
                best.tp = costs[b].tp
                best.dp = int(pairs.d[pair])
                best.stages = walk(st, walkers.get(key) or walkers[key[:2]], int(pairs.S[pair]))

        capped_groups = []
        for h, (time1, time2) in times.items():
            sel = active & (pairs.hop == h)
            if not np.any(sel):
                continue
            blocks = np.unique(pairs.block[sel])
            pos = np.searchsorted(blocks, pairs.block)
            allowed = st.grad[blocks] < x[blocks][:, None, None]
            c1 = np.where(allowed & (st.kmax[blocks] >= 1), time1[blocks], INF)
            c2 = np.where(allowed, time2[blocks], INF)
            kmax = st.kmax[blocks]

            def uncapped(k, cut, cols, c1=c1, c2=c2, kmax=kmax):
                if k == 1:
                    return c1[:, :cut, :cols]
                return np.where(kmax[:, :cut, :cols] >= k, c2[:, :cut, :cols], INF)

            free = sweep(st, blocks, uncapped, 1, int(np.max(pairs.S[sel])), *sweep_start(st, len(blocks)))
            for p, b in enumerate(blocks.tolist()):
                walkers[(h, b)] = lambda k, free=free, p=p: free.arg[k - 1, p]
            idx = np.flatnonzero(sel)
            C[idx] = free.f[pairs.S[idx] - 1, pos[idx], 0]
            G[idx] = free.g[pairs.S[idx] - 1, pos[idx], 0]
            consider(np.flatnonzero(sel & (pairs.cap == 0)))
            capped_sel = sel & (pairs.cap > 0)
            if not np.any(capped_sel):
                continue
            # A pair with m < S holds at most m microbatches per stage: its memory lies between
            # the uncapped sweep's and one microbatch per stage (the loosest). Where those two
            # agree, so does the capped one; where even the loosest cannot win, drop the pair.
            loose_c2 = np.where(kmax >= 1, c2, INF)
            loosest = sweep(
                st, blocks, lambda k, cut, cols: (c1 if k == 1 else loose_c2)[:, :cut, :cols], 1,
                int(np.max(pairs.S[capped_sel])), *sweep_start(st, len(blocks)),
            )
            idx = np.flatnonzero(capped_sel)
            low = loosest.f[pairs.S[idx] - 1, pos[idx], 0]
            same = low == C[idx]
            consider(idx[same])
            rest = idx[~same]
            lows = np.full(active.shape[0], INF)
            lows[rest] = low[~same]
            for b, mc in sorted(set(zip(pairs.block[rest].tolist(), pairs.cap[rest].tolist()))):
                part = rest[(pairs.block[rest] == b) & (pairs.cap[rest] == mc)]
                p = int(np.searchsorted(blocks, b))
                capped_groups.append((h, b, mc, p, part, lows, free, kmax, c2))
        # The capped sweeps, most promising first, each only while it can still beat the incumbent.
        def promise(group):
            part, lows = group[4], group[5]
            with np.errstate(invalid="ignore"):
                return float(np.min(lows[part] * pairs.multiplier[part] + floor_allreduce[part]))

        for group in sorted(capped_groups, key=promise):
            h, b, mc, p, part, lows, free, kmax, c2 = group
            with np.errstate(invalid="ignore"):
                hopeless = lows[part] * pairs.multiplier[part] + floor_allreduce[part] >= best.time
            drop[part[hopeless]] = True
            part = part[~hopeless]
            C[part] = INF
            if part.size == 0:
                continue
            cost = np.where(kmax[p : p + 1] >= mc, c2[p : p + 1], INF)
            sw = sweep(
                st, np.array([b]), lambda k, cut, cols, cost=cost: cost[:, :cut, :cols], mc + 1,
                int(np.max(pairs.S[part])), free.f[mc - 1, p : p + 1], free.g[mc - 1, p : p + 1],
            )
            walkers[(h, b, mc)] = lambda k, sw=sw, free=free, p=p, mc=mc: (
                sw.arg[k - sw.k0, 0] if k > mc else free.arg[k - 1, p]
            )
            C[part] = sw.f[pairs.S[part] - (mc + 1), 0, 0]
            G[part] = sw.g[pairs.S[part] - (mc + 1), 0, 0]
            consider(part)
        with np.errstate(invalid="ignore"):
            bound = C * pairs.multiplier + floor_allreduce
        active &= ~drop & np.isfinite(C) & (bound < best.time) & (G > pairs.g_floor)
        for b in np.unique(pairs.block[active]):
            x[b] = float(np.max(G[active & (pairs.block == b)]))
    return best


# --------------------------------------------------------------------------------------------
# The general search: ZeRO, overlapped reduction or interleaving
# --------------------------------------------------------------------------------------------


def _half(nbytes, d: int, link) -> np.ndarray:
    """Ring reduce-scatter / all-gather of nbytes per device over d replicas (placement.evaluate)."""
    if d <= 1:
        return np.zeros_like(nbytes)
    with np.errstate(invalid="ignore"):
        return (d - 1) * link.latency + (d - 1) / d * nbytes / link.bandwidth


def zero3_exposed(st: StageStack, b: int, gather: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([1, R, W] forward, backward, all): the all-gather time each candidate stage of width b exposes per microbatch under
    ZeRO-3 with FSDP's prefetch (`placement.evaluate.fsdp_exposed_s`), forward and backward pass, from
    the per-layer gather times `gather` [L]. A chain stage [i, i + w] exposes
    g_i + sum_{j=i}^{i+w-1} (max(f_j, g_{j+1}) - f_j) forward and
    g_{i+w} + sum_{j=i+1}^{i+w} (max(b_j, g_{j-1}) - b_j) backward: window sums of per-pair terms; and the
    stage's gathers of one pass, g_i + ... + g_{i+w} (the link time they take)."""
    f, bw = st.layer_fwd[b], st.layer_bwd[b]
    L = st.n_layers
    R, W = st.dst.shape
    out = np.full((1, R, W), INF)
    out_b = np.full((1, R, W), INF)
    total = np.full((1, R, W), INF)
    if st.masks is None:
        pf = np.zeros(L)
        pf[:-1] = np.maximum(f[:-1], gather[1:]) - f[:-1]
        pb = np.zeros(L)
        pb[1:] = np.maximum(bw[1:], gather[:-1]) - bw[1:]

        def window(row):
            padded = np.concatenate([row, np.zeros(W)])
            return np.lib.stride_tricks.sliding_window_view(padded, W)[:L, :]

        wf, wb, wg = window(pf), window(pb), window(gather)
        fwd = wg[:, :1] + (np.cumsum(wf, axis=1) - wf)
        bwd = wg + (np.cumsum(wb, axis=1) - wb[:, :1])
        out[0, :L] = fwd
        out_b[0, :L] = bwd
        total[0, :L] = np.cumsum(wg, axis=1)
        return out, out_b, total
    for r in range(R - 1):
        for a in range(W):
            if int(st.dst[r, a]) >= R:
                continue
            members = st.members(r, a)
            g = [float(gather[v]) for v in members]
            out[0, r, a] = fsdp_exposed_s([float(f[v]) for v in members], g, reverse=False)
            out_b[0, r, a] = fsdp_exposed_s([float(bw[v]) for v in members], g, reverse=True)
            total[0, r, a] = sum(g)
    return out, out_b, total


def _general_groups(problem: PlacementProblem, costs, free: dict, v: int) -> dict:
    """The (width, d, links[, S]) groups of `_search_general`, each with its (lower bound, S,
    pipeline multiplier) items, least bound first; items whose bound is infinite are left out.

    Lower bounds on the time per batch of any placement of the item (exposed parts only: an overlap
    can hide the reductions): C x (m + (S - 1) / v) + tail, with C at least the memory-free least
    bottleneck (`free`) and, under ZeRO-3, at least the mean stage time, which is at least
    (all layers' work + 2 S gathers of P / S parameters) / S, since a ring all-gather's time is
    affine in its bytes (so the gathers of the S stages add up to S gathers of the mean stage); the
    tail at least the reduction and optimizer step of the mean stage (the largest is no smaller).
    Vectorised over every (d, S) of a width: a 1024-device system has thousands of them.
    """
    system = problem.system
    N, dpn = system.accelerators, system.devices_per_node
    w_b, g_b, o_b = state_split(problem)
    r_b = reduce_bytes(problem)  # on the data-parallel ring
    gw_b = gather_bytes(problem)
    L = costs[0].n_layers
    groups: dict = {}
    for b, c in enumerate(costs):
        t = c.tp
        total_params = float(np.sum(c.params))
        kept, _, rec = layer_terms(problem, c)
        kept_total = float(np.sum(kept))
        work_total = float(np.sum(c.fwd_s + c.bwd_s) + np.sum(rec))
        ds = np.arange(1, N // t + 1, dtype=np.int64)
        counts = np.minimum(L, N // (t * ds))
        d = np.repeat(ds, counts)
        S = np.concatenate([np.arange(1, k + 1) for k in counts]).astype(np.int64)
        m = -(-system.global_batch // (problem.training.mbs * d))
        ok = np.ones(d.shape, dtype=bool)
        if v > 1:  # Megatron's interleaving constraints (PlacementProblem.interleaves)
            ok = (S == 1) | (problem.training.interleave_split_ok(problem.interleave_layers, S) & (m % S == 0))
        h = (dpn % (S * t) == 0).astype(np.int64)
        rings = ring_links(system, t, S, d, problem.training.shard_group)
        mult = m + (S - 1) / v
        lat, bw = rings.latency(), rings.bandwidth()

        def half(nbytes, n=d, lat=lat, bw=bw):  # ring reduce-scatter / all-gather over n replicas (ring_half_s)
            return np.where(n > 1, (n - 1) * lat + (n - 1) / np.maximum(n, 1) * nbytes / bw, 0.0)

        # ZeRO-3's shard group (HSDP: the recipe's, which must divide d; else all d) and its ring
        gs = np.broadcast_to(np.asarray(problem.training.shard_ranks(d), dtype=np.int64), d.shape)
        shards = ring_links(system, t, S, gs) if problem.training.shard_group is not None else rings
        s_lat, s_bw = shards.latency(), shards.bandwidth()
        if problem.training.zero == 3:
            ok &= d % gs == 0

        big = total_params / S
        c_lb = np.where(h == 1, free[1].f[S - 1, b, 0], free[0].f[S - 1, b, 0])
        tail_lb = np.zeros(d.shape)
        if problem.training.zero == 3:
            # Each pass of a stage takes at least its compute and at least its layers' gathers (one
            # link, each layer waits for its own), and at least its compute plus its first layer's
            # gather (at least the smallest layer's); summed over the stages (max(0, x) is convex)
            # the mean stage is at least this.
            step_lat = np.where(gs > 1, (gs - 1) * s_lat, 0.0)
            gathers = L * step_lat + half(total_params * gw_b, gs, s_lat, s_bw) - step_lat
            f_total, b_total = float(np.sum(c.fwd_s)), float(np.sum(c.bwd_s) + np.sum(rec))
            passes = 2 if problem.training.reshard_after_forward else 1  # without resharding: forward only
            over = np.maximum(0.0, gathers - f_total) + (passes - 1) * np.maximum(0.0, gathers - b_total)
            first_last = passes * S * half(float(np.min(c.params)) * gw_b, gs, s_lat, s_bw)  # each pass's first shows
            # without overlap each stage also waits for its gradients' reduce-scatter (affine too)
            scatter = 0.0 if problem.training.overlap_grad_reduce else S * half(big * r_b, gs, s_lat, s_bw)
            c_lb = np.maximum(c_lb, (work_total + np.maximum(over, first_last) + scatter) / S)
            if not problem.training.overlap_grad_reduce:  # HSDP: the shards' all-reduce across the replicas
                tail_lb = 2.0 * half(big * r_b / gs, d // gs)
        elif problem.training.zero == 2:
            # every stage reduce-scatters its gradients each microbatch (affine in its parameters, so
            # the S stages' scatters add up to S of the mean stage's); the weights' all-gather
            # follows the optimizer step, hidden only by an overlapped param gather
            if not problem.training.overlap_grad_reduce:
                c_lb = np.maximum(c_lb, (work_total + S * half(big * r_b)) / S)
            if not problem.training.overlap_param_gather:
                tail_lb = half(big * gw_b)
        elif not problem.training.overlap_grad_reduce:
            # an overlapped param gather (ZeRO-1) may hide entirely: the reduce-scatter alone then
            gather_lb = 0.0 if problem.training.overlap_param_gather and problem.training.zero == 1 else half(
                big * (r_b if problem.training.zero == 0 else gw_b))
            tail_lb = half(big * r_b) + gather_lb
        if problem.hbm_bandwidth > 0:
            tail_lb = tail_lb + big * step_per_param(problem, d) / problem.hbm_bandwidth
        with np.errstate(invalid="ignore"):
            lb = (c_lb * mult + tail_lb) * (1.0 - 1e-12)  # slack against rounding: a bound, never above
        # Memory: the fullest stage holds at least the mean stage's state (linear bounds of the ZeRO
        # formulas) plus the in-flight activations of the least-loaded position (1F1B: one
        # microbatch at the last stage; interleaved: its min((v - 1) S + 1, m v) chunks of 1/v).
        k = weight_copies(problem)  # held whole by every rank under ZeRO 0, 1 and 2 (types.weight_copies)
        held = 0.0 if problem.training.reshard_after_forward else w_b + k  # ZeRO-3's gathered weights kept
        coef = {0: w_b + g_b + o_b + k, 1: w_b + g_b + k + o_b / d, 2: w_b + k + (g_b + o_b) / d,
                3: (w_b + g_b + o_b) / gs + held}[problem.training.zero]
        inflight = np.where((v > 1) & (S > 1), np.minimum((v - 1) * S + 1, m * v) / v, 1.0)
        mem_lb = (total_params * coef + inflight * kept_total) / S
        ok &= mem_lb * (1.0 - 1e-12) <= problem.hbm_bytes
        keep = np.flatnonzero(ok & np.isfinite(lb))
        s_key = np.where((v > 1) & (S > 1), S, 0)
        for i in keep[np.argsort(lb[keep], kind="stable")].tolist():
            key = (b, int(d[i]), int(h[i]), rings.links[int(rings.ids[i])], shards.links[int(shards.ids[i])],
                   int(s_key[i]))
            groups.setdefault(key, []).append((float(lb[i]), int(S[i]), float(mult[i])))
    return groups


def _search_general(problem: PlacementProblem, costs, force_dag: bool, stats: dict) -> Best:
    """Exact search when memory or the per-batch tail depends on the replica count d (ZeRO,
    overlapped reduction) or the in-flight count on the stage count S (interleaving).

    Every (width, d) and the links S picks form groups; with v > 1 each S is its own group (its
    in-flight count depends on S). Within a group memory at position k is monotone in k, so "the
    stage fits at position k" is kmax >= k with the microbatch cap folded into kmax, and the
    per-batch tail of a stage (exposed reduction + optimizer step, seconds) is a per-stage number
    whose maximum adds to the pipeline time: the epsilon-constraint on it (as in `_search`, with the
    tail in place of the gradient bytes) is exact. Groups are visited by a lower bound (the
    memory-free bottleneck x the pipeline multiplier) and skipped once that cannot beat the best.
    """
    system = problem.system
    N = system.accelerators
    v = problem.training.virtual_stages
    w_b, g_b, o_b = state_split(problem)
    r_b = reduce_bytes(problem)  # on the data-parallel ring
    gw_b = gather_bytes(problem)
    st = stage_stack(problem, costs, force_dag)
    links = {0: system.inter_node, 1: system.intra_node}
    fixed = system.efficiency.microbatch_overhead_s
    # With overlapped point-to-point a stage's time depends on S (p2p_exposed_share): the sweeps that
    # order the groups take the least of it (share 0), each group its own S's.
    overlap = 0.0 if problem.training.overlaps_p2p and v > 1 else None
    times = {h: st.stage_time(links[h], v, fixed, overlap)[1] for h in (0, 1)}
    L = st.n_layers
    T = len(costs)
    blocks = np.arange(T)
    tops = [min(L, N // c.tp) for c in costs]
    free = {h: sweep(st, blocks, lambda k, cut, cols, h=h: times[h][:, :cut, :cols], 1, max(tops),
                      *sweep_start(st, T)) for h in (0, 1)}
    groups = _general_groups(problem, costs, free, v)
    order = sorted(groups.items(), key=lambda kv: kv[1][0][0])
    best = Best()
    valid = np.isfinite(st.grad)
    for (b, d, h, ring, shard, S_only), items in order:
        if items[0][0] >= best.time:  # groups come by their least bound: none after this one can win
            break
        items = [x for x in items if x[0] < best.time]
        stats["groups"] = stats.get("groups", 0) + 1
        if stats["groups"] == NO_FIT_CHECK and not math.isfinite(best.time):
            # Many groups and no placement that fits yet: when even the least memory any placement
            # needs (a lower bound under ZeRO and interleaving) exceeds HBM, none will.
            need = min_memory_needed(problem, force_dag)
            stats["min_memory"] = need
            if need[0] > problem.hbm_bytes:
                return best
        m = problem.microbatches(d)
        sl = slice(b, b + 1)
        params, acts, workmax, bwdwin = st.params[sl], st.acts[sl], st.workmax[sl], st.bwdwin[sl]
        params0 = np.where(valid[sl], params, 0.0)
        beside = 0.0  # ZeRO-2/3: the exposed part of each microbatch's data-parallel collectives
        tail = np.zeros(params.shape)
        hide_gather = problem.training.zero in (1, 2) and problem.training.overlap_param_gather
        if problem.training.zero == 2:  # each microbatch's reduce-scatter (placement.evaluate)
            scatter = _half(params0 * r_b, d, ring)
            if problem.training.overlap_grad_reduce:  # beside that microbatch's backward
                scatter = np.maximum(0.0, scatter - bwdwin)
            beside = scatter
        if problem.training.zero == 3:
            g = problem.training.shard_ranks(d)  # HSDP: gathers and reduce-scatters within its group
            scatter = _half(params0 * r_b, g, shard)
            gather = _half(st.layer_params[b] * gw_b, g, shard)
            exposed_f, exposed_b, busy = zero3_exposed(st, b, gather)
            if not problem.training.reshard_after_forward:  # held from the forward: no backward gather
                exposed_b, busy = np.zeros_like(exposed_b), np.zeros_like(busy)
            if problem.training.overlap_grad_reduce:  # beside the backward pass, on the link its gathers leave
                with np.errstate(invalid="ignore"):  # padding (inf - inf) is masked with the invalid stages
                    scatter = np.maximum(0.0, scatter + busy - (bwdwin + exposed_b))
            beside = exposed_f + exposed_b + scatter
            if g < d:  # HSDP: the shards all-reduced across the d / g replicas once per batch
                with np.errstate(invalid="ignore"):
                    reduce = 2.0 * _half(params0 * r_b / g, d // g, ring)
                if problem.training.overlap_grad_reduce:
                    reduce = (np.zeros_like(reduce) if problem.reduction_hidden
                              else np.maximum(0.0, reduce - np.where(valid[sl], bwdwin, 0.0)))
                tail = tail + reduce
        else:
            if problem.training.zero == 0:
                with np.errstate(invalid="ignore"):
                    reduce = np.where(d > 1, 2 * (d - 1) * ring.latency + 2 * (d - 1) / d * (params0 * r_b) / ring.bandwidth, 0.0)
            elif problem.training.zero == 2:  # reduce-scattered per microbatch already
                reduce = np.zeros(params0.shape)
            elif hide_gather:
                reduce = _half(params0 * r_b, d, ring)
            else:
                reduce = _half(params0 * r_b, d, ring) + _half(params0 * gw_b, d, ring)
            if problem.training.overlap_grad_reduce:
                reduce = (np.zeros_like(reduce) if problem.reduction_hidden
                          else np.maximum(0.0, reduce - np.where(valid[sl], bwdwin, 0.0)))
            if hide_gather:  # under the next iteration's forward (placement_eval)
                gather = _half(params0 * gw_b, d, ring)
                reduce = reduce + (np.zeros_like(reduce) if problem.reduction_hidden
                                   else np.maximum(0.0, gather - np.where(valid[sl], st.fwdwin[sl], 0.0)))
            elif problem.training.zero == 2:  # after the optimizer step, with nothing beside it
                reduce = reduce + _half(params0 * gw_b, d, ring)
            tail = tail + reduce
        if problem.hbm_bandwidth > 0:
            tail = tail + params0 * step_per_param(problem, d) / problem.hbm_bandwidth
        tail = np.where(valid[sl], tail, INF)
        share = p2p_exposed_share(problem, S_only, m)
        time_g = times[h][sl] + beside if share is None else st.stage_time(links[h], v, fixed, share, sl, beside)[1]
        state = state_bytes(problem, params0, d)
        kmax = stage_fit(state, acts, workmax, valid[sl], problem.hbm_bytes, S_only, v, m)
        time_g = np.where(valid[sl] & (kmax >= 1), time_g, INF)
        active = {S: mult for _, S, mult in items}
        # The least largest-stage tail an S-stage split can have: the optimizer step, and without
        # overlap the reduction, grow with the stage's parameters (affine in them), and the largest
        # stage holds at least max(P / S, the largest layer); an overlapped reduction can be 0.
        floor = {}
        c = costs[b]
        for S in active:
            p = np.float64(max(float(np.sum(c.params)) / S, float(np.max(c.params))))
            red = 0.0  # ZeRO-3 reduces per microbatch; an overlapped reduction may hide entirely
            if problem.training.zero == 0 and not problem.training.overlap_grad_reduce:
                red = float(ring_allreduce_s(p * r_b, d, ring.bandwidth, ring.latency))
            elif problem.training.zero == 1 and not problem.training.overlap_grad_reduce:
                # an overlapped param gather may hide entirely: only the reduce-scatter then
                red = float(_half(p * r_b, d, ring) + (0.0 if hide_gather else _half(p * gw_b, d, ring)))
            elif problem.training.zero == 2 and not hide_gather:  # the gather after the step
                red = float(_half(p * gw_b, d, ring))
            step = p * step_per_param(problem, d) / problem.hbm_bandwidth \
                if problem.hbm_bandwidth > 0 else 0.0
            floor[S] = (red + step) * (1.0 - 1e-12)

        def record(stages, tp=costs[b].tp, d=d):
            best.tp, best.dp, best.stages = tp, d, stages

        epsilon_sweeps(st, stats, tail, kmax, time_g, {S: (mult, floor[S]) for S, mult in active.items()}, best, record)
    return best


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def optimal_dense_placement(problem: PlacementProblem, *, force_dag: bool = False) -> PlacementResult:
    """The placement with the least time per batch, checked by the independent evaluator.

    Never raises for a design that cannot run: the result is then infeasible, with the least memory
    any placement needs against the HBM. `force_dag` runs the general downset DP even on a chain
    (for testing the two against each other).
    """
    start = time.perf_counter()
    system = problem.system
    stats: dict = {}
    method = "dp-chain" if (problem.costs[0].is_chain() and not force_dag) else "dp-dag"
    costs = [c for c in problem.costs if c.tp <= system.accelerators]
    if not costs:
        return infeasible_result(
            problem,
            f"every TP width ({', '.join(map(str, problem.tp_widths))}) exceeds the {system.accelerators} accelerators",
            method=method,
            min_memory_bytes=INF,
            solve_s=time.perf_counter() - start,
        )
    search = _search if problem.simple else _search_general
    best = search(problem, costs, force_dag, stats)
    if not math.isfinite(best.time):
        need, where = stats.get("min_memory") or min_memory_needed(problem, force_dag)
        reason = (
            f"no placement fits in HBM: the smallest memory any placement needs is {format_bytes(need)} per "
            f"device (tp {where.get('tp')}, pp {where.get('pp')}, dp {where.get('dp')}), more than the "
            f"{format_bytes(problem.hbm_bytes)} of HBM"
        )
        return infeasible_result(
            problem, reason, method=method, min_memory_bytes=need, solve_s=time.perf_counter() - start,
            info={"sweeps": stats.get("sweeps", 0), "min_memory_at": where},
        )
    result = checked_by_evaluator(problem, Placement(best.tp, best.dp, best.stages), best.time, method, "placement DP")
    result.solve_s = time.perf_counter() - start
    result.info = {"sweeps": stats.get("sweeps", 0), "dp_time_per_batch_s": best.time}
    return result


def _minmax_split(weights: np.ndarray, parts: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous split into `parts` non-empty ranges: least largest sum, then least sum of squares."""
    n = weights.shape[0]
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    seg = prefix[None, :] - prefix[:, None]  # seg[i, j] = sum of weights[i:j]
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    seg = np.where(valid, seg, INF)
    # Least bottleneck: g[k][i] = best for weights[i:] in k parts.
    g = np.full(n + 1, INF)
    g[n] = 0.0
    for _ in range(parts):
        g = np.min(np.maximum(seg, g[None, :]), axis=1)
    limit = g[0] * (1 + 1e-12) + 1e-300
    # Least sum of squares among splits within the bottleneck.
    sq = np.where(seg <= limit, seg * seg, INF)
    h = np.full(n + 1, INF)
    h[n] = 0.0
    choices = []
    for _ in range(parts):
        vals = sq + h[None, :]
        choices.append(np.argmin(vals, axis=1))
        h = np.min(vals, axis=1)
    stages = []
    i = 0
    for k in range(parts, 0, -1):
        j = int(choices[k - 1][i])
        stages.append(tuple(range(i, j)))
        i = j
    return tuple(stages)


def even_placement(problem: PlacementProblem, tp: int, pp: int, dp: int, balance: str = "time") -> Placement:
    """A given tp x pp x dp with the layers (in their topological numbering) split evenly.

    balance="time": contiguous stages whose largest forward + backward time is least, and among
    those the most even (least sum of squared stage times); for a transformer this puts the
    embedding with the first decoder layers and the head with the last, as Megatron does.
    balance="layers": equal layer counts, the first (layers mod pp) stages one layer longer.
    """
    costs = problem.costs_for(tp)
    n = costs.n_layers
    for key, value in (("tp", tp), ("pp", pp), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise PhazeError(f"placement: {key} must be a positive integer, got {value!r}")
    if pp > n:
        raise PhazeError(f"placement: pp {pp} is more than the {n} layers")
    if balance == "time":
        stages = _minmax_split(costs.fwd_s + costs.bwd_s, pp)
    elif balance == "layers":
        size, extra = divmod(n, pp)
        stages, start = [], 0
        for s in range(pp):
            length = size + (1 if s < extra else 0)
            stages.append(tuple(range(start, start + length)))
            start += length
        stages = tuple(stages)
    else:
        raise PhazeError(f"placement: balance must be time or layers, got {balance!r}")
    return Placement(tp, dp, stages)
