"""Per-operator latency, in seconds, on one core of the op's type and split across all of them.

The exhaustive mode needs millions of estimates, so everything is computed on 2-D arrays: designs on
the first axis (struct of arrays, `DesignArrays`), ops on the second. Each op gets

- `single`: on one core of its type (one TC and one VC for a fused "tc+vc" op) while the other cores
  may run other ops. Shared resources are split evenly: the op gets 1/n of the GLB capacity and of the
  GLB and HBM bandwidth (n = cores of its type), because the schedule may run n such ops side by side
  and the model has no contention term;
- `split`: across all n cores of its type, with the whole GLB and all bandwidth.

Both use the same formulas with k = 1 or k = n cores and a resource share of k/n, so with one core
`split == single`, and latency never grows with k.

GEMM on a weight-stationary systolic array of tc_y rows (reduction) x tc_x columns (SCALE-Sim model,
Samajdar et al., "A Systematic Methodology for Characterizing Scalability of DNN Accelerators using
SCALE-Sim", ISPASS 2020): a fold maps a tc_y x tc_x tile of the stationary operand; streaming T rows
of the other operand through it takes 2*tc_y + tc_x + T - 2 cycles (weight fill, skewed fill, stream,
drain); partial tiles at the edges cost a full fold. As in a TPU's matrix unit (Jouppi et al., ISCA
2017) the second operand B (K x N, the weights of a linear layer) is stationary and the M rows of A
(the tokens) stream, so folds = ceil(K/tc_y) x ceil(N/tc_x) per batch, each streaming M rows. The
core's accumulators are assumed to hold a fold's partial sums. Across k cores the column tiles (and
batches) are dealt out; when there are fewer than k, the streamed rows are cut too. The compute time
is bounded below by

- GLB traffic / GLB bandwidth: A is read once per column tile, B and the output once;
- HBM traffic / HBM bandwidth: every operand once, plus re-reads when the GLB cannot hold what is
  reused: the operand kept resident (either one, whichever costs less) is cut into chunks of half the
  GLB share (the other half double-buffers the stream), and the streamed operand is re-read per chunk.

Memory traffic and compute overlap (double buffering), so the latency is the largest of the three.

Vector ops: ceil(elements / (lanes x k)) x cycles-per-element, bounded below by bytes / bandwidth:
every op reads its inputs from HBM and writes its outputs back, through the GLB, so the slower of
the two sets the pace. The cycles per element come from a table per vector-op kind (never fewer
than the op's counted FLOPs per element, one op per lane per cycle). Fused TC+VC ops run the vector epilogue
on output tiles as they drain from the array (as a TPU's vector unit consumes MXU results), so the two
pipelines overlap: latency = max(GEMM, epilogue).

Fused attention (an op with `gemms`, FlashAttention's forward or backward kernel; workload/trace.py)
runs its GEMMs one after another on the tensor cores, the score tiles draining into the vector cores
for the softmax, as a fused TC+VC op does: latency = max(sum of the GEMMs' compute times, sum of
their GLB traffic times, HBM time, softmax time). The HBM traffic is the op's own (Q, K, V in and
O and the log-sum-exp out; the backward also O, dO and the gradients: no s x s tensor) plus the
re-reads of the MAC-equivalent GEMM `op.gemm` when the GLB share cannot hold a tile's operands,
the re-reads of the tiled algorithm (Dao et al. 2022, Theorem 2: K and V are streamed once per
block of Q rows that fits on chip). The score tiles pass through the GLB (in the GLB terms), never HBM.

Collectives (unit "net") use the interconnect link: ring all-reduce 2(g-1)/g x bytes / bw + 2(g-1) x
latency (Patarasuk and Yuan, JPDC 2009), all-gather / reduce-scatter / all-to-all (g-1)/g x bytes /
bw + (g-1) x latency. They take the same time on every design. "none" ops take zero time.

Low-precision GEMMs (an op with a `datatype`, set by workload/precision.py): the PE computes
`mac_rate` MACs of that format per cycle (Accelerator.tc_datatypes; FP8 on Hopper: 2), as a
multi-precision MAC does, by reducing `mac_rate` products of the K dimension in one cycle (NVIDIA's
FP8 MMA instructions take K = 32 where BF16 takes K = 16 for the same M x N tile; PTX ISA, mma
shapes m16n8k32 .e4m3 against m16n8k16 .bf16): a fold covers tc_y x mac_rate rows of the stationary
operand, in the same fill, stream and drain cycles. Both operands move at the format's bytes
(`op_bytes`, the op's own HBM bytes already cut by workload/precision.py); the output in BF16.
At rate 1 and two-byte operands every term is the BF16 one, bit for bit.

Software efficiency (hardware/efficiency.py, one `Efficiency` per preset, carried by the Accelerator
and by DesignArrays as a scalar): the activation's GLB stream is shared by `gemm_tile_reuse` column
tiles (A x ceil(col / reuse) instead of A x col), `gemm_wave_balance` takes back that share of the
last round's idle cores (Stream-K), the array computes at `tc_fraction` of its peak,
every HBM term runs at `hbm_fraction` of the bandwidth, and each kernel on the cores costs
`op_overhead_s` more (single and split alike): one per op, one per group of a grouped GEMM the
stack issues expert by expert (`kernels_of`). The identity leaves every number above unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import shown
from ..workload.ops import NET, NONE, TC, TCVC, VC, OpGraph
from ..workload.precision import FORMATS
from .accelerator import Accelerator
from .efficiency import IDENTITY, Efficiency

BYTES_PER_ELEMENT = 2  # bf16 operands, as the published system

# Cycles per output element per vector lane, one ALU op per lane per cycle. Transcendentals (exp, tanh,
# reciprocal square root, division) issue at a quarter rate on a typical pipelined special-function
# unit; composite ops count their steps: softmax = max, subtract, exp, sum, scale; layernorm = mean,
# variance (2), subtract, scale by rsqrt, affine (2); GELU (tanh form) = 3 mul/add + tanh + 3 mul/add.
CYCLES_PER_ELEMENT = {
    "add": 1, "sub": 1, "mul": 1, "neg": 1, "scale": 1, "copy": 1, "cast": 1, "to": 1, "contiguous": 1,
    "clone": 1, "masked_fill": 1, "where": 1, "bias": 1, "residual": 1, "relu": 1, "abs": 1, "max": 1,
    "min": 1, "amax": 1, "sum": 1, "mean": 1, "reduce": 1, "compare": 1, "embedding": 1, "cat": 1, "index": 1,
    "gather": 1, "scatter": 1,
    "div": 4, "exp": 4, "log": 4, "sqrt": 4, "rsqrt": 4, "reciprocal": 4, "pow": 4,
    "tanh": 4, "sigmoid": 5, "silu": 5, "swish": 5, "gelu": 10,
    "dropout": 2,  # compare a random number, then scale
    "softmax": 8, "log_softmax": 8,
    "layernorm": 7, "layer_norm": 7, "rmsnorm": 5, "rms_norm": 5,
    "cross_entropy": 10, "loss": 10, "nll_loss": 2,
    "adam": 10, "sgd": 2,
}
# When an op lists no known vector kind: by its op kind.
CYCLES_BY_OP_KIND = {
    "elementwise": 1, "activation": 10, "norm": 7, "softmax": 8, "dropout": 2, "embedding": 1, "loss": 10,
    "fused": 1, "reduction": 1, "gather": 1,
}
BACKWARD_SUFFIXES = ("_backward", "_bwd", "_grad")
BACKWARD_FACTOR = 2  # a backward elementwise reads the incoming gradient and the saved input


@dataclass(frozen=True)
class Interconnect:
    """The link a collective uses, per device and direction."""

    bandwidth_Bps: float = 300e9  # NVLink-class intra-node link, as configs/systems/default.yaml
    latency_s: float = 1e-6

    def __post_init__(self):
        if not (self.bandwidth_Bps > 0 and self.latency_s >= 0):
            raise ValueError(f"interconnect needs bandwidth > 0 and latency >= 0, got {self}")


DEFAULT_INTERCONNECT = Interconnect()


def _link(interconnect) -> tuple[float, float]:
    if interconnect is None:
        interconnect = DEFAULT_INTERCONNECT
    if isinstance(interconnect, Interconnect):
        return interconnect.bandwidth_Bps, interconnect.latency_s
    bw, lat = getattr(interconnect, "bandwidth", None), getattr(interconnect, "latency", None)  # system.Link
    if bw is None or lat is None:
        raise TypeError(f"interconnect must be an Interconnect or have .bandwidth and .latency, got {shown(interconnect)}")
    return float(bw), float(lat)


@dataclass(frozen=True)
class DesignArrays:
    """Accelerator fields as float64 column vectors [n_designs, 1] (struct of arrays)."""

    num_tc: np.ndarray
    tc_x: np.ndarray
    tc_y: np.ndarray
    num_vc: np.ndarray
    vc_width: np.ndarray
    glb_bytes: np.ndarray
    glb_bw: np.ndarray
    hbm_bw: np.ndarray
    clock_hz: np.ndarray
    # How the software stack uses the template (hardware/efficiency.py): one per preset, so a scalar
    # shared by every row; the identity leaves the template's latencies exactly as the template gives them.
    efficiency: Efficiency = IDENTITY

    FIELDS = ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_bytes", "glb_bw", "hbm_bw", "clock_hz")

    @classmethod
    def from_accelerators(cls, designs: Sequence[Accelerator]) -> "DesignArrays":
        rows = np.array([[getattr(d, f) for f in cls.FIELDS] for d in designs], dtype=float).reshape(-1, len(cls.FIELDS))
        effs = {d.efficiency for d in designs}
        if len(effs) > 1:
            raise ValueError(f"designs with different efficiencies ({len(effs)}) cannot share one DesignArrays; "
                             "estimate them apart")
        eff = effs.pop() if effs else IDENTITY
        return cls(*(rows[:, i : i + 1] for i in range(len(cls.FIELDS))), efficiency=eff)

    @classmethod
    def from_columns(cls, efficiency: Efficiency = IDENTITY, **columns) -> "DesignArrays":
        cols = np.broadcast_arrays(*(np.asarray(columns[f], dtype=float).reshape(-1) for f in cls.FIELDS))
        return cls(*(c.reshape(-1, 1).copy() for c in cols), efficiency=efficiency)

    def rows(self, lo: int, hi: int) -> "DesignArrays":
        """Designs lo..hi-1, with the same efficiency."""
        return DesignArrays(*(getattr(self, f)[lo:hi] for f in self.FIELDS), efficiency=self.efficiency)

    def __len__(self) -> int:
        return self.num_tc.shape[0]


@dataclass(frozen=True)
class OpLatencies:
    """Latencies in seconds, float64 [n_designs, n_ops]; ops in the graph's order."""

    single: np.ndarray
    split: np.ndarray
    units: tuple[str, ...]
    names: tuple[str, ...]
    unknown_vector_ops: tuple[str, ...] = field(default=())  # kinds costed by the op-kind fallback

    def design(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(single, split) rows of design i."""
        return self.single[i], self.split[i]


def cycles_per_element(op) -> tuple[float, list[str]]:
    """Lane-cycles per output element for a vector op, and the kinds the table did not know."""
    total, unknown = 0.0, []
    for kind in op.vector_ops:
        k = kind.lower()
        factor = 1
        for suffix in BACKWARD_SUFFIXES:
            if k.endswith(suffix) and k not in CYCLES_PER_ELEMENT:
                k, factor = k[: -len(suffix)], BACKWARD_FACTOR
        if k in CYCLES_PER_ELEMENT:
            total += factor * CYCLES_PER_ELEMENT[k]
        else:
            unknown.append(kind)
    if total == 0.0:
        total = float(CYCLES_BY_OP_KIND.get(op.kind, 1))
    return total, unknown


def _ceil_div(a, b):
    return np.ceil(a / b)


def _gemm_seconds(B, M, K, N, hbm_bytes, d: DesignArrays, k, share, e, op_bytes=None, rate=1.0):
    """GEMM latency on k tensor cores holding `share` of the GLB and of the bandwidths; arrays broadcast."""
    compute_s, glb_s, hbm_s = _gemm_terms(B, M, K, N, hbm_bytes, d, k, share, e, op_bytes, rate)
    return np.maximum(np.maximum(compute_s, glb_s), hbm_s)


def _gemm_terms(B, M, K, N, hbm_bytes, d: DesignArrays, k, share, e, op_bytes=None, rate=1.0):
    """(compute, GLB, HBM) seconds of a GEMM, the three bounds `_gemm_seconds` takes the largest of.
    `op_bytes`: bytes per operand element (default `e`); `rate`: MACs per PE per cycle in that format."""
    tx, ty = d.tc_x, d.tc_y * rate  # a fold reduces tc_y x rate rows of K (module docstring)
    eff = d.efficiency
    # HBM: compulsory traffic plus re-reads when the resident operand does not fit half the GLB share,
    # at the achieved fraction of the bandwidth (efficiency.hbm_fraction)
    cap = np.maximum(d.glb_bytes * share / 2.0, 1.0)
    ob = e if op_bytes is None else op_bytes
    a_b, w_b = M * K * ob, K * N * ob
    extra = np.minimum((_ceil_div(w_b, cap) - 1.0) * B * a_b, (_ceil_div(a_b, cap) - 1.0) * B * w_b)
    hbm_s = (hbm_bytes + extra) / (d.hbm_bw * eff.hbm_fraction * share)
    # compute: the stationary operand (K x N) in folds of tc_y x tc_x, the M rows of A streaming through
    col = _ceil_div(N, tx)
    units = B * col  # independent column tiles, dealt out to the k cores
    parts = np.maximum(1.0, np.floor(k / units))  # cores left over cut the stream
    m_per = _ceil_div(M, parts)
    rounds = _ceil_div(units, k)
    # Stream-K balance (efficiency.gemm_wave_balance): the last round's idle cores take a share of the
    # work; at 1 the time is the work spread over all k cores (units x parts / k rounds of m_per rows)
    rounds = rounds - eff.gemm_wave_balance * (rounds - units * parts / k)
    cycles = rounds * _ceil_div(K, ty) * (2.0 * d.tc_y + tx + m_per - 2.0)
    compute_s = cycles / (d.clock_hz * eff.tc_fraction)  # at the sustained fraction of the peak rate
    # GLB: A streams once per group of `gemm_tile_reuse` column tiles (the template: once per tile)
    glb_s = B * (a_b * _ceil_div(col, eff.gemm_tile_reuse) + w_b + M * N * e) / (d.glb_bw * share)
    return compute_s, glb_s, hbm_s


def _fused_attention_seconds(op, d: DesignArrays, k_tc, k_vc, share, e):
    """A fused attention op (`op.gemms`) on k_tc tensor cores and k_vc vector cores; see the module
    docstring. Returns [n_designs] seconds."""
    B, M, K, N = (float(x) for x in op.gemm)  # the MAC-equivalent GEMM: operands (Q, O, ...) and (K, V, ...)
    _, _, hbm_s = _gemm_terms(B, M, K, N, op.bytes_read + op.bytes_written, d, k_tc, share, e)
    compute_s = glb_s = 0.0
    for g in op.gemms:
        c, gl, _ = _gemm_terms(*(float(x) for x in g), 0.0, d, k_tc, share, e)
        compute_s, glb_s = compute_s + c, glb_s + gl
    cpe, _ = cycles_per_element(op)
    elements = float(op.elements)
    cpe = max(cpe, (op.flops - 2.0 * B * M * K * N) / elements)
    softmax_s = _ceil_div(elements, d.vc_width * k_vc) * cpe / d.clock_hz
    return np.maximum(np.maximum(compute_s, glb_s), np.maximum(hbm_s, softmax_s))[:, 0]


def _vector_seconds(elements, cpe, nbytes, d: DesignArrays, k, share):
    cycles = _ceil_div(elements, d.vc_width * k) * cpe
    mem_s = nbytes / (np.minimum(d.hbm_bw * d.efficiency.hbm_fraction, d.glb_bw) * share)
    return np.maximum(cycles / d.clock_hz, mem_s)


def collective_traffic(op) -> tuple[float, int]:
    """(bytes one device sends, message steps) of a collective, by its algorithm: ring all-reduce
    2(g-1)/g x bytes in 2(g-1) steps; all-gather / reduce-scatter / all-to-all (g-1)/g x bytes in
    g-1 steps; sequence parallelism's reduce-scatter + all-gather pair both of those; point to
    point the bytes in one step. The latency and the energy model share it."""
    g = op.group
    if g <= 1:
        return 0.0, 0
    nbytes = op.comm_bytes or op.bytes_read
    kind = op.collective.lower().replace("-", "").replace("_", "")
    if kind in ("allreduce", ""):
        return 2.0 * (g - 1) / g * nbytes, 2 * (g - 1)
    if kind in ("allgather", "reducescatter", "alltoall"):
        return (g - 1) / g * nbytes, g - 1
    if kind == "reducescatter+allgather":
        # Sequence parallelism's pair in place of a TP all-reduce (Korthikanti et al. 2022, Sec.
        # 4.2.2, the g / g-bar conjugates): a ring reduce-scatter of the full tensor then a ring
        # all-gather back to it, (g-1)/g x bytes in g-1 steps each: the all-reduce's bandwidth term
        # and step count exactly (a ring all-reduce is this pair; Patarasuk and Yuan, JPDC 2009).
        return 2.0 * (g - 1) / g * nbytes, 2 * (g - 1)
    if kind in ("sendrecv", "p2p", "send", "recv"):
        return float(nbytes), 1
    raise ValueError(f"op {op.name}: unknown collective {shown(op.collective)}")


def _collective_seconds(op, bw: float, lat: float) -> float:
    nbytes, steps = collective_traffic(op)
    return nbytes / bw + steps * lat


@dataclass
class ClassifiedOps:
    """The ops of a graph by cost model, with the per-op figures both the latency and the energy
    model start from (`classify_ops`)."""

    gemm_idx: list = field(default_factory=list)
    gemm_rows: list = field(default_factory=list)  # (B, M, K, N, hbm bytes, epilogue elements, epilogue cpe, is fused)
    vec_idx: list = field(default_factory=list)
    vec_rows: list = field(default_factory=list)  # (elements, cpe, bytes)
    net_idx: list = field(default_factory=list)  # collectives
    attention_idx: list = field(default_factory=list)  # fused attention ops (several GEMMs each), when kept apart
    gemm_datatypes: list = field(default_factory=list)  # per GEMM row: its `op.datatype` ("" = BF16)
    unknown: set = field(default_factory=set)  # vector op kinds costed by the op-kind fallback


def classify_ops(ops, bytes_per_element: float, model: str = "latency",
                 attention_apart: bool = False) -> ClassifiedOps:
    """Sort ops into GEMMs (TC, TC+VC epilogue), vector ops and collectives; ops on no unit are
    skipped. An op on a unit no cost model knows raises, naming `model`. With `attention_apart`, a
    fused attention op (one with several `gemms`) goes to `attention_idx` for its own cost model;
    otherwise it is one GEMM of the same multiply-adds (`op.gemm`), as the energy model counts it."""
    e = float(bytes_per_element)
    out = ClassifiedOps()
    for i, op in enumerate(ops):
        if attention_apart and op.unit == TCVC and op.gemms:
            if len(op.gemm) != 4 or not op.elements:
                raise ValueError(f"op {op.name}: a fused attention op needs gemm and elements, got {shown(op)}")
            out.unknown.update(cycles_per_element(op)[1])
            out.attention_idx.append(i)
        elif op.unit in (TC, TCVC):
            if len(op.gemm) != 4:
                raise ValueError(f"op {op.name}: unit {op.unit} needs gemm=(batch, M, K, N), got {shown(op.gemm)}")
            b, m, kk, n = (float(x) for x in op.gemm)
            dims_bytes = b * (m * kk + kk * n + m * n) * e
            nbytes = op.bytes_read + op.bytes_written or dims_bytes
            cpe, unk = cycles_per_element(op) if op.unit == TCVC else (0.0, [])
            out.unknown.update(unk)
            elements = float(op.elements or b * m * n)
            if op.unit == TCVC and op.flops > 0:
                cpe = max(cpe, (op.flops - 2.0 * b * m * kk * n) / elements)
            out.gemm_idx.append(i)
            out.gemm_rows.append((b, m, kk, n, nbytes, elements, cpe, op.unit == TCVC))
            out.gemm_datatypes.append(op.datatype)
        elif op.unit == VC:
            cpe, unk = cycles_per_element(op)
            out.unknown.update(unk)
            elements = float(op.elements or max(op.bytes_written / e, 1.0))
            if op.flops > 0:  # never fewer lane-cycles than the op's counted operations
                cpe = max(cpe, op.flops / elements)
            nbytes = op.bytes_read + op.bytes_written or 2.0 * elements * e
            out.vec_idx.append(i)
            out.vec_rows.append((elements, cpe, nbytes))
        elif op.unit == NET:
            out.net_idx.append(i)
        elif op.unit != NONE:  # Op validates its unit; a new unit must be costed here before it is used
            raise ValueError(f"op {op.name}: no {model} model for unit {shown(op.unit)}")
    return out


def gemm_formats(datatypes, designs, bytes_per_element: float):
    """(operand bytes [1, n_gemm], MAC rate [n_designs, n_gemm]) of GEMM rows in `datatypes`
    ("" = BF16: `bytes_per_element` at rate 1). A format a design lacks raises: callers check
    support first (design/evaluate.py makes such a design infeasible with the reason)."""
    op_bytes = np.array([[FORMATS[t].operand_bytes if t else float(bytes_per_element) for t in datatypes]])
    if isinstance(designs, DesignArrays):
        raise ValueError("low-precision GEMMs need the designs as Accelerators (their tc_datatypes)")
    rates = np.ones((len(designs), len(datatypes)))
    for j, t in enumerate(datatypes):
        for i, a in enumerate(designs):
            if t:
                r = a.mac_rate(t)
                if r is None:
                    raise ValueError(f"design {a.name or i}: its tensor cores do not support {t}")
                # BF16 is the reference the other efficiencies were measured in
                rates[i, j] = r if t == "bf16" else r * a.efficiency.low_precision_fraction
    return op_bytes, rates


def kernels_of(op) -> int:
    """The kernels an op launches: one per group for a grouped GEMM its stack issues expert by
    expert (`Op.per_group_kernels`, workload/stack.py), else one."""
    return int(op.gemm[0]) if op.per_group_kernels and op.gemm else 1


def estimate(op_graph: OpGraph, designs, interconnect=None, bytes_per_element: int = BYTES_PER_ELEMENT) -> OpLatencies:
    """Latency of every op of `op_graph` on every design: `single` and `split`, [n_designs, n_ops] s.

    `designs` is a sequence of Accelerators or a DesignArrays (BF16 graphs only); `interconnect` an
    Interconnect, a system Link (.bandwidth, .latency) or None for the default NVLink-class link.
    """
    d = designs if isinstance(designs, DesignArrays) else DesignArrays.from_accelerators(list(designs))
    ops = op_graph.ops
    n_d, n_o = len(d), len(ops)
    single = np.zeros((n_d, n_o))
    split = np.zeros((n_d, n_o))
    e = float(bytes_per_element)
    unknown: set[str] = set()

    bw, lat = _link(interconnect)
    c = classify_ops(ops, e, "latency", attention_apart=True)
    unknown.update(c.unknown)
    gemm_idx, gemm_rows, vec_idx, vec_rows = c.gemm_idx, c.gemm_rows, c.vec_idx, c.vec_rows
    attention_idx = c.attention_idx
    for i in c.net_idx:
        t = _collective_seconds(ops[i], bw, lat)
        single[:, i] = t
        split[:, i] = t

    if gemm_idx:
        g = np.array(gemm_rows, dtype=float).T[:, None, :]  # each field [1, n_gemm]
        B, M, K, N, nbytes, elements, cpe, fused = g
        op_bytes, rate = None, 1.0
        if any(c.gemm_datatypes):
            op_bytes, rate = gemm_formats(c.gemm_datatypes, designs, e)
        for out, k_tc, k_vc, share in (
            (single, 1.0, 1.0, 1.0 / d.num_tc),
            (split, d.num_tc, d.num_vc, 1.0),
        ):
            t = _gemm_seconds(B, M, K, N, nbytes, d, k_tc, share, e, op_bytes, rate)
            epilogue = _ceil_div(elements, d.vc_width * k_vc) * cpe / d.clock_hz
            out[:, gemm_idx] = np.where(fused > 0, np.maximum(t, epilogue), t)
    for i in attention_idx:
        single[:, i] = _fused_attention_seconds(ops[i], d, 1.0, 1.0, 1.0 / d.num_tc, e)
        split[:, i] = _fused_attention_seconds(ops[i], d, d.num_tc, d.num_vc, 1.0, e)
    if vec_idx:
        v = np.array(vec_rows, dtype=float).T[:, None, :]
        elements, cpe, nbytes = v
        single[:, vec_idx] = _vector_seconds(elements, cpe, nbytes, d, 1.0, 1.0 / d.num_vc)
        split[:, vec_idx] = _vector_seconds(elements, cpe, nbytes, d, d.num_vc, 1.0)
    overhead = d.efficiency.op_overhead_s
    if overhead:  # a fixed cost per kernel on the cores (efficiency.op_overhead_s); not collectives
        on_cores = gemm_idx + attention_idx + vec_idx
        kernels = np.array([kernels_of(ops[i]) for i in on_cores], dtype=float)
        single[:, on_cores] += overhead * kernels
        split[:, on_cores] += overhead * kernels

    return OpLatencies(
        single=single, split=split, units=tuple(op.unit for op in ops), names=tuple(op.name for op in ops),
        unknown_vector_ops=tuple(sorted(unknown)),
    )


def estimate_one(op_graph: OpGraph, accel: Accelerator, interconnect=None) -> tuple[np.ndarray, np.ndarray]:
    """(single, split) latency rows of one design."""
    lat = estimate(op_graph, [accel], interconnect)
    return lat.single[0], lat.split[0]
