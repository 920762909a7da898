"""EP/CP placement DP speed: a Mixtral-8x7B-like chain (34 layers) on 1024 accelerators, TP 1/2/4/8,
EP 1/2/4/8, CP 1/2/4/8 (the sequence 32K so CP is searched), no recompute and full recompute, and
full recompute under ZeRO-3 (FSDP over DP x CP, the experts over their own replicas).

Target: at most 50 ms per solve, excluding the per-layer ILP. The layer costs are
synthetic but sized like Mixtral at 32K tokens (hidden 4096, 8 experts of FFN 14336, top-2, 8 KV
heads) on a TPUv4-like chip (275 TFLOP/s at an assumed 50%, 32 GiB HBM), as bench_placement.py
does for GPT-3.

    python benchmarks/bench_expert_parallel.py [--runs 9]

Prints the median and min of warm runs per scenario (the first, cold run is not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from phaze_opt.solve.placement.expert import optimal_placement
from phaze_opt.solve.placement.types import LayerCosts, PlacementProblem
from phaze_opt.system import load_system
from phaze_opt.training import Training

GIB = 2**30


def mixtral_costs(t: int, c: int, system, seq: int = 32768, hidden: int = 4096, layers: int = 32, vocab: int = 32000,
                  experts: int = 8, top_k: int = 2, ffn: int = 14336, kv_heads: int = 8, peak: float = 275e12,
                  efficiency: float = 0.5) -> LayerCosts:
    s = seq // c
    rate = peak * efficiency
    link = system.tp_link(t)
    boundary = 2.0 * s * hidden
    allreduce = 0.0 if t == 1 else 2 * (t - 1) * link.latency + 2 * (t - 1) / t * boundary / link.bandwidth
    attn_params = 2 * hidden * hidden + 2 * hidden * 1024
    expert_params = experts * 3 * hidden * ffn
    core = 4 * s * s * hidden / t / rate  # one K/V block of the attention core
    expert_flops = 2 * s * top_k * 3 * hidden * ffn
    dense_flops = 2 * s * attn_params
    fwd_block = (dense_flops + expert_flops) / t / rate + core + 2 * allreduce
    acts = s * hidden * 34 / t
    n = layers + 2
    head_fwd = 2 * s * hidden * vocab / t / rate + allreduce
    return LayerCosts(
        tp=t, cp=c,
        fwd_s=[boundary / 1.2e12] + [fwd_block] * layers + [head_fwd],
        bwd_s=[2 * boundary / 1.2e12] + [2 * fwd_block] * layers + [2 * head_fwd],
        params=[vocab * hidden / t] + [(attn_params + expert_params) / t] * layers + [vocab * hidden / t],
        activation_bytes=[boundary] + [acts] * layers + [4.0 * s * vocab / t],
        boundary_bytes=[boundary] * (n - 1) + [0.0], input_bytes=[8.0 * s] + [boundary] * (n - 1),
        expert_params=[0.0] + [expert_params / t] * layers + [0.0],
        dispatch_bytes=[0.0] + [2.0 * s * top_k * hidden] * layers + [0.0],
        expert_fwd_s=[0.0] + [expert_flops / t / rate] * layers + [0.0],
        expert_bwd_s=[0.0] + [2 * expert_flops / t / rate] * layers + [0.0],
        core_fwd_s=[0.0] + [core] * layers + [0.0], core_bwd_s=[0.0] + [2.5 * core] * layers + [0.0],
        kv_bytes=[0.0] + [2.0 * 2 * s * kv_heads / t * 128] * layers + [0.0],
    )


def problem(recompute: str, imbalance: float = 1.0, **recipe) -> PlacementProblem:
    system = load_system("default")
    widths, cps = (1, 2, 4, 8), (1, 2, 4, 8)
    return PlacementProblem(
        costs=tuple(mixtral_costs(t, 1, system) for t in widths), system=system, hbm_bytes=32 * GIB,
        peak_flops=275e12, training=Training(recompute=recompute, load_imbalance=imbalance, **recipe), seq_len=32768,
        ep_widths=(1, 2, 4, 8), cp_widths=cps,
        cp_costs=tuple(mixtral_costs(t, c, system) for t in widths for c in cps if c > 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    for name, prob in (("none", problem("none")), ("full", problem("full")), ("full, imbalance 1.2", problem("full", 1.2)),
                       ("full, ZeRO-3 (FSDP)", problem("full", zero=3, overlap_grad_reduce=True))):
        optimal_placement(prob)  # cold
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            r = optimal_placement(prob)
            times.append(time.perf_counter() - t0)
        print(f"{name:22s} median {statistics.median(times) * 1e3:7.1f} ms  min {min(times) * 1e3:7.1f} ms  "
              f"-> tp {r.tp} pp {r.pp} dp {r.dp} ep {r.ep} cp {r.cp}, {r.throughput:.3f} seq/s, "
              f"{r.info.get('groups')} groups, {r.info.get('sweeps')} sweeps")


if __name__ == "__main__":
    main()
