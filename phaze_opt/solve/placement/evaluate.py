"""The independent evaluator: time and memory of any given placement, recomputed from scratch.

It shares no code with the DP (`dp.py`) beyond the input types and the System's link rules;
it walks the stages and layers one by one, so a slip in the DP's vectorised tables shows up as a
disagreement in the tests. The model it implements (the definition the DP must optimise exactly):

- A placement is a TP width t, a data-parallel degree d and S stages, each a set of layers that is a
  difference of two downsets of the layer DAG (every edge runs forward or within a stage). Each
  stage runs on t devices in each of the d replicas; S*t*d must not exceed the accelerators.
- Microbatches per pipeline: m = ceil(global batch / (mbs * d)).
- Stage time per microbatch = sum of its layers' forward + backward time, plus the recompute of
  the recipe's mode on every stage, the last included, as Megatron does (Korthikanti et al. 2022,
  Sec. 5): `full` adds each layer's forward, `selective` the attention core's forward
  (`LayerCosts.selective_s`) when the core is among `Training.recompute_modules` (the default)
  plus the forward of the recipe's other modules (`module_s`), `none` nothing; `full` with
  `Training.recompute_every` n > 1 only on the blocks it checkpoints (`Training.checkpointed`: every
  n-th decoder block, torchtitan), the others as `none`; torchtitan's op-level policy
  (`Training.recompute_ops`) on each decoder block the forward ops it does not keep (`op_policy_s`);
  plus receiving its inputs and the gradients of its
  outputs. Inputs are the outputs of producers in earlier stages that feed the stage (each
  producer's `boundary_bytes` once); output gradients are those of the stage's layers that feed
  later stages. Each direction with anything to receive costs one message on the pipeline link:
  latency + bytes / bandwidth; with v virtual stages (interleaved 1F1B) every microbatch crosses
  v times as many stage boundaries, so v times the messages (Narayanan et al., SC'21, Sec. 2.2).
  With `overlap_p2p_comm` (interleaved only, as Megatron-LM allows it) each step's messages run
  beside the stage's work W of the step after it (its compute and recompute, and the exposed part
  of its per-microbatch ZeRO-2/3 collectives), except in the warm-up and flush: the messages of a
  share f = ((S - 1) / v) / (m + (S - 1) / v) of the steps stay exposed, so the stage takes
  max(W + f P, f W + P) instead of W + P, non-decreasing in every layer time.
  With ZeRO-3 the stage also all-gathers each layer's parameters over the d replicas before the
  layer's forward and again before its backward (not again with `reshard_after_forward` off, which
  holds the stage's gathered weights from forward to backward: FSDP2), and reduce-scatters its
  gradients after the backward, every microbatch (Rajbhandari et al., SC'20, Sec. 5.3; ring collectives, (d - 1) / d x
  bytes / bw + (d - 1) x latency each). The gathers are prefetched as FSDP does (`fsdp_exposed_s`:
  each layer's gather runs during the previous layer's compute of the same pass; only what does not
  fit under it is exposed); with overlap_grad_reduce only the part of the reduce-scatter longer
  than the stage's backward pass (its compute and exposed gathers) less the backward's gathers
  (one link carries both) is exposed, so the stage time holds max(backward pass, gathers +
  reduce-scatter), non-decreasing in every layer time.
  With ZeRO-2 the stage reduce-scatters its gradients after every microbatch's backward (a
  sharded gradient cannot be held whole until the last one: DeepSpeed ZeRO-2 reduces after every
  backward, deepspeedai/DeepSpeed issue 2252; ZeRO, Sec. 5.2), each kind over its own replicas
  as ZeRO-1 shards them; with overlap_grad_reduce only the part longer than that microbatch's
  backward (compute and recompute) is exposed, max(backward, reduce-scatter) as under ZeRO-3.
- Memory per device (Korthikanti et al. 2022, Sec. 4; Rajbhandari et al., SC'20):
  parameters x (weight + gradient + optimizer bytes), with ZeRO-1 the optimizer part, with ZeRO-2
  the optimizer part and the gradients (over their own replicas, as ZeRO-1's state) and with
  ZeRO-3 all three divided over the d replicas (rounded up to whole bytes; without resharding after
  forward plus the stage's whole gathered weights and their low-precision copies), plus the in-flight
  activations, plus the recompute working set. Per microbatch a stage keeps, per layer,
  `activation_bytes` (none), `selective_bytes` (selective; `activation_bytes` when the attention
  core is not recomputed; less `module_bytes` of the other modules), `checkpoint_bytes` (full, on a
  checkpointed layer) or `op_policy_bytes` (a block under the op-level policy: its input and the
  kept ops' outputs).
  A `moe` recompute reruns the MoE layer's forward whole, its two all-to-alls and the busiest
  rank's experts at the EP width's shape included (`LayerCosts.module_moe`). Under
  1F1B (PipeDream-Flush; Narayanan et al., SOSP'19) the stage k-th from the end holds q = min(k, m)
  microbatches. Interleaved (v > 1, pp > 1), Megatron's schedule holds on the device k-th from the
  end min(2 (k - 1) + (v - 1) p + 1, m v) model chunks of one microbatch in flight (its warm-up
  count plus one; Megatron-LM `forward_backward_pipelining_with_interleaving`), each 1/v of the
  stage's activations: ceil(chunks x stash / v) bytes (on the first device (1 + (p - 1)/(p v)) p
  microbatches' worth, Korthikanti et al. 2022, Sec. 4.2.3). The working set is the largest, over
  the stage's layers, of what exists only during that layer's backward: its attention core and
  its other recomputed modules' `module_bytes` (selective), all its activations (full on a
  checkpointed layer, and a block under the op-level policy), plus under ZeRO-3 (resharded after
  forward) its gathered parameters.
  Interleaving also needs (Megatron-Core) whole layers in every virtual stage as its pipeline
  split allows them (`Training.interleave_split_ok`: uneven first/last ranks, or the embedding and
  loss counted as layers) and m a multiple of p; otherwise the placement is infeasible.
- A stage's time per microbatch also holds v x the system's fixed cost per microbatch and model
  chunk (`SystemEfficiency.microbatch_overhead_s`: each chunk's forward and backward step of the
  schedule launches its kernels and sets up its point-to-point transfers), so the batch pays it
  (m v + S - 1) times.
- Time per batch = bottleneck stage time x (m + (S - 1) / v) (the bubble of the interleaved
  schedule is (p - 1) / v stage times; Narayanan et al., SC'21, Sec. 2.2) + the slowest stage's
  per-batch tail: its data-parallel gradient reduction plus its optimizer step. The reduction is a
  ring all-reduce of its gradients over the d replicas, 2 (d - 1) / d x bytes / bandwidth +
  2 (d - 1) x latency (Patarasuk and Yuan, JPDC 2009; Thakur et al., IJHPCA 2005), zero when
  d = 1; under ZeRO-1 a reduce-scatter of the gradients plus an all-gather of the 16-bit weights
  (the same bytes when they have the same width); under ZeRO-2 only the all-gather of the updated
  weights after the optimizer step (the reduce-scatters ran per microbatch; nothing runs beside
  the gather, so overlap_grad_reduce leaves it whole); under ZeRO-3 none (it ran per microbatch). With
  overlap_grad_reduce the reduction of a stage's gradients runs beside the backward of the last
  microbatch (Megatron's `--overlap-grad-reduce` launches each bucket's reduction as soon as its
  gradients are final, i.e. during the last microbatch's backward; Li et al., VLDB 2020, PyTorch
  DDP): only max(0, reduction - that stage's backward time per microbatch) is exposed (0 in the
  lower-bound mode `PlacementProblem.reduction_hidden`, see design/upper_bound.py). With
  overlap_param_gather (ZeRO-1 and 2) the weights' all-gather runs under the next iteration's forward
  (Megatron-Core `--overlap-param-gather`): only max(0, all-gather - the stage's forward time per
  microbatch) of it is exposed (0 in the lower-bound mode), the reduce-scatter as above on its own. The
  optimizer step reads the gradients and the optimizer state and writes the state and the
  weights once per batch on HBM: params x (weight + gradient + 2 x optimizer) bytes / HBM
  bandwidth (divided over the replicas under ZeRO-1, 2 and 3), zero when no HBM bandwidth is given.
- Throughput = global batch / time per batch; MFU = model FLOP per sequence x global batch /
  (devices used x peak FLOP/s x time per batch); bubble fraction = (S - 1) / (m + S - 1).

Expert parallelism e and context parallelism c. Ranks are ordered tp, cp, ep/dp, pp
(Megatron-Core), so a stage runs on t x c devices per replica, t x c x S x d devices in all, and
the pipeline and data-parallel links are those of a TP width t x c (`System.pipeline_link`,
`dp_ring_link`, which is `dp_link` without a torus). EP splits each MoE layer's routed experts over e of the d replicas (e divides d;
expert tensor parallelism = t); CP splits every sequence over c groups of t devices. Per layer, with
its costs traced at seq / c tokens (`PlacementProblem.costs_at`) and i the load imbalance:
- MoE: the forward and the backward each run two all-to-alls (dispatch and combine; Lepikhin et
  al., GShard, 2021, Sec. 3.2) of i x `dispatch_bytes` per device over the e ranks of stride t c,
  on the two-level network (`System.alltoall_s`, pairwise exchange), none at e = 1; the busiest
  rank's experts compute i x their balanced time (`expert_fwd_s`, `expert_bwd_s`); the routed
  experts' parameters are divided by e.
- EP all-to-all overlap (`Training.moe_a2a_overlap`, Megatron-Core `--overlap-moe-expert-parallel-comm`
  with `--delay-wgrad-compute`): in the steady 1F1B phase each MoE layer's forward of one microbatch
  runs merged with its backward of another (Megatron-LM megatron/core/models/common/
  model_chunk_schedule_plan.py, `schedule_layer_1f1b`), each all-to-all a on the communication
  stream under one compute phase of the other microbatch: the backward's combine under the forward's
  attention (with the previous attention's weight gradient), the forward's dispatch under the
  experts' data gradient, the backward's dispatch under the forward's experts (with their weight
  gradient), the forward's combine under the attention's data gradient. With the experts' GEMMs
  x_e (i x `expert_fwd_s`, `expert_bwd_s`), the rest of each pass x_a, and each backward half data,
  half weight gradient (their GEMMs' FLOPs are equal), the pair takes
  max(x_a,f + x_a,b/2, a) + max(x_e,b/2, a) + max(x_e,f + x_e,b/2, a) + max(x_a,b/2, a), at least
  max(compute, 4 a) and at most their sum; the stage time per microbatch holds that (the hidden
  part taken off, half from each pass), and the
  stage's per-batch tail adds u x its hidden time for the unpaired warm-up forwards and cool-down
  backwards (`PlacementProblem.unpaired_microbatches`: u = 1 at pp = 1). Megatron-Core needs
  interleaving when pp > 1: with e > 1, pp > 1 and v = 1 the placement is infeasible. The
  dispatcher (`Training.moe_dispatcher`, DeepEP: once per node) sets the all-to-all's time.
- CP (ring attention: Liu et al., "Ring Attention with Blockwise Transformers", 2023, Sec. 3;
  Megatron-Core context parallelism): each device attends its s/c queries to all c K/V blocks, the
  traced block plus c - 1 more (`core_fwd_s`, `core_bwd_s` each); each of those c - 1 steps passes
  a K/V block (`kv_bytes`) to the ring neighbour on `System.cp_link`, overlapped with that step's
  compute: exposed max(0, latency + bytes / bandwidth - core) per step, forward; in backward the
  K/V block and its gradient travel (twice the bytes) beside the block's backward. Everything else
  is traced at s/c tokens. Memory: the activations traced at s/c, plus c - 1 more attention cores
  (the unfused s x s blocks; none with flash) where they are kept (none) or rebuilt (selective
  working set x c, full working set); selective recompute reruns c attention cores.
  All-gather CP (`Training.cp_comm = "all_gather"`, Megatron-Core `--cp-comm-type all_gather`,
  Transformer Engine's `AttnFuncWithCPAndKVAllGather`, "KV all-gather between CP ranks is
  exposed"; Meta's CP for Llama 3, arXiv 2407.21783, Sec. 3.3.2: "Although the all-gather
  communication latency is exposed in the critical path ..."): the same c blocks of attention core
  and the same c - 1 K/V blocks on the same link, but gathered before the attention and, in
  backward, gathered again with dK/dV reduce-scattered after it, none of it under compute: exposed
  (c - 1) x (latency + bytes / bandwidth) forward and (c - 1) x (latency + 2 x bytes / bandwidth)
  backward, never less than the ring's exposed part (the difference is (c - 1) x min(hop, core)
  each way). The gathered c - 1 blocks live through the layer's attention: (c - 1) x `kv_bytes` on
  its working set in every recompute mode, kept across no layer.
- Gradients: the dense ones are reduced over the d x c ranks that hold the same weights, the routed
  experts' over their own d c / e replicas (one reduction over d c when e = 1); ZeRO-1 shards each
  kind's optimizer state over its own group, ZeRO-2 its gradients and state; the optimizer step
  likewise. ZeRO-3 shards all three kinds so: each layer's dense weights are gathered over the d c
  ranks (FSDP over data and context parallelism, as torchtitan's `dp_shard_cp` mesh does), its routed
  experts over their own replicas (a second gather, only in layers that have experts), and each
  kind's gradients reduce-scattered over its group every microbatch. Hybrid sharding
  (`Training.shard_group` g, HSDP): each kind is sharded within groups of g of its ranks (g must
  divide them), the gathers and reduce-scatters on the ring of g ranks t apart
  (`System.dp_ring_link(t, S, g)`), and the per-batch tail adds a ring all-reduce of each kind's
  shard (n / g parameters) across its n_ranks / g replicas on the data-parallel ring (exposed past
  the backward with overlap_grad_reduce); the optimizer steps the group's shard.
- MoE parallel folding (`Training.expert_tensor_parallel` set; Liu et al. 2025, arXiv 2504.14960,
  Megatron-Core `--expert-tensor-parallel-size`): the MoE layers run on their own grid ETP x e x EDP
  over the t x c x d ranks of a stage (ranks etp, ep, edp), so e x ETP must divide t c d (not e
  divide d); the all-to-all's e ranks are ETP apart (`Training.expert_stride`), the routed experts'
  parameters per device are E x one expert's / (ETP e) (`LayerCosts.expert_params` carries the
  / ETP) and their gradients reduce over EDP = t c d / (e ETP) replicas
  (`Training.expert_replicas`), on the data-parallel ring's link, as their own group whenever EDP
  differs from d c (also at e = 1 with ETP != t). With ETP = t and c = 1 this is the layout above.
"""

from __future__ import annotations

from .types import (
    Placement,
    PlacementProblem,
    PlacementResult,
    StageResult,
    check_placement_shape,
    gather_bytes,
    infeasible_result,
    optimizer_pass_bytes,
    reduce_bytes,
    state_split,
    weight_copies,
)


def format_bytes(n: float) -> str:
    """Bytes for a reason line: '170 B', '1.500 MiB', '29.789 GiB'."""
    for unit, size in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if abs(n) >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n:.0f} B"


def ring_allreduce_s(nbytes: float, replicas: int, bandwidth: float, latency: float) -> float:
    if replicas <= 1:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps * latency + steps / replicas * nbytes / bandwidth


def ring_half_s(nbytes: float, replicas: int, bandwidth: float, latency: float) -> float:
    """A ring reduce-scatter or all-gather of `nbytes` per device: half of a ring all-reduce."""
    if replicas <= 1:
        return 0.0
    steps = replicas - 1
    return steps * latency + steps / replicas * nbytes / bandwidth


def fsdp_exposed_s(compute: list, gathers: list, reverse: bool) -> float:
    """The all-gather time one pass of a ZeRO-3 stage exposes, with FSDP's prefetch: the first
    layer's parameters are gathered before it runs, and each further layer's gather runs while the
    layer before it (in the pass's order: forward ascending, backward descending) computes, so only
    max(0, gather - that compute) of it shows (Zhao et al., "PyTorch FSDP", VLDB 2023, Sec. 3.3.2,
    forward and backward prefetching; Rajbhandari et al., ZeRO, SC'20, Sec. 7). Written as
    gather_first + sum of (max(compute_prev, gather_next) - compute_prev): the pass time, compute
    plus this, is non-decreasing in every compute time (the bound of design/upper_bound relies on it)."""
    order = list(range(len(compute)))[::-1] if reverse else list(range(len(compute)))
    if not order:
        return 0.0
    exposed = gathers[order[0]]
    for prev, nxt in zip(order[:-1], order[1:]):
        exposed += max(compute[prev], gathers[nxt]) - compute[prev]
    return exposed


def _ceil(x: float) -> float:
    return float(-(-x // 1))


def _parallel_layer(problem, costs, v: int, e: int, c: int, imb: float, ring_cp, stride: int):
    """One layer under expert parallelism e, context parallelism c and load imbalance imb (the
    module docstring), the EP group's members `stride` ranks apart: (forward s, backward s, extra
    activation bytes kept, extra working-set bytes, routed-expert parameters per device, the
    all-to-all time the EP overlap hides per paired forward and backward, what a `moe` recompute's
    rerun adds to `module_s` (its all-to-alls, its experts at this width's shape), the gathered
    K/V bytes of all-gather CP)."""
    # the experts' grouped GEMMs at the shape an EP-e rank runs (E/e experts of e x the tokens)
    fwd, bwd, expert_f, expert_b = costs.at_expert_width(e, v)
    expert = float(costs.expert_params[v])
    a2a = 0.0
    extra_kept = extra_work = moe_again = gathered = 0.0
    if expert > 0 or costs.expert_fwd_s[v] > 0:
        fwd += (imb - 1.0) * expert_f
        bwd += (imb - 1.0) * expert_b
        a2a = problem.system.alltoall_s(imb * float(costs.dispatch_bytes[v]), e, stride, problem.training,
                                        problem.top_k, problem.router_groups)
        fwd += 2.0 * a2a  # dispatch and combine
        bwd += 2.0 * a2a  # their gradients, the other way
        # a rerun MoE layer (`moe` recompute) runs these forward terms again, its experts at this
        # width's shape (the busiest rank's) in place of the traced ones `module_s` holds
        moe_again = float(costs.module_moe[v]) * (imb * expert_f - float(costs.expert_fwd_s[v]) + 2.0 * a2a)
        expert = _ceil(expert / e)
    if c > 1:
        core_f, core_b = float(costs.core_fwd_s[v]), float(costs.core_bwd_s[v])
        kv = float(costs.kv_bytes[v])
        steps = c - 1
        fwd += steps * core_f
        bwd += steps * core_b
        if kv > 0 and problem.training.cp_comm == "all_gather":
            # K and V all-gathered before the attention, dK and dV reduce-scattered after its
            # backward, nothing under them (TE AttnFuncWithCPAndKVAllGather; Llama 3, Sec. 3.3.2:
            # "the all-gather communication latency is exposed in the critical path")
            fwd += steps * (ring_cp.latency + kv / ring_cp.bandwidth)
            bwd += steps * (ring_cp.latency + 2.0 * kv / ring_cp.bandwidth)
            gathered = steps * kv  # the other ranks' K/V blocks, held through the layer's attention
        elif kv > 0:
            fwd += steps * max(0.0, ring_cp.latency + kv / ring_cp.bandwidth - core_f)
            bwd += steps * max(0.0, ring_cp.latency + 2.0 * kv / ring_cp.bandwidth - core_b)
        core_bytes = float(costs.activation_bytes[v]) - float(costs.selective_bytes[v])
        extra_kept = extra_work = steps * core_bytes
    hidden = 0.0
    if problem.training.moe_a2a_overlap and a2a > 0:
        # Megatron-Core's paired layer (schedule_layer_1f1b): each of the four all-to-alls runs under
        # one compute phase of the other microbatch; a phase takes max(its compute, the all-to-all)
        mlp_f = imb * expert_f
        mlp_b = imb * expert_b
        attn_f = max(0.0, fwd - 2.0 * a2a - mlp_f)
        attn_b = max(0.0, bwd - 2.0 * a2a - mlp_b)
        paired = (max(attn_f + 0.5 * attn_b, a2a) + max(0.5 * mlp_b, a2a)
                  + max(mlp_f + 0.5 * mlp_b, a2a) + max(0.5 * attn_b, a2a))
        hidden = max(0.0, fwd + bwd - paired)
        fwd -= 0.5 * hidden
        bwd -= 0.5 * hidden
    return fwd, bwd, extra_kept, extra_work, expert, hidden, moe_again, gathered


def evaluate_placement(
    problem: PlacementProblem, placement: Placement, *, method: str = "evaluated"
) -> PlacementResult:
    """Time, memory and throughput of `placement`. Never raises for running out of memory or
    devices (the result is infeasible with the reason); raises PhazeError for a malformed placement."""
    check_placement_shape(problem, placement)
    system = problem.system
    e, c = int(placement.ep), int(placement.cp)
    costs = problem.costs_at(placement.tp, c)
    t, d, S = placement.tp, int(placement.dp), placement.pp
    m = problem.microbatches(d)
    hbm = problem.hbm_bytes
    hop = system.pipeline_link(t * c, S)
    imb = problem.training.load_imbalance
    ring_cp = system.cp_link(t, c)
    ranks = d * c  # holders of the same dense weights
    expert_ranks = int(problem.training.expert_replicas(t, c, d, e))  # holders of the same routed experts
    # the experts' gradients and state form their own group when its ranks are not the dense ones'
    moe = any(float(x) > 0 for x in costs.expert_params)
    split = e > 1 or (expert_ranks != ranks and moe)
    stride = problem.training.expert_stride(t, c)
    shard_of = problem.training.shard_ranks  # ZeRO-3's shard of a group of ranks (HSDP: its shard group)
    # the ring the network gives (a torus's, or spread over the NICs of its members in each node, the
    # fewest of every group it carries: HSDP's replicas, none spread beside a MoE's own expert groups)
    ring = system.dp_ring_link(t * c, S, d, problem.training.shard_group, spread=not split)
    # the shard group's ring: g data-parallel ranks t apart (the whole data-parallel ring without HSDP)
    shard_ring = ring if problem.training.shard_group is None else system.dp_ring_link(
        t, S, shard_of(ranks), spread=not split)

    stage_of = {}
    for s, stage in enumerate(placement.stages):
        for v in stage:
            stage_of[int(v)] = s
    preds: dict[int, list[int]] = {v: [] for v in range(costs.n_layers)}
    succs: dict[int, list[int]] = {v: [] for v in range(costs.n_layers)}
    for u, v in costs.edges:
        preds[v].append(u)
        succs[u].append(v)

    mode = problem.training.recompute
    core = "core_attn" in problem.training.recomputed_modules
    op_policy = problem.training.recompute_ops
    wrapped = problem.training.checkpointed(costs.block_ordinal)
    v_virt = problem.training.virtual_stages
    zero = problem.training.zero
    reshard = problem.training.reshard_after_forward
    w_b, g_b, o_b = state_split(problem)
    r_b = reduce_bytes(problem)  # gradient bytes per parameter on the data-parallel ring
    gw_b = gather_bytes(problem)
    k_b = weight_copies(problem)  # low-precision weight copies, held whole under ZeRO 0, 1 and 2
    unpaired = problem.unpaired_microbatches(S, d) if problem.training.moe_a2a_overlap else 0.0
    stages = []
    for s, stage in enumerate(placement.stages):
        layers = sorted(int(v) for v in stage)
        k = S - s  # position from the end: the last stage is 1
        compute = 0.0
        backward = 0.0
        recompute = 0.0
        params = 0.0
        stash = 0.0
        working = 0.0
        flops = 0.0
        rec_of, fwd_of, bwd_of, dense_of, expert_of = {}, {}, {}, {}, {}
        forward = 0.0
        experts = 0.0
        hidden = 0.0
        for v in layers:
            fwd_v, bwd_v, extra_kept, extra_work, expert_v, hidden_v, moe_again, gathered = _parallel_layer(
                problem, costs, v, e, c, imb, ring_cp, stride)
            hidden += hidden_v
            compute += fwd_v + bwd_v
            dense_of[v], expert_of[v] = float(costs.params[v]) - float(costs.expert_params[v]), expert_v
            params += dense_of[v] + expert_v
            experts += expert_v
            flops += float(costs.flops[v])
            if mode == "full" and wrapped[v]:  # Korthikanti et al. 2022, Sec. 5: the whole forward again
                rec, kept, work = fwd_v, float(costs.checkpoint_bytes[v]), float(costs.full_work_bytes[v]) + extra_work
            elif op_policy and costs.block_ordinal[v] > 0:  # torchtitan's op policy: the unkept forward ops again
                rec, kept = float(costs.op_policy_s[v]), float(costs.op_policy_bytes[v])
                work = float(costs.full_work_bytes[v]) + extra_work
            elif mode == "selective" and not op_policy:  # the attention core again (all c of its blocks under CP) ...
                if core:
                    rec, kept = c * float(costs.selective_s[v]), float(costs.selective_bytes[v])
                    work = c * float(costs.selective_work_bytes[v])
                else:
                    rec, kept, work = 0.0, float(costs.activation_bytes[v]) + extra_kept, 0.0
                # ... and the recipe's other modules (traced at s / c: once)
                rec += max(0.0, float(costs.module_s[v]) + moe_again)
                kept -= float(costs.module_bytes[v])
                work += float(costs.module_bytes[v])
            else:
                rec, kept, work = 0.0, float(costs.activation_bytes[v]) + extra_kept, 0.0
            if zero == 3 and reshard:  # the layer's gathered parameters (and their low-precision copies) live through its passes
                work += (dense_of[v] + expert_v) * (w_b + k_b)
            work += gathered  # all-gather CP's K/V, whatever the recompute mode
            recompute += rec
            rec_of[v], fwd_of[v], bwd_of[v] = rec, fwd_v, bwd_v
            backward += bwd_v + rec
            forward += fwd_v
            stash += kept
            working = max(working, work)
        producers_in = {u for v in layers for u in preds[v] if stage_of[u] != s}
        producers_out = {v for v in layers if any(stage_of[w] != s for w in succs[v])}
        bytes_in = sum(float(costs.boundary_bytes[u]) for u in producers_in)
        bytes_out = sum(float(costs.boundary_bytes[u]) for u in producers_out)
        comm = 0.0
        if producers_in:
            comm += v_virt * (hop.latency + bytes_in / hop.bandwidth)
        if producers_out:
            comm += v_virt * (hop.latency + bytes_out / hop.bandwidth)
        dense = params - experts
        groups = [(dense, ranks), (experts, expert_ranks)] if split else [(params, ranks)]
        shard_s = 0.0  # ZeRO-2 and 3: the data-parallel collectives of every microbatch, exposed part
        if zero == 2:  # each microbatch's gradients reduce-scattered after its backward
            for n_params, n_ranks in groups:
                if not (split and n_params == 0):
                    shard_s += ring_half_s(n_params * r_b, n_ranks, ring.bandwidth, ring.latency)
            if problem.training.overlap_grad_reduce:  # beside that microbatch's backward
                shard_s = max(0.0, shard_s - backward)
        if zero == 3:
            # each layer's weights gathered over the ranks that shard them: the dense ones over the d x c
            # ranks that hold them alike, the routed experts (where the layer has them) over their own
            # replicas when they form a group of their own (torchtitan shards over dp x cp and the
            # experts over their own data-parallel mesh); under HSDP within the shard group, on its link
            gathers = [ring_half_s(dense_of[v] * gw_b if split else (dense_of[v] + expert_of[v]) * gw_b,
                                   shard_of(ranks), shard_ring.bandwidth, shard_ring.latency)
                       + (ring_half_s(expert_of[v] * gw_b, shard_of(expert_ranks), shard_ring.bandwidth,
                                      shard_ring.latency)
                          if split and expert_of[v] > 0 else 0.0) for v in layers]
            fwds = [fwd_of[v] for v in layers]
            bwds = [bwd_of[v] + rec_of[v] for v in layers]
            scatter = sum(ring_half_s(n_params * r_b, shard_of(n_ranks), shard_ring.bandwidth, shard_ring.latency)
                          for n_params, n_ranks in groups if not (split and n_params == 0))
            # held from the forward (reshard_after_forward off), the weights need no gather in backward
            exposed_bwd = fsdp_exposed_s(bwds, gathers, reverse=True) if reshard else 0.0
            if problem.training.overlap_grad_reduce:  # beside the whole backward pass, its exposed gathers included
                # The backward's gathers and the reduce-scatters share the data-parallel link (FSDP runs
                # them on two streams over one NIC; Zhao et al., VLDB 2023, Sec. 3.3.2): the pass lasts at
                # least their sum, so the scatter hides only under what the gathers leave of it
                busy = sum(gathers) if reshard else 0.0
                scatter = max(0.0, scatter + busy - (backward + exposed_bwd))
            shard_s = fsdp_exposed_s(fwds, gathers, reverse=False) + exposed_bwd + scatter
        if problem.training.overlaps_p2p and v_virt > 1 and S > 1:
            # Megatron's overlapped p2p: a step's sends and receives run beside the stage's work (its
            # compute and exposed data-parallel collectives), except in the warm-up and flush,
            # (S - 1) / v of the m + (S - 1) / v stage times
            share = (S - 1) / v_virt / (m + (S - 1) / v_virt)
            work = compute + recompute + shard_s
            comm = max(work + share * comm, share * work + comm) - work
        # In flight: 1F1B (q microbatches) or Megatron's interleaved schedule (chunks of 1/v each).
        if v_virt > 1 and S > 1:
            chunks = min(2 * (k - 1) + (v_virt - 1) * S + 1, m * v_virt)
            inflight = chunks / v_virt
            stashed = _ceil(chunks * stash / v_virt)
        else:
            inflight = min(k, m)
            stashed = inflight * stash
        # Model state per device (ZeRO, Rajbhandari et al., SC'20, Sec. 5): weights, gradients,
        # optimizer state, low-precision weight copies; ZeRO-1 and 2 shard each kind of parameter
        # over its own replicas.
        def sharded(nbytes):
            return sum(_ceil(n * nbytes / (shard_of(r) if zero == 3 else r)) for n, r in groups)
        if zero == 3:
            # without resharding after forward the stage's gathered weights (and their copies) are held
            # beside the shards from the forward to the backward (FSDP2 reshard_after_forward=False)
            kinds = (sharded(w_b), sharded(g_b), sharded(o_b), 0.0 if reshard else params * (w_b + k_b))
        else:
            kinds = (params * w_b, sharded(g_b) if zero == 2 else params * g_b,
                     sharded(o_b) if zero else params * o_b, params * k_b)
        state = sum(kinds)
        memory = state + stashed + working
        # The per-batch tail: gradient reduction (exposed part) and the optimizer step.
        reduce = gather = 0.0
        hide_gather = zero in (1, 2) and problem.training.overlap_param_gather
        for n_params, n_ranks in groups:
            if split and n_params == 0:
                continue
            if zero == 0:
                reduce += ring_allreduce_s(n_params * r_b, n_ranks, ring.bandwidth, ring.latency)
            elif hide_gather or zero == 2:
                if zero == 1:
                    reduce += ring_half_s(n_params * r_b, n_ranks, ring.bandwidth, ring.latency)
                gather += ring_half_s(n_params * gw_b, n_ranks, ring.bandwidth, ring.latency)
            elif zero == 1:
                reduce += ring_half_s(n_params * r_b, n_ranks, ring.bandwidth, ring.latency) + ring_half_s(
                    n_params * gw_b, n_ranks, ring.bandwidth, ring.latency)
            elif zero == 3 and shard_of(n_ranks) < n_ranks:  # HSDP: the shards all-reduced across the replicas
                reduce += ring_allreduce_s(n_params * r_b / shard_of(n_ranks), n_ranks // shard_of(n_ranks),
                                           ring.bandwidth, ring.latency)
        if problem.training.overlap_grad_reduce:
            reduce = 0.0 if problem.reduction_hidden else max(0.0, reduce - backward)
        if hide_gather:  # under the next iteration's forward of this stage
            reduce += 0.0 if problem.reduction_hidden else max(0.0, gather - forward)
        elif zero == 2:  # after the optimizer step, with nothing beside it
            reduce += gather
        # the optimizer's pass over its shard, then the gradient buffer's zeroing (types.optimizer_pass_bytes)
        shard = (dense / shard_of(ranks) + experts / shard_of(expert_ranks) if split  # HSDP: the group's shard
                 else params / shard_of(ranks))
        step_b, zero_b = optimizer_pass_bytes(problem)
        step_bytes = (shard if zero else params) * step_b + (shard if zero >= 2 else params) * zero_b
        step = step_bytes / problem.hbm_bandwidth if problem.hbm_bandwidth > 0 else 0.0
        stages.append(
            StageResult(
                index=s,
                layers=layers,
                first_layer=costs.names[layers[0]],
                last_layer=costs.names[layers[-1]],
                devices=t * c,
                ranks=[t * c * s, t * c * s + t * c - 1],
                inflight_microbatches=inflight,
                time_s=compute + recompute + comm + shard_s + v_virt * system.efficiency.microbatch_overhead_s,
                compute_s=compute,
                recompute_s=recompute,
                comm_s=comm + shard_s,
                params=params,
                memory_bytes=memory,
                headroom_bytes=hbm - memory,
                allreduce_s=reduce,
                flops=flops,
                optimizer_step_s=step,
                unpaired_a2a_s=unpaired * hidden,
                memory_split={
                    "parameters": kinds[0],
                    "gradients": kinds[1],
                    "optimizer_state": kinds[2],
                    **({"gathered_weights" if zero == 3 else "low_precision_weights": kinds[3]} if kinds[3] else {}),
                    "activations": stashed,
                    "recompute_working_set": working,
                },
            )
        )

    bottleneck = max(st.time_s for st in stages)
    pipeline = bottleneck * (m + (S - 1) / v_virt)
    tail = max(st.allreduce_s + st.optimizer_step_s + st.unpaired_a2a_s for st in stages)
    allreduce = max(st.allreduce_s for st in stages)
    total = pipeline + tail
    peak_memory = max(st.memory_bytes for st in stages)
    used = t * c * S * d
    common = dict(
        tp=t, pp=S, dp=d, ep=e, cp=c, microbatches=m, devices_used=used, stages=stages,
        bottleneck_s=bottleneck, pipeline_s=pipeline, allreduce_s=allreduce,
        bubble_fraction=(S - 1) / v_virt / (m + (S - 1) / v_virt), peak_memory_bytes=peak_memory, method=method,
        optimizer_step_s=max(st.optimizer_step_s for st in stages),
    )

    reasons = []
    if used > system.accelerators:
        wide = f" x cp {c}" if c > 1 else ""
        reasons.append(
            f"needs {used} accelerators (tp {t}{wide} x pp {S} x dp {d}) but the system has {system.accelerators}"
        )
    # (folded, a model without routed experts has no expert grid to fit)
    if not problem.training.expert_fits(t, c, d, e) and (moe or problem.training.expert_tensor_parallel is None):
        reasons.append(problem.training.expert_fit_reason(t, c, d, e))
    uneven = [r for r in ((ranks, expert_ranks) if split else (ranks,)) if r % problem.training.shard_ranks(r)]
    if zero == 3 and uneven:
        reasons.append(f"the HSDP shard group {problem.training.shard_group} must divide the {uneven[0]} "
                       f"data-parallel ranks that hold the same weights")
    if problem.training.moe_a2a_overlap and e > 1 and S > 1 and v_virt == 1:
        reasons.append("the EP all-to-all overlap needs interleaving (virtual_stages > 1) when pp > 1 "
                       "(Megatron-Core's TransformerConfig)")
    why = problem.interleaves(S, d)
    if why:
        reasons.append(why)
    if peak_memory > hbm:
        worst = max(stages, key=lambda st: st.memory_bytes)
        reasons.append(
            f"stage {worst.index} needs {format_bytes(worst.memory_bytes)} per device, more than the "
            f"{format_bytes(hbm)} of HBM"
        )
    if reasons:
        return infeasible_result(problem, "; ".join(reasons), **common)

    if not total > 0:  # a degenerate model (every op costs nothing): no throughput to speak of
        return infeasible_result(problem, "the model's ops take no time on this design (every op costs zero FLOPs, "
                                          "bytes and communication): check the model's sizes", **common)
    batch = problem.system.global_batch
    throughput = batch / total
    flops_per_batch = problem.model_flops_per_sequence * batch
    mfu = flops_per_batch / (used * problem.peak_flops * total) if problem.peak_flops > 0 else 0.0
    return PlacementResult(
        feasible=True,
        reason="",
        time_per_batch_s=total,
        throughput=throughput,
        tokens_per_s=throughput * problem.seq_len,
        mfu=mfu,
        hbm_bytes=hbm,
        **common,
    )
