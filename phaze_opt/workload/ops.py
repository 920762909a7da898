"""The values that flow from the workload into the hardware model and the solvers.

An `OpGraph` is one layer kind's forward or backward pass as a DAG of `Op`s on one device (already
sharded for its tensor-parallel width). A `LayerGraph` is the whole model as layers (a chain for
transformers, any DAG in general) with the per-device memory facts the placement needs and a
pointer from every layer to its op graphs, so identical repeated layers share one op graph and are
scheduled once.

All sizes are bytes, all work is FLOP (2 per multiply-add), per device and per microbatch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property

# Which core type executes an op.
TC = "tc"  # tensor core (systolic array): GEMM and batched GEMM
VC = "vc"  # vector core: elementwise, norm, softmax, activation, dropout, reductions
TCVC = "tc+vc"  # a GEMM fused with its elementwise epilogue: one TC and one VC together
NET = "net"  # a collective over the interconnect: occupies no core
NONE = "none"  # views, reshapes, transposes folded into addressing: zero time
UNITS = (TC, VC, TCVC, NET, NONE)
# The fused attention kind (FlashAttention; see trace.py): forward and backward are one op each.
FLASH_ATTENTION = "flash_attention"
ATTENTION_MODES = ("unfused", "flash")
RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Op:
    """One operator on one device.

    `gemm` is (batch, M, K, N) for C[b] = A[b] (M x K) @ B[b] (K x N); empty for non-GEMMs.
    `vector_ops` lists the elementwise kinds applied per output element (one entry for a plain op,
    several for a fused chain); the hardware model keeps a cycles-per-element table keyed by them.
    `contains` names the traced nodes a fused op was made from.

    A fused attention op (kind `FLASH_ATTENTION`, unit tc+vc) runs several GEMMs on one tensor core
    with the softmax on one vector core: `gemms` lists them, and `gemm` is the single GEMM with the
    same multiply-adds, (batch, M, sum of the K's, N), which is what models that read `gemm` alone
    (area-free energy, bounds) need. `gemms` is empty for every other op and then left out of
    `cost_fields`, so graphs without fused attention hash as before.
    """

    name: str
    kind: str  # gemm, bgemm, elementwise, norm, softmax, activation, dropout, reduction, gather, embedding, loss, collective, noop, fused, flash_attention
    unit: str  # one of UNITS
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    gemm: tuple[int, int, int, int] | tuple[()] = ()
    elements: int = 0
    vector_ops: tuple[str, ...] = ()
    collective: str = ""  # "allreduce" for Megatron's TP all-reduces
    comm_bytes: float = 0.0  # payload per device of a collective
    group: int = 1  # devices taking part in the collective (the TP width)
    contains: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()  # output shape
    gemms: tuple[tuple[int, int, int, int], ...] = ()  # the GEMMs of a fused attention op, in order

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"op {self.name}: unit {self.unit!r} not in {UNITS}")

    def cost_fields(self) -> dict:
        """Everything about the op that affects its cost: the name is left out on purpose."""
        d = asdict(self)
        d.pop("name")
        d.pop("contains")
        if not d["gemms"]:
            d.pop("gemms")
        return d


@dataclass(frozen=True)
class OpGraph:
    """A DAG of ops; `edges` are (src, dst) index pairs and ops are listed in a topological order."""

    layer: str  # the layer kind this graph belongs to, e.g. "decoder"
    pass_name: str  # "fwd" or "bwd"
    ops: tuple[Op, ...]
    edges: tuple[tuple[int, int], ...]

    def __post_init__(self):
        n = len(self.ops)
        for s, d in self.edges:
            if not (0 <= s < d < n):
                raise ValueError(f"{self.layer}/{self.pass_name}: edge ({s}, {d}) is not forward in topological order")

    @cached_property
    def content_key(self) -> str:
        """A hash of the graph's structure and op costs; equal keys schedule identically."""
        payload = json.dumps(
            {"ops": [op.cost_fields() for op in self.ops], "edges": sorted(self.edges)},
            sort_keys=True,
            default=list,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:32]

    @property
    def flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    def count_by_unit(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.unit] = out.get(op.unit, 0) + 1
        return out


@dataclass(frozen=True)
class Layer:
    """One layer of the model as the placement sees it, per device at the graph's TP width."""

    name: str  # e.g. "embedding", "decoder.17", "head"
    kind: str  # key into LayerGraph.op_graphs; identical layers share a kind
    params: int  # parameters held per device (1/t of the full layer when sharded)
    param_bytes: float  # params x bytes per element
    activation_bytes: float  # stashed for backward, per microbatch, no recompute
    boundary_bytes: float  # the tensor sent to the next layer, per microbatch
    input_bytes: float  # the tensor received from the previous layer, per microbatch
    fwd_flops: float
    bwd_flops: float
    # Where the activation bytes live (read off the traced graph, see trace.py), so that recompute and
    # sequence parallelism can be priced without tracing again. Defaults: nothing recomputable or
    # shardable, so a hand-made Layer keeps `activation_bytes` in every mode.
    tp: int = 1  # the TP width these per-device sizes are for; sequence parallelism shards over it too
    attention_core_bytes: float = 0.0  # the a*s^2 tensors between QK^T and PV (selective recompute drops them)
    sequence_parallel_bytes: float = 0.0  # of activation_bytes: outside Megatron's TP region (norms, dropouts, residual)
    input_sequence_parallel_bytes: float = 0.0  # of input_bytes: the floating inputs (hidden states)

    def activation_bytes_for(self, recompute: str = "none", sequence_parallel: bool = False) -> int:
        """Bytes one microbatch keeps between this layer's forward and its backward.

        `none`: every saved tensor; `selective`: all but the attention core (Korthikanti et al. 2022,
        Sec. 5: recomputed in backward from the kept Q, K, V); `full`: only the layer's input (the
        checkpoint). With `sequence_parallel` the tensors outside the tensor-parallel region (and the
        checkpoint) are split over the `tp` devices (Korthikanti et al. 2022, Sec. 4.2.2).
        """
        if recompute == "full":
            return self.checkpoint_bytes(sequence_parallel)
        kept = _whole(self.activation_bytes)
        if recompute == "selective":
            kept -= _whole(self.attention_core_bytes)
        elif recompute != "none":
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        return kept - self._sp_saving(self.sequence_parallel_bytes, sequence_parallel)

    def checkpoint_bytes(self, sequence_parallel: bool = False) -> int:
        """What full recompute keeps: the layer's inputs (hidden states split over `tp` with SP)."""
        return _whole(self.input_bytes) - self._sp_saving(self.input_sequence_parallel_bytes, sequence_parallel)

    def recompute_working_bytes(self, recompute: str = "none", sequence_parallel: bool = False) -> int:
        """Bytes that exist only during this layer's own backward because they were recomputed: the
        attention core for `selective`, the whole `none` set for `full` (it is rebuilt from the
        checkpoint before the layer's backward runs), nothing for `none`."""
        if recompute == "full":
            return self.activation_bytes_for("none", sequence_parallel)
        if recompute == "selective":
            return _whole(self.attention_core_bytes)
        if recompute == "none":
            return 0
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")

    def activation_bytes_by_mode(self) -> dict[str, int]:
        """`activation_bytes_for` of every mode: keys `none`, `selective`, `full`, and each with `+sp`."""
        return {f"{mode}{'+sp' if sp else ''}": self.activation_bytes_for(mode, sp)
                for sp in (False, True) for mode in RECOMPUTE_MODES}

    def _sp_saving(self, shardable: float, sequence_parallel: bool) -> int:
        n = _whole(shardable)
        return n - -(-n // self.tp) if sequence_parallel else 0


def _whole(x: float) -> int:
    return int(round(x))


@dataclass(frozen=True)
class LayerGraph:
    """The model for one (TP width, microbatch, sequence length) as layers plus op graphs."""

    model: str
    tp: int
    mbs: int
    seq: int
    bytes_per_element: int
    layers: tuple[Layer, ...]
    edges: tuple[tuple[int, int], ...]  # layer DAG; (i, i+1) for a chain
    op_graphs: dict  # kind -> {"fwd": OpGraph, "bwd": OpGraph}
    total_params: int  # the whole model, not per device
    train_flops_per_sequence: float  # fwd + bwd of the whole model, no recompute
    extra: dict = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        """Distinct layer kinds in first-appearance order."""
        seen: dict[str, None] = {}
        for layer in self.layers:
            seen.setdefault(layer.kind, None)
        return list(seen)

    def is_chain(self) -> bool:
        return sorted(self.edges) == [(i, i + 1) for i in range(len(self.layers) - 1)]
