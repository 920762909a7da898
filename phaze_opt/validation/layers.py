"""The per-layer comparison of a `layer_seconds` suite (layers-h100): predicted against measured.

    compare_layers(suite, arch=None, time_limit_s=60.0, fuse=False) -> list[LayerResult]
    compare_gemms(suite, arch=None) -> list[GemmResult]
    mape(results) -> float            (mean absolute percentage error of fwd + bwd, or of the GEMM time)

What is predicted for a layer row (model, tp, microbatch, flash): one transformer block's TP shard,
forward and backward, on the suite's arch (or `arch`), compute only, as the measurement ran it (one
device, no all-reduce). The block graph is the project's traced layer (workload/graphs.py) at that TP
width and microbatch, with the row's attention kernel (flash: the fused FlashAttention op; unfused:
QK^T, mask, softmax, dropout, PV as separate ops). The measurement ran eager PyTorch, one kernel per
ATen operator (configs/validation/truth/README.md), so by default the graph is the trace before the
fusion pass (`fuse=False`: every operator its own op, as eager launched it); `fuse=True` compares the
project's fused graph instead (the element-wise chains a compiler or Megatron's fused kernels merge). Its operators are priced by the latency model
(hardware/latency.py, with the arch's `efficiency`), the collectives (the TP all-reduces) are given zero
time, and the pass's makespan is the exact per-layer schedule (solve/schedule/solver.py: proven optimal, or the
verified incumbent and its bound if the time limit stops it; `LayerResult.proven` and `.gap` say
which and how far: with the calibrated h100-sxm, Llama-2's unfused backward passes stop at the
60 s limit at most 0.3% above their bound).

A GEMM row (M, N, K, measured seconds) is one (M x K) @ (K x N) bf16 GEMM on the whole chip: the
template's split latency of that op, with the compulsory traffic of its three operands.

The functions are pure (the schedule cache aside, which only remembers answers) and print nothing; the
`validate` command formats them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..hardware.accelerator import Accelerator
from ..hardware.arch import load_arch
from ..hardware.latency import BYTES_PER_ELEMENT, estimate
from ..solve.schedule.solver import schedule_graph
from ..workload.graphs import build_layer_graph
from ..workload.ops import NET, TC, Op, OpGraph
from ..workload.stack import TRACE_FUSION
from .suites import Gemm, LayerRow, Suite

BLOCK = "block"  # the layer kind of a transformer block in the traced graphs (workload/graphs.py)
PASSES = ("fwd", "bwd")


@dataclass(frozen=True)
class LayerResult:
    """One layer row: measured and predicted seconds of the forward and backward pass."""

    row: LayerRow
    fwd_s: float  # predicted
    bwd_s: float
    proven: bool = True  # both passes' schedules proven optimal
    gap: float = 0.0  # largest relative gap (makespan / proven lower bound - 1) of the two passes

    @property
    def fwd_bwd_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def error(self) -> float:
        """Signed relative error of fwd + bwd: (predicted - measured) / measured."""
        return self.fwd_bwd_s / self.row.fwd_bwd_s - 1.0

    @property
    def fwd_error(self) -> float:
        return self.fwd_s / self.row.fwd_s - 1.0

    @property
    def bwd_error(self) -> float:
        return self.bwd_s / self.row.bwd_s - 1.0


@dataclass(frozen=True)
class GemmResult:
    gemm: Gemm
    seconds: float  # predicted

    @property
    def flops(self) -> float:
        return 2.0 * self.gemm.m * self.gemm.n * self.gemm.k

    @property
    def tflops(self) -> float:
        """Predicted TFLOP/s (the measured one is `gemm.tflops`)."""
        return self.flops / self.seconds / 1e12

    @property
    def error(self) -> float:
        """Signed relative error of the time."""
        return self.seconds / self.gemm.seconds - 1.0


def suite_accelerator(suite: Suite, arch) -> Accelerator:
    if arch is None:
        return load_arch(suite.arch)
    return arch if isinstance(arch, Accelerator) else load_arch(arch)


def _check(suite: Suite) -> None:
    if suite.metric != "layer_seconds":
        raise ValueError(f"suite {suite.name}: metric {suite.metric}, not layer_seconds")


# A row timed with compiled kernels (`measure --kernels inductor`: torch.compile, TorchInductor) is
# predicted with the kernels of the `torch-compile` stack, the one stack every compiled PyTorch run is
# priced with (the torchtitan suites' compiled rows too): TorchInductor fuses pointwise chains with
# the reductions they feed and across consumers, one loop nest a kernel (PyTorch 2 paper, Ansel et
# al., ASPLOS 2024, Sec. 5.3; workload/stack.py). It predicts the backward passes of the compiled
# GPT-3 (unfused attention) and Qwen3 (MoE) blocks 9-14% too fast, where the row fusion of
# `megatron-te` is within 4% (docs/validation.md, "Blocks of the 2024-26 models").
KERNEL_FUSION = {"inductor": TRACE_FUSION["torch-compile"]}


def layer_row_config(row: LayerRow) -> dict:
    """A layer row's configuration as the report prints it: the block, its TP width, microbatch and
    attention kernel."""
    return {"model": row.model, "tp": row.tp, "mbs": row.microbatch, "attention": "flash" if row.flash else "unfused"}


def block_pass_latencies(op_graph: OpGraph, arch: Accelerator) -> tuple[np.ndarray, np.ndarray]:
    """(single, split) latencies of a block pass on `arch` with its collectives at zero time (the
    measurement ran the TP shard alone: compute only)."""
    lat = estimate(op_graph, [arch])
    single, split = lat.single[0].copy(), lat.split[0].copy()
    net = [i for i, op in enumerate(op_graph.ops) if op.unit == NET]
    single[net] = 0.0
    split[net] = 0.0
    return single, split


def block_graph(model: str, tp: int, mbs: int, flash: bool, fuse: bool = False):
    """The traced layer graph of a row (see the module docstring for `fuse`)."""
    return build_layer_graph(model, tp, mbs, attention="flash" if flash else "unfused", fuse=fuse)


def predict_layer(model: str, tp: int, mbs: int, flash: bool, arch: Accelerator,
                  time_limit_s: float = 60.0, fuse: bool = False) -> tuple[float, float, bool, float]:
    """(forward s, backward s, proven, gap) of one block's TP shard on `arch`, compute only; `gap` is
    the largest relative distance of a pass's makespan above its proven lower bound (0 when proven)."""
    graph = block_graph(model, tp, mbs, flash, fuse)
    out, proven, gap = [], True, 0.0
    for pass_name in PASSES:
        op_graph = graph.op_graphs[BLOCK][pass_name]
        single, split = block_pass_latencies(op_graph, arch)
        sched = schedule_graph(op_graph, single, split, arch, time_limit_s=time_limit_s)
        if sched.status not in ("optimal", "time_limit"):
            raise RuntimeError(f"schedule of {model} block/{pass_name} (tp {tp}, mbs {mbs}) failed: {sched.status}")
        proven = proven and sched.status == "optimal"
        if sched.status != "optimal":
            gap = max(gap, sched.makespan / sched.lower_bound - 1.0)
        out.append(float(sched.makespan))
    return out[0], out[1], proven, gap


def compare_layers(suite: Suite, arch: Accelerator | str | None = None,
                   time_limit_s: float = 60.0, fuse: bool = False) -> list[LayerResult]:
    """Every layer row of `suite` predicted on `arch` (default: the suite's arch), in the suite's order."""
    _check(suite)
    acc = suite_accelerator(suite, arch)
    results = []
    for row in suite.rows:
        row_fuse = KERNEL_FUSION.get(row.kernels, fuse)
        fwd, bwd, proven, gap = predict_layer(row.model, row.tp, row.microbatch, row.flash, acc, time_limit_s, row_fuse)
        results.append(LayerResult(row=row, fwd_s=fwd, bwd_s=bwd, proven=proven, gap=gap))
    return results


def gemm_op(m: int, n: int, k: int, e: float = BYTES_PER_ELEMENT) -> Op:
    """The (M x K) @ (K x N) GEMM as an op with its compulsory traffic."""
    return Op("gemm", "gemm", TC, flops=2.0 * m * n * k, bytes_read=e * (m * k + k * n), bytes_written=e * m * n,
              gemm=(1, m, k, n))


def gemm_seconds(m: int, n: int, k: int, arch: Accelerator) -> float:
    """The template's latency of one GEMM on the whole chip (split across all tensor cores)."""
    lat = estimate(OpGraph("gemm", "fwd", (gemm_op(m, n, k),), ()), [arch])
    return float(lat.split[0, 0])


def compare_gemms(suite: Suite, arch: Accelerator | str | None = None) -> list[GemmResult]:
    """Every GEMM timing of `suite` (Suite.gemms) predicted on `arch` (default: the suite's arch)."""
    _check(suite)
    acc = suite_accelerator(suite, arch)
    return [GemmResult(gemm=g, seconds=gemm_seconds(g.m, g.n, g.k, acc)) for g in suite.gemms]


def mape(results) -> float:
    """Mean absolute percentage error (as a fraction) of LayerResults (fwd + bwd) or GemmResults."""
    results = list(results)
    if not results:
        return float("nan")
    return float(np.mean([abs(r.error) for r in results]))
