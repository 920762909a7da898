"""Expert and context parallelism for a design (MoE, long sequences): which widths are searched, and the
per-layer terms the placement prices them with (`solve/placement/evaluate.py`'s docstring).

- EP widths: the powers of two that divide the model's routed experts (1 for a dense model); each
  EP rank then holds experts / e whole experts.
- CP widths: 1, and for sequences of at least `CP_MIN_SEQ` tokens the powers of two up to
  `CP_MAX` that split the sequence into 2c equal chunks (Megatron-Core's load-balanced causal split
  gives each rank two chunks). Shorter sequences are not split: with a few thousand tokens the
  per-step K/V hop cannot hide under a block of attention (our choice of search space; Llama 3 used
  CP only for its long-context stage, Dubey et al. 2024, Sec. 3.3.2).
- Per layer at TP width t and sequence s (traced at s / c for CP): the routed experts' parameters
  per device (E x one expert's / t), one all-to-all's payload per device (tokens x k x capacity
  factor x hidden x bytes: every TP rank dispatches its copy of the tokens; GShard, Lepikhin et
  al. 2021, Sec. 3.2; with sequence parallelism each TP rank holds and dispatches only its s/t
  share, as Megatron-Core's all-to-all dispatcher does, then all-gathers the received tokens over
  the TP group: that NVLink gather is left to the traced block's SP reduce-scatter + all-gather of
  its hidden states, k x capacity factor fewer bytes than the gathered tokens), the experts' grouped-GEMM time forward and backward (each op spread over
  all cores, added in sequence: `expert_s`), the attention core's forward and backward time (one
  K/V block's worth, `attention_core_s`, the same sum selective recompute prices), and the K and V
  block a ring step passes on (2 x s/c x batch x KV heads / t x head size x bytes).
- Expert tensor parallelism (`Training.expert_tensor_parallel`, MoE parallel folding): the routed
  experts' parameters per device are E x one expert's / ETP. A device's share of a stage's expert
  FLOPs is the same at any ETP and EP (balanced: the tokens x k x one expert's FLOPs / (t c));
  what ETP changes is each GEMM's shape, experts ETP-way sharded instead of t-way. So the experts'
  time is the grouped GEMMs of the layer traced at TP width ETP times ETP / t (that trace computes
  t / ETP times a device's share), and the layer's forward and backward change by its difference
  from the TP-width experts' time (proven lower bounds by the same difference, so they stay
  bounds). As at ETP = t, the ETP group's
  gather of the received tokens (and its reduce-scatter) is left to the traced block's SP
  collectives at width t.
- Tokens per expert under EP (`expert_parallel_op`): a layer is traced at EP 1, all E experts
  with C token slots each. An EP-e rank runs the same FLOPs as E/e experts of e x C slots (each
  local expert receives the slots of all e ranks' tokens) and reads only its E/e experts'
  weights, so its grouped GEMMs pay E/e groups' fold fills and drains instead of E and move 1/e
  of the weight bytes (under MoE parallel folding, the slots of a trace at width ETP are a rank's
  t / ETP times over: ETP / t of them per rank): the grouped GEMM's efficiency follows the tokens
  per expert the device sees (tests/test_grouped_gemm.py holds the template's per-group cost to DeepGEMM's published
  kernel timings at 256-8192 tokens per expert). Under the plain all-to-all dispatcher a rank
  with more than one local expert also sorts the tokens it receives by expert and back, each pass
  (`chunk_sorts`), copies the EP-1 trace has no counterpart for. `expert_ep` holds the experts' times at every
  EP width above 1; the placement replaces the EP-1 experts' time by that width's
  (`LayerCosts.experts_at`), and the bounds take the largest such saving off
  (`ep_expert_saving`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..errors import PhazeError
from ..hardware.latency import estimate
from ..solve.placement.types import LayerCosts
from ..workload.graphs import routed_expert_params
from ..workload.kinds import attention_kind, layer_sequence, routed_kind
from ..workload.models import ModelConfig
from ..workload.ops import VC, Op
from ..workload.stack import recipe_graph

CP_MIN_SEQ = 8192
CP_MAX = 32


def ep_widths(model: ModelConfig) -> tuple[int, ...]:
    if not model.moe:
        return (1,)
    return tuple(e for e in (2**i for i in range(17)) if e <= model.experts and model.experts % e == 0)


def cp_widths(model: ModelConfig) -> tuple[int, ...]:
    if model.seq < CP_MIN_SEQ:
        return (1,)
    return tuple(c for c in (2**i for i in range(6)) if c <= CP_MAX and model.seq % (2 * c) == 0)


def attention_core_s(op_graph, split, forward: bool = True) -> float:
    """Time of a layer's attention core in one pass, from the op latencies of that pass's graph: the
    activation x activation batched GEMMs (Q K^T, P V and, backward, their gradients) and the
    softmax, mask and dropout ops over the s x s scores (those with as many elements as the
    forward's Q K^T output, or the largest batched GEMM output backward), each spread over all
    cores of its type (`split` latency), one after another: a schedule the chip can run, as
    Megatron's selective recompute runs these kernels back to back before the layer's backward
    (Korthikanti et al. 2022, Sec. 5) and as each ring-attention step runs one K/V block's core
    (Liu et al. 2023, Sec. 3). A fused flash-attention op counts whole.

    The `split` latencies, never `single`: a single-core latency is the op on one core with 1/n of
    the bandwidth, about n times the real time (summed, it made selective recompute cost as much
    as full recompute, and a context-parallel block 8-31x too slow on a 132-core H100).
    """
    ops = op_graph.ops
    sizes = [op.gemm[0] * op.gemm[1] * op.gemm[3] for op in ops if op.kind == "bgemm" and op.gemm]
    size = (sizes[0] if forward else max(sizes)) if sizes else -1
    return float(sum(split[i] for i, op in enumerate(ops)
                     if op.kind in ("bgemm", "flash_attention") or (size > 0 and op.unit != "tc" and op.elements == size)))


def expert_s(op_graph, split) -> float:
    """The routed experts' grouped GEMMs of one pass, each spread over all tensor cores (`split`),
    one after another: the part of the pass the busiest EP rank's extra tokens lengthen."""
    return float(sum(split[i] for i, op in enumerate(op_graph.ops) if op.kind == "grouped_gemm"))


def expert_capacity_of(fwd_graph) -> int:
    """The token slots per expert a MoE layer was traced with: the rows of its first grouped GEMM
    forward (the dispatched tokens times the first experts' linear, workload/layers.py `MoE`); 0
    for a layer without routed experts."""
    return next((int(op.gemm[1]) for op in fwd_graph.ops if op.kind == "grouped_gemm"), 0)


def slots_per_expert(capacity: int, e: int, share: float = 1.0) -> int:
    """Token slots each local expert of an EP-e rank receives when the trace gave every expert
    `capacity` (`expert_parallel_op`): all e ranks' slots, times `share` under MoE parallel folding."""
    return max(1, round(capacity * e * share))


def expert_parallel_op(op, capacity: int, e: int, share: float = 1.0):
    """A routed-expert grouped GEMM traced at EP 1 (E experts of `capacity` token slots) as one
    rank of an EP group of e runs it: E/e experts, each with the slots of all e ranks' tokens, as
    the all-to-all gathers them for each local expert (GShard, Lepikhin et al. 2021, Sec. 3.2;
    Megatron-Core's token dispatcher), so e x `capacity` slots, times `share` when the trace
    holds 1/share of a rank's tokens (MoE parallel folding: a trace at width ETP under sequence
    parallelism at TP t holds t / ETP ranks' tokens, share ETP / t). The slots are the rows of a
    data-path GEMM (tokens x weights: M is the capacity) and the reduction of a weight-gradient
    GEMM (K is the capacity), whose weight operand, respectively output, shrinks to the E/e
    local experts'; the token operands follow the slots."""
    B, M, K, N = (int(x) for x in op.gemm)
    if B % e:
        raise ValueError(f"op {op.name}: EP width {e} does not divide its {B} experts")
    rows = slots_per_expert(capacity, e, share)
    f = rows / capacity  # the slots per local expert against the trace's
    flops = op.flops * f / e
    if M == capacity:  # data path: read tokens (B M K) and weights (B K N), write B M N
        tokens, weights = B * M * K, B * K * N
        read = op.bytes_read * (tokens * f + weights) / (e * (tokens + weights))
        return replace(op, gemm=(B // e, rows, K, N), flops=flops, bytes_read=read, bytes_written=op.bytes_written * f / e)
    if K == capacity:  # weight gradient: read two token operands, write the weights' gradient
        return replace(op, gemm=(B // e, M, rows, N), flops=flops, bytes_read=op.bytes_read * f / e,
                       bytes_written=op.bytes_written / e)
    raise ValueError(f"op {op.name}: no dimension of {op.gemm} is the {capacity} token slots per expert")


def chunk_sorts(slots: int, width: int, bytes_per_element: int) -> tuple:
    """The two token sorts Megatron-Core's all-to-all dispatcher adds on an EP rank with more than
    one local expert (megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher:
    "Permutation 2: Sort tokens by local expert", `sort_chunks_by_idxs`, after the dispatch, and
    "Unpermutation 2" before the combine; in backward their gradients, the same two copies the
    other way): each reads and writes the rank's `slots` received token rows of `width` elements
    once. The traced layer already holds the one permutation every dispatcher does (tokens into
    expert order), which DeepEP's dispatcher does once too (its kernels send the tokens unsorted)."""
    elements = slots * width
    nbytes = float(elements * bytes_per_element)
    return tuple(Op(name, "gather", VC, bytes_read=nbytes, bytes_written=nbytes, elements=elements,
                    vector_ops=("gather",)) for name in ("sort_chunks", "unsort_chunks"))


def expert_pass_s(op_graph, capacity: int, e: int, designs, link, share: float = 1.0,
                  sort_width: int = 0, bytes_per_element: int = 2) -> np.ndarray:
    """The routed experts' grouped GEMMs of one pass at EP width e (`expert_parallel_op`), split
    over all cores one after another (as `expert_s`), on each design: [n_designs] seconds; with
    `sort_width` (the tokens' width; 0: none) also the all-to-all dispatcher's two token sorts
    where the rank holds more than one expert (`chunk_sorts`, none at EP 1)."""
    ops = tuple(expert_parallel_op(op, capacity, e, share) for op in op_graph.ops if op.kind == "grouped_gemm")
    if not ops:
        return np.zeros(len(designs))
    local = ops[0].gemm[0]  # the rank's experts
    if sort_width and e > 1 and local > 1:
        ops += chunk_sorts(local * slots_per_expert(capacity, e, share), sort_width, bytes_per_element)
    graph = replace(op_graph, ops=ops, edges=())
    return estimate(graph, designs, interconnect=link).split.sum(axis=1)


def ep_expert_saving(fwd_graph, bwd_graph, designs, link, widths) -> tuple[np.ndarray, np.ndarray]:
    """The most any EP width in `widths` takes off a MoE layer's forward and backward experts' time
    (the EP-1 shape's less that width's, never below 0), per design: what a lower bound on the
    layer's time at EP 1 gives up to hold at every EP width."""
    capacity = expert_capacity_of(fwd_graph)
    n = len(designs)
    saving = [np.zeros(n), np.zeros(n)]
    if not capacity:
        return saving[0], saving[1]
    for i, og in enumerate((fwd_graph, bwd_graph)):
        base = expert_pass_s(og, capacity, 1, designs, link)
        for e in widths:
            np.maximum(saving[i], base - expert_pass_s(og, capacity, e, designs, link), out=saving[i])
    return saving[0], saving[1]


def parallel_sizes(costs: LayerCosts, model: ModelConfig, training, cp: int = 1) -> LayerCosts:
    """`costs` (at its TP width, for `model`'s sequence) with the EP/CP per-layer sizes (routed
    expert parameters, all-to-all and K/V bytes) and no time terms: what the bounds use
    (design/upper_bound.py), the time terms being non-negative additions."""
    t = costs.tp
    kinds = _layer_kinds(model)
    e_bytes = model.bytes_per_element
    tokens = training.mbs * model.seq
    if training.sequence_parallel:  # each TP rank's SP share (module docstring)
        tokens = -(-tokens // t)
    routed = routed_expert_params(model) * model.experts if model.moe else 0
    expert_params = routed // training.expert_tp(t)
    traced = routed // t  # what the layer's parameters, traced at width t, hold of the experts
    dispatch = float(np.ceil(model.capacity_factor * tokens * model.top_k) * model.hidden * e_bytes) if model.moe else 0.0
    kv = float(tokens * model.kv_elements_per_token(t) * e_bytes)
    moe = np.array([routed_kind(model, k) for k in kinds], dtype=bool)
    return replace(
        costs,
        params=np.where(moe, costs.params - traced + expert_params, costs.params),
        expert_params=np.where(moe, float(expert_params), 0.0),
        dispatch_bytes=[dispatch if routed_kind(model, k) else 0.0 for k in kinds],
        kv_bytes=[kv if attention_kind(k) else 0.0 for k in kinds],
        cp=cp,
    )


def _layer_kinds(model: ModelConfig) -> list[str]:
    return [kind for _, kind in layer_sequence(model)]


def _pass_times(graph, arch, link, ep=(), share: float = 1.0, sort_width: int = 0) -> dict:
    """{kind: {"core": (fwd, bwd), "expert": (fwd, bwd), "ep": {e: (fwd, bwd)}}} of a layer graph's
    passes (split latencies); "ep": the experts' times at each EP width of `ep`, a rank's `share`
    of the traced tokens, with the dispatcher's token sorts where `sort_width` (`expert_pass_s`)."""
    per_kind = {}
    for kind in graph.kinds:
        fwd, bwd = graph.op_graphs[kind]["fwd"], graph.op_graphs[kind]["bwd"]
        lat = {p: estimate(graph.op_graphs[kind][p], [arch], interconnect=link).split[0] for p in ("fwd", "bwd")}
        capacity = expert_capacity_of(fwd)
        per_kind[kind] = {
            "core": (attention_core_s(fwd, lat["fwd"], True), attention_core_s(bwd, lat["bwd"], False)),
            "expert": (expert_s(fwd, lat["fwd"]), expert_s(bwd, lat["bwd"])),
            "ep": {e: tuple(float(expert_pass_s(og, capacity, e, [arch], link, share, sort_width,
                                                graph.bytes_per_element)[0]) for og in (fwd, bwd))
                   for e in ep} if capacity else {},
        }
    return per_kind


def check_expert_tp(model: ModelConfig, training) -> None:
    """The recipe's ETP must be a width the model's experts can be traced at (one of its TP widths)."""
    etp = training.expert_tensor_parallel
    if etp is not None and model.moe and etp not in model.tp_widths:
        raise PhazeError(f"expert_tensor_parallel {etp}: not a width {model.name}'s layers shard at; "
                         f"allowed: {', '.join(map(str, model.tp_widths))}")


def with_parallel_terms(costs: LayerCosts, model: ModelConfig, arch, training, system, cp: int = 1) -> LayerCosts:
    """`costs` (at its TP width, traced for `model`'s sequence) with the EP/CP per-layer terms, the
    experts' GEMMs in the recipe's `precision` as the layer times have them, and at the recipe's
    expert TP width (the module docstring; `expert_shift` is what that changed in each layer's
    forward and backward)."""
    t = costs.tp
    graph = recipe_graph(model, t, training)
    eps = ep_widths(model)[1:]
    # the plain all-to-all dispatcher sorts what it receives by local expert (`chunk_sorts`)
    sort_width = model.hidden if model.moe and training.moe_dispatcher == "alltoall" else 0
    etp = training.expert_tp(t)
    folded = etp != t and model.moe  # the experts then run at width ETP: their EP times come from there
    per_kind = _pass_times(graph, arch, system.tp_link(t), () if folded else eps, sort_width=sort_width)
    rows = [(l.kind, routed_kind(model, l.kind), attention_kind(l.kind)) for l in graph.layers]
    expert = {k: per_kind[k]["expert"] for k in per_kind}
    at_ep = {k: per_kind[k]["ep"] for k in per_kind}
    if folded:
        check_expert_tp(model, training)
        at_etp = _pass_times(recipe_graph(model, etp, training), arch, system.tp_link(etp), eps, etp / t, sort_width)
        expert = {k: tuple(x * etp / t for x in at_etp[k]["expert"]) for k in per_kind}
        at_ep = {k: at_etp[k]["ep"] for k in per_kind}
    shift_f = np.array([expert[k][0] - per_kind[k]["expert"][0] if moe else 0.0 for k, moe, _ in rows])
    shift_b = np.array([expert[k][1] - per_kind[k]["expert"][1] if moe else 0.0 for k, moe, _ in rows])
    return replace(
        parallel_sizes(costs, model, training, cp),
        fwd_s=np.maximum(0.0, costs.fwd_s + shift_f) if etp != t else costs.fwd_s,
        bwd_s=np.maximum(0.0, costs.bwd_s + shift_b) if etp != t else costs.bwd_s,
        # a rerun MoE module (`moe` recompute) holds the same experts as the forward
        module_s=np.maximum(0.0, costs.module_s + costs.module_moe * shift_f) if etp != t else costs.module_s,
        expert_fwd_s=[expert[k][0] if moe else 0.0 for k, moe, _ in rows],
        expert_bwd_s=[expert[k][1] if moe else 0.0 for k, moe, _ in rows],
        expert_ep=tuple((e, np.array([at_ep[k][e][0] if moe else 0.0 for k, moe, _ in rows]),
                            np.array([at_ep[k][e][1] if moe else 0.0 for k, moe, _ in rows]))
                        for e in eps if model.moe),
        core_fwd_s=[per_kind[k]["core"][0] if attn else 0.0 for k, _, attn in rows],
        core_bwd_s=[per_kind[k]["core"][1] if attn else 0.0 for k, _, attn in rows],
    )


def _bound_of(full: LayerCosts, traced: LayerCosts, bound: LayerCosts | None) -> LayerCosts:
    """`full` with the proven lower-bound layer times of `bound` (traced beside `traced`), moved by
    the same expert-TP change as `full`'s times (a lower bound plus a difference stays one)."""
    if bound is None:
        return full
    return replace(full, fwd_s=np.maximum(0.0, bound.fwd_s + (full.fwd_s - traced.fwd_s)),
                   bwd_s=np.maximum(0.0, bound.bwd_s + (full.bwd_s - traced.bwd_s)))


def _ep_cp_widths(model: ModelConfig, fixed=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The EP and CP widths the placement tries: the model's, or 1 and the fixed layout's."""
    if fixed is not None:
        return tuple(sorted({1, fixed.ep})), tuple(sorted({1, fixed.cp}))
    return ep_widths(model), cp_widths(model)


def cp_traces(model: ModelConfig, system, widths, fixed=None) -> list[tuple[int, ModelConfig, int]]:
    """(CP width c, the model at 1/c of its sequence, TP width t) of each shorter sequence whose
    layer costs `parallel_setup` prices, in the order it asks for them: known before any is traced,
    so that they can be computed side by side."""
    eps, cps = _ep_cp_widths(model, fixed)
    if eps == (1,) and cps == (1,) and not model.moe:
        return []
    return [(c, replace(model, seq=model.seq // c), t) for c in cps if c > 1
            for t in widths if t * c <= system.accelerators]


def parallel_setup(model: ModelConfig, arch, training, system, per_tp: dict, layer_costs_fn, fixed=None) -> dict:
    """The PlacementProblem fields for EP and CP: {} for a dense model with short sequences (the
    problem then has no EP or CP terms). `per_tp`: {t: LayerCosts} at the full sequence;
    `layer_costs_fn(model_at_seq, t)` gives (LayerCosts, proven lower-bound LayerCosts or None) of a
    shorter sequence (CP). The result's `bounds` are the costs with proven lower-bound layer times
    (for the throughput bound), `unproven` what the CP traces left open."""
    eps, cps = _ep_cp_widths(model, fixed)
    if eps == (1,) and cps == (1,) and not model.moe:
        return {}
    costs, bounds = [], []
    for lc, bound in per_tp.values():
        full = with_parallel_terms(lc, model, arch, training, system)
        costs.append(full)
        bounds.append(_bound_of(full, lc, bound))
    cp_costs, cp_bounds, unproven = [], [], []
    for c, short, t in cp_traces(model, system, per_tp, fixed):
        lc, bound, open_passes = layer_costs_fn(short, t)
        full = with_parallel_terms(lc, short, arch, training, system, c)
        cp_costs.append(full)
        cp_bounds.append(_bound_of(full, lc, bound))
        unproven += [f"tp{t} cp{c} {u}" for u in open_passes]
    return {"costs": tuple(costs), "cp_costs": tuple(cp_costs), "ep_widths": eps, "cp_widths": cps,
            "bounds": {"costs": tuple(bounds), "cp_costs": tuple(cp_bounds)}, "unproven": unproven}
