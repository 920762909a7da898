"""Energy, in joules: per operator from the latency model's own counts, and per training batch.

Per operator (one device, one microbatch), from the quantities `latency.estimate` already works with,
each times a published per-event energy (constants and citations in `configs/energy.yaml`):

- compute: tensor-core MACs (B x M x K x N per GEMM) x `mac` in the GEMM's operand format
  (`format_mac_j`, below); vector lane operations (elements x
  cycles-per-element, the same table and FLOP floor as the latency model; a fused GEMM's epilogue
  too) x `vector_op`;
- SRAM: the GLB bytes the latency model moves (GEMM: A once per column tile, B and the output once,
  the operands at their format's width (workload/precision.py `operand_bytes`), the output in BF16;
  vector op: its inputs and outputs) x the GLB's energy per byte, which grows with the bank size;
- HBM: the compulsory bytes plus the GEMM re-reads when the resident operand does not fit the GLB
  share, which depends on whether the schedule ran the op on one core (1/n of the GLB) or split
  across all cores (the whole GLB) x pJ/bit;
- link: bytes a device sends in a collective (ring all-reduce 2(g-1)/g x bytes, all-gather /
  reduce-scatter / all-to-all (g-1)/g x bytes, send/recv the bytes) x pJ/bit of the link used.

Logic and SRAM energies are given at a reference node and scaled to the design's node by a factor per
node step; HBM and link energies are per bit and not scaled.

Per training batch for a placement (tp x pp stages x dp replicas, m microbatches per pipeline):

    dynamic = dp x m x tp x sum over stages, layers (E_fwd + E_bwd [+ E_fwd recomputed])
    pipeline = dp x m x tp x sum over stages (bytes received forward + gradient bytes received) x link
    dp ring  = sum over stages tp x dp x 2 (dp - 1)/dp x gradient bytes per device x link
    static   = W/mm^2 x area x devices used x time per batch

The recomputed forward runs on every stage, the last included, as in the placement evaluator
(as Megatron does; `full` recomputes each layer's forward, `selective` the attention core's share of it,
in the ratio of its forward time)
(`solve/placement/evaluate.py`), and a stage's inputs and output gradients cross the pipeline link as
there. Left out: the optimizer step (its time is not modelled either), HBM refresh/background power,
on-chip wires beyond the GLB bank, the PE-array register traffic and the memory traffic of
collectives.

Everything is vectorised over designs like the latency model: arrays [n_designs, n_ops].
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

import numpy as np

from .. import configs
from ..errors import PhazeError, config_error, shown
from ..workload.ops import OpGraph
from ..workload.precision import operand_bytes, significand_ratio
from .latency import BYTES_PER_ELEMENT, DesignArrays, classify_ops, collective_traffic

PJ = 1e-12
NODES_NM = (45, 32, 22, 14, 10, 7, 5, 3)  # full node steps (16/14 nm counted as one)
COMPONENTS = ("compute", "sram", "hbm", "link")  # per-op energy parts, in this order


@dataclass(frozen=True)
class EnergyConstants:
    reference_node_nm: int
    node_nm: int
    energy_scale_per_node: float
    mac_pj: float
    vector_op_pj: float
    sram_pj_per_64b: float
    sram_ref_bytes: float
    sram_size_exponent: float
    sram_bank_bytes: float
    hbm_pj_per_bit: float
    intra_node_pj_per_bit: float
    inter_node_pj_per_bit: float
    static_w_per_mm2: float
    mac_multiply_pj: float = 1.1  # the multiplier's share of `mac_pj` (energy.yaml); optional in a file

    @property
    def node_scale(self) -> float:
        """Factor from the reference node to the target node for logic and SRAM energies."""
        steps = NODES_NM.index(self.node_nm) - NODES_NM.index(self.reference_node_nm)
        return float(self.energy_scale_per_node**steps)

    @property
    def mac_j(self) -> float:
        """Joules per BF16 MAC (`mac_pj` at the node)."""
        return self.mac_pj * PJ * self.node_scale

    def format_mac_j(self, datatype: str) -> float:
        """Joules per MAC in a GEMM operand format ("" or "bf16": `mac_j`).

        A PE's MAC is a multiply and an FP32 accumulate; only the multiplier shrinks with the
        format: its array grows with the significand bits squared (Horowitz, ISSCC 2014: an 8-bit
        integer multiply 0.2 pJ against 3.1 pJ for 32 bits, about (8/32)^2 of it; 16-bit FP 1.1 pJ),
        so a format pays `mac_multiply_pj` x (its bits / BF16's 8)^2 plus the FP32 accumulate, which no format changes:
        FP8/MXFP8 (E4M3, 4 bits) 0.275 + 0.9 = 1.175 pJ at 45 nm, 0.59x BF16's 2.0; NVFP4 (E2M1,
        2 bits) 0.97 pJ, 0.48x. Uncertainty: NVIDIA doubles the dense rate in FP8 at the same power
        (H100 SXM datasheet: BF16 989 and FP8 1979 TFLOPS, both at 700 W; B200: FP4 twice FP8), so
        whole-chip energy per MAC can fall to 0.5x (FP8) and 0.25x (FP4) of BF16 where dot-product
        trees accumulate low-precision products in fixed point and add once to FP32 per k products:
        this per-PE figure is the upper end, about 1.2x the datasheet's for FP8 and 2x for NVFP4."""
        ratio = significand_ratio(datatype)
        return (self.mac_pj - self.mac_multiply_pj * (1.0 - ratio)) * PJ * self.node_scale

    @property
    def vector_op_j(self) -> float:
        return self.vector_op_pj * PJ * self.node_scale

    @property
    def hbm_j_per_byte(self) -> float:
        return self.hbm_pj_per_bit * 8.0 * PJ

    def glb_j_per_byte(self, glb_bytes) -> np.ndarray:
        """Energy per byte of a GLB access: a bank of min(GLB, bank size), size^exponent, at the node."""
        bank = np.minimum(np.asarray(glb_bytes, dtype=float), self.sram_bank_bytes)
        per_64b = self.sram_pj_per_64b * (np.maximum(bank, 1.0) / self.sram_ref_bytes) ** self.sram_size_exponent
        return per_64b / 8.0 * PJ * self.node_scale

    def link_j_per_byte(self, intra_node: bool) -> float:
        return (self.intra_node_pj_per_bit if intra_node else self.inter_node_pj_per_bit) * 8.0 * PJ


INT_FIELDS = ("reference_node_nm", "node_nm")
OPTIONAL_FIELDS = ("mac_multiply_pj",)  # a file without it keeps the dataclass's cited default
FIELDS = tuple(f.name for f in fields(EnergyConstants))


def constants_path() -> Path:
    return configs.constants_file("energy.yaml")


def load_constants(path: str | os.PathLike | None = None) -> EnergyConstants:
    """Read and validate `configs/energy.yaml` (cached per file and modification time)."""
    return configs.load_constants(path if path is not None else constants_path(), "energy constants file not found",
                                  _parse_constants)


def _parse_constants(path: str, data) -> EnergyConstants:
    if not isinstance(data, dict):
        raise PhazeError(f"{path}: expected a mapping of energy constants at the top level")
    configs.check_keys(data, path, [f for f in FIELDS if f not in OPTIONAL_FIELDS], OPTIONAL_FIELDS)
    values = {}
    for f in FIELDS:
        if f in OPTIONAL_FIELDS and f not in data:
            continue
        v = configs.finite_number(data[f], path, f)
        if f in INT_FIELDS:
            if v not in NODES_NM:
                raise config_error(path, f, f"must be one of {', '.join(map(str, NODES_NM))} (nm), got {shown(data[f])}")
            values[f] = int(v)
            continue
        if v < 0:
            raise config_error(path, f, f"must be >= 0, got {shown(data[f])}")
        values[f] = v
    for f in ("energy_scale_per_node", "sram_ref_bytes", "sram_bank_bytes"):
        if not values[f] > 0:
            raise config_error(path, f, f"must be > 0, got {shown(data[f])}")
    constants = EnergyConstants(**values)
    if constants.mac_multiply_pj > constants.mac_pj:
        raise config_error(path, "mac_multiply_pj", f"must be at most mac_pj ({shown(constants.mac_pj)}), "
                                                    f"got {shown(constants.mac_multiply_pj)}")
    return constants


# ---- per operator ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpEnergies:
    """Joules per op on one device for one microbatch, [n_designs, n_ops] per component; ops in graph order.

    Also the counts they come from (same shape), so callers and tests can check them by hand.
    """

    compute: np.ndarray
    sram: np.ndarray
    hbm: np.ndarray
    link: np.ndarray
    macs: np.ndarray  # tensor-core multiply-accumulates
    lane_ops: np.ndarray  # vector-lane operations
    glb_bytes: np.ndarray  # bytes moved through the GLB
    hbm_bytes: np.ndarray  # bytes moved to/from HBM
    link_bytes: np.ndarray  # bytes sent on the interconnect
    names: tuple[str, ...] = ()

    @property
    def total(self) -> np.ndarray:
        return self.compute + self.sram + self.hbm + self.link

    def by_component(self) -> np.ndarray:
        """[n_designs, 4] sums over ops in COMPONENTS order."""
        return np.stack([getattr(self, c).sum(axis=1) for c in COMPONENTS], axis=1)


def op_energy(
    op_graph: OpGraph,
    designs,
    *,
    split=None,
    intra_node: bool = True,
    constants: EnergyConstants | None = None,
    bytes_per_element: int = BYTES_PER_ELEMENT,
) -> OpEnergies:
    """Energy of every op of `op_graph` on every design (see the module docstring).

    `designs`: Accelerators or a DesignArrays. `split`: per op, whether it ran split across all cores
    of its type (a schedule's `split`), shape [n_ops] or [n_designs, n_ops]; None means split (the
    whole GLB, the fewest HBM re-reads). `intra_node`: whether the op graph's collectives use the
    intra-node link (else the inter-node one).
    """
    c = constants or load_constants()
    d = designs if isinstance(designs, DesignArrays) else DesignArrays.from_accelerators(list(designs))
    ops = op_graph.ops
    n_d, n_o = len(d), len(ops)
    e = float(bytes_per_element)
    z = lambda: np.zeros((n_d, n_o))  # noqa: E731
    macs, lane_ops, glb, hbm, link = z(), z(), z(), z(), z()
    if split is None:
        split_mask = np.ones((1, n_o), dtype=bool)
    else:
        s = np.asarray(split, dtype=bool)
        split_mask = s.reshape(1, n_o) if s.ndim == 1 else np.broadcast_to(s, (n_d, n_o))

    kinds = classify_ops(ops, e, "energy")
    gemm_idx, vec_idx = kinds.gemm_idx, kinds.vec_idx
    gemm_rows = [(b, m, kk, n, nbytes, elements * cpe) for b, m, kk, n, nbytes, elements, cpe, _ in kinds.gemm_rows]
    vec_rows = [(elements * cpe, nbytes) for elements, cpe, nbytes in kinds.vec_rows]
    for i in kinds.net_idx:
        link[:, i] = collective_traffic(ops[i])[0]

    mac_j = np.zeros((1, n_o))
    if gemm_idx:
        B, M, K, N, nbytes, epi = (col[None, :] for col in np.array(gemm_rows, dtype=float).T)
        macs[:, gemm_idx] = B * M * K * N
        lane_ops[:, gemm_idx] = epi
        mac_j[0, gemm_idx] = [c.format_mac_j(dt) for dt in kinds.gemm_datatypes]
        operand = np.array([[operand_bytes(dt, e) for dt in kinds.gemm_datatypes]])
        a_b, w_b = M * K * operand, K * N * operand
        col = np.ceil(N / d.tc_x)
        glb[:, gemm_idx] = B * (a_b * col + w_b + M * N * e)
        share = np.where(split_mask[:, gemm_idx], 1.0, 1.0 / d.num_tc)  # GLB share, as latency.estimate
        cap = np.maximum(d.glb_bytes * share / 2.0, 1.0)
        extra = np.minimum((np.ceil(w_b / cap) - 1.0) * B * a_b, (np.ceil(a_b / cap) - 1.0) * B * w_b)
        hbm[:, gemm_idx] = nbytes + extra
    if vec_idx:
        ops_, nbytes = (col[None, :] for col in np.array(vec_rows, dtype=float).T)
        lane_ops[:, vec_idx] = ops_
        glb[:, vec_idx] = nbytes
        hbm[:, vec_idx] = nbytes

    return OpEnergies(
        compute=macs * mac_j + lane_ops * c.vector_op_j,
        sram=glb * c.glb_j_per_byte(d.glb_bytes),
        hbm=hbm * c.hbm_j_per_byte,
        link=link * c.link_j_per_byte(intra_node),
        macs=macs, lane_ops=lane_ops, glb_bytes=glb, hbm_bytes=hbm, link_bytes=link,
        names=tuple(op.name for op in ops),
    )


# ---- per training batch ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchEnergy:
    """Joules per training batch (one optimizer step over the global batch), all devices."""

    compute_j: float
    sram_j: float
    hbm_j: float
    tp_link_j: float
    pipeline_link_j: float
    dp_link_j: float
    static_j: float
    recompute_j: float  # part of compute/sram/hbm/tp_link spent on recomputed forwards (already included)

    @property
    def dynamic_j(self) -> float:
        return self.compute_j + self.sram_j + self.hbm_j + self.tp_link_j + self.pipeline_link_j + self.dp_link_j

    @property
    def total_j(self) -> float:
        return self.dynamic_j + self.static_j

    def to_dict(self) -> dict:
        return {**asdict(self), "dynamic_j": self.dynamic_j, "total_j": self.total_j}


def batch_energy(
    layer_fwd_j: np.ndarray,
    layer_bwd_j: np.ndarray,
    costs,
    stages: Sequence[Sequence[int]],
    dp: int,
    microbatches: int,
    recompute: bool | str,
    time_per_batch_s: float,
    area_mm2: float,
    system,
    constants: EnergyConstants | None = None,
    recompute_core: bool = True,
    training=None,
) -> BatchEnergy:
    """Energy per batch of a placement.

    `layer_fwd_j`, `layer_bwd_j`: [n_layers, 4] per layer, device and microbatch, in COMPONENTS order
    (`layer_energies`); `costs`: the LayerCosts at the placement's TP width (edges, boundary bytes,
    params); `stages`: layer indices per stage, first to last; `system`: the System (links, precision).
    `recompute_core`: whether selective recompute reruns the attention core (`selective_s`; the
    recipe's modules, `Training.recompute_modules`), besides its other modules' `module_s`.
    `training` (the recipe, where the caller has it): full recompute on the layers it checkpoints
    (`Training.checkpointed`), the op-level policy's rerun ops (`op_policy_s`).
    """
    c = constants or load_constants()
    fwd = np.asarray(layer_fwd_j, dtype=float)
    bwd = np.asarray(layer_bwd_j, dtype=float)
    t, S, d, m = int(costs.tp), len(stages), int(dp), int(microbatches)
    stage_of = np.empty(costs.n_layers, dtype=int)
    for s, stage in enumerate(stages):
        stage_of[list(stage)] = s
    # share of each layer's forward run again in its backward (every stage, as Megatron does)
    share = np.zeros(costs.n_layers)
    fwd_s = np.asarray(costs.fwd_s, dtype=float)
    if recompute is True or recompute == "full":
        share = np.ones(costs.n_layers) if training is None else training.checkpointed(costs.block_ordinal) * 1.0
    elif training is not None and training.recompute_ops:
        share = np.divide(np.asarray(costs.op_policy_s, dtype=float), fwd_s, out=np.zeros(costs.n_layers),
                          where=fwd_s > 0)
    elif recompute == "selective":
        again_s = np.asarray(costs.module_s, dtype=float) + (np.asarray(costs.selective_s, dtype=float)
                                                             if recompute_core else 0.0)
        share = np.divide(again_s, fwd_s, out=np.zeros(costs.n_layers), where=fwd_s > 0)
    again = (fwd * share[:, None]).sum(axis=0)
    per_mb = fwd.sum(axis=0) + bwd.sum(axis=0) + again  # one replica's TP rank, [4]
    scale = float(d * m * t)
    compute, sram, hbm, tp_link = per_mb * scale
    recompute_j = float(again.sum() * scale)

    # pipeline: each stage receives its inputs forward and its outputs' gradients backward (placement.evaluate)
    boundary = np.asarray(costs.boundary_bytes, dtype=float)
    crossing = [(u, v) for u, v in costs.edges if stage_of[u] != stage_of[v]]
    inputs = {(u, int(stage_of[v])) for u, v in crossing}  # each producer once per consuming stage
    outputs = {u for u, _ in crossing}  # each producer's output gradient once, to its own stage
    received = float(sum(boundary[u] for u, _ in inputs) + sum(boundary[u] for u in outputs))
    hop_intra = system.pipeline_link(t, S) is system.intra_node
    pipeline_link = received * t * d * m * c.link_j_per_byte(hop_intra)

    # data-parallel gradient ring of every stage
    params = np.asarray(costs.params, dtype=float)
    dp_link = 0.0
    if d > 1:
        ring_intra = system.dp_link(t, S, d) is system.intra_node
        grad_bytes = np.array([params[list(stage)].sum() for stage in stages]) * system.grad_bytes_per_param
        dp_link = float((t * d * 2.0 * (d - 1) / d * grad_bytes).sum()) * c.link_j_per_byte(ring_intra)

    static = c.static_w_per_mm2 * float(area_mm2) * t * S * d * float(time_per_batch_s)
    return BatchEnergy(float(compute), float(sram), float(hbm), float(tp_link), float(pipeline_link),
                       float(dp_link), float(static), recompute_j)


def layer_energies(graph, pass_energies: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per-layer [n_layers, 4] forward and backward energies of a LayerGraph, from each layer kind's
    pass totals `{(kind, "fwd"|"bwd"): array[4]}` (one device, one microbatch)."""
    fwd = np.array([pass_energies[(l.kind, "fwd")] for l in graph.layers], dtype=float).reshape(-1, len(COMPONENTS))
    bwd = np.array([pass_energies[(l.kind, "bwd")] for l in graph.layers], dtype=float).reshape(-1, len(COMPONENTS))
    return fwd, bwd
