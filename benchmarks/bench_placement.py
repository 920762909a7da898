"""Placement DP speed on a GPT-3-175B-like chain: 98 layers, 1024 accelerators, TP widths 1/2/4/8.

The published system's C++ DP takes about 3 s on this size; the target here is <= 30 ms warm,
excluding the per-layer ILP. The layer costs are synthetic but sized like GPT-3 175B (hidden 12288,
96 heads, sequence 2048, vocabulary 50257, microbatch 1) on a TPUv4-like chip (275 TFLOP/s bf16 at
an assumed 50% efficiency, 32 GiB HBM), with Megatron's activation sizes (Korthikanti et al., 2022):
the numbers only need the right shape for the DP's work to be representative.

    python benchmarks/bench_placement.py [--runs 15]

Prints the median and min of several warm runs per scenario (the first, cold run is not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from phaze_opt.solve.placement.dp import optimal_dense_placement
from phaze_opt.solve.placement.types import LayerCosts, PlacementProblem
from phaze_opt.system import load_system
from phaze_opt.training import Training

GIB = 2**30


def gpt3_costs(t: int, system, mbs: int = 1, seq: int = 2048, hidden: int = 12288, heads: int = 96,
               vocab: int = 50257, layers: int = 96, peak: float = 275e12, efficiency: float = 0.5):
    rate = peak * efficiency
    tp_link = system.tp_link(t)
    boundary = 2.0 * mbs * seq * hidden  # bf16 activations between layers
    allreduce = 0.0 if t == 1 else 2 * (t - 1) * tp_link.latency + 2 * (t - 1) / t * boundary / tp_link.bandwidth
    dec_flops = 24 * mbs * seq * hidden**2 + 4 * mbs * seq**2 * hidden
    dec_fwd = dec_flops / t / rate + 2 * allreduce
    dec_params = 12 * hidden**2 / t
    dec_acts = mbs * seq * hidden * (10 + 24 / t + 5 * heads * seq / (hidden * t))
    emb_params = vocab * hidden / t
    head_flops = 2 * mbs * seq * hidden * vocab
    fwd = [boundary / 1.2e12] + [dec_fwd] * layers + [head_flops / t / rate + allreduce]
    bwd = [2 * boundary / 1.2e12] + [2 * dec_fwd] * layers + [2 * head_flops / t / rate + allreduce]
    params = [emb_params] + [dec_params] * layers + [emb_params]
    acts = [boundary] + [dec_acts] * layers + [4.0 * mbs * seq * vocab / t]
    names = ["embedding"] + [f"decoder.{i}" for i in range(layers)] + ["head"]
    return LayerCosts(
        tp=t, fwd_s=fwd, bwd_s=bwd, params=params, activation_bytes=acts,
        boundary_bytes=[boundary] * (layers + 1) + [0.0], input_bytes=[4.0 * mbs * seq] + [boundary] * (layers + 1),
        names=tuple(names),
    )


def problem(system, hbm_gib: float, mbs: int, recompute, seq: int = 2048, **recipe) -> PlacementProblem:
    costs = tuple(gpt3_costs(t, system, mbs=mbs, seq=seq) for t in (1, 2, 4, 8))
    params = 175e9
    return PlacementProblem(
        costs=costs, system=system, hbm_bytes=hbm_gib * GIB, peak_flops=275e12,
        training=Training(mbs=mbs, recompute=recompute, **recipe), seq_len=seq,
        model_flops_per_sequence=6 * params * seq, hbm_bandwidth=1.2e12, interleave_layers=96,
    )


SCENARIOS = [
    # name, system, HBM GiB, microbatch, recompute
    ("gpt3 tpuv4-32GiB mbs1", "default", 32, 1, False),
    ("gpt3 tpuv4-32GiB mbs1 recompute", "default", 32, 1, True),
    ("gpt3 96GiB mbs2", "default", 96, 2, False),
    ("gpt3 phaze-system 32GiB mbs1", "phaze", 32, 1, False),
    ("gpt3 1TiB (memory never binds) mbs1", "default", 1024, 1, False),
    ("gpt3 1TiB mbs16 (memory caps bind)", "default", 1024, 16, False),
    ("gpt3 8GiB (infeasible)", "default", 8, 1, False),
    # the general search (memory or the per-batch tail depends on d, or in-flight on S)
    ("gpt3 32GiB selective zero1", "default", 32, 1, "selective", {"zero": 1}),
    ("gpt3 32GiB full zero1 overlap", "default", 32, 1, "full", {"zero": 1, "overlap_grad_reduce": True}),
    ("gpt3 32GiB full zero3", "default", 32, 1, "full", {"zero": 3}),
    ("gpt3 32GiB full v2", "default", 32, 1, "full", {"virtual_stages": 2}),
    ("gpt3 32GiB full v2 zero1 overlap", "default", 32, 1, "full",
     {"virtual_stages": 2, "zero": 1, "overlap_grad_reduce": True}),
    ("gpt3 32GiB full zero3 overlap", "default", 32, 1, "full", {"zero": 3, "overlap_grad_reduce": True}),
    ("gpt3 32GiB full v2 zero3 overlap", "default", 32, 1, "full",
     {"virtual_stages": 2, "zero": 3, "overlap_grad_reduce": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"{'scenario':40s} {'median ms':>10s} {'min ms':>8s}  result")
    for name, system_name, hbm, mbs, recompute, *extra in SCENARIOS:
        system = load_system(system_name)
        prob = problem(system, hbm, mbs, recompute, **(extra[0] if extra else {}))
        optimal_dense_placement(prob)  # cold run: imports, allocations
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            result = optimal_dense_placement(prob)
            times.append(time.perf_counter() - start)
        if result.feasible:
            what = (f"tp {result.tp} pp {result.pp} dp {result.dp} m {result.microbatches}: "
                    f"{result.time_per_batch_s:.2f} s/batch, MFU {result.mfu:.3f}, sweeps {result.info.get('sweeps')}")
        else:
            what = result.reason[:90]
        print(f"{name:40s} {1e3 * statistics.median(times):10.2f} {1e3 * min(times):8.2f}  {what}")


if __name__ == "__main__":
    main()
