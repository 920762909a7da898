"""Proven upper bounds on a design's throughput, so the exhaustive sweep can skip what cannot win.

A grid point may be skipped only if no schedule and no placement could make it beat the best
design already evaluated. Both bounds below are built from *lower* bounds on every layer pass's
makespan, and the placement cost model (`solve.placement.evaluate`) is non-decreasing in every layer
time (stage times are sums of layer times; time per batch is (m + S - 1) x bottleneck + all-reduce),
so shorter layer times can only raise throughput. Everything is vectorised over designs.

Per layer pass, on each design (`pass_lower_bounds`), the largest of three sound bounds for the
scheduling semantics of `solve.schedule.solver` (the scheduler's own `solve.schedule.bounds`, restated on arrays
of designs, whole graph at once):

- critical path with every op at its faster mode;
- the link: collectives are serialised, so the earliest any can start + all of them + the least
  time after the last one;
- the timeline bound: split ops run alone and single-mode work shares the cores, so for any
  lam in [0, 1], makespan >= sum_i min(split_i, lam * tc_work_i / num_tc + (1 - lam) *
  vc_work_i / num_vc) over compute ops. We take the best of a fixed grid of lam values, each of
  which is valid on its own.

Level 0, `ideal_throughput`: with S stages, TP width t and d replicas (S t d <= N devices) and
m = ceil(B / (mbs d)) microbatches, time per batch >= m x bottleneck >= B / (mbs d) x W_t / S,
with W_t the per-microbatch sum of all layers' forward + backward lower bounds at width t. So
throughput <= mbs N / min_t (t W_t): perfect scaling with no bubble, no communication and no
memory limit. It holds for every HBM capacity and recipe (recompute, sequence parallelism, virtual
stages, ZeRO, overlap: each only adds time or memory over the ideal) of a design whose latencies
are no lower; the attention kernel changes the layer graph, so a space with both kernels takes
the larger of the two bounds (`solve.schedule.solver` makespans grow with latencies, and latencies fall with HBM
bandwidth), which lets one bound cover a whole architecture.

`pipeline_throughput` tightens level 0 with what every placement pays whatever its recipe: whole
microbatches and replicas, the pipeline bubble at the space's most virtual stages, and no stage
faster than its slowest layer (per TP and CP width). The sweep takes the smaller of the two.

Expert and context parallelism. EP adds no work per device (the balanced experts'
FLOPs are the traced ones; imbalance and all-to-alls only add), but it runs the experts' grouped
GEMMs as fewer experts of more tokens each, which can take less time than the traced EP-1 shape
(design/parallel.py, "Tokens per expert under EP"); a MoE layer's lower bounds therefore give up
the most any EP width saves on each design (`parallel.ep_expert_saving`): the EP-1 bound less
that is at most the layer's time at every width, so level 0 stands. With CP c a
stage's t c devices share each microbatch: time per batch >= B / (mbs d S) x W_{t,c} with W_{t,c}
the lower-bound work of the layers traced at s / c (the further ring-attention blocks only add), so
level 0 takes min over t and c of t c W_{t,c} (`WidthBounds.cp_bounds`). Level 1 runs the EP/CP
placement search with the sizes exact (expert parameters, all-to-all and K/V bytes) and the time
terms at their lower bounds: the experts' imbalance and the attention cores at zero (CP's per-step
time (c - 1) max(core, K/V hop) is non-decreasing in the core, so zero bounds it). All-gather CP
(`Training.cp_comm`) takes (c - 1) (core + K/V hop) per pass, at least the ring's (c - 1) max(core,
hop) and non-decreasing in the core too; its hop and its gathered K/V bytes on the working set
depend only on the exact K/V sizes and the link, so level 1, which runs the point's own recipe,
prices them as the evaluation does (the same memory fits), and level 0, which leaves every
communication out, stands for both.

MoE parallel folding (`Training.expert_tensor_parallel`) prices the experts' GEMMs at another width
than the layers these bounds are traced at, so neither level covers it: its declaration says so
(`bound=AT_DEFAULT`), a space sampling it is swept by evaluation (`training.bound_obstacles`), and
`placement_throughput` gives no bound (inf) for such a recipe.

Level 1, `placement_throughput`: the exact placement DP run on the lower-bound layer times of one
point (its HBM capacity and recipe). The DP is exact for its costs, and its optimum can only fall
with longer layer times, so its throughput bounds the point's; it also proves points with no memory-feasible placement (a
placement's memory does not depend on time). An overlapped reduction's exposed part is the one
term that shrinks as the backward grows: the bound counts it as 0, see `placement_throughput`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..hardware.latency import DesignArrays, estimate
from ..solve.placement.expert import optimal_placement
from ..solve.placement.types import LayerCosts, PlacementProblem
from ..training import Training
from ..workload.graphs import build_layer_graph
from ..workload.ops import NET, NONE, TC, TCVC, VC
from .parallel import cp_widths, ep_expert_saving, ep_widths, parallel_sizes

PASSES = ("fwd", "bwd")
LAMBDAS = np.linspace(0.0, 1.0, 21)
ROUNDING = 1e-9  # relative slack taken off every lower bound against floating-point rounding
CHUNK = 16384  # designs per estimate call, to keep [designs, ops] arrays small


def pass_lower_bounds(op_graph, single: np.ndarray, split: np.ndarray, num_tc: np.ndarray,
                      num_vc: np.ndarray) -> np.ndarray:
    """A lower bound on the optimal makespan of one layer pass on each design, seconds [n_designs]."""
    ops = op_graph.ops
    n_d = single.shape[0]
    if not ops:
        return np.zeros(n_d)
    units = [op.unit for op in ops]
    compute = np.array([u in (TC, VC, TCVC) for u in units])
    uses_tc = np.array([u in (TC, TCVC) for u in units])
    uses_vc = np.array([u in (VC, TCVC) for u in units])
    zero = np.array([u == NONE for u in units])
    # A split mode exists only with more than one core of the type; with one core split == single.
    fast = np.where(compute[None, :], np.minimum(single, split), single)
    fast[:, zero] = 0.0

    preds: list[list[int]] = [[] for _ in ops]
    succs: list[list[int]] = [[] for _ in ops]
    for a, b in op_graph.edges:
        preds[b].append(a)
        succs[a].append(b)
    # Ops on the first axis, designs contiguous on the second: each step below is one vector op.
    fast_t = np.ascontiguousarray(fast.T)
    head = np.zeros_like(fast_t)
    for j in range(len(ops)):  # ops are in topological order
        for p in preds[j]:
            np.maximum(head[j], head[p] + fast_t[p], out=head[j])
    tail = np.zeros_like(fast_t)
    for j in reversed(range(len(ops))):
        for s in succs[j]:
            np.maximum(tail[j], tail[s] + fast_t[s], out=tail[j])
    bound = (head + fast_t).max(axis=0)

    nets = [i for i, u in enumerate(units) if u == NET]
    if nets:
        link = head[nets].min(axis=0) + fast_t[nets].sum(axis=0) + tail[nets].min(axis=0)
        np.maximum(bound, link, out=bound)

    if compute.any():
        cols = np.flatnonzero(compute)
        s1, s2 = single[:, cols].T, split[:, cols].T
        a = np.where(uses_tc[cols][:, None], s1 / num_tc.reshape(1, -1), 0.0)
        b = np.where(uses_vc[cols][:, None], s1 / num_vc.reshape(1, -1), 0.0)
        for lam in LAMBDAS:
            np.maximum(bound, np.minimum(s2, lam * a + (1.0 - lam) * b).sum(axis=0), out=bound)
    return bound * (1.0 - ROUNDING)


@dataclass(frozen=True)
class WidthBounds:
    """Lower-bound times of each layer kind at one TP width, per design ([n_designs, n_kinds] s).

    Layers of one kind share op graphs, so a model's ~100 layers are a handful of kinds; the
    per-layer rows are expanded only for the design whose placement is bounded.
    """

    tp: int
    kind_fwd: np.ndarray
    kind_bwd: np.ndarray
    layer_kind: np.ndarray  # [n_layers] index into the kinds
    cp: int = 1  # the context-parallel width: these are the layers traced at seq / cp
    cp_bounds: tuple = ()  # the same at each further CP width of the model (cp > 1), for long sequences

    @property
    def work(self) -> np.ndarray:
        """Per-microbatch forward + backward time of all layers on one device group, [n_designs]."""
        counts = np.bincount(self.layer_kind, minlength=self.kind_fwd.shape[1]).astype(float)
        return (self.kind_fwd + self.kind_bwd) @ counts

    def layer_rows(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        return self.kind_fwd[row, self.layer_kind], self.kind_bwd[row, self.layer_kind]

    def take(self, rows) -> "WidthBounds":
        return WidthBounds(self.tp, self.kind_fwd[rows], self.kind_bwd[rows], self.layer_kind, self.cp,
                           tuple(w.take(rows) for w in self.cp_bounds))

    def all_cp(self) -> list["WidthBounds"]:
        """These bounds and those of every further CP width."""
        return [self, *self.cp_bounds]


def concat_bounds(chunks: list[WidthBounds]) -> WidthBounds:
    """Design rows of several chunks of one width, in order (CP bounds included)."""
    first = chunks[0]
    return WidthBounds(first.tp, np.concatenate([c.kind_fwd for c in chunks]), np.concatenate([c.kind_bwd for c in chunks]),
                       first.layer_kind, first.cp,
                       tuple(concat_bounds([c.cp_bounds[i] for c in chunks]) for i in range(len(first.cp_bounds))))


def layer_lower_bounds(model, designs: DesignArrays, mbs: int, system, tp: int,
                       attention: str | None = None, cp: int = 1) -> WidthBounds:
    """Lower bounds on every layer kind's forward and backward time at TP width `tp`, per design
    (with the given attention kernel; None: the model's own); for a model whose sequence CP may
    split, also at every further CP width (`cp_bounds`)."""
    further = ()
    if cp == 1:
        further = tuple(layer_lower_bounds(replace(model, seq=model.seq // c), designs, mbs, system, tp, attention, c)
                        for c in cp_widths(model)[1:] if tp * c <= system.accelerators)
    graph = build_layer_graph(model, tp, mbs, attention=attention)
    link = system.tp_link(tp)
    num_tc, num_vc = designs.num_tc[:, 0], designs.num_vc[:, 0]
    out = {p: np.empty((len(designs), len(graph.kinds))) for p in PASSES}
    for k, kind in enumerate(graph.kinds):
        for pass_name in PASSES:
            og = graph.op_graphs[kind][pass_name]
            for lo in range(0, len(designs), CHUNK):
                hi = min(lo + CHUNK, len(designs))
                lat = estimate(og, slice_designs(designs, lo, hi), interconnect=link)
                out[pass_name][lo:hi, k] = pass_lower_bounds(og, lat.single, lat.split, num_tc[lo:hi], num_vc[lo:hi])
        widths = ep_widths(model)[1:]
        if widths:  # what running the experts at an EP width can save (module docstring)
            for lo in range(0, len(designs), CHUNK):
                hi = min(lo + CHUNK, len(designs))
                saved = ep_expert_saving(graph.op_graphs[kind]["fwd"], graph.op_graphs[kind]["bwd"],
                                         slice_designs(designs, lo, hi), link, widths)
                for pass_name, s in zip(PASSES, saved):
                    out[pass_name][lo:hi, k] = np.maximum(0.0, out[pass_name][lo:hi, k] - s)
    layer_kind = np.array([graph.kinds.index(layer.kind) for layer in graph.layers], dtype=int)
    return WidthBounds(tp=tp, kind_fwd=out["fwd"], kind_bwd=out["bwd"], layer_kind=layer_kind, cp=cp, cp_bounds=further)


def slice_designs(designs: DesignArrays, lo: int, hi: int) -> DesignArrays:
    return designs.rows(lo, hi)


def ideal_throughput(widths: list[WidthBounds], mbs: int, accelerators: int) -> np.ndarray:
    """Level 0: sequences/s no placement of any HBM or recompute setting can exceed, [n_designs]."""
    device_seconds = np.min(np.stack([w.tp * w.cp * w.work for width in widths for w in width.all_cp()]), axis=0)
    with np.errstate(divide="ignore"):
        return np.where(device_seconds > 0, mbs * accelerators / device_seconds, np.inf)


def pipeline_throughput(widths: list[WidthBounds], mbs: int, accelerators: int, global_batch: int,
                        max_virtual_stages: int = 1) -> np.ndarray:
    """Level 0 too, tighter: sequences/s no placement of any HBM or recipe can exceed, [n_designs].

    With TP width t, S stages and d replicas (S t d <= N, S <= layers), the bottleneck stage time is
    at least max(W_t / S, the slowest layer's forward + backward) (a split's largest stage holds at
    least the mean and at least one layer), and the time per batch at least that times
    m + (S - 1) / v with m = ceil(B / (mbs d)) microbatches (Narayanan et al., SC'21, Sec. 2.2: the
    interleaved bubble, v at most the space's largest virtual stage count). Communication, memory,
    recompute and the per-batch tail only add. For each (t, S) the most replicas d = N // (S t)
    give the fewest microbatches; vectorised over designs.
    """
    best = np.full(widths[0].kind_fwd.shape[0], np.inf)
    v = max(1, int(max_virtual_stages))
    # With context parallelism c a stage is t x c devices, each running the layers traced at
    # seq / c (ring attention's further K/V blocks only add), so the same argument holds per (t, c).
    for w in (cw for width in widths for cw in width.all_cp()):
        per_kind = w.kind_fwd + w.kind_bwd
        present = np.unique(w.layer_kind)
        slowest = per_kind[:, present].max(axis=1)
        work = w.work
        n_layers = int(w.layer_kind.shape[0])
        group = w.tp * w.cp
        for S in range(1, min(n_layers, accelerators // group) + 1):
            d = accelerators // (S * group)
            m = -(-global_batch // (mbs * d))
            time = np.maximum(work / S, slowest) * (m + (S - 1) / v)
            np.minimum(best, time, out=best)
    with np.errstate(divide="ignore"):
        return np.where(best > 0, global_batch / best, np.inf)


# A process's layer sizes by (model, TP, CP and the recipe fields they read), each with its model
# object, so that an id freed and taken by another model never matches; cleared when full.
_SIZES: dict[tuple, tuple] = {}
SIZES_HELD = 4096


def layer_sizes(model, tp: int, cp: int, training: Training) -> LayerCosts:
    """The model's layers at TP width `tp` and CP width `cp` (traced at seq / cp) under the recipe's
    microbatch, attention kernel, sequence parallelism and expert TP, with the EP/CP sizes
    (`parallel_sizes`) and zero times: every design's level 1 prices these same sizes with its own
    layer times (`LayerCosts.with_times`), so they are built once a process, not once a design."""
    key = (id(model), tp, cp, training.mbs, training.attention, training.sequence_parallel, training.expert_tp(tp))
    held = _SIZES.get(key)
    if held is not None and held[0] is model:
        return held[1]
    m = replace(model, seq=model.seq // cp) if cp > 1 else model
    graph = build_layer_graph(m, tp, training.mbs, attention=training.attention)
    zeros = np.zeros(len(graph.layers))
    sizes = parallel_sizes(LayerCosts.from_layer_graph(graph, zeros, zeros, sequence_parallel=training.sequence_parallel),
                           m, training, cp)
    if len(_SIZES) >= SIZES_HELD:
        _SIZES.clear()
    _SIZES[key] = (model, sizes)
    return sizes


def placement_throughput(model, widths: list[WidthBounds], row: int, *, system, training: Training,
                         hbm_bytes: float, peak_flops: float) -> float:
    """Level 1: the optimal placement's throughput on design `row`'s lower-bound layer times.

    The memory facts (HBM capacity, the whole recipe `training`: recompute mode, sequence
    parallelism, virtual stages, ZeRO; the microbatch) are the point's own, so exactly the placements that fit the real
    evaluation fit here (the same interleaving constraint too); only times are bounds: the layer
    times (`widths`, which must be those of the recipe's attention kernel), selective recompute's
    attention-core time (0 here) and the optimizer step (not costed here). Every time term of the
    placement model grows with the layer times except an overlapped per-batch reduction's exposed
    part (reduction minus backward), which shrinks as the backward grows; with
    `overlap_grad_reduce` the bound therefore counts that part as 0 (`reduction_hidden`), which only
    lowers the time; likewise the weights' all-gather with `overlap_param_gather` (its exposed part,
    all-gather minus the stage's forward, shrinks as the forward grows; ZeRO-1's and 2's alike).
    (ZeRO-3's overlapped per-microbatch reduce-scatter needs no such care: it
    runs beside the stage's whole backward pass B, prefetched gathers included, so the stage time
    holds max(B, its gathers + scatter), non-decreasing in every layer time; ZeRO-2's likewise beside the stage's
    backward compute, which has no gathers; against the backward compute alone
    it would not be, since compute hidden under gathers lengthens the window but not the pass.)
    0.0 when no placement fits memory (then no schedule can make one fit).
    """
    if training.expert_tensor_parallel is not None and model.moe:
        return float("inf")  # folded experts run at another width than these layer bounds: no bound
    if training.recompute_modules is not None or training.recompute_ops or training.recompute_every != 1:
        return float("inf")  # module-level, op-level and every-n-th recompute are not in these layer rows: no bound
    graph = build_layer_graph(model, widths[0].tp, training.mbs, attention=training.attention)  # its layers and FLOPs
    kinds = [layer.kind for layer in graph.layers]

    def costs_of(w):
        return layer_sizes(model, w.tp, w.cp, training).with_times(*w.layer_rows(row))

    further = [costs_of(cw) for w in widths for cw in w.cp_bounds]
    # The imbalance only lengthens the experts' times, which the bound takes at zero (module docstring).
    problem = PlacementProblem(
        costs=tuple(costs_of(w) for w in widths),
        ep_widths=ep_widths(model), cp_widths=tuple(sorted({1, *(c.cp for c in further)})), cp_costs=tuple(further),
        system=system, hbm_bytes=hbm_bytes, peak_flops=peak_flops, training=training,
        seq_len=model.seq, model_flops_per_sequence=graph.train_flops_per_sequence,
        interleave_layers=max(kinds.count(k) for k in set(kinds)),
        reduction_hidden=training.overlap_grad_reduce or training.overlap_param_gather,
        fp8_transposed_copy=False,  # the fewest FP8 weight copies any chip keeps: a bound for every chip
        top_k=model.top_k if model.moe else 1,
        router_groups=(model.router_groups, model.router_group_topk),
    )
    result = optimal_placement(problem)
    return float(result.throughput) if result.feasible else 0.0


def relaxed_recipe(training: Training) -> Training:
    """The recipe a group bound runs (`group_placement_throughput`): `training` with the fields the
    relaxation takes the best of (recompute mode, sequence parallelism, attention kernel) cleared.
    Recipes with the same relaxed recipe share every other field, including any added later, so they
    may be bounded together."""
    return replace(training, recompute="none", recompute_modules=None, recompute_every=1, recompute_ops=False,
                   sequence_parallel=False, attention=None,
                   placement="optimal")


def group_placement_throughput(model, widths_by_attention: dict, row: int, *, system, recipes: Sequence[Training],
                               hbm_bytes: float, peak_flops: float) -> float:
    """Level 1 for a group of recipes at once: `recipes`, which share their microbatch, virtual stage
    count, ZeRO stage and overlap choice and may differ in attention kernel (`widths_by_attention`:
    kernel -> its lower-bound layer times), recompute mode and sequence parallelism.

    One placement DP on a relaxed problem: per layer the least forward and backward lower bound over
    the kernels, no recompute time, the least bytes kept per microbatch over every kernel, mode and
    SP choice, no recompute working set, the least boundary bytes. Every recipe of the group has,
    for every placement, no less time (each time term is non-decreasing in the layer, recompute and
    transfer times; see `placement_throughput`) and no less memory, under the same constraints, so
    this bound is at least each of their level-1 bounds. inf when the kernels' layer graphs differ
    in shape, or the model may use expert or context parallelism (no relaxation then).
    """
    shared = {relaxed_recipe(r) for r in recipes}
    if len(shared) != 1:
        raise ValueError("group_placement_throughput: the recipes may differ only in recompute, sequence "
                         "parallelism and attention kernel")
    relaxed = shared.pop()
    mbs = relaxed.mbs
    if any(r.recompute_modules is not None or r.recompute_ops or r.recompute_every != 1 for r in recipes):
        return float("inf")  # the kept bytes below are by mode only: no bound for module-level recompute
    recomputes = {r.recompute for r in recipes}
    sequence_parallels = {r.sequence_parallel for r in recipes}
    if ep_widths(model) != (1,) or any(w.cp_bounds for ws in widths_by_attention.values() for w in ws):
        return float("inf")  # the relaxation below fixes EP = CP = 1: no bound for models that may use them
    per_kernel = {}
    for attention, widths in widths_by_attention.items():
        per_kernel[attention] = [build_layer_graph(model, w.tp, mbs, attention=attention) for w in widths]
    graphs0 = next(iter(per_kernel.values()))
    shape = [(len(g.layers), tuple(g.edges)) for g in graphs0]
    if any([(len(g.layers), tuple(g.edges)) for g in graphs] != shape for graphs in per_kernel.values()):
        return float("inf")
    costs = []
    for i, w0 in enumerate(next(iter(widths_by_attention.values()))):
        fwd = np.min([widths[i].layer_rows(row)[0] for widths in widths_by_attention.values()], axis=0)
        bwd = np.min([widths[i].layer_rows(row)[1] for widths in widths_by_attention.values()], axis=0)
        layers = [graphs[i].layers for graphs in per_kernel.values()]
        kept = [min(l.activation_bytes_for(mode, sp) for ls in layers for l in (ls[j],) for mode in recomputes
                    for sp in sequence_parallels) for j in range(len(layers[0]))]
        g0 = graphs0[i]
        costs.append(LayerCosts(
            tp=w0.tp, fwd_s=fwd, bwd_s=bwd, params=[l.params for l in g0.layers], activation_bytes=kept,
            boundary_bytes=[min(ls[j].boundary_bytes_for(sp) for ls in layers for sp in sequence_parallels)
                            for j in range(len(g0.layers))],
            input_bytes=[min(ls[j].input_bytes for ls in layers) for j in range(len(g0.layers))],
            edges=tuple(g0.edges), names=tuple(l.name for l in g0.layers)))
    kinds = [layer.kind for layer in graphs0[0].layers]
    # The relaxation runs the group's shared fields with no recompute (its kept bytes are the least above).
    problem = PlacementProblem(
        costs=tuple(costs), system=system, hbm_bytes=hbm_bytes, peak_flops=peak_flops, training=relaxed,
        seq_len=model.seq, model_flops_per_sequence=graphs0[0].train_flops_per_sequence,
        interleave_layers=max(kinds.count(k) for k in set(kinds)),
        reduction_hidden=relaxed.overlap_grad_reduce or relaxed.overlap_param_gather,
        fp8_transposed_copy=False,  # as in placement_throughput
    )
    result = optimal_placement(problem)
    return float(result.throughput) if result.feasible else 0.0
