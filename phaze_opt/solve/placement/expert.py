"""Exact placement with expert parallelism (EP) and context parallelism (CP) as further dimensions.

The cost model is `placement.evaluate`'s (its docstring, "Expert parallelism e and context parallelism
c"); this module finds the placement minimising it over every TP width t, CP width c, EP width e,
stage count S, data-parallel degree d (one EP fits: a multiple of e, or with MoE parallel folding
one with e x ETP dividing t c d, `Training.data_step`; t c S d <= accelerators) and split into
stages, and re-checks the answer with that independent evaluator, as `dp.optimal_dense_placement`
does for TP/PP/DP alone. Problems without EP, CP or a load imbalance go to that DP unchanged.

How. For a fixed (c, e) every layer's time and memory terms are fixed numbers
(`effective_costs`: the all-to-alls, the extra ring-attention blocks and their exposed K/V
transfers, or all-gather CP's exposed K/V gathers and its gathered blocks on the working set, the
routed experts' parameters over e, the c - 1 further attention cores), so the stage
costs are those of `placement`'s stacks over these per-layer arrays; what (c, e) adds is
per-stage: the gradient reduction of the dense parameters over d c ranks and of the routed experts
over their EDP replicas (d c / e, or t c d / (e ETP) folded: `Training.expert_replicas`), and
ZeRO-1's and 2's sharding of each over its own group (ZeRO-2 also reduce-scatters per
microbatch, in the stage time). As in `dp._search_general`, each (t, d, pipeline link, ring
link) is a group in which memory at position k is monotone in k (kmax), and the per-batch tail
of a stage (exposed reduction + optimizer step) is a per-stage number whose maximum adds to the
pipeline time: an epsilon-constraint on it is exact.

Every (c, e, t) is a block of a stage stack (the layer graph is the same for all), so the
memory-free sweeps that bound the groups run once per stack and pipeline link for all its blocks
together; a chain's blocks are split into a few stacks by the longest stage each can fit
(`_prepare`), as a stack costs its widest block's width for every block. Every (block, d, S) gets a lower bound
(`_items`): the memory-free bottleneck x the pipeline multiplier, plus the tail of the mean stage
(the reduction and optimizer step are at least affine in a stage's dense and expert parameters,
and the largest of the S stages is at least their mean); items whose mean stage cannot fit HBM are
dropped. Groups are visited by their least bound over every block at once and skipped once it
cannot beat the best found; inside a group an S drops out once its bottleneck x multiplier plus
that tail floor cannot (`tests/test_expert_parallel_bounds.py` checks every bound against brute
force).

Which d. Without ZeRO only the smallest allowed d (a multiple of `Training.data_step`) giving each distinct microbatch count m can
be optimal, or the smallest whose ring has more members per node (`kernel.ring_degrees`): memory
does not depend on d, and a larger d only lengthens the rings (more ranks, a link no faster unless
more of them share a node's NICs). With ZeRO-1 or 2 memory falls as d grows, so every allowed d is tried; so it is on
a torus, where a larger ring can span more torus lines and run faster (`kernel.RingLinks`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from ...errors import PhazeError
from ...system import Link
from .dp import optimal_dense_placement, zero3_exposed
from .kernel import (
    INF,
    Best,
    chain_stack,
    chain_width,
    checked_by_evaluator,
    epsilon_sweeps,
    layer_terms,
    min_memory_needed,
    p2p_exposed_share,
    ring_degrees,
    ring_links,
    stage_fit,
    stage_stack,
    sweep,
    sweep_start,
)
from .evaluate import format_bytes
from .types import (LayerCosts, Placement, PlacementProblem, PlacementResult, gather_bytes, infeasible_result,
                    optimizer_pass_bytes, reduce_bytes, state_split, weight_copies)


def effective_costs(problem: PlacementProblem, lc: LayerCosts, e: int, c: int) -> LayerCosts:
    """The per-layer costs at EP width e and CP width c, vectorised (the evaluator adds the same
    terms layer by layer): times with the all-to-alls, the load imbalance and the ring attention,
    parameters with the routed experts over e, activations with the c - 1 further attention cores."""
    return effective_costs_at(problem, lc, c, (e,))[0]


def effective_costs_at(problem: PlacementProblem, lc: LayerCosts, c: int, es) -> list:
    """`effective_costs` at CP width c for every EP width in es: the terms that do not depend on e
    are computed once (the same sums in the same order, so the numbers are identical)."""
    system = problem.system
    imb = problem.training.load_imbalance
    moe = (lc.expert_params > 0) | (lc.expert_fwd_s > 0)
    any_moe = bool(np.any(moe))
    if any_moe:
        sizes, where = np.unique(lc.dispatch_bytes, return_inverse=True)
    core_bytes = lc.activation_bytes - lc.selective_bytes
    extra = np.zeros(lc.n_layers)
    zeros = np.zeros(lc.n_layers)
    gathered = zeros
    if c > 1:
        link = system.cp_link(lc.tp, c)
        core_f = (c - 1) * lc.core_fwd_s
        core_b = (c - 1) * lc.core_bwd_s
        send = lc.kv_bytes > 0
        hop_f = link.latency + lc.kv_bytes / link.bandwidth
        hop_b = link.latency + 2.0 * lc.kv_bytes / link.bandwidth
        if problem.training.cp_comm == "all_gather":  # placement.evaluate: gathered, nothing under it
            kv_f = np.where(send, (c - 1) * hop_f, 0.0)
            kv_b = np.where(send, (c - 1) * hop_b, 0.0)
            gathered = np.where(send, (c - 1) * lc.kv_bytes, 0.0)
        else:  # the ring: each hop under one block's core
            kv_f = np.where(send, (c - 1) * np.maximum(0.0, hop_f - lc.core_fwd_s), 0.0)
            kv_b = np.where(send, (c - 1) * np.maximum(0.0, hop_b - lc.core_bwd_s), 0.0)
        extra = (c - 1) * core_bytes
    common = dict(
        activation_bytes=lc.activation_bytes + extra,
        full_work_bytes=lc.full_work_bytes + extra,
        selective_work_bytes=c * lc.selective_work_bytes,
        selective_s=c * lc.selective_s,
        # the arrays below only feed `effective_costs` itself; zero so nothing is added twice
        dispatch_bytes=zeros, expert_fwd_s=zeros, expert_bwd_s=zeros, core_fwd_s=zeros, core_bwd_s=zeros, kv_bytes=zeros,
        expert_ep=(), gathered_kv_bytes=gathered,
        cp=1,
    )
    outs = []
    for e in es:
        # the experts' grouped GEMMs at the shape an EP-e rank runs (placement.evaluate alike)
        fwd, bwd, expert_f, expert_b = lc.at_expert_width(e)
        expert = lc.expert_params.copy()
        hidden = zeros
        again = lc.module_s
        if any_moe:
            stride = problem.training.expert_stride(lc.tp, c)
            a2a = np.array([system.alltoall_s(imb * b, e, stride, problem.training, problem.top_k, problem.router_groups)
                            for b in sizes])[where]
            fwd = np.where(moe, fwd + (imb - 1.0) * expert_f + 2.0 * a2a, fwd)
            bwd = np.where(moe, bwd + (imb - 1.0) * expert_b + 2.0 * a2a, bwd)
            expert = np.where(moe, np.ceil(expert / e), expert)
            # a rerun MoE layer (`moe` recompute) runs its forward's all-to-alls again, its experts at
            # this width's shape (the busiest rank's) in place of the traced ones
            again = np.maximum(0.0, lc.module_s + np.where(
                moe, lc.module_moe * (imb * expert_f - lc.expert_fwd_s + 2.0 * a2a), 0.0))
        if c > 1:
            fwd = fwd + core_f + kv_f
            bwd = bwd + core_b + kv_b
        if any_moe and problem.training.moe_a2a_overlap:  # placement.evaluate: four phases of a paired layer
            mlp_f = imb * expert_f
            mlp_b = imb * expert_b
            attn_f = np.maximum(0.0, fwd - 2.0 * a2a - mlp_f)
            attn_b = np.maximum(0.0, bwd - 2.0 * a2a - mlp_b)
            paired = (np.maximum(attn_f + 0.5 * attn_b, a2a) + np.maximum(0.5 * mlp_b, a2a)
                      + np.maximum(mlp_f + 0.5 * mlp_b, a2a) + np.maximum(0.5 * attn_b, a2a))
            hidden = np.where(moe & (a2a > 0), np.maximum(0.0, fwd + bwd - paired), 0.0)
            fwd = fwd - 0.5 * hidden
            bwd = bwd - 0.5 * hidden
        # Every array is finite, non-negative and whole where it must be (built from validated ones
        # by sums, ceilings and integer factors), so the copy skips LayerCosts' checks (speed).
        out = object.__new__(LayerCosts)
        out.__dict__.update(lc.__dict__)
        out.__dict__.update(common, fwd_s=fwd, bwd_s=bwd, params=lc.params - lc.expert_params + expert, expert_params=expert,
                            a2a_hidden_s=hidden, module_s=again, module_moe=np.zeros(lc.n_layers))
        outs.append(out)
    return outs


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


def _degrees(problem: PlacementProblem, top: int, step: int) -> np.ndarray:
    """The data-parallel degrees worth trying (the module docstring: "Which d"), the multiples of
    `step` (`Training.data_step`: those EP fits): without ZeRO the first of each microbatch count
    (m falls as d grows, so each count is a run)."""
    multiples = np.arange(step, top + 1, step, dtype=np.int64)
    if problem.training.zero or problem.system.torus is not None or multiples.size == 0:
        return multiples
    m = -(-problem.system.global_batch // (problem.training.mbs * multiples))  # PlacementProblem.microbatches
    return multiples[ring_degrees(multiples, m, problem.system.devices_per_node)]


@dataclass
class _Blocks:
    """Every (c, e, t) at once: one stage stack over the effective costs of all of them (a block
    each; the layer graph is the same, so rows and candidate stages are shared), the per-stage
    expert parameters, and the stage times per pipeline link."""

    costs: list  # effective LayerCosts per block
    e: np.ndarray  # [T] EP width of each block
    c: np.ndarray  # [T] CP width
    t: np.ndarray  # [T] TP width
    st: object
    experts: np.ndarray  # [T, R, W]
    hidden: np.ndarray  # [T, R, W] all-to-all time the EP overlap hides per microbatch (`a2a_hidden_s`)
    times: dict  # pipeline link (0 inter, 1 intra) -> [T, R, W] stage time per microbatch
    own: np.ndarray | None = None  # [T] chain: each block's own `chain_width` (None: a DAG)


_NARROW = 12  # chain blocks of own width up to 12 share a stack, then up to 24, 48, ... (`_prepare`)


def _fit_mask(problem: PlacementProblem, b: _Blocks) -> np.ndarray | None:
    """[T, R, W] bool: candidate stages some placement of the block could use, for the memory-free
    bounds (None: all). Without ZeRO and interleaving a stage's memory at one microbatch in flight
    does not depend on d or S, and every placement holds at least one microbatch, so a stage with
    kmax = 0 (`chain_stack`/`dag_stack`: state + one microbatch's activations + working set >
    HBM) is in none. Otherwise a chain stage longer than its own width's `chain_width` (the
    longest that fits at the most replicas and 1/v microbatch) is in none."""
    st = b.st
    if problem.training.zero == 0 and problem.training.virtual_stages == 1:
        return st.kmax >= 1
    if b.own is None:
        return None
    return np.broadcast_to(np.arange(st.dst.shape[1])[None, None, :] < b.own[:, None, None], st.grad.shape)


def _build(problem: PlacementProblem, blocks: list, force_dag: bool, own: np.ndarray | None) -> _Blocks:
    costs = [lc for _, _, lc in blocks]
    # A chain's stack is as wide as its widest block needs: no stage longer than a block's own
    # `chain_width` fits that block at any d (its docstring), so a narrower class loses no placement.
    st = chain_stack(problem, costs, int(np.max(own))) if own is not None else stage_stack(problem, costs, force_dag)
    experts = _stage_sums(st, np.stack([lc.expert_params for lc in costs]))
    hidden = _stage_sums(st, np.stack([lc.a2a_hidden_s for lc in costs]))
    links = {0: problem.system.inter_node, 1: problem.system.intra_node}
    v = problem.training.virtual_stages
    # overlapped point-to-point: the least stage time over every S (share 0) here, each group's own
    # S in `_search_group` (kernel.p2p_exposed_share)
    overlap = 0.0 if problem.training.overlaps_p2p and v > 1 else None
    times = {h: st.stage_time(links[h], v, problem.system.efficiency.microbatch_overhead_s, overlap)[1]
             for h in (0, 1)}
    return _Blocks(costs, np.array([e for _, e, _ in blocks]), np.array([c for c, _, _ in blocks]),
                   np.array([lc.tp for lc in costs]), st, experts, hidden, times, own)


def _items(problem: PlacementProblem, b: _Blocks, free: dict) -> dict:
    """Every (block, d, S) with its lower bound `lb`, the tail floor `tail_lb` and `fits` (False:
    no split of it fits HBM), as flat arrays; `_search_all` skips items with an infinite bound or
    that do not fit.

    Lower bound on the time per batch of any placement of (block, d, S): C x (m + (S - 1) / v) +
    tail, where C >= the memory-free least bottleneck (`free`, over the stages some placement of
    the block can use) and the tail >= that of the mean stage. The tail of a stage (exposed
    reduction + optimizer step, `_search_group`) is at least an affine function of its dense and
    expert parameters, lin(stage) = a x dense + b x experts (+ the ring's latency when e = 1, paid
    by every stage): each ring term is latency steps plus (n - 1) / n x bytes / bandwidth, the
    latency part dropped where it may be skipped (e > 1: a stage without parameters of a kind does
    not reduce that kind), the whole reduction dropped when an overlap may hide it, and the step is
    linear. The stages partition the layers, so the lin() of the S stages sum to lin(all layers)
    and the largest is at least their mean, lin(all) / S (the constant not divided).

    Memory: the fullest stage holds at least the mean stage's state (linear lower bounds of the
    ZeRO-1 and 2 ceilings) plus the activations of the least-loaded position (1F1B: one microbatch at the
    last stage; interleaved: min((v - 1) S + 1, m v) chunks of 1/v), so when that exceeds HBM no
    split of the item fits (as `dp._general_groups`)."""
    system = problem.system
    N, dpn = system.accelerators, system.devices_per_node
    v = problem.training.virtual_stages
    w_b, g_b, o_b = state_split(problem)
    r_b = reduce_bytes(problem)  # on the data-parallel ring
    gw_b = gather_bytes(problem)
    st = b.st
    L = st.n_layers
    n_seq = -(-system.global_batch // problem.training.mbs)
    widths = b.t * b.c
    cache: dict = {}
    blk_parts, d_parts, cnt_parts = [], [], []
    for i in range(len(b.costs)):
        w, e = int(widths[i]), int(b.e[i])
        if N // w < 1:
            continue
        # folded, a model without routed experts has no expert grid to fit (placement_eval)
        step = problem.training.data_step(int(b.t[i]), int(b.c[i]), e) if np.any(b.costs[i].expert_params > 0) else e
        key = (N // w, step)
        if key not in cache:
            ds = _degrees(problem, N // w, step)
            counts = np.minimum(L, N // (w * ds))
            cache[key] = (ds[counts >= 1], counts[counts >= 1])
        ds, counts = cache[key]
        blk_parts.append(np.full(ds.shape, i, dtype=np.int64))
        d_parts.append(ds)
        cnt_parts.append(counts)
    if not blk_parts:
        return {}
    blk0, d0, counts = np.concatenate(blk_parts), np.concatenate(d_parts), np.concatenate(cnt_parts)
    blk, d = np.repeat(blk0, counts), np.repeat(d0, counts)
    S = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    m = -(-n_seq // d)
    w = widths[blk]
    if v > 1:  # Megatron's interleaving constraint (PlacementProblem.interleaves), vectorised
        ok = (S == 1) | (problem.training.interleave_split_ok(problem.interleave_layers, S) & (m % S == 0))
        blk, d, S, m, w = blk[ok], d[ok], S[ok], m[ok], w[ok]
    elif problem.training.moe_a2a_overlap:  # the EP overlap needs interleaving when pp > 1 (placement_eval)
        ok = (S == 1) | (b.e[blk] == 1)
        blk, d, S, m, w = blk[ok], d[ok], S[ok], m[ok], w[ok]
    h = (dpn % (S * w) == 0).astype(np.int64)
    mult = m + (S - 1) / v
    c_lb = np.where(h == 1, free[1][S - 1, blk], free[0][S - 1, blk])
    # per block: total dense and expert parameters, kept activations per microbatch
    Pe_b = np.array([float(np.sum(lc.expert_params)) for lc in b.costs])
    P_b = np.array([float(np.sum(lc.params)) for lc in b.costs])
    kept_b = np.array([float(np.sum(layer_terms(problem, lc)[0])) for lc in b.costs])
    e = b.e[blk]
    ranks = d * b.c[blk]
    eranks = problem.training.expert_replicas(b.t[blk], b.c[blk], d, e)
    P, Pe = P_b[blk], Pe_b[blk]
    Pd = P - Pe
    moe = np.array([bool(np.any(lc.expert_params > 0)) for lc in b.costs])[blk]
    split = (e > 1) | ((eranks != ranks) & moe)  # the experts reduce as their own group (placement_eval)
    rings = ring_links(system, w, S, d, problem.training.shard_group, spread=~split)
    lat, bw = rings.latency(), rings.bandwidth()
    zero = problem.training.zero
    hide_gather = zero in (1, 2) and problem.training.overlap_param_gather  # the gather may hide wholly
    # the tail's ring bytes and latency steps: all-reduce, RS + AG, or (ZeRO-2) the gather after the step
    ring_bytes = {0: 2 * r_b, 1: r_b + (0 if hide_gather else gw_b), 2: 0 if hide_gather else gw_b}.get(zero, 0)
    ring_steps = {0: 2, 1: 1 if hide_gather else 2, 2: 0 if hide_gather else 1}.get(zero, 0)
    tail_lin = np.zeros(d.shape)
    tail_const = np.zeros(d.shape)
    if not problem.training.overlap_grad_reduce or zero == 2:  # an overlapped reduction may hide wholly
        tail_lin = (np.where(split, (ranks - 1) / ranks * Pd + (eranks - 1) / eranks * Pe, (ranks - 1) / ranks * P)
                    * ring_bytes / bw)
        tail_const = np.where(split, 0.0, ring_steps * (ranks - 1) * lat)
    if problem.hbm_bandwidth > 0:
        step_b, zero_b = optimizer_pass_bytes(problem)
        shard = np.where(split, Pd / ranks + Pe / eranks, P / ranks)
        tail_lin = tail_lin + ((shard if zero else P) * step_b + (shard if zero >= 2 else P) * zero_b) / problem.hbm_bandwidth
    tail_lb = (tail_const + tail_lin / S) * (1.0 - 1e-12)  # slack against rounding: a bound, never above
    with np.errstate(invalid="ignore"):
        lb = (c_lb * mult + tail_lb) * (1.0 - 1e-12)
    k_b = weight_copies(problem)  # held whole by every rank (types.weight_copies)
    if problem.training.zero == 0:
        state = P * (w_b + g_b + o_b + k_b)
    else:
        whole, shard = {2: (w_b + k_b, g_b + o_b), 3: (0 if problem.training.reshard_after_forward else w_b + k_b,
                                                         w_b + g_b + o_b)}.get(zero, (w_b + g_b + k_b, o_b))
        state = P * whole + np.where(split, Pd / ranks + Pe / eranks, P / ranks) * shard
    inflight = np.where((v > 1) & (S > 1), np.minimum((v - 1) * S + 1, m * v) / v, 1.0)
    fits = (state + inflight * kept_b[blk]) / S * (1.0 - 1e-12) <= problem.hbm_bytes
    shards = rings  # ZeRO-3's shard group ring: the whole data-parallel ring, or HSDP's group of g ranks t apart
    if zero == 3 and problem.training.shard_group is not None:
        g = problem.training.shard_group
        fits &= (ranks % g == 0) & (~split | (eranks % g == 0))  # the group divides each kind's ranks
        shards = ring_links(system, b.t[blk], S, np.full(d.shape, g), spread=~split)
    s_only = np.where((v > 1) & (S > 1), S, 0)
    return {"blk": blk, "d": d, "S": S, "h": h, "ring_bw": bw, "ring_lat": lat, "mult": mult, "lb": lb, "tail_lb": tail_lb,
            "s_only": s_only, "fits": fits, "shard_bw": shards.bandwidth(), "shard_lat": shards.latency()}


def _search_all(problem: PlacementProblem, classes: list, items: dict, best: Best, stats: dict) -> None:
    """Every (class, block, d, links, S_only) group, least lower bound first, until none can beat the best."""
    if not items:
        return
    keep = np.isfinite(items["lb"]) & items["fits"]
    items = {k: a[keep] for k, a in items.items()}
    lb = items["lb"]
    if lb.size == 0:
        return
    # One integer per group: the (class, block, d) run (items come in that order) and the links and
    # S_only; the ring link's id numbers the distinct (ring, shard ring) links, so groups of
    # different classes on the same rings share an id.
    items["ring"] = np.unique(np.stack([items["ring_bw"], items["ring_lat"], items["shard_bw"], items["shard_lat"]]), axis=1,
                              return_inverse=True)[1].reshape(-1)
    rings = int(np.max(items["ring"])) + 1
    run = np.cumsum(np.concatenate([[0], (items["cls"][1:] != items["cls"][:-1]) | (items["blk"][1:] != items["blk"][:-1])
                                    | (items["d"][1:] != items["d"][:-1])]))
    key = ((run * 2 + items["h"]) * rings + items["ring"]) * (int(np.max(items["s_only"])) + 1) + items["s_only"]
    order = np.argsort(key, kind="stable")
    ks = key[order]
    lo = np.concatenate([[0], np.flatnonzero(ks[1:] != ks[:-1]) + 1])
    hi = np.concatenate([lo[1:], [order.size]])
    least = np.minimum.reduceat(lb[order], lo)
    for g in np.argsort(least, kind="stable").tolist():
        if least[g] >= best.time:  # groups come by their least bound: none after this one can win
            break
        idx = order[lo[g]:hi[g]]
        idx = idx[lb[idx] < best.time]
        idx = idx[np.argsort(lb[idx], kind="stable")]  # least bound first (which of equal totals is kept)
        i = int(idx[0])
        key = tuple(int(items[k][i]) for k in ("blk", "d", "h", "s_only"))
        ring = Link(float(items["ring_bw"][i]), float(items["ring_lat"][i]))
        shard = Link(float(items["shard_bw"][i]), float(items["shard_lat"][i]))
        _search_group(problem, classes[int(items["cls"][i])], key, (ring, shard), items["S"][idx].tolist(),
                      items["mult"][idx].tolist(), items["tail_lb"][idx].tolist(), best, stats)


def _search_group(problem: PlacementProblem, b: _Blocks, key: tuple, rings: tuple, Ss: list, mults: list, floors: list,
                  best: Best, stats: dict):
    """One (block, d, pipeline link, S_only) group on the data-parallel ring and ZeRO-3's shard-group
    ring `rings`: the epsilon-constraint on the stage tail."""
    ring, shard = rings
    system = problem.system
    v = problem.training.virtual_stages
    w_b, g_b, o_b = state_split(problem)
    r_b = reduce_bytes(problem)  # on the data-parallel ring
    gw_b = gather_bytes(problem)
    st, experts, costs = b.st, b.experts, b.costs
    blk, d, h, S_only = key
    e, c = int(b.e[blk]), int(b.c[blk])
    if not Ss:
        return
    stats["groups"] = stats.get("groups", 0) + 1
    m = problem.microbatches(d)
    ranks, expert_ranks = d * c, int(problem.training.expert_replicas(int(b.t[blk]), c, d, e))
    # as the evaluator: the experts reduce as their own group
    split = e > 1 or (expert_ranks != ranks and bool(np.any(costs[blk].expert_params > 0)))
    sl = slice(blk, blk + 1)
    ok = np.isfinite(st.grad[sl])
    params0 = np.where(ok, st.params[sl], 0.0)
    expert0 = experts[sl]
    dense0 = params0 - expert0
    acts, workmax, bwdwin = st.acts[sl], st.workmax[sl], st.bwdwin[sl]
    parts = [(dense0, ranks), (expert0, expert_ranks)] if split else [(params0, ranks)]
    reduce = np.zeros(params0.shape)
    gather = np.zeros(params0.shape)
    scatter = np.zeros(params0.shape)  # ZeRO-2: every microbatch's reduce-scatter
    zero = problem.training.zero
    hide_gather = zero in (1, 2) and problem.training.overlap_param_gather
    for n_params, n_ranks in parts:
        def kept(x, n_params=n_params):  # a stage without parameters of a kind does not reduce that kind
            return np.where(n_params > 0, x, 0.0) if split else x
        if zero == 0:
            r = _ring_allreduce(n_params * r_b, n_ranks, ring)
        elif zero == 3:  # reduce-scattered every microbatch in its shard group (placement.evaluate) ...
            g = problem.training.shard_ranks(n_ranks)
            scatter = scatter + kept(_ring_half(n_params * r_b, g, shard))
            # ... and under HSDP the shards all-reduced across the n / g replicas once per batch
            r = _ring_allreduce(n_params * r_b / g, n_ranks // g, ring)
        elif zero == 2:
            r = np.zeros(params0.shape)
            scatter = scatter + kept(_ring_half(n_params * r_b, n_ranks, ring))
            gather = gather + kept(_ring_half(n_params * gw_b, n_ranks, ring))
        elif hide_gather:
            r = _ring_half(n_params * r_b, n_ranks, ring)
            gather = gather + kept(_ring_half(n_params * gw_b, n_ranks, ring))
        else:
            r = _ring_half(n_params * r_b, n_ranks, ring) + _ring_half(n_params * gw_b, n_ranks, ring)
        reduce = reduce + kept(r)
    exposed = np.zeros(params0.shape)  # ZeRO-3: the per-layer gathers FSDP's prefetch leaves exposed
    if zero == 3:
        lc = costs[blk]
        dense_l = lc.params - lc.expert_params
        shard_of = problem.training.shard_ranks
        gathers = _ring_half((dense_l if split else lc.params) * gw_b, shard_of(ranks), shard)
        if split:  # the routed experts' own gather, in the layers that have them
            gathers = gathers + np.where(lc.expert_params > 0,
                                         _ring_half(lc.expert_params * gw_b, shard_of(expert_ranks), shard), 0.0)
        exposed_f, exposed_b, busy = zero3_exposed(st, blk, gathers)
        if not problem.training.reshard_after_forward:  # held from the forward: no backward gather
            exposed_b, busy = np.zeros_like(exposed_b), np.zeros_like(busy)
        exposed = exposed_f + exposed_b
        # an overlapped reduce-scatter runs beside the whole backward pass, on the link its gathers leave
        with np.errstate(invalid="ignore"):  # padding (inf - inf) is masked below (`ok`)
            window = bwdwin + exposed_b - busy
    else:
        window = bwdwin
    if problem.training.overlap_grad_reduce:  # wholly hidden in the bound's lower-bound mode (PlacementProblem.reduction_hidden)
        reduce = np.zeros_like(reduce) if problem.reduction_hidden else np.maximum(0.0, reduce - np.where(ok, bwdwin, 0.0))
        scatter = np.maximum(0.0, scatter - np.where(ok, window, 0.0))  # beside its microbatch's backward
    scatter = scatter + exposed
    if hide_gather:  # under the next iteration's forward of the stage (placement_eval)
        reduce = reduce + (np.zeros_like(reduce) if problem.reduction_hidden
                           else np.maximum(0.0, gather - np.where(ok, st.fwdwin[sl], 0.0)))
    elif zero == 2:  # after the optimizer step, with nothing beside it
        reduce = reduce + gather
    tail = reduce
    if problem.hbm_bandwidth > 0:  # as the evaluator (types.optimizer_pass_bytes)
        step_b, zero_b = optimizer_pass_bytes(problem)
        hs = problem.training.shard_ranks  # HSDP: each replica steps its group's shard
        part = dense0 / hs(ranks) + expert0 / hs(expert_ranks) if split else params0 / hs(ranks)
        step = (part if zero else params0) * step_b + (part if zero >= 2 else params0) * zero_b
        tail = tail + step / problem.hbm_bandwidth
    tail = np.where(ok, tail, INF)
    k_b = weight_copies(problem)  # held whole by every rank (types.weight_copies)
    if problem.training.zero == 0:
        state = params0 * (w_b + g_b + o_b + k_b)
    elif zero == 3:  # every kind sharded over its group, the gathered weights held without resharding
        state = sum(np.ceil(n * x / problem.training.shard_ranks(r)) for n, r in parts for x in (w_b, g_b, o_b))
        state = state if problem.training.reshard_after_forward else state + params0 * (w_b + k_b)
    elif zero == 2 and split:
        state = (params0 * (w_b + k_b) + np.ceil(dense0 * g_b / ranks) + np.ceil(dense0 * o_b / ranks)
                 + np.ceil(expert0 * g_b / expert_ranks) + np.ceil(expert0 * o_b / expert_ranks))
    elif zero == 2:
        state = params0 * (w_b + k_b) + np.ceil(params0 * g_b / ranks) + np.ceil(params0 * o_b / ranks)
    elif split:
        state = params0 * (w_b + g_b + k_b) + np.ceil(dense0 * o_b / ranks) + np.ceil(expert0 * o_b / expert_ranks)
    else:
        state = params0 * (w_b + g_b + k_b) + np.ceil(params0 * o_b / ranks)
    kmax = stage_fit(state, acts, workmax, ok, problem.hbm_bytes, S_only, v, m)
    share = p2p_exposed_share(problem, S_only, m)
    times = b.times[h][sl] + scatter if share is None else b.st.stage_time(
        (system.inter_node, system.intra_node)[h], v, system.efficiency.microbatch_overhead_s, share, sl, scatter)[1]
    time_g = np.where(ok & (kmax >= 1), times, INF)

    def record(stages):
        best.tp, best.dp, best.stages, best.ep, best.cp = costs[blk].tp, d, stages, e, c

    # S -> (pipeline multiplier, the least largest-stage tail any S-stage split has: `_items`)
    active = {S: (mult, floor) for S, mult, floor in zip(Ss, mults, floors)}
    if not (problem.training.moe_a2a_overlap and np.any(b.hidden[sl] > 0)):
        epsilon_sweeps(st, stats, tail, kmax, time_g, active, best, record)
        return
    # The EP overlap's unpaired microbatches add u(S) x the stage's hidden all-to-all to its tail
    # (placement_eval): one epsilon-constraint per distinct u, each over its own S.
    by_u: dict = {}
    for S in active:
        by_u.setdefault(problem.unpaired_microbatches(S, d), {})[S] = active[S]
    hid = np.where(ok, b.hidden[sl], 0.0)
    for u, part in by_u.items():
        epsilon_sweeps(st, stats, np.where(ok, tail + u * hid, INF), kmax, time_g, part, best, record)


def _free_bottleneck(st, times: np.ndarray, k_to: int) -> np.ndarray:
    """[k_to, B]: the least bottleneck of any k-stage split of all layers, k = 1..k_to, with stage
    costs `times` [B, R, W]: `placement.sweep`'s recursion f_k(D) = min_a max(cost, f_{k-1}(next)),
    for a chain without its back-pointers and gradient tables (only the values are needed)."""
    B = times.shape[0]
    if st.masks is not None:
        twice = replace(st, grad=np.broadcast_to(st.grad[:1], (B,) + st.grad.shape[1:]))
        return sweep(twice, np.arange(B), lambda k, cut, cols: times[:, :cut, :cols], 1, k_to, *sweep_start(st, B)).f[:, :, 0]
    R, W = st.dst.shape
    tt = np.ascontiguousarray(times.transpose(2, 0, 1))  # [W, B, R]: the min runs over the leading axis (faster)
    f_prev, _ = sweep_start(st, B)
    out = np.full((k_to, B), INF)
    for k in range(1, k_to + 1):
        cut = st.cuts[k] if k < len(st.cuts) else 0
        if cut <= 0:
            break
        cols = st.colcuts[k]
        step = f_prev.strides[1]  # dst[i, a] = i + a + 1: the next rows are a sliding window
        ahead = np.lib.stride_tricks.as_strided(f_prev[:, 1:], shape=(cols, B, cut),
                                                strides=(step, f_prev.strides[0], step), writeable=False)
        f = np.full((B, R + 1 + W), INF)
        f[:, :cut] = np.maximum(tt[:cols, :, :cut], ahead).min(axis=0)
        out[k - 1] = f[:, 0]
        f_prev = f
    return out


def _prepare(problem: PlacementProblem, force_dag: bool) -> tuple[list, dict]:
    """Every (c, e, t) as a block; the blocks of a chain in classes by their own `chain_width`
    (12 or less, up to 24, 48, ...: a stack and its sweeps cost its widest block's width for every
    block), each class one stack whose memory-free sweeps run together (one per pipeline link); and
    every (class, block, d, S) item with its lower bound (`_items`)."""
    N = problem.system.accelerators
    has_experts = any(np.any(lc.expert_params > 0) for lc in problem.costs)
    blocks = []
    for c in problem.cp_widths:
        costs = [problem.costs_at(lc.tp, c) for lc in problem.costs if lc.tp * c <= N]
        es = [e for e in problem.ep_widths if e == 1 or has_experts]
        at = [effective_costs_at(problem, lc, c, es) for lc in costs]
        blocks.extend((c, e, at[i][j]) for j, e in enumerate(es) for i in range(len(costs)))
    if not blocks:
        return [], {}
    if blocks[0][2].is_chain() and not force_dag:
        own = np.array([chain_width(problem, [lc]) for _, _, lc in blocks])
        cls_of = np.ceil(np.log2(np.maximum(own, _NARROW) / _NARROW)).astype(np.int64)
    else:
        own, cls_of = None, np.zeros(len(blocks), dtype=np.int64)
    classes, parts = [], []
    for k in np.unique(cls_of).tolist():
        idx = np.flatnonzero(cls_of == k)
        b = _build(problem, [blocks[i] for i in idx], force_dag, None if own is None else own[idx])
        st = b.st
        T = len(idx)
        tops = [min(st.n_layers, N // int(w)) for w in b.t * b.c]
        mask = _fit_mask(problem, b)
        masked = {h: b.times[h] if mask is None else np.where(mask, b.times[h], INF) for h in (0, 1)}
        # The intra-node pipeline link needs S x t x c to divide a node (`System.pipeline_link`), so
        # only S <= dpn // (t c) reads its bounds: that sweep stops there.
        free = {0: _free_bottleneck(st, masked[0], max(tops)), 1: np.full((max(tops), T), INF)}
        k_intra = min(max(tops), int(np.max(problem.system.devices_per_node // (b.t * b.c))))
        if k_intra >= 1:
            free[1][:k_intra] = _free_bottleneck(st, masked[1], k_intra)
        items = _items(problem, b, free)
        if items:
            items["cls"] = np.full(items["blk"].shape, len(classes), dtype=np.int64)
            parts.append(items)
        classes.append(b)
    if not parts:
        return classes, {}
    return classes, {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def optimal_placement(problem: PlacementProblem, *, force_dag: bool = False) -> PlacementResult:
    """The placement with the least time per batch over TP, CP, EP, PP, DP and the stage split,
    checked by the independent evaluator; `dp.optimal_dense_placement` when there is no EP/CP."""
    if not problem.parallel_dims:
        return optimal_dense_placement(problem, force_dag=force_dag)
    start = time.perf_counter()
    stats: dict = {}
    method = "dp-ep-cp"
    best = Best()
    best.ep, best.cp = 1, 1
    classes, items = _prepare(problem, force_dag)
    _search_all(problem, classes, items, best, stats)
    if not math.isfinite(best.time):
        need, where = min_memory_needed(problem, force_dag)
        reason = (
            f"no placement fits in HBM (expert and context parallelism searched too): without them the "
            f"smallest memory any placement needs is {format_bytes(need)} per device (tp {where.get('tp')}, "
            f"pp {where.get('pp')}, dp {where.get('dp')}), more than the {format_bytes(problem.hbm_bytes)} of HBM"
        )
        return infeasible_result(problem, reason, method=method, min_memory_bytes=need,
                                 solve_s=time.perf_counter() - start, info={"sweeps": stats.get("sweeps", 0)})
    result = checked_by_evaluator(problem, Placement(best.tp, best.dp, best.stages, best.ep, best.cp), best.time,
                                  method, "EP/CP placement DP")
    result.solve_s = time.perf_counter() - start
    result.info = {"sweeps": stats.get("sweeps", 0), "groups": stats.get("groups", 0), "dp_time_per_batch_s": best.time}
    return result


def check_widths(name: str, value: int, allowed: tuple) -> int:
    """A fixed placement's ep or cp among the widths the model allows, or a one-line error."""
    if value not in allowed:
        raise PhazeError(f"placement {name}={value}: not allowed here; allowed: {', '.join(map(str, allowed))}")
    return value
