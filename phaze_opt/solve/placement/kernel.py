"""The placement DP's kernel, shared by the dense DP (`dp`) and the expert-parallel DP (`expert`).

Both DPs price stages the same way, so they share the pieces that build and sweep the candidate
stages: the stage tables of every TP width (`StageStack`, from a chain's windows or a DAG's
downsets), the bottleneck sweep f_k(D) = min over D' of max(c_k(D, D'), f_{k-1}(D')) and its
back-walk, the HBM fit of a stage at each pipeline position, the epsilon-constraint over the
per-batch tail, the least memory any placement needs, and the independent evaluator's check of a
DP's answer. What each DP searches over (widths, replicas, EP/CP) stays in its own module; `dp`'s
docstring derives the recursion and why it is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ...errors import PhazeError
from .evaluate import evaluate_placement
from .types import Placement, PlacementProblem, PlacementResult, reduce_bytes, state_split, weight_copies

INF = math.inf
MAX_DOWNSETS = 4096  # a DAG with more downsets than this is refused (chains have layers + 1)
MAX_TRANSITIONS = 2_000_000
KMAX_CAP = 1 << 30  # "any number of microbatches fits"
RTOL = 1e-9  # DP value vs evaluator


# --------------------------------------------------------------------------------------------
# Candidate stages of every TP width, stacked
# --------------------------------------------------------------------------------------------


@dataclass
class StageStack:
    """Candidate stages as dense [widths, rows, columns] tables.

    Row r is the downset placed in earlier stages (sizes ascending; row 0 the empty set, the last
    row the full set, which has no candidates). Column a is the stage D' minus D_r with D' the row
    `dst[r, a]`; padding points at the sentinel row R, whose f is always infinite. The layer graph
    is the same at every TP width, so rows and `dst` are shared; the costs are per width.
    """

    widths: tuple[int, ...]
    n_layers: int
    sizes: np.ndarray  # [R] layers in each row's downset
    masks: list | None  # DAG: bitmask per row; chain: None (row r = the first r layers)
    dst: np.ndarray  # [R, W] int
    work1: np.ndarray  # [T, R, W] compute time per microbatch, recompute included (every stage)
    work2: np.ndarray  # [T, R, W] the same (kept apart for the sweeps' last-stage column)
    bytes_in: np.ndarray  # [T, R, W] activations received from earlier stages
    has_in: np.ndarray  # [T, R, W] bool: something is received from earlier stages
    bytes_out: np.ndarray  # [T, R, W] output gradients received back from later stages
    has_out: np.ndarray
    grad: np.ndarray  # [T, R, W] gradient bytes the stage reduces (`types.reduce_bytes`) (inf for padding)
    base: np.ndarray  # [T, R, W] state + one microbatch's activations
    stash: np.ndarray  # [T, R, W] bytes per further in-flight microbatch
    kmax: np.ndarray  # [T, R, W] most in-flight microbatches that fit HBM (0: never)
    params: np.ndarray  # [T, R, W] parameters per device of the stage
    acts: np.ndarray  # [T, R, W] activations kept per in-flight microbatch (by recompute mode)
    workmax: np.ndarray  # [T, R, W] recompute working set (+ ZeRO-3's gathered layer parameters)
    bwdwin: np.ndarray  # [T, R, W] backward time per microbatch (recompute included)
    cuts: list  # cuts[k]: rows that leave at least k layers for k stages, k = 0..layers
    colcuts: list  # colcuts[k]: columns that can leave k - 1 layers for the later stages
    # per layer [T, L]: forward, backward + recompute, parameters (ZeRO-3's prefetched gathers)
    layer_fwd: np.ndarray | None = None
    layer_bwd: np.ndarray | None = None
    layer_params: np.ndarray | None = None
    fwdwin: np.ndarray | None = None  # [T, R, W] forward time per microbatch (an overlapped param gather's window)

    @property
    def rows(self) -> int:
        return int(self.sizes.shape[0])

    def stage_time(self, link, v: int = 1, fixed_s: float = 0.0, exposed: float | None = None,
                   rows: slice = slice(None), beside=0.0) -> tuple[np.ndarray, np.ndarray]:
        """Stage time per microbatch on this pipeline link: (last stage, other stages); v virtual
        stages send v times the messages and pay v times the fixed cost per microbatch `fixed_s`
        (`SystemEfficiency.microbatch_overhead_s`, as `evaluate_placement` charges it).

        `exposed` (overlapped point-to-point, `Training.overlap_p2p_comm`): the share f of the
        schedule's steps in its warm-up and flush, whose messages are exposed; the others run
        beside the stage's work W (its compute, plus `beside`: the exposed per-microbatch ZeRO-2/3
        collectives), so the stage takes max(W + f P, f W + P). Non-decreasing in f, so f = 0 gives
        a lower bound on every f. `rows`: the widths to price (all by default). Without `exposed`,
        `beside` is the caller's to add."""
        has_in, has_out, grad = self.has_in[rows], self.has_out[rows], self.grad[rows]
        work1, work2 = self.work1[rows], self.work2[rows]
        p2p_in = np.where(has_in, v * (link.latency + self.bytes_in[rows] / link.bandwidth), 0.0)
        p2p_out = np.where(has_out, v * (link.latency + self.bytes_out[rows] / link.bandwidth), 0.0)
        valid = np.isfinite(grad)
        if exposed is None:
            comm = v * fixed_s + (0.0 + p2p_in) + p2p_out
            return np.where(valid, work1 + comm, INF), np.where(valid, work2 + comm, INF)
        p2p = p2p_in + p2p_out

        def overlapped(work):  # max(W + f P, f W + P), written so that an infinite W stays infinite
            work = work + beside
            return work + np.maximum(exposed * p2p, p2p - (1.0 - exposed) * work) + v * fixed_s

        return np.where(valid, overlapped(work1), INF), np.where(valid, overlapped(work2), INF)

    def members(self, row: int, a: int) -> tuple[int, ...]:
        nxt = int(self.dst[row, a])
        if self.masks is None:
            return tuple(range(row, nxt))
        diff = self.masks[nxt] & ~self.masks[row]
        return tuple(v for v in range(self.n_layers) if diff >> v & 1)


def most_in_flight(base: np.ndarray, stash: np.ndarray, hbm: float) -> np.ndarray:
    """Largest q with base + (q - 1) * stash <= hbm (0 if even q = 1 does not fit).

    Inputs are whole bytes below 2**53, where the division cannot round across an integer; the
    products below re-check that exactly anyway, as the evaluator compares the same sums.
    """
    finite = np.isfinite(base)
    base = np.where(finite, base, 0.0)
    stash = np.where(np.isfinite(stash), stash, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.floor((hbm - base) / stash) + 1.0
    q = np.where(stash > 0, q, KMAX_CAP)
    q = np.clip(np.nan_to_num(q, nan=0.0, posinf=KMAX_CAP, neginf=0.0), 0, KMAX_CAP)
    small = np.minimum(q, 1 << 20)
    q = np.where((small >= 1) & (base + (small - 1) * stash > hbm), q - 1, q)
    q = np.where((q < (1 << 20)) & (base + q * stash <= hbm), q + 1, q)
    q = np.where((base > hbm) | ~finite, 0, q)
    return q.astype(np.int64)


@dataclass(frozen=True)
class RingLinks:
    """The data-parallel ring link of every candidate (width, S, d), as an id into `links`.

    Without a torus the rule of `System.dp_ring_link`, vectorised: id 0 the intra-node link (the
    ring stays inside a node), id r > 0 the `spanning_link` of r members per node. On a torus each
    distinct (width, S, d) asks
    `System.dp_ring_link` for the ring the torus really gives (multi-dimensional inside a slice, the
    1/g shards across slices), the same link `evaluate_placement` prices, so the DPs and their
    independent check agree; the distinct links are few, so a group keyed by the id stays small.
    """

    ids: np.ndarray
    links: tuple

    def bandwidth(self) -> np.ndarray:
        return np.array([k.bandwidth for k in self.links])[self.ids]

    def latency(self) -> np.ndarray:
        return np.array([k.latency for k in self.links])[self.ids]


def ring_degrees(ds: np.ndarray, runs: np.ndarray, devices_per_node: int) -> np.ndarray:
    """Which of the ascending data-parallel degrees `ds` can be optimal where a larger d only costs
    a longer ring, except through its link: `runs` labels the ds sharing a microbatch count. Kept:
    the first d of each run, and the first multiple of each divisor k > 1 of a node's devices in it,
    whose ring may have more members per node (`System.ring_members_per_node`, a multiple of
    gcd(d, devices_per_node / t)) and so a faster spanning link; any other d of the run has no more
    members per node than the multiple before it and a longer ring."""
    ds, runs = np.asarray(ds), np.asarray(runs)
    keep = np.concatenate([[True], runs[1:] != runs[:-1]]) if ds.size else np.zeros(0, dtype=bool)
    for k in node_divisors(devices_per_node):
        idx = np.flatnonzero(ds % k == 0)
        first = np.concatenate([[True], runs[idx][1:] != runs[idx][:-1]]) if idx.size else idx.astype(bool)
        keep[idx[first]] = True
    return keep


def node_divisors(devices_per_node: int) -> tuple[int, ...]:
    """The divisors k > 1 of a node's devices: the members per node a spanning ring can have."""
    small = [k for k in range(1, math.isqrt(devices_per_node) + 1) if devices_per_node % k == 0]
    return tuple(sorted({*small, *(devices_per_node // k for k in small)} - {1}))


def ring_links(system, width, S: np.ndarray, d: np.ndarray, shard=None, spread=True) -> RingLinks:
    """`RingLinks` for the candidates (width, S, d); width is a TP (x CP) width or an array of them;
    `shard` and `spread` (a bool or an array of them) as `System.dp_ring_link` takes them."""
    width = np.broadcast_to(np.asarray(width, dtype=np.int64), np.shape(S))
    if system.torus is None:
        dpn = system.devices_per_node
        members = np.where(spread, system.ring_members_per_node(width, d, shard), 1)
        values, inverse = np.unique(np.where(S * width * d <= dpn, 0, members), return_inverse=True)
        links = tuple(system.spanning_link(int(r)) if r else system.intra_node for r in values)
        return RingLinks(ids=inverse.reshape(np.shape(S)).astype(np.int64), links=links)
    triples, inverse = np.unique(np.stack([width, S, d]).reshape(3, -1), axis=1, return_inverse=True)
    found = [system.dp_ring_link(int(w), int(s), int(r)) for w, s, r in triples.T]
    links = tuple(dict.fromkeys(found))
    index = {link: i for i, link in enumerate(links)}
    ids = np.array([index[k] for k in found], dtype=np.int64)[inverse.reshape(-1)]
    return RingLinks(ids=ids.reshape(np.shape(S)), links=links)


def layer_terms(problem: PlacementProblem, c) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, by the recipe's recompute mode: (bytes kept per in-flight microbatch, working set
    during its backward, recompute time); see placement.evaluate for the model and its sources."""
    if problem.training.recompute == "full":
        wrapped = problem.training.checkpointed(c.block_ordinal)
        kept = np.where(wrapped, c.checkpoint_bytes, c.activation_bytes)
        work, rec = np.where(wrapped, c.full_work_bytes, 0.0), np.where(wrapped, c.fwd_s, 0.0)
    elif problem.training.recompute_ops:
        wrapped = c.block_ordinal > 0
        kept = np.where(wrapped, c.op_policy_bytes, c.activation_bytes)
        work, rec = np.where(wrapped, c.full_work_bytes, 0.0), np.where(wrapped, c.op_policy_s, 0.0)
    elif problem.training.recompute == "selective":
        if "core_attn" in problem.training.recomputed_modules:
            kept, work, rec = c.selective_bytes, c.selective_work_bytes, c.selective_s
        else:
            kept, work, rec = c.activation_bytes, np.zeros(c.n_layers), np.zeros(c.n_layers)
        kept, work, rec = kept - c.module_bytes, work + c.module_bytes, rec + c.module_s
    else:
        kept, work, rec = c.activation_bytes, np.zeros(c.n_layers), np.zeros(c.n_layers)
    if problem.training.zero == 3 and problem.training.reshard_after_forward:  # else held in `state_bytes`
        work = work + c.params * (state_split(problem)[0] + weight_copies(problem))
    work = work + c.gathered_kv_bytes  # all-gather CP's K/V, whatever the mode (zero but in effective costs)
    return kept, work, rec


def state_bytes(problem: PlacementProblem, params: np.ndarray, d) -> np.ndarray:
    """Model state bytes per device of stages with `params` parameters at d replicas (ZeRO)."""
    w, g, o = state_split(problem)
    k = weight_copies(problem)
    if problem.training.zero == 0:
        return params * (w + g + o + k)
    with np.errstate(invalid="ignore"):
        if problem.training.zero == 1:
            return params * (w + g + k) + np.ceil(params * o / d)
        if problem.training.zero == 2:
            return params * (w + k) + np.ceil(params * g / d) + np.ceil(params * o / d)
        held = 0.0 if problem.training.reshard_after_forward else params * (w + k)  # gathered, forward to backward
        d = problem.training.shard_ranks(d)  # HSDP: sharded within its group
        return np.ceil(params * w / d) + np.ceil(params * g / d) + np.ceil(params * o / d) + held


def chain_width(problem: PlacementProblem, costs) -> int:
    """The longest chain stage that fits HBM at all (one microbatch in flight), over all widths.

    A stage's smallest footprint (state at the most replicas, 1/v of one microbatch's kept
    activations) grows with its length, so from each start the stages that fit are a prefix of
    lengths; longer candidates are never needed.
    """
    w, g, o = state_split(problem)
    L = costs[0].n_layers
    width = 1
    N = problem.system.accelerators
    for c in costs:
        # the most replicas a shard can have: N / t for the dense parameters; folded experts
        # (Training.expert_replicas: t c d / (e ETP)) reach N / ETP, more than N / t when ETP < t
        dmax = max(1, N // c.tp) if problem.training.zero else 1
        emax = max(dmax, N // problem.training.expert_tp(c.tp)) if problem.training.zero else 1
        experts = np.asarray(c.expert_params, dtype=float) if c.expert_params is not None else 0.0
        dense = c.params - experts
        if problem.training.zero == 3:
            # HSDP shards within its group, which divides the replicas (at most dmax, emax)
            dmax, emax = min(dmax, problem.training.shard_ranks(dmax)), min(emax, problem.training.shard_ranks(emax))
            state = (w + g + o) * (dense / dmax + experts / emax)
            if not problem.training.reshard_after_forward:  # the gathered weights held (`state_bytes`)
                state = state + c.params * (w + weight_copies(problem))
        else:
            k = weight_copies(problem)
            whole, shard = (w + k, g + o) if problem.training.zero == 2 else (w + g + k, o)  # ZeRO-2 shards g too
            state = c.params * whole + shard * (dense / dmax + experts / emax)
        footprint = (state + layer_terms(problem, c)[0] / problem.training.virtual_stages) * (1 - 1e-9)
        prefix = np.concatenate([[0.0], np.cumsum(footprint)])
        ends = np.searchsorted(prefix, prefix[:-1] + problem.hbm_bytes, side="right") - 1
        width = max(width, int(np.max(ends - np.arange(L))))
    return min(width, L)


def chain_stack(problem: PlacementProblem, costs, width: int, shard_d=1) -> StageStack:
    """Stages of a chain are ranges [i, i + w], w < width; all widths at once, [T, L + 1, width]."""
    T = len(costs)
    L = costs[0].n_layers
    R = L + 1
    W = width

    def window(rows):  # [T, L] -> [T, L, W] with entry (t, i, w) = rows[t, i + w] (zero past the end)
        padded = np.concatenate([rows, np.zeros((T, W))], axis=1)
        return np.lib.stride_tricks.sliding_window_view(padded, W, axis=1)[:, :L, :]

    def stacked(name):
        return np.stack([getattr(c, name) for c in costs])

    fwd, bwd = stacked("fwd_s"), stacked("bwd_s")
    terms = [layer_terms(problem, c) for c in costs]
    kept, wset, rec = (np.stack([tm[i] for tm in terms]) for i in range(3))
    # Running sums from each stage's first layer: the evaluator adds in the same order.
    work = np.cumsum(window(fwd + bwd), axis=2) + np.cumsum(window(rec), axis=2)
    bwdwin = np.cumsum(window(bwd + rec), axis=2)
    fwdwin = np.cumsum(window(fwd), axis=2)
    params = np.cumsum(window(stacked("params")), axis=2)
    acts = np.cumsum(window(kept), axis=2)
    workmax = np.maximum.accumulate(window(wset), axis=2)
    boundary = stacked("boundary_bytes")
    i = np.arange(L)[:, None]
    j = i + np.arange(W)[None, :]
    valid = np.broadcast_to(j < L, (T, L, W))
    prev_boundary = np.concatenate([np.zeros((T, 1)), boundary[:, :-1]], axis=1)  # [T, L]: into layer i
    has_in = np.broadcast_to(i > 0, (T, L, W))
    bytes_in = np.broadcast_to(prev_boundary[:, :, None], (T, L, W))
    has_out = np.broadcast_to(j < L - 1, (T, L, W))
    bytes_out = boundary[:, np.minimum(j, L - 1)]
    base = state_bytes(problem, params, shard_d) + acts + workmax
    stash = acts

    def full(a, fill, dtype=np.float64):
        out = np.full((T, R, W), fill, dtype=dtype)
        out[:, :L] = np.where(valid, a, fill)
        return out

    base_f = full(base, INF)
    stash_f = full(stash, INF)
    dst = np.full((R, W), R, dtype=np.int64)
    dst[:L] = np.where(j < L, j + 1, R)
    return StageStack(
        widths=tuple(c.tp for c in costs),
        n_layers=L,
        sizes=np.arange(R),
        masks=None,
        dst=dst,
        work1=full(work + 0.0, INF),
        work2=full(work + 0.0, INF),
        params=full(params, INF),
        acts=full(acts, INF),
        workmax=full(workmax, INF),
        bwdwin=full(bwdwin, INF),
        fwdwin=full(fwdwin, INF),
        bytes_in=full(bytes_in, 0.0),
        has_in=full(has_in, False, bool),
        bytes_out=full(bytes_out, 0.0),
        has_out=full(has_out, False, bool),
        grad=full(params * reduce_bytes(problem), INF),
        base=base_f,
        stash=stash_f,
        kmax=most_in_flight(base_f, stash_f, problem.hbm_bytes),
        cuts=[L - k + 1 for k in range(L + 1)],
        colcuts=[max(1, min(W, L - k + 1)) for k in range(L + 1)],
        layer_fwd=fwd, layer_bwd=bwd + rec, layer_params=stacked("params"),
    )


def downsets(n: int, edges) -> list[int]:
    preds = [0] * n
    for u, v in edges:
        preds[v] |= 1 << u
    seen = {0}
    stack = [0]
    while stack:
        down = stack.pop()
        for v in range(n):
            bit = 1 << v
            if not down & bit and preds[v] & ~down == 0:
                grown = down | bit
                if grown not in seen:
                    seen.add(grown)
                    stack.append(grown)
                    if len(seen) > MAX_DOWNSETS:
                        raise PhazeError(
                            f"the layer graph has more than {MAX_DOWNSETS} downsets; the exact placement "
                            "supports chains and small DAGs"
                        )
    return sorted(seen, key=lambda m: (m.bit_count(), m))


def dag_stack(problem: PlacementProblem, costs, shard_d=1) -> StageStack:
    """Stages of a DAG: every difference of two nested downsets, [T, downsets, most supersets]."""
    first = costs[0]
    n = first.n_layers
    masks = downsets(n, first.edges)
    index = {m: r for r, m in enumerate(masks)}
    R = len(masks)
    preds = [[] for _ in range(n)]
    succs = [[] for _ in range(n)]
    for u, v in first.edges:
        preds[v].append(u)
        succs[u].append(v)
    supersets = [[m2 for m2 in masks if m2 != m and m2 & m == m] for m in masks]
    W = max(1, max(len(s) for s in supersets))
    if R * W > MAX_TRANSITIONS:
        raise PhazeError(f"the layer graph has too many candidate stages ({R} x {W}) for the exact placement")
    T = len(costs)
    shape = (T, R, W)
    dst = np.full((R, W), R, dtype=np.int64)
    arrays = {name: np.full(shape, INF) for name in ("work1", "work2", "grad", "base", "stash", "params", "acts",
                                                     "workmax", "bwdwin", "fwdwin")}
    terms = [layer_terms(problem, c) for c in costs]
    arrays.update(bytes_in=np.zeros(shape), bytes_out=np.zeros(shape))
    has_in = np.zeros(shape, dtype=bool)
    has_out = np.zeros(shape, dtype=bool)
    for r, m in enumerate(masks):
        for a, m2 in enumerate(supersets[r]):
            dst[r, a] = index[m2]
            layers = [v for v in range(n) if (m2 & ~m) >> v & 1]
            producers_in = sorted({u for v in layers for u in preds[v] if not (m2 & ~m) >> u & 1})
            producers_out = [v for v in layers if any(not (m2 >> w & 1) for w in succs[v])]
            for ti, c in enumerate(costs):
                kept, wset, rec = terms[ti]
                work = 0.0
                recs = 0.0
                bwdwin = fwdwin = 0.0
                for v in layers:
                    work += float(c.fwd_s[v]) + float(c.bwd_s[v])
                    recs += float(rec[v])
                    bwdwin += float(c.bwd_s[v]) + float(rec[v])
                    fwdwin += float(c.fwd_s[v])
                params = float(sum(c.params[v] for v in layers))
                acts = float(sum(kept[v] for v in layers))
                workmax = float(max(wset[v] for v in layers))
                b_in = float(sum(c.boundary_bytes[u] for u in producers_in))
                arrays["work1"][ti, r, a] = work + recs
                arrays["work2"][ti, r, a] = work + recs
                arrays["params"][ti, r, a] = params
                arrays["acts"][ti, r, a] = acts
                arrays["workmax"][ti, r, a] = workmax
                arrays["bwdwin"][ti, r, a] = bwdwin
                arrays["fwdwin"][ti, r, a] = fwdwin
                arrays["bytes_in"][ti, r, a] = b_in
                arrays["bytes_out"][ti, r, a] = float(sum(c.boundary_bytes[u] for u in producers_out))
                has_in[ti, r, a] = bool(producers_in)
                has_out[ti, r, a] = bool(producers_out)
                arrays["grad"][ti, r, a] = params * reduce_bytes(problem)
                arrays["base"][ti, r, a] = float(state_bytes(problem, np.float64(params), shard_d)) + acts + workmax
                arrays["stash"][ti, r, a] = acts
    sizes = np.array([m.bit_count() for m in masks])
    return StageStack(
        widths=tuple(c.tp for c in costs),
        n_layers=n,
        sizes=sizes,
        masks=masks,
        dst=dst,
        has_in=has_in,
        has_out=has_out,
        kmax=most_in_flight(arrays["base"], arrays["stash"], problem.hbm_bytes),
        cuts=[int(np.searchsorted(sizes, n - k, side="right")) for k in range(n + 1)],
        colcuts=[W] * (n + 1),
        layer_fwd=np.stack([c.fwd_s for c in costs]), layer_bwd=np.stack([c.bwd_s + tm[2] for c, tm in zip(costs, terms)]),
        layer_params=np.stack([c.params for c in costs]),
        **arrays,
    )


def stage_stack(problem: PlacementProblem, costs, force_dag: bool, full_width: bool = False, shard_d=1) -> StageStack:
    """The candidate stages; `base` holds the state sharded over shard_d replicas (ZeRO; scalar
    or [T, 1, 1]), the fast path's 1 when ZeRO is off."""
    if costs[0].is_chain() and not force_dag:
        width = costs[0].n_layers if full_width else chain_width(problem, costs)
        return chain_stack(problem, costs, width, shard_d)
    return dag_stack(problem, costs, shard_d)


# --------------------------------------------------------------------------------------------
# The bottleneck sweep
# --------------------------------------------------------------------------------------------


@dataclass
class Sweep:
    """f_k, the largest stage gradient G of the chosen split, and the chosen column.

    Arrays are [steps, blocks, rows] for k = k0 .. k0 + steps - 1 and the TP widths `blocks`.
    """

    k0: int
    blocks: np.ndarray
    f: np.ndarray
    g: np.ndarray
    arg: np.ndarray


def sweep_start(st: StageStack, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    f0 = np.full((blocks, st.rows + 1 + st.dst.shape[1]), INF)
    f0[:, st.rows - 1] = 0.0
    return f0, f0.copy()


def sweep(st: StageStack, blocks: np.ndarray, cost_at, k_from: int, k_to: int, f_prev, g_prev) -> Sweep:
    """f_k(D) = min_a max(cost_at(k, cut)[., D, a], f_{k-1}(dst[D, a])) for k = k_from..k_to.

    cost_at(k, cut, cols) gives the [blocks, cut, cols] stage costs at position k for the first
    `cut` rows and `cols` columns (the others cannot leave room for k stages). f_prev, g_prev:
    [blocks, R + 1 + W]: row R is the sentinel and the W rows after it pad the chain's windows,
    all infinite.
    """
    B = len(blocks)
    R = st.rows
    width = R + 1 + st.dst.shape[1]
    steps = max(0, k_to - k_from + 1)
    F = np.full((steps, B, width), INF)
    G = np.full((steps, B, width), INF)
    A = np.full((steps, B, R), -1, dtype=np.int64)
    grad = st.grad[blocks]
    bi = np.arange(B)[:, None]
    rows = np.arange(R)[None, :]
    chain = st.masks is None
    for s, k in enumerate(range(k_from, k_to + 1)):
        cut = st.cuts[k] if k < len(st.cuts) else 0
        if cut > 0:
            cols = st.colcuts[k]
            ri = rows[:, :cut]
            if chain:
                # dst[i, a] = i + a + 1: the next rows are a sliding window, no gather needed.
                step = f_prev.strides[1]
                ahead = np.lib.stride_tricks.as_strided(
                    f_prev[:, 1:], shape=(B, cut, cols), strides=(f_prev.strides[0], step, step), writeable=False
                )
                vals = np.maximum(cost_at(k, cut, cols), ahead)
                a = np.argmin(vals, axis=2)
                nxt = ri + a + 1
            else:
                dst = st.dst[:cut, :cols]
                vals = np.maximum(cost_at(k, cut, cols), f_prev[:, dst])
                a = np.argmin(vals, axis=2)
                nxt = dst[ri, a]
            F[s, :, :cut] = vals[bi, ri, a]
            G[s, :, :cut] = np.maximum(grad[bi, ri, a], g_prev[bi, nxt])
            A[s, :, :cut] = a
        f_prev, g_prev = F[s], G[s]
    return Sweep(k_from, np.asarray(blocks), F, G, A)


def walk(st: StageStack, arg_at, S: int) -> tuple[tuple[int, ...], ...]:
    """Rebuild the stages of f_S({}) from the chosen columns; arg_at(k) -> that step's row array."""
    stages = []
    row = 0
    for k in range(S, 0, -1):
        a = int(arg_at(k)[row])
        if a < 0:
            raise RuntimeError("placement DP: broken back-pointer")
        stages.append(st.members(row, a))
        row = int(st.dst[row, a])
    if row != st.rows - 1:
        raise RuntimeError("placement DP: reconstruction did not cover every layer")
    return tuple(stages)


@dataclass
class Best:
    time: float = INF
    tp: int = 0
    dp: int = 0
    stages: tuple = ()


def p2p_exposed_share(problem: PlacementProblem, S: int, m: int) -> float | None:
    """With overlapped point-to-point (`Training.overlap_p2p_comm`, interleaved, S > 1): the share of
    the schedule's steps in its warm-up and flush, (S - 1) / v of m + (S - 1) / v stage times, whose
    messages stay exposed (`StageStack.stage_time`); None when every message is exposed."""
    v = problem.training.virtual_stages
    if not (problem.training.overlaps_p2p and v > 1 and S > 1):
        return None
    return (S - 1) / v / (m + (S - 1) / v)


def stage_fit(state, acts, workmax, ok, hbm_bytes: float, S_only: int, v: int, m: int) -> np.ndarray:
    """Per candidate stage of one block, the most microbatches it can hold in flight within HBM
    (KMAX_CAP: any number), so that a stage at pipeline position k (k in flight) fits iff kmax >= k.
    Interleaved (S_only = the group's stage count): memory at position k from Megatron's in-flight
    chunk count, as placement.evaluate prices it; otherwise 1F1B's q = min(k, m), past m nothing grows."""
    if S_only:
        fits = np.zeros(np.broadcast(state, acts).shape, dtype=np.int64)
        for k in range(1, S_only + 1):
            chunks = min(2 * (k - 1) + (v - 1) * S_only + 1, m * v)
            mem = state + np.ceil(chunks * np.where(ok, acts, 0.0) / v) + np.where(ok, workmax, 0.0)
            fits += (mem <= hbm_bytes) & (fits == k - 1)
        kmax = np.where(ok, fits, 0)
        return np.where(kmax >= S_only, KMAX_CAP, kmax)
    base = np.where(ok, state + acts + workmax, INF)
    kmax = most_in_flight(base, np.where(ok, acts, INF), hbm_bytes)
    return np.where(kmax >= m, KMAX_CAP, kmax)


def epsilon_sweeps(st: StageStack, stats: dict, tail, kmax, time_g, active: dict, best: Best, record) -> None:
    """The best split of one group (fixed width, replicas and links) whose time is the pipeline
    multiplier x the bottleneck stage plus the largest stage's per-batch tail: an
    epsilon-constraint over the tail. Each sweep finds the least bottleneck C among splits whose
    stages all have tails below x, and its largest tail G; the next sweep lowers x to G, which only
    finds splits with C no smaller. `active` maps a stage count S to (multiplier, floor), the floor
    being the least largest tail any S-stage split has; S stops when C x mult + floor cannot beat
    `best.time` or G reaches its floor. `record(stages)` is called on each improvement, after
    `best.time` is set."""
    st_g = replace(st, grad=tail)
    x = INF
    while active:
        stats["sweeps"] = stats.get("sweeps", 0) + 1
        allowed = tail < x

        def cost_at(k, cut, cols, allowed=allowed):
            return np.where(allowed[:, :cut, :cols] & (kmax[:, :cut, :cols] >= k), time_g[:, :cut, :cols], INF)

        sw = sweep(st_g, np.array([0]), cost_at, 1, max(active), *sweep_start(st, 1))
        nxt = {}
        for S, (mult, floor) in active.items():
            C = float(sw.f[S - 1, 0, 0])
            G = float(sw.g[S - 1, 0, 0])
            if not math.isfinite(C):
                continue
            total = C * mult + G
            if total < best.time:
                best.time = total
                record(walk(st, lambda k, sw=sw: sw.arg[k - 1, 0], S))
            if C * mult + floor < best.time and G > floor:
                nxt[S] = (mult, floor, G)
        active = {S: mfg[:2] for S, mfg in nxt.items()}
        if active:
            x = max(mfg[2] for mfg in nxt.values())


def checked_by_evaluator(problem: PlacementProblem, placement: Placement, dp_time: float, method: str,
                         solver: str) -> PlacementResult:
    """The independent evaluator's result for the placement a DP chose; a DP whose own time for it
    differs (beyond rounding), or that chose a placement the evaluator finds infeasible, is a bug in
    one of the two, so it stops the run rather than report a number nobody checked."""
    result = evaluate_placement(problem, placement, method=method)
    if dp_time == 0 and not result.feasible:
        return result  # a model whose ops cost nothing: the evaluator's one-line reason
    if not result.feasible or abs(result.time_per_batch_s - dp_time) > RTOL * dp_time:
        raise RuntimeError(
            f"{solver} disagrees with the evaluator: DP {dp_time!r} s, evaluator "
            f"{result.time_per_batch_s!r} s ({result.reason or 'feasible'}) for {placement}"
        )
    return result


# --------------------------------------------------------------------------------------------
# Smallest memory any placement needs (the reason when nothing fits)
# --------------------------------------------------------------------------------------------


def min_memory_needed(problem: PlacementProblem, force_dag: bool = False) -> tuple[float, dict]:
    """The least, over every placement, of its fullest stage's memory per device, and where.

    For each (t, S) the most replicas d = N // (S t) give the fewest microbatches in flight, so the
    least memory; the split minimising the largest stage memory comes from the same sweep as the
    time DP with memory as the stage cost.
    """
    system = problem.system
    N = system.accelerators
    costs = [c for c in problem.costs if c.tp <= N]
    if not costs:
        return INF, {}
    # ZeRO: the state sharded over the most replicas any width has (a lower bound, for the message).
    st = stage_stack(problem, costs, force_dag, full_width=True, shard_d=max(1, N // costs[0].tp))
    blocks = np.arange(len(costs))
    base = st.base
    stash = np.where(np.isfinite(st.stash), st.stash, 0.0)

    def memory(k, cut, cols, b=None, q=None):
        q = k if q is None else min(k, q)
        sl = slice(None) if b is None else slice(b, b + 1)
        return base[sl, :cut, :cols] + (q - 1) * stash[sl, :cut, :cols]

    tops = [min(st.n_layers, N // c.tp) for c in costs]
    free = sweep(st, blocks, memory, 1, max(tops), *sweep_start(st, len(costs)))
    best = (INF, {})
    for b, c in enumerate(costs):
        groups: dict[int, list] = {}
        for S in range(1, tops[b] + 1):
            d = N // (S * c.tp)
            m = problem.microbatches(d)
            if S <= m:
                value = float(free.f[S - 1, b, 0])
            else:
                groups.setdefault(m, []).append((S, d))
                continue
            if value < best[0]:
                best = (value, {"tp": c.tp, "pp": S, "dp": d, "microbatches": m})
        for m, items in groups.items():
            top = max(S for S, _ in items)
            sw = sweep(st, np.array([b]), lambda k, cut, cols, b=b, m=m: memory(k, cut, cols, b, m), m + 1, top,
                        free.f[m - 1, b : b + 1], free.g[m - 1, b : b + 1])
            for S, d in items:
                value = float(sw.f[S - (m + 1), 0, 0])
                if value < best[0]:
                    best = (value, {"tp": c.tp, "pp": S, "dp": d, "microbatches": m})
    return best
