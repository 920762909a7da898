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
import math
from dataclasses import asdict, dataclass, field, fields, replace
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
# The trace's fusion level of a stack with Transformer Engine's kernels (trace.py says what it fuses).
# Here, not in trace.py, so the stacks (workload/stack.py) name it without importing PyTorch: a
# study's processes never trace and start seconds sooner without it.
ROW_FUSION = "row"
# The trace's fusion level of TorchInductor's generated kernels (torch.compile; trace.py says what it fuses).
INDUCTOR_FUSION = "inductor"
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
    `cost_fields`, so an empty field never enters a graph's hash (cache keys name only what prices a graph).
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
    # A GEMM's operand number format when not the graph's own BF16 ("fp8", "mxfp8", "nvfp4"; set by
    # workload/precision.py, never by the tracer): left out of `cost_fields` and the cached JSON
    # when empty, so a BF16 graph's hash and cache file name only what prices it.
    datatype: str = ""
    # A grouped GEMM the stack issues as one kernel per group (Transformer Engine's GroupedLinear:
    # a cuBLASLt GEMM per local expert; workload/stack.py), so it pays the arch's fixed cost per
    # kernel once per group (hardware/latency.py). Left out of `cost_fields` and the cached JSON
    # when False, as `datatype` is.
    per_group_kernels: bool = False

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
        return _without_unset(d)


# Op fields left out of an op's hash and plain data when unset, so graphs made before a field
# existed keep their hashes and cache files.
UNSET_WHEN_EMPTY = ("datatype", "per_group_kernels")


def _without_unset(d: dict) -> dict:
    for key in UNSET_WHEN_EMPTY:
        if not d[key]:
            d.pop(key)
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
    # Of activation_bytes: the saved linear-GEMM inputs only weight gradients read, and those other
    # backward ops read too, each with its sequence-parallel part (trace.LayerTrace); what a
    # low-precision recipe changes (workload/precision.py `precision_layer`).
    linear_input_bytes: float = 0.0
    linear_input_sp_bytes: float = 0.0
    linear_shared_bytes: float = 0.0
    linear_shared_sp_bytes: float = 0.0
    # Module-level recompute (trace.py, "Module-level recompute"): of activation_bytes, the saved
    # bytes made inside modules with a recompute name, grouped by those names, as ("a,b" (every
    # such module around the producer), bytes, of which sequence-parallel bytes); the rest untagged.
    module_groups: tuple[tuple[str, float, float], ...] = ()
    # Op-level selective checkpointing (trace.py): the bytes of the ops a checkpointed block keeps the
    # outputs of, of which sequence-parallel (the TP collectives').
    op_policy_bytes: float = 0.0
    op_policy_sp_bytes: float = 0.0

    def module_bytes(self, tags, sequence_parallel: bool = False) -> int:
        """Bytes one microbatch stops keeping when the modules named `tags` (a set of
        `recompute_module` names, layers.py; not the attention core, whose bytes stay in
        `attention_core_bytes`) are recomputed: every group made inside one of them, each with
        its sequence-parallel share split over `tp` as `activation_bytes_for` splits it. They are
        rebuilt during the layer's backward, so they are also its extra working set. At most what
        selective recompute keeps (a group lies outside the attention core)."""
        tags = set(tags)
        dropped = sum(_whole(b) - self._sp_saving(sp, sequence_parallel)
                      for names, b, sp in self.module_groups if tags & set(names.split(",")))
        return max(0, min(dropped, self.activation_bytes_for("selective", sequence_parallel)))

    def op_policy_kept_bytes(self, sequence_parallel: bool = False) -> int:
        """What a block checkpointed under torchtitan's op-level policy keeps per microbatch: its input
        (the checkpoint) and the cached outputs of the kept ops, the collectives' s/t shard with SP."""
        return (self.checkpoint_bytes(sequence_parallel) + _whole(self.op_policy_bytes)
                - self._sp_saving(self.op_policy_sp_bytes, sequence_parallel))

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

    def boundary_bytes_for(self, sequence_parallel: bool = False) -> int:
        """Bytes one TP rank sends to the next pipeline stage per microbatch: the layer's output, or
        with sequence parallelism its s/t share of it (Megatron-Core sends the SP shard: its p2p
        tensor shape is (s / t, b, h) under SP, `pipeline_parallel/schedules.py`
        `get_tensor_shapes`), the t ranks sending their shares side by side."""
        return _whole(self.boundary_bytes) - self._sp_saving(self.boundary_bytes, sequence_parallel)

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
        """Distinct layer kinds in first-appearance order (a fresh list; the bounds ask for it tens of
        thousands of times a cell, so the walk over the layers is made once a graph)."""
        return list(self._kinds)

    @cached_property
    def _kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(layer.kind for layer in self.layers))

    def is_chain(self) -> bool:
        return sorted(self.edges) == [(i, i + 1) for i in range(len(self.layers) - 1)]


EXACT_BYTES = 2.0**53  # float64 adds whole byte counts exactly below this (8 PiB)


def largest_memory_bytes(params: float, state_bytes_per_param: float, n_layers: int, layer_bytes: float) -> float:
    """The largest memory figure the placement adds up for one device: all parameter state
    (`params` x `state_bytes_per_param`) plus every layer's activation, boundary and input tensors
    (`layer_bytes`, summed over layers) once per possible in-flight microbatch (at most one per layer).
    It must stay below EXACT_BYTES for the placement's sums to be exact."""
    return params * state_bytes_per_param + (n_layers + 1) * layer_bytes


# --------------------------------------------------------------------------------------------
# Plain-data form (the disk cache): JSON that can only ever decode to these values, never run code
# --------------------------------------------------------------------------------------------

# The type of every field, for the strict decoder: "str", "int", "num" (int or float, finite),
# "bool", "ints"/"strs" (a list of them, back to a tuple). tests/test_workload_graphs.py checks
# that these name exactly the dataclasses' fields, so a new field cannot be forgotten here.
OP_FIELDS = {
    "name": "str", "kind": "str", "unit": "str", "flops": "num", "bytes_read": "num", "bytes_written": "num",
    "gemm": "ints", "elements": "int", "vector_ops": "strs", "collective": "str", "comm_bytes": "num",
    "group": "int", "contains": "strs", "shape": "ints", "gemms": "gemm list", "datatype": "str",
    "per_group_kernels": "bool",
}
LAYER_FIELDS = {
    "name": "str", "kind": "str", "params": "int", "param_bytes": "num", "activation_bytes": "num",
    "boundary_bytes": "num", "input_bytes": "num", "fwd_flops": "num", "bwd_flops": "num", "tp": "int",
    "attention_core_bytes": "num", "sequence_parallel_bytes": "num", "input_sequence_parallel_bytes": "num",
    "linear_input_bytes": "num", "linear_input_sp_bytes": "num", "linear_shared_bytes": "num",
    "linear_shared_sp_bytes": "num", "module_groups": "groups", "op_policy_bytes": "num", "op_policy_sp_bytes": "num",
}
GRAPH_FIELDS = {  # LayerGraph's plain fields; layers, edges, op_graphs and extra are decoded by hand
    "model": "str", "tp": "int", "mbs": "int", "seq": "int", "bytes_per_element": "int", "total_params": "int",
    "train_flops_per_sequence": "num",
}


class GraphFormatError(ValueError):
    """Plain data that is not a layer graph; the message says where."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(value, kind: str, where: str):
    """`value` checked against a field kind of the tables above (lists come back as tuples)."""
    if kind == "groups":  # module-level recompute groups: [[names, bytes, sp bytes], ...]
        if isinstance(value, list) and all(
                isinstance(g, list) and len(g) == 3 and isinstance(g[0], str)
                and all((_is_int(x) or isinstance(x, float)) and math.isfinite(x) and x >= 0 for x in g[1:])
                for g in value):
            return tuple(tuple(g) for g in value)
    elif kind == "gemm list":  # a fused op's GEMMs: [[batch, M, K, N], ...]
        if isinstance(value, list) and all(isinstance(g, list) and len(g) == 4 and all(map(_is_int, g)) for g in value):
            return tuple(tuple(g) for g in value)
    elif kind in ("ints", "strs"):
        item = _is_int if kind == "ints" else (lambda v: isinstance(v, str))
        if isinstance(value, list) and all(item(v) for v in value):
            return tuple(value)
    elif kind == "num":
        # json keeps int and float apart, so a round trip returns the very values that were written
        if (_is_int(value) or isinstance(value, float)) and math.isfinite(value):
            return value
    elif {"str": isinstance(value, str), "int": _is_int(value), "bool": isinstance(value, bool)}[kind]:
        return value
    raise GraphFormatError(f"{where}: expected {kind}, got {type(value).__name__}")


def _record(data, spec: dict, where: str) -> dict:
    if not isinstance(data, dict) or set(data) != set(spec):
        raise GraphFormatError(f"{where}: expected the fields {', '.join(sorted(spec))}")
    return {k: _typed(data[k], kind, f"{where}.{k}") for k, kind in spec.items()}


def _pairs(data, n: int, where: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(data, list) or not all(isinstance(e, list) and len(e) == 2 for e in data):
        raise GraphFormatError(f"{where}: expected a list of [src, dst] pairs")
    edges = tuple((_typed(a, "int", where), _typed(b, "int", where)) for a, b in data)
    if any(not 0 <= a < b < n for a, b in edges):
        raise GraphFormatError(f"{where}: an edge is not forward between the {n} nodes")
    return edges


def _tuples(value):
    """JSON lists back to the tuples they were written from, at every depth."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def per_group_kernel_graph(graph: LayerGraph) -> LayerGraph:
    """`graph` with its grouped GEMMs issued one kernel per group (`Op.per_group_kernels`); a graph
    without any is returned as it is."""
    def marked(og: OpGraph) -> OpGraph:
        return replace(og, ops=tuple(replace(op, per_group_kernels=True) if op.kind == "grouped_gemm" else op
                                     for op in og.ops))
    if not any(op.kind == "grouped_gemm" for passes in graph.op_graphs.values() for og in passes.values()
               for op in og.ops):
        return graph
    return replace(graph, op_graphs={kind: {p: marked(og) for p, og in passes.items()}
                                     for kind, passes in graph.op_graphs.items()})


def layer_graph_to_json(graph: LayerGraph) -> dict:
    """The graph as plain JSON data (`layer_graph_from_json` reads it back equal)."""
    return {
        **{k: getattr(graph, k) for k in GRAPH_FIELDS},
        "layers": [asdict(layer) for layer in graph.layers],
        "edges": [list(e) for e in graph.edges],
        "op_graphs": {
            kind: {p: {"layer": og.layer, "ops": [_op_json(op) for op in og.ops], "edges": [list(e) for e in og.edges]}
                   for p, og in passes.items()}
            for kind, passes in graph.op_graphs.items()
        },
        "extra": graph.extra,
    }


def _op_json(op: Op) -> dict:
    """An op as plain data; an unset `UNSET_WHEN_EMPTY` field (an empty `datatype`: the graph's own
    format) is left out, as it was before the field existed."""
    return _without_unset(asdict(op))


def _op_graph(data, kind: str, pass_name: str) -> OpGraph:
    where = f"op_graphs.{kind}.{pass_name}"
    if not isinstance(data, dict) or set(data) != {"layer", "ops", "edges"} or not isinstance(data["ops"], list):
        raise GraphFormatError(f"{where}: expected layer, ops and edges")
    unset = {f.name: f.default for f in fields(Op) if f.name in UNSET_WHEN_EMPTY}  # left out when written
    ops = tuple(Op(**_record({**unset, **op} if isinstance(op, dict) else op, OP_FIELDS, f"{where}.ops[{i}]"))
                for i, op in enumerate(data["ops"]))
    return OpGraph(layer=_typed(data["layer"], "str", where), pass_name=pass_name, ops=ops,
                   edges=_pairs(data["edges"], len(ops), f"{where}.edges"))


def layer_graph_from_json(data) -> LayerGraph:
    """A LayerGraph from `layer_graph_to_json`'s data, every field type-checked; any other shape
    raises GraphFormatError (or the dataclasses' own ValueError), never anything worse."""
    if not isinstance(data, dict) or set(data) != {*GRAPH_FIELDS, "layers", "edges", "op_graphs", "extra"}:
        raise GraphFormatError("not a layer graph")
    plain = _record({k: data[k] for k in GRAPH_FIELDS}, GRAPH_FIELDS, "graph")
    if not isinstance(data["layers"], list) or not isinstance(data["op_graphs"], dict):
        raise GraphFormatError("layers or op_graphs has the wrong shape")
    layers = tuple(Layer(**_record(layer, LAYER_FIELDS, f"layers[{i}]")) for i, layer in enumerate(data["layers"]))
    op_graphs = {}
    for kind, passes in data["op_graphs"].items():
        if not isinstance(passes, dict) or set(passes) != {"fwd", "bwd"}:
            raise GraphFormatError(f"op_graphs.{kind}: expected fwd and bwd")
        op_graphs[kind] = {p: _op_graph(passes[p], kind, p) for p in ("fwd", "bwd")}
    if any(layer.kind not in op_graphs for layer in layers):
        raise GraphFormatError("a layer's kind has no op graphs")
    extra = data["extra"]
    if not isinstance(extra, dict):
        raise GraphFormatError("extra: expected a mapping")
    if isinstance(extra.get("saved_tensors"), dict):  # the tracer's (name, shape, dtype, bytes) tuples
        extra = dict(extra, saved_tensors={k: _tuples(v) for k, v in extra["saved_tensors"].items()})
    return LayerGraph(**plain, layers=layers, edges=_pairs(data["edges"], len(layers), "edges"),
                      op_graphs=op_graphs, extra=extra)
