"""Evaluate one design: workload graphs -> operator latencies -> per-layer ILP -> placement DP.

    evaluate(model, arch, Training(mbs, recompute, placement, ...), system="default") -> DesignResult

The recipe travels whole: every caller builds one `Training` (a study from its point with
`Training.from_point`, the CLI from its flags) and every layer below reads what it needs of it.

The study, the exhaustive sweep and `phaze-opt evaluate` all go through `evaluate`, so a
design means the same thing everywhere. It never raises for a design that cannot train: the result
is then infeasible with the reason (for example the least memory any placement needs against the
HBM). Mistakes in the request itself (unknown model, malformed placement) are `PhazeError`s.

Reuse. The per-layer costs depend only on the model, the compute part of the architecture
(`Accelerator.compute_key`: not the HBM capacity), the microbatch and the TP links of the system.
They are memoised in-process under that content key, so grid points that differ only in HBM
capacity or recompute pay for the placement DP alone; below that, layer graphs are cached on disk
by the workload module and schedules on disk by content by the scheduler.

A layer pass whose ILP stops at its time limit does not fail the design. Its verified incumbent
schedule gives the layer time (an achievable schedule, so the throughput is one this chip really
reaches) and the solver's proven lower bound gives a second, optimistic set of layer times. The
placement run on those lower bounds is an upper bound on the design's throughput, because a
placement's time per batch never falls when a layer time rises and memory does not depend on time.
Such a result has `proven=False`, `throughput_bound` > `throughput` and the unproven passes listed.
When the bound equals the throughput (the open passes do not matter to the best placement, e.g.
a TP width it does not use), the throughput is proven after all: `proven=True`, with the open
passes still listed in `unproven`. Only a solver error raises.

Energy per batch (`energy_j`, hardware/energy.py) is filled for feasible designs: per-layer energies
(each op in the mode its schedule chose) are memoised under the same content key plus the energy
constants; only the cheap per-placement sum runs on every call.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..activity import phase
from ..cache import BoundedMemo
from ..errors import PhazeError
from ..hardware.accelerator import Accelerator
from ..hardware.area import area_mm2
from ..hardware.energy import batch_energy, layer_energies, load_constants as load_energy_constants, op_energy
from ..hardware.latency import estimate
from ..solve.placement.expert import optimal_placement
from ..solve.placement.dp import even_placement
from ..solve.placement.evaluate import evaluate_placement
from ..solve.placement.types import LayerCosts, PlacementProblem
from ..solve.schedule.solver import schedule_graph
from ..system import System, load_system
from ..training import EXPERT, OPTIMAL, Expert, Fixed, Layout, Training
from ..workload.graphs import SP_COLLECTIVE, adopt, memo_entries
from ..workload.kinds import BLOCK_KINDS
from ..workload.stack import recipe_graph, recompute_tags
from ..workload.models import ModelConfig, load_model
from .parallel import attention_core_s, check_expert_tp, cp_traces, ep_widths as model_ep_widths, parallel_setup

PASSES = ("fwd", "bwd")
PROVEN_REL_TOL = 1e-9  # a bound this close to the throughput reached proves it (rounding only)
DEFAULT_ILP_TIME_LIMIT_S = 60.0  # per layer pass; a pass not proven optimal by then counts as unproven
# Below this many parameters a model's layers trace and schedule in seconds at every width, less than
# starting the worker processes costs (each imports torch, ~3 s of CPU); at or above it (Llama 3
# 405B: 30 graphs of 1-2 s each to trace and schedule) `jobs` processes share the widths. Counted
# as 12 layers x hidden^2 (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec. 2.1:
# the non-embedding parameters of a transformer with a 4 x hidden FFN), which needs no tracing.
SIDE_BY_SIDE_MIN_PARAMS = 10**10


@dataclass
class DesignResult:
    feasible: bool
    reason: str  # "" when feasible
    throughput: float  # sequences/s; 0.0 when infeasible
    tokens_per_s: float
    time_per_batch_s: float  # inf when infeasible
    area_mm2: float
    mfu: float
    placement: dict  # {"tp", "pp", "dp", "microbatches", "stages": [...]}
    timings: dict  # {"graph_s", "estimate_s", "ilp_s", "dp_s"}
    layers: list = field(default_factory=list)  # per-layer cost table at the chosen TP width
    model: str = ""
    energy_j: float | None = None  # per batch, when the hardware model provides it
    schedules: dict = field(default_factory=dict)  # per TP width: solve status counts
    proven: bool = True  # `throughput` is proven to be this design's best (see the module docstring)
    throughput_bound: float = 0.0  # proven upper bound on the throughput (== throughput when proven)
    unproven: list = field(default_factory=list)  # "tp{t} {kind}/{pass}: gap g" per pass not proven
    note: str = ""  # what stood in for what was asked (the optimal placement for a missing expert one)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _TpCosts:
    costs: LayerCosts
    table: list  # per-layer rows for reports
    statuses: dict  # schedule status -> count
    timings: dict
    modes: dict = field(default_factory=dict)  # (kind, pass) -> per op: ran split (schedule), for energy
    key: tuple = ()  # the memo key (content) of these costs
    bound_costs: LayerCosts | None = None  # the same with proven lower-bound layer times; None: all proven
    unproven: tuple = ()  # "{kind}/{pass}: gap g" of each pass whose schedule is not proven optimal


# Per-layer costs at one TP width, ~50 kB each for a 100-layer model: 4096 of them are ~200 MB, a few
# hundred designs' worth of TP widths (a sweep revisits a design's compute part while its HBM and
# recompute choices run, then moves on). A miss re-reads the schedules from their disk cache.
MEMO_MAX = 4096
_COSTS_MEMO: BoundedMemo = BoundedMemo(MEMO_MAX)
_ENERGY_MEMO: BoundedMemo = BoundedMemo(MEMO_MAX)


def sp_collective_s(op_graph, single) -> float:
    """Seconds of a pass's sequence-parallel collectives (reduce-scatter + all-gather pairs), what
    `--tp-comm-overlap` pipelines with the GEMMs around them."""
    return float(sum(single[i] for i, op in enumerate(op_graph.ops) if op.collective == SP_COLLECTIVE))


# What Transformer Engine's userbuffers overlap (Megatron-Core `--tp-comm-overlap`) leaves exposed of a
# pass's SP collectives, as a fraction of their time. Each SP op is a reduce-scatter out of a
# row-parallel GEMM plus an all-gather into the next column-parallel one (half its time each). The
# plan is the `ub_tp_comm_overlap_cfg` NVIDIA ships for H100 (NeMo launcher configs, e.g.
# dgxc-benchmarking v24.11.1 llama3.1/llama3.1_70b.yaml and nemo_megatron/gpt3_175b_hydra.yaml, the
# same methods and SM counts in both): forward reduce-scatters `pipeline` with num_splits 4 and
# num_sm 16-24 of the 132 SMs (proj_fprop 24, fc2_fprop 16-20), forward all-gathers `ring_exchange`
# with 1 SM (the copy engines move the data); backward reduce-scatters `bulk` under the weight
# gradient GEMM with 4-24 SMs (fc1_wgrad 4, qkv_wgrad 24), backward all-gathers `ring_exchange` or
# `bulk` with 1-4 SMs. Two costs remain (Wang et al., ASPLOS 2023, Sec. 4: the decomposed GEMM
# waits for the last chunk's collective; the collective kernels occupy SMs the GEMM then lacks):
# a pipelined reduce-scatter's last of num_splits chunks runs after the GEMM (1/4 of it exposed),
# and while a collective runs, its num_sm SMs are taken from the GEMM beside it (num_sm / 132 of
# the collective's time lost to compute). Per pass: forward 0.5 (20/132 + 1/4) + 0.5 (1/132),
# backward 0.5 (14/132) + 0.5 (2/132), the SM counts the middles of their ranges. Taken as shares
# of the chip's cores, the same on any design.
UB_SMS = 132  # H100 SXM's SMs, which the config's num_sm counts are out of
UB_EXPOSED = {
    "fwd": 0.5 * (20 / UB_SMS + 1 / 4) + 0.5 * (1 / UB_SMS),
    "bwd": 0.5 * (14 / UB_SMS) + 0.5 * (2 / UB_SMS),
}


def overlapped_pass_s(pass_s: float, comm_s: float, exposed: float = 0.0) -> float:
    """A pass of `pass_s` whose collectives (`comm_s`, on its critical path) overlap the rest of
    it: max(pass - comm + exposed x comm, comm), what the compute cannot cover plus the `exposed`
    share the overlap itself costs (`UB_EXPOSED`), never more than the pass run without overlap.
    Non-decreasing in `pass_s`, so a lower bound on the pass gives a lower bound on this."""
    return min(pass_s, max(pass_s - (1.0 - exposed) * comm_s, min(comm_s, pass_s)))


def recomputed_s(op_graph, split, op_modules: dict, tags) -> float:
    """Time of a forward pass's ops made inside the recompute modules `tags` (an op by the modules
    around the traced node it writes, `LayerGraph.extra["forward_modules"]`), each spread over all
    cores of its type (`split`), one after another: what module-level recompute runs again before
    the layer's backward, as `attention_core_s` prices the attention core's."""
    if not tags:
        return 0.0
    return float(sum(split[i] for i, op in enumerate(op_graph.ops)
                     if set(op_modules.get(op.name, "").split(",")) & tags))


def op_policy_tags(op_graph, rerun) -> dict:
    """The forward ops torchtitan's op-level policy reruns (`rerun`: the traced ops it does not
    keep, workload/trace.py), tagged "op" for `recomputed_s`, with the low-precision cast of each
    rerun GEMM's operand (workload/precision.py names it `<gemm>.cast_<format>`): it reruns with the
    GEMM it feeds."""
    rerun = set(rerun)
    return {op.name: "op" for op in op_graph.ops if op.name in rerun or op.name.rpartition(".cast_")[0] in rerun}


def _link_key(link) -> tuple:
    return (float(link.bandwidth), float(link.latency))


def layer_costs(model: ModelConfig, arch: Accelerator, training: Training, system: System, tp: int,
                ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S) -> _TpCosts:
    """Per-layer forward/backward time and memory facts at TP width tp.

    Times are proven-optimal schedules, or incumbents of passes that hit the ILP time limit (then
    `bound_costs` holds the proven lower bounds as well; see the module docstring). Memory by
    recompute mode follows the recipe's sequence parallelism; `attention` picks the kernel;
    `precision` the linear layers' GEMM format (workload/precision.py). `tp_comm_overlap`
    (`Training.tp_comm_overlap`): each pass's SP collectives run beside its compute, max(T - C + x C, C)
    with x the share the userbuffers plan leaves exposed (`overlapped_pass_s`, `UB_EXPOSED`), the proven lower bounds likewise (non-decreasing in T, so they stay
    bounds). Only the recipe fields that change a layer's time or memory key the memo
    (`Training.layer_key`), so recipes that differ elsewhere share the work.
    """
    sequence_parallel, tp_comm_overlap = training.sequence_parallel, training.tp_comm_overlap
    link = system.tp_link(tp)
    key = _costs_key(model, arch, training, system, tp, ilp_time_limit_s)
    hit = _COSTS_MEMO.get(key)
    if hit is not None:  # the work was paid for by an earlier call: this one spent nothing on it
        return replace(hit, timings={"graph_s": 0.0, "estimate_s": 0.0, "ilp_s": 0.0})
    timings = {"graph_s": 0.0, "estimate_s": 0.0, "ilp_s": 0.0}
    t0 = time.perf_counter()
    # SP's collectives: reduce-scatter + all-gather (the same cost as the all-reduce)
    graph = recipe_graph(model, tp, training, sequence_parallel=sequence_parallel)
    timings["graph_s"] += time.perf_counter() - t0
    times: dict[tuple[str, str], float] = {}
    core_s: dict[str, float] = {}
    module_s: dict[str, float] = {}  # module-level recompute's forward again (Training.recompute_modules)
    op_policy_s: dict[str, float] = {}  # torchtitan's op-level policy's forward again (Training.recompute_ops)
    module_tags = recompute_tags(training)
    lower: dict[tuple[str, str], float] = {}
    unproven = []
    statuses: dict[str, int] = {}
    modes: dict[tuple[str, str], tuple[bool, ...]] = {}
    for kind in graph.kinds:
        for pass_name in PASSES:
            op_graph = graph.op_graphs[kind][pass_name]
            t0 = time.perf_counter()
            with phase(f"solving {model.name}'s {kind}/{pass_name} schedule (tp {tp})"):
                lat = estimate(op_graph, [arch], interconnect=link)
                t1 = time.perf_counter()
                sched = schedule_graph(op_graph, lat.single[0], lat.split[0], arch, time_limit_s=ilp_time_limit_s)
            t2 = time.perf_counter()
            timings["estimate_s"] += t1 - t0
            timings["ilp_s"] += t2 - t1
            if pass_name == "fwd":
                core_s[kind] = attention_core_s(op_graph, lat.split[0])
                module_s[kind] = recomputed_s(op_graph, lat.split[0], graph.extra.get("forward_modules", {}).get(kind, {}),
                                              module_tags)
                if training.recompute_ops:
                    rerun = op_policy_tags(op_graph, graph.extra.get("op_policy_rerun", {}).get(kind, ()))
                    op_policy_s[kind] = recomputed_s(op_graph, lat.split[0], rerun, {"op"})
            if sched.status not in ("optimal", "time_limit"):
                raise RuntimeError(f"schedule of {model.name} {kind}/{pass_name} (tp {tp}) failed: {sched.status}")
            label = sched.method if sched.status == "optimal" else "time_limit"
            statuses[label] = statuses.get(label, 0) + 1
            times[(kind, pass_name)] = sched.makespan
            lower[(kind, pass_name)] = sched.makespan if sched.status == "optimal" else sched.lower_bound
            if tp_comm_overlap and sequence_parallel:
                comm = sp_collective_s(op_graph, lat.single[0])
                times[(kind, pass_name)] = overlapped_pass_s(times[(kind, pass_name)], comm, UB_EXPOSED[pass_name])
                lower[(kind, pass_name)] = overlapped_pass_s(lower[(kind, pass_name)], comm, UB_EXPOSED[pass_name])
            if sched.status != "optimal":
                unproven.append(f"{kind}/{pass_name}: gap {sched.makespan / sched.lower_bound - 1:.1e}")
            modes[(kind, pass_name)] = tuple(sched.split)
    layers = graph.layers
    # Selective recompute runs the attention core again only where it was dropped (not with flash,
    # whose core was never kept).
    costs = LayerCosts.from_layer_graph(
        graph,
        [times[(l.kind, "fwd")] for l in layers],
        [times[(l.kind, "bwd")] for l in layers],
        selective_s=[min(core_s.get(l.kind, 0.0), times[(l.kind, "fwd")]) if l.attention_core_bytes > 0 else 0.0
                     for l in layers],
        sequence_parallel=sequence_parallel,
        module_tags=module_tags,
        module_s=[min(module_s.get(l.kind, 0.0), times[(l.kind, "fwd")]) for l in layers],
        # `moe` reruns the MoE layer whole: its all-to-alls too (placement.evaluate)
        module_moe=[float("moe" in module_tags and l.module_bytes({"moe"}) > 0) for l in layers],
        op_policy_s=[min(op_policy_s.get(l.kind, 0.0), times[(l.kind, "fwd")]) if l.kind in BLOCK_KINDS else 0.0
                     for l in layers],
    )
    bound_costs = None
    if unproven:
        bound_costs = replace(costs, fwd_s=[lower[(l.kind, "fwd")] for l in layers],
                              bwd_s=[lower[(l.kind, "bwd")] for l in layers])
    table = [
        {
            "name": l.name,
            "kind": l.kind,
            "fwd_s": times[(l.kind, "fwd")],
            "bwd_s": times[(l.kind, "bwd")],
            "param_bytes": l.param_bytes,
            "activation_bytes": l.activation_bytes,
            "boundary_bytes": l.boundary_bytes,
        }
        for l in layers
    ]
    out = _TpCosts(costs=costs, table=table, statuses=statuses, timings=timings, modes=modes, key=key,
                   bound_costs=bound_costs, unproven=tuple(unproven))
    _COSTS_MEMO[key] = out
    return out


def _costs_key(model: ModelConfig, arch: Accelerator, training: Training, system: System, tp: int,
               ilp_time_limit_s: float) -> tuple:
    """What `layer_costs` depends on, its memo's key."""
    return ((model, arch.compute_key, tp, _link_key(system.tp_link(tp)), system.precision, float(ilp_time_limit_s))
            + training.layer_key())


def costs_side_by_side(tasks, arch: Accelerator, training: Training, system: System, ilp_time_limit_s: float,
                       jobs: int) -> dict:
    """`layer_costs` of each (model, TP width) of `tasks` not memoised yet, computed in up to `jobs`
    processes at once and memoised here: {(model, tp): costs}. The widths are independent work (a
    graph to trace, its passes to schedule), and a cold evaluation of a 10^11-parameter model is
    mostly that work. Empty, leaving the work to the caller's own process, with `jobs` < 2, fewer
    than two tasks to do, or a model below SIDE_BY_SIDE_MIN_PARAMS. The workers write the graph and
    schedule disk caches as this process would, and hand back the graphs they traced (`_worker_costs`)."""
    todo = [(m, t) for m, t in dict.fromkeys(tasks)
            if _COSTS_MEMO.get(_costs_key(m, arch, training, system, t, ilp_time_limit_s)) is None]
    if jobs < 2 or len(todo) < 2 or 12 * todo[0][0].layers * todo[0][0].hidden ** 2 < SIDE_BY_SIDE_MIN_PARAMS:
        return {}
    workers = min(jobs, len(todo))
    # spawn, as the study's pools: a forked child would inherit this process's threads and torch state
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        with phase(f"tracing and scheduling {todo[0][0].name}'s layers at {len(todo)} widths in {workers} processes"):
            futures = [pool.submit(_worker_costs, m, arch, training, system, t, ilp_time_limit_s) for m, t in todo]
            done = {}
            for task, f in zip(todo, futures):
                done[task], graphs = f.result()
                adopt(graphs)
    except BaseException:  # a stop request, or a width that failed: the others' work is not wanted
        # A worker would finish its solve first (seconds to minutes); it holds nothing a kill can
        # spoil (the caches are written whole or not at all), so end it now.
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=False)  # idle workers exit on their own; this process need not wait for them
    for costs in done.values():
        _COSTS_MEMO[costs.key] = costs
    return done


def _worker_costs(model, arch, training, system, tp, ilp_time_limit_s):
    """`layer_costs` in a worker process, with the layer graphs it traced or read for them, so that
    the process that started it holds them too (the placement's EP and CP terms read them)."""
    held = {key for key, _ in memo_entries()}
    costs = layer_costs(model, arch, training, system, tp, ilp_time_limit_s)
    return costs, [(key, graph) for key, graph in memo_entries() if key not in held]


def tp_layer_energies(model: ModelConfig, arch: Accelerator, training: Training, system: System, tp_costs: _TpCosts):
    """Per-layer (fwd, bwd) energy [n_layers, 4] J per device and microbatch at the costs' TP width,
    with every op in the mode its schedule chose (the graph `training` runs, without SP's collectives);
    memoised by the costs' content key and the constants."""
    constants = load_energy_constants()
    key = (tp_costs.key, constants)
    hit = _ENERGY_MEMO.get(key)
    if hit is not None:
        return hit
    tp = tp_costs.costs.tp
    # the ops the schedules chose modes for (the casts included); a low-precision GEMM is charged
    # the BF16 MAC energy (the energy model has one MAC energy), its operand bytes at the format's
    graph = recipe_graph(model, tp, training)
    intra = system.tp_within_node(tp)
    passes = {}
    for kind in graph.kinds:
        for pass_name in PASSES:
            e = op_energy(graph.op_graphs[kind][pass_name], [arch], split=tp_costs.modes.get((kind, pass_name)),
                          intra_node=intra, constants=constants)
            passes[(kind, pass_name)] = e.by_component()[0]
    out = layer_energies(graph, passes)
    _ENERGY_MEMO[key] = out
    return out


def _design_energy(model, arch, training: Training, system, tp_costs: _TpCosts, result, area: float) -> float:
    fwd, bwd = tp_layer_energies(model, arch, training, system, tp_costs)
    stages = [st.layers for st in result.stages]
    return batch_energy(fwd, bwd, tp_costs.costs, stages, result.dp, result.microbatches, training.recompute,
                        result.time_per_batch_s, area, system,
                        recompute_core="core_attn" in training.recomputed_modules, training=training).total_j


def check_ilp_time_limit(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0 \
            or not np.isfinite(value):
        raise PhazeError(f"--ilp-time-limit: must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DesignEvaluator:
    """The real evaluator (`evaluate`) at a per-pass ILP time limit; picklable, so study
    workers get it too. A `protocols.BoundedEvaluator`: the proven throughput bounds hold for it."""

    ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S

    jobs: int = 1  # processes that may share a cold evaluation's layer costs (`costs_side_by_side`)

    def __call__(self, model, arch: Accelerator, training: Training, system="default") -> DesignResult:
        return evaluate(model, arch, training, system, self.ilp_time_limit_s, self.jobs)


def design_evaluator(ilp_time_limit_s: float | None = None, jobs: int = 1) -> DesignEvaluator:
    """The real evaluator, with a per-pass ILP time limit other than the default when one is given,
    computing a cold design's layer costs in up to `jobs` processes (a study's workers keep 1: they
    are the parallelism there)."""
    if ilp_time_limit_s is None:
        return DesignEvaluator(jobs=jobs)
    return DesignEvaluator(check_ilp_time_limit(ilp_time_limit_s), jobs)


def tp_widths(model: ModelConfig, system: System) -> tuple[int, ...]:
    """The model's TP widths that fit in the system."""
    return tuple(t for t in model.tp_widths if t <= system.accelerators)


def training_problem(model, arch: Accelerator, training: Training, system, widths=None,
                     ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S):
    """The PlacementProblem of a design trained by `training`, plus per-TP cost tables and the work timings:
    (model, system, problem, per_tp)."""
    return _training_problem(model, arch, training, system, widths, ilp_time_limit_s)[:4]


def _training_problem(model, arch: Accelerator, training: Training, system, widths, ilp_time_limit_s: float,
                      jobs: int = 1):
    """`training_problem`, plus what `evaluate`'s throughput bound needs of an EP/CP problem: the
    PlacementProblem fields with proven lower-bound layer times (None: the per-TP bound costs serve)
    and the layer passes its CP traces left open."""
    model = load_model(model)
    if model.moe and training.capacity_factor != model.capacity_factor:
        model = replace(model, capacity_factor=training.capacity_factor)
    system = system if isinstance(system, System) else load_system(system)
    widths = tuple(widths) if widths else tp_widths(model, system)
    fixed = fixed_layout(model, training)
    # Every width's costs, and those of the shorter sequences context parallelism prices, side by
    # side where that pays; what that leaves (or all of it) here, one after another.
    fresh = costs_side_by_side([(model, t) for t in widths] + [(short, t) for _, short, t in
                                                               cp_traces(model, system, widths, fixed)],
                               arch, training, system, ilp_time_limit_s, jobs)
    per_tp = {t: fresh.get((model, t)) or layer_costs(model, arch, training, system, t, ilp_time_limit_s)
              for t in widths}
    graph = recipe_graph(model, widths[0], training)
    kinds = [l.kind for l in graph.layers]
    repeated = max(kinds.count(k) for k in set(kinds))  # the decoder layers Megatron interleaves
    problem = PlacementProblem(
        costs=tuple(v.costs for v in per_tp.values()),
        system=system,
        hbm_bytes=arch.hbm_bytes,
        peak_flops=arch.peak_flops,
        seq_len=model.seq,
        model_flops_per_sequence=graph.train_flops_per_sequence,
        hbm_bandwidth=float(arch.hbm_bw * arch.efficiency.hbm_fraction),  # a streaming kernel (efficiency.py)
        interleave_layers=repeated,
        training=training,
        fp8_transposed_copy=not arch.tc_fp8_any_layout,
        top_k=model.top_k if model.moe else 1,
        router_groups=(model.router_groups, model.router_group_topk),
    )
    # Expert and context parallelism (design/parallel.py): nothing changes for a dense
    # model at a short sequence.

    def short_costs(short, t):
        v = layer_costs(short, arch, training, system, t, ilp_time_limit_s)
        return v.costs, v.bound_costs, v.unproven

    extra = parallel_setup(model, arch, training, system, {t: (v.costs, v.bound_costs) for t, v in per_tp.items()},
                           short_costs, fixed)
    bounds, unproven = None, []
    if extra:
        bounds, unproven = extra.pop("bounds"), extra.pop("unproven")
        problem = replace(problem, **extra)
    return model, system, problem, per_tp, bounds, unproven


def fixed_layout(model: ModelConfig, training: Training) -> Layout | None:
    """The layout a recipe's placement fixes: the model config's own for `Expert`, the given one for
    `Fixed`, None for `Optimal` (the DP chooses)."""
    match training.placement:
        case Fixed(layout=layout):
            return layout
        case Expert():
            return model.expert_placement
    return None


def _check_tp(layout: Layout, widths, model: ModelConfig) -> None:
    if layout.tp not in widths:
        raise PhazeError(f"placement tp={layout.tp}: TP width not allowed for {model.name}; "
                         f"allowed: {', '.join(map(str, widths))}")


def _fixed_placement(problem: PlacementProblem, model: ModelConfig, training: Training):
    layout = fixed_layout(model, training)
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    _check_tp(layout, problem.tp_widths, model)
    ep, cp = layout.ep, layout.cp
    if ep not in model_ep_widths(model) and not (model.moe and model.experts % ep == 0):
        raise PhazeError(f"placement ep={ep}: must divide the {model.experts} experts of {model.name}"
                         if model.moe else f"placement ep={ep}: {model.name} has no experts; use ep=1")
    check_expert_tp(model, training)
    if cp > 1 and model.seq % (2 * cp):
        raise PhazeError(f"placement cp={cp}: the sequence of {model.seq} tokens must split into 2 x cp equal chunks")
    return replace(even_placement(problem, tp, pp, dp), ep=ep, cp=cp)


def evaluate(model, arch: Accelerator, training: Training, system="default",
             ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S, jobs: int = 1) -> DesignResult:
    """Throughput of one design: `arch` trained by `training` (its placement the best or the given one);
    a cold one's layer costs computed in up to `jobs` processes (`costs_side_by_side`)."""
    check_ilp_time_limit(ilp_time_limit_s)
    model_cfg = load_model(model)
    if arch.mac_rate(training.precision) is None:
        return unsupported_precision(model_cfg, arch, training)
    training, note = _without_missing_expert(model_cfg, training)
    fixed = fixed_layout(model_cfg, training)
    widths = None
    if fixed is not None:
        _check_tp(fixed, model_cfg.tp_widths, model_cfg)
        widths = (fixed.tp,)
    model_cfg, system, problem, per_tp, parallel_bounds, parallel_unproven = _training_problem(
        model_cfg, arch, training, system, widths, float(ilp_time_limit_s), jobs)
    t0 = time.perf_counter()
    if fixed is None:
        result = optimal_placement(problem)
    else:
        chosen_placement = _fixed_placement(problem, model_cfg, training)
        result = evaluate_placement(problem, chosen_placement)
    unproven = [f"tp{t} {u}" for t, v in per_tp.items() for u in v.unproven]
    unproven += parallel_unproven
    bound = result.throughput
    if unproven and result.feasible:  # the same placement search on proven lower-bound layer times
        optimistic = replace(problem, **parallel_bounds or {
            "costs": tuple(v.bound_costs or v.costs for v in per_tp.values())})
        bound = (optimal_placement(optimistic) if fixed is None
                 else evaluate_placement(optimistic, chosen_placement)).throughput
    dp_s = time.perf_counter() - t0
    timings = {"graph_s": 0.0, "estimate_s": 0.0, "ilp_s": 0.0}
    for v in per_tp.values():
        for k in timings:
            timings[k] += v.timings[k]
    timings["dp_s"] = dp_s
    chosen = per_tp.get(result.tp) if result.feasible else None
    area = float(area_mm2(arch))
    energy = _design_energy(model_cfg, arch, training, system, chosen, result, area) if chosen else None
    return DesignResult(
        feasible=result.feasible,
        reason=result.reason,
        throughput=result.throughput,
        tokens_per_s=result.tokens_per_s,
        time_per_batch_s=result.time_per_batch_s,
        area_mm2=area,
        mfu=result.mfu,
        placement=result.placement_dict() if (result.feasible or result.stages)
        else {"tp": 0, "pp": 0, "dp": 0, "microbatches": 0, "stages": []},
        timings=timings,
        layers=chosen.table if chosen else [],
        model=model_cfg.name,
        energy_j=energy,
        schedules={t: v.statuses for t, v in per_tp.items()},
        proven=not unproven or bound <= result.throughput * (1.0 + PROVEN_REL_TOL),
        throughput_bound=max(bound, result.throughput),
        unproven=unproven,
        note=note,
    )


def unsupported_precision(model: ModelConfig, arch: Accelerator, training: Training) -> DesignResult:
    """The infeasible result of a recipe whose GEMM format the chip's tensor cores cannot multiply."""
    reason = (f"precision {training.precision}: the tensor cores of {arch.name or 'this design'} support "
              f"{', '.join(arch.datatype_names)}")
    return DesignResult(feasible=False, reason=reason, throughput=0.0, tokens_per_s=0.0,
                        time_per_batch_s=float("inf"), area_mm2=float(area_mm2(arch)), mfu=0.0,
                        placement={"tp": 0, "pp": 0, "dp": 0, "microbatches": 0, "stages": []},
                        timings={"graph_s": 0.0, "estimate_s": 0.0, "ilp_s": 0.0, "dp_s": 0.0}, model=model.name)


def _without_missing_expert(model: ModelConfig, training: Training) -> tuple[Training, str]:
    """`training`, or the same recipe with the optimal placement when it asks for the model's expert
    placement and the model config gives none (it is optional), with a note saying so."""
    if training.placement != EXPERT or model.expert_placement is not None:
        return training, ""
    return (replace(training, placement=OPTIMAL),
            f"{model.name} has no expert_placement in its config; the optimal placement stands in")
