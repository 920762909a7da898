"""Evaluate one design: workload graphs -> operator latencies -> per-layer ILP -> placement DP.

CONTRACT (implemented by the integration step; the study and exhaustive modes call only this):

    evaluate_design(model, arch, mbs, recompute, system="default", placement="optimal") -> DesignResult

`model` is a model name/path or a loaded model config, `arch` an Accelerator, `system` a system
name/path or a loaded System. It never raises for an infeasible design: `feasible` is False and
`reason` says why (for example the smallest memory needed against the HBM). Work shared between
calls (graphs, latencies and ILP solutions of the same compute architecture and microbatch) is
cached by content, so a repeated compute architecture costs milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    layers: list = field(default_factory=list)  # per-layer cost table
    model: str = ""
    energy_j: float | None = None  # per batch, when the hardware model provides it

    def to_json(self) -> dict:
        return asdict(self)
