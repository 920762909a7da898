"""The independent evaluator: time and memory of any given placement, recomputed from scratch.

It shares no code with the DP (`placement.py`) beyond the input types and the System's link rules;
it walks the stages and layers one by one, so a slip in the DP's vectorised tables shows up as a
disagreement in the tests. The model it implements (the definition the DP must optimise exactly):

- A placement is a TP width t, a data-parallel degree d and S stages, each a set of layers that is a
  difference of two downsets of the layer DAG (every edge runs forward or within a stage). Each
  stage runs on t devices in each of the d replicas; S*t*d must not exceed the accelerators.
- Microbatches per pipeline: m = ceil(global batch / (mbs * d)).
- Stage time per microbatch = sum of its layers' forward + backward time, plus one more forward
  when recomputing (every stage but the last, which runs its backward right after its forward),
  plus receiving its inputs and the gradients of its outputs. Inputs are the outputs of producers in
  earlier stages that feed the stage (each producer's `boundary_bytes` once); output gradients are
  those of the stage's layers that feed later stages. Each direction with anything to receive costs
  one message on the pipeline link: latency + bytes / bandwidth.
- Memory per device = parameters x the System's state bytes per parameter + stashed activations.
  The stage k-th from the end holds q = min(k, m) microbatches in flight under 1F1B (Narayanan et
  al., SOSP'19, PipeDream-Flush). Without recompute it keeps q microbatches' activations. With
  recompute it keeps the stage input of each in-flight microbatch and materialises one
  microbatch's full activations at a time; the input of that microbatch is part of them, so
  memory = full + (q - 1) x stage input (the same accounting as the published Phaze DP). The stage
  input is what it receives from earlier stages plus the model input of its source layers.
- Time per batch = bottleneck stage time x (m + S - 1) + the data-parallel gradient all-reduce: a
  ring over the d replicas of each stage's gradients, 2 (d - 1) / d x bytes / bandwidth +
  2 (d - 1) x latency (Patarasuk and Yuan, JPDC 2009; Thakur et al., IJHPCA 2005), the slowest
  stage counting; zero when d = 1.
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

    stages = []
    for s, stage in enumerate(placement.stages):
        layers = sorted(int(v) for v in stage)
        k = S - s  # position from the end: the last stage is 1
        compute = 0.0
        forward = 0.0
        params = 0.0
        activations = 0.0
        flops = 0.0
        source_input = 0.0
        for v in layers:
            compute += float(costs.fwd_s[v]) + float(costs.bwd_s[v])
            forward += float(costs.fwd_s[v])
            params += float(costs.params[v])
            activations += float(costs.activation_bytes[v])
            flops += float(costs.flops[v])
            if not preds[v]:
                source_input += float(costs.input_bytes[v])
        producers_in = {u for v in layers for u in preds[v] if stage_of[u] != s}
        producers_out = {v for v in layers if any(stage_of[w] != s for w in succs[v])}
        bytes_in = sum(float(costs.boundary_bytes[u]) for u in producers_in)
        bytes_out = sum(float(costs.boundary_bytes[u]) for u in producers_out)
        comm = 0.0
        if producers_in:
            comm += hop.latency + bytes_in / hop.bandwidth
        if producers_out:
            comm += hop.latency + bytes_out / hop.bandwidth
        recompute = forward if (problem.recompute and k > 1) else 0.0
        inflight = min(k, m)
        if problem.recompute:
            stashed = activations + (inflight - 1) * (bytes_in + source_input)
        else:
            stashed = inflight * activations
        memory = params * system.state_bytes_per_param + stashed
        grad_bytes = params * system.grad_bytes_per_param
        stages.append(
            StageResult(
                index=s,
                layers=layers,
                first_layer=costs.names[layers[0]],
                last_layer=costs.names[layers[-1]],
                devices=t,
                ranks=[t * s, t * s + t - 1],
                inflight_microbatches=inflight,
                time_s=compute + recompute + comm,
                compute_s=compute,
                recompute_s=recompute,
                comm_s=comm,
                params=params,
                memory_bytes=memory,
                headroom_bytes=hbm - memory,
                allreduce_s=ring_allreduce_s(grad_bytes, d, ring.bandwidth, ring.latency),
                flops=flops,
            )
        )

    bottleneck = max(st.time_s for st in stages)
    pipeline = bottleneck * (m + S - 1)
    allreduce = max(st.allreduce_s for st in stages)
    total = pipeline + allreduce
    peak_memory = max(st.memory_bytes for st in stages)
    common = dict(
        tp=t, pp=S, dp=d, microbatches=m, devices_used=t * S * d, stages=stages,
        bottleneck_s=bottleneck, pipeline_s=pipeline, allreduce_s=allreduce,
        bubble_fraction=(S - 1) / (m + S - 1), peak_memory_bytes=peak_memory, method=method,
    )

    reasons = []
    if t * S * d > system.accelerators:
        reasons.append(
            f"needs {t * S * d} accelerators (tp {t} x pp {S} x dp {d}) but the system has {system.accelerators}"
        )
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
