"""The independent evaluator: time and memory of any given placement, recomputed from scratch.

It shares no code with the DP (`placement.py`) beyond the input types and the System's link rules;
it walks the stages and layers one by one, so a slip in the DP's vectorised tables shows up as a
disagreement in the tests. The model it implements (the definition the DP must optimise exactly):

- A placement is a TP width t, a data-parallel degree d and S stages, each a set of layers that is a
  difference of two downsets of the layer DAG (every edge runs forward or within a stage). Each
  stage runs on t devices in each of the d replicas; S*t*d must not exceed the accelerators.
- Microbatches per pipeline: m = ceil(global batch / (mbs * d)).
- Stage time per microbatch = sum of its layers' forward + backward time, plus the recompute of
  the recipe's mode on every stage, the last included, as Megatron does (Korthikanti et al. 2022,
  Sec. 5): `full` adds each layer's forward, `selective` the attention core's forward
  (`LayerCosts.selective_s`), `none` nothing; plus receiving its inputs and the gradients of its
  outputs. Inputs are the outputs of producers in earlier stages that feed the stage (each
  producer's `boundary_bytes` once); output gradients are those of the stage's layers that feed
  later stages. Each direction with anything to receive costs one message on the pipeline link:
  latency + bytes / bandwidth; with v virtual stages (interleaved 1F1B) every microbatch crosses
  v times as many stage boundaries, so v times the messages (Narayanan et al., SC'21, Sec. 2.2).
  With ZeRO-3 the stage also all-gathers each layer's parameters over the d replicas before the
  layer's forward and again before its backward, and reduce-scatters its gradients after the
  backward, every microbatch (Rajbhandari et al., SC'20, Sec. 5.3; ring collectives, (d - 1) / d x
  bytes / bw + (d - 1) x latency each). The gathers are prefetched as FSDP does (`fsdp_exposed_s`:
  each layer's gather runs during the previous layer's compute of the same pass; only what does not
  fit under it is exposed); with overlap_grad_reduce only the part of the reduce-scatter longer
  than the stage's backward pass (its compute and exposed gathers) is exposed, so the stage time
  holds max(backward pass, reduce-scatter), non-decreasing in every layer time.
- Memory per device (Korthikanti et al. 2022, Sec. 4; Rajbhandari et al., SC'20):
  parameters x (weight + gradient + optimizer bytes), with ZeRO-1 the optimizer part and with
  ZeRO-3 all three divided over the d replicas (rounded up to whole bytes), plus the in-flight
  activations, plus the recompute working set. Per microbatch a stage keeps, per layer,
  `activation_bytes` (none), `selective_bytes` (selective) or `checkpoint_bytes` (full). Under
  1F1B (PipeDream-Flush; Narayanan et al., SOSP'19) the stage k-th from the end holds q = min(k, m)
  microbatches. Interleaved (v > 1, pp > 1), Megatron's schedule holds on the device k-th from the
  end min(2 (k - 1) + (v - 1) p + 1, m v) model chunks of one microbatch in flight (its warm-up
  count plus one; Megatron-LM `forward_backward_pipelining_with_interleaving`), each 1/v of the
  stage's activations: ceil(chunks x stash / v) bytes (on the first device (1 + (p - 1)/(p v)) p
  microbatches' worth, Korthikanti et al. 2022, Sec. 4.2.3). The working set is the largest, over
  the stage's layers, of what exists only during that layer's backward: its attention core
  (selective), all its activations (full), plus under ZeRO-3 its gathered parameters.
  Interleaving also needs (Megatron) the layer count divisible by p v and m a multiple of p;
  otherwise the placement is infeasible.
- Time per batch = bottleneck stage time x (m + (S - 1) / v) (the bubble of the interleaved
  schedule is (p - 1) / v stage times; Narayanan et al., SC'21, Sec. 2.2) + the slowest stage's
  per-batch tail: its data-parallel gradient reduction plus its optimizer step. The reduction is a
  ring all-reduce of its gradients over the d replicas, 2 (d - 1) / d x bytes / bandwidth +
  2 (d - 1) x latency (Patarasuk and Yuan, JPDC 2009; Thakur et al., IJHPCA 2005), zero when
  d = 1; under ZeRO-1 a reduce-scatter of the gradients plus an all-gather of the 16-bit weights
  (the same bytes when they have the same width); under ZeRO-3 none (it ran per microbatch). With
  overlap_grad_reduce the reduction of a stage's gradients runs beside the backward of the last
  microbatch (Megatron's `--overlap-grad-reduce` launches each bucket's reduction as soon as its
  gradients are final, i.e. during the last microbatch's backward; Li et al., VLDB 2020, PyTorch
  DDP): only max(0, reduction - that stage's backward time per microbatch) is exposed (0 in the
  lower-bound mode `PlacementProblem.reduction_hidden`, see design/upper_bound.py). The
  optimizer step reads the gradients and the optimizer state and writes the state and the
  weights once per batch on HBM: params x (weight + gradient + 2 x optimizer) bytes / HBM
  bandwidth (divided over the replicas under ZeRO-1 and 3), zero when no HBM bandwidth is given.
- Throughput = global batch / time per batch; MFU = model FLOP per sequence x global batch /
  (devices used x peak FLOP/s x time per batch); bubble fraction = (S - 1) / (m + S - 1).
"""

from __future__ import annotations

from .placement_types import (
    Placement,
    PlacementProblem,
    PlacementResult,
    StageResult,
    check_placement_shape,
    infeasible_result,
    state_split,
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


def evaluate_placement(
    problem: PlacementProblem, placement: Placement, *, method: str = "evaluated"
) -> PlacementResult:
    """Time, memory and throughput of `placement`. Never raises for running out of memory or
    devices (the result is infeasible with the reason); raises PhazeError for a malformed placement."""
    check_placement_shape(problem, placement)
    system = problem.system
    costs = problem.costs_for(placement.tp)
    t, d, S = placement.tp, int(placement.dp), placement.pp
    m = problem.microbatches(d)
    hbm = problem.hbm_bytes
    hop = system.pipeline_link(t, S)
    ring = system.dp_link(t, S, d)

    stage_of = {}
    for s, stage in enumerate(placement.stages):
        for v in stage:
            stage_of[int(v)] = s
    preds: dict[int, list[int]] = {v: [] for v in range(costs.n_layers)}
    succs: dict[int, list[int]] = {v: [] for v in range(costs.n_layers)}
    for u, v in costs.edges:
        preds[v].append(u)
        succs[u].append(v)

    mode = problem.recompute
    v_virt = problem.virtual_stages
    zero = problem.zero
    w_b, g_b, o_b = state_split(system)
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
        rec_of = {}
        for v in layers:
            compute += float(costs.fwd_s[v]) + float(costs.bwd_s[v])
            params += float(costs.params[v])
            flops += float(costs.flops[v])
            if mode == "full":  # Korthikanti et al. 2022, Sec. 5: the whole forward again
                rec, kept, work = float(costs.fwd_s[v]), float(costs.checkpoint_bytes[v]), float(costs.full_work_bytes[v])
            elif mode == "selective":  # only the attention core again
                rec, kept, work = float(costs.selective_s[v]), float(costs.selective_bytes[v]), float(costs.selective_work_bytes[v])
            else:
                rec, kept, work = 0.0, float(costs.activation_bytes[v]), 0.0
            if zero == 3:  # the layer's gathered parameters live through its forward and backward
                work += float(costs.params[v]) * w_b
            recompute += rec
            rec_of[v] = rec
            backward += float(costs.bwd_s[v]) + rec
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
        grad_bytes = params * g_b
        weight_bytes = params * w_b
        zero3_s = 0.0
        if zero == 3:
            gathers = [ring_half_s(float(costs.params[v]) * w_b, d, ring.bandwidth, ring.latency) for v in layers]
            fwds = [float(costs.fwd_s[v]) for v in layers]
            bwds = [float(costs.bwd_s[v]) + rec_of[v] for v in layers]
            scatter = ring_half_s(grad_bytes, d, ring.bandwidth, ring.latency)
            exposed_bwd = fsdp_exposed_s(bwds, gathers, reverse=True)
            if problem.overlap_grad_reduce:  # beside the whole backward pass, its exposed gathers included
                scatter = max(0.0, scatter - (backward + exposed_bwd))
            zero3_s = fsdp_exposed_s(fwds, gathers, reverse=False) + exposed_bwd + scatter
        # In flight: 1F1B (q microbatches) or Megatron's interleaved schedule (chunks of 1/v each).
        if v_virt > 1 and S > 1:
            chunks = min(2 * (k - 1) + (v_virt - 1) * S + 1, m * v_virt)
            inflight = chunks / v_virt
            stashed = _ceil(chunks * stash / v_virt)
        else:
            inflight = min(k, m)
            stashed = inflight * stash
        # Model state per device (ZeRO, Rajbhandari et al., SC'20, Sec. 5).
        if zero == 0:
            state = params * (w_b + g_b + o_b)
        elif zero == 1:
            state = params * (w_b + g_b) + _ceil(params * o_b / d)
        else:
            state = _ceil(params * w_b / d) + _ceil(params * g_b / d) + _ceil(params * o_b / d)
        memory = state + stashed + working
        # The per-batch tail: gradient reduction (exposed part) and the optimizer step.
        if zero == 0:
            reduce = ring_allreduce_s(grad_bytes, d, ring.bandwidth, ring.latency)
        elif zero == 1:
            reduce = ring_half_s(grad_bytes, d, ring.bandwidth, ring.latency) + ring_half_s(
                weight_bytes, d, ring.bandwidth, ring.latency)
        else:
            reduce = 0.0
        if problem.overlap_grad_reduce:
            reduce = 0.0 if problem.reduction_hidden else max(0.0, reduce - backward)
        step_bytes = params * (w_b + g_b + 2 * o_b)
        if zero:
            step_bytes = step_bytes / d
        step = step_bytes / problem.hbm_bandwidth if problem.hbm_bandwidth > 0 else 0.0
        stages.append(
            StageResult(
                index=s,
                layers=layers,
                first_layer=costs.names[layers[0]],
                last_layer=costs.names[layers[-1]],
                devices=t,
                ranks=[t * s, t * s + t - 1],
                inflight_microbatches=inflight,
                time_s=compute + recompute + comm + zero3_s,
                compute_s=compute,
                recompute_s=recompute,
                comm_s=comm + zero3_s,
                params=params,
                memory_bytes=memory,
                headroom_bytes=hbm - memory,
                allreduce_s=reduce,
                flops=flops,
                optimizer_step_s=step,
                memory_split={
                    "parameters": params * w_b if zero < 3 else _ceil(params * w_b / d),
                    "gradients": params * g_b if zero < 3 else _ceil(params * g_b / d),
                    "optimizer_state": params * o_b if zero == 0 else _ceil(params * o_b / d),
                    "activations": stashed,
                    "recompute_working_set": working,
                },
            )
        )

    bottleneck = max(st.time_s for st in stages)
    pipeline = bottleneck * (m + (S - 1) / v_virt)
    tail = max(st.allreduce_s + st.optimizer_step_s for st in stages)
    allreduce = max(st.allreduce_s for st in stages)
    total = pipeline + tail
    peak_memory = max(st.memory_bytes for st in stages)
    common = dict(
        tp=t, pp=S, dp=d, microbatches=m, devices_used=t * S * d, stages=stages,
        bottleneck_s=bottleneck, pipeline_s=pipeline, allreduce_s=allreduce,
        bubble_fraction=(S - 1) / v_virt / (m + (S - 1) / v_virt), peak_memory_bytes=peak_memory, method=method,
        optimizer_step_s=max(st.optimizer_step_s for st in stages),
    )

    reasons = []
    if t * S * d > system.accelerators:
        reasons.append(
            f"needs {t * S * d} accelerators (tp {t} x pp {S} x dp {d}) but the system has {system.accelerators}"
        )
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

    batch = problem.system.global_batch
    throughput = batch / total
    flops_per_batch = problem.model_flops_per_sequence * batch
    mfu = flops_per_batch / (t * S * d * problem.peak_flops * total) if problem.peak_flops > 0 else 0.0
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
