"""The layer graph of a model at one (TP width, microbatch, sequence length), cached on disk.

A transformer is a chain: embedding, `layers` identical blocks, head. Only one module per distinct
layer kind is built and traced (three traces per TP width, whatever the depth), and every block
points at the same pair of op graphs, so later stages schedule a block once.

Per-device parameter bytes are what one device of the TP group holds for the layer. The head of a
model with tied embeddings holds its own copy of the word-embedding matrix (Megatron keeps one on
the last pipeline stage and all-reduces its gradient with the first stage's), so that copy is
counted in the head's `params`/`param_bytes`, where it really costs memory, while `total_params`
of the whole model counts the shared matrix once, as published sizes do.

Extraction is cached in memory and on disk under `$PHAZE_OPT_CACHE/graphs`, by default
`.cache/phaze_opt/graphs` in the project folder, keyed by a hash of the model config, TP width,
microbatch, sequence length, fusion flag and the source of this package's workload code, so a code
change never serves a stale graph. The disk cache is data, never code: one JSON file per key
(`ops.layer_graph_to_json`), read back by a strict decoder that checks every field's type, then
checked against the model's own shapes (`implausible`), so a file planted or edited in the cache
folder can at worst be a miss. A file that is not such a graph (garbage,
another format, another key) is logged and traced again, and the file rewritten. Files of the
older pickle format (`<key>.pkl`) are never opened; one found beside a key being written is removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import math
import logging
import time
from pathlib import Path

from ..activity import phase
from ..cache import BoundedMemo, cache_root, signature, signed, write_atomic
from ..configs import positive_arg
from ..errors import PhazeError
from ..system import MAX_STATE_BYTES_PER_PARAM, MBS_LIMIT
from ..training import EXPERT_WEIGHTS
from .models import ATTENTIONS, LIMITS, ModelConfig, check_capacity_factor, check_tp, load_model
from .ops import (EXACT_BYTES, GraphFormatError, Layer, LayerGraph, largest_memory_bytes, layer_graph_from_json,
                  layer_graph_to_json, per_group_kernel_graph)

# A few MB per graph; a sweep touches (models x TP widths x microbatches), a few dozen.
MEMO_MAX = 256
_MEMO: BoundedMemo[LayerGraph] = BoundedMemo(MEMO_MAX)
_PACKAGE = Path(__file__).resolve().parent
FORMAT = "phaze_opt layer graph 3"  # 2: fused attention GEMMs, per-region activation bytes; 3: signed
log = logging.getLogger(__name__)


def _code_version() -> str:
    h = hashlib.sha256()
    for path in sorted(_PACKAGE.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    try:  # aten decompositions change with torch; read the version without importing torch
        h.update(importlib.metadata.version("torch").encode())
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        pass
    return h.hexdigest()[:16]


_CODE_VERSION = _code_version()


def graph_key(model: ModelConfig, tp: int, mbs: int, seq: int, fuse: bool | str = True,
              expert_weights: str = "combine") -> str:
    payload = json.dumps(
        {"model": model.identity(), "tp": tp, "mbs": mbs, "seq": seq, "fuse": fuse, "code": _CODE_VERSION,
         **({"expert_weights": expert_weights} if model.moe else {})},
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def build_layer_graph(
    model: ModelConfig | str, tp: int = 1, mbs: int = 1, seq: int | None = None, *, fuse: bool | str = True,
    cache: bool = True, attention: str | None = None, capacity_factor: float | None = None,
    expert_weights: str = "combine", per_group_kernels: bool = False,
) -> LayerGraph:
    """The model's layer graph at TP width `tp` for microbatches of `mbs` sequences of length `seq`.

    `model` may be a ModelConfig or a model name/path. `attention` ("unfused" or "flash") overrides
    the model's own `attention` choice; it is part of the model's identity, hence of the cache key.
    `fuse`: True fuses chains of pointwise ops, False keeps one op per traced operator (eager),
    `ops.ROW_FUSION` also fuses norms and RoPE (workload/stack.py says which stack runs which).
    `expert_weights`: where a MoE layer applies its gate weights (training.EXPERT_WEIGHTS).
    `per_group_kernels`: its grouped GEMMs issued one kernel per expert (`ops.per_group_kernel_graph`;
    the disk cache holds the traced graph, the in-memory one each form). `cache=False` skips the
    disk cache (the in-memory one still applies). Bad arguments raise a
    one-line PhazeError.
    """
    model = load_model(model)
    if attention is not None and attention != model.attention:
        if attention not in ATTENTIONS:
            raise PhazeError(f"attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
        model = dataclasses.replace(model, attention=attention)
    if capacity_factor is not None and model.moe and capacity_factor != model.capacity_factor:
        model = dataclasses.replace(model, capacity_factor=check_capacity_factor(capacity_factor, "capacity factor"))
    tp = check_tp(model, tp)
    seq = model.seq if seq is None else seq
    positive_arg(mbs, "microbatch size", MBS_LIMIT)
    positive_arg(seq, "sequence length", LIMITS["seq"])
    if model.position == "learned" and seq > model.positions:
        raise PhazeError(f"model {model.name}: sequence length {seq} exceeds its {model.positions} learned positions")

    if expert_weights not in EXPERT_WEIGHTS:
        raise PhazeError(f"expert weights must be one of {', '.join(EXPERT_WEIGHTS)}, got {expert_weights!r}")
    key = graph_key(model, tp, mbs, seq, fuse, expert_weights)
    held = f"{key}+per-group-kernels" if per_group_kernels else key
    if held in _MEMO:
        return _MEMO[held]
    path = cache_root() / "graphs" / f"{key}.json"
    graph = _read(path, key) if cache else None
    if graph is not None:
        problem = implausible(model, tp, mbs, seq, graph)
        if problem:
            log.warning("graph cache %s: rejected, %s; tracing again", path, problem)
            graph = None
    if graph is None:
        graph = _extract(model, tp, mbs, seq, fuse, cache, expert_weights)
        if cache:
            _write(path, key, graph)
    _check_exact(model, graph)
    if per_group_kernels:
        graph = per_group_kernel_graph(graph)
    _MEMO[held] = graph
    return graph


def memo_entries() -> list[tuple[str, LayerGraph]]:
    """The graphs this process holds, by key: what a worker process hands back (`adopt`) so that
    the process that started it neither reads them from disk nor checks them again."""
    return _MEMO.items()


def adopt(entries: list[tuple[str, LayerGraph]]) -> None:
    """Hold the graphs a worker process of this run traced or read (`memo_entries`), as if this
    process had: they passed the same checks there."""
    for key, graph in entries:
        _MEMO[key] = graph


SP_COLLECTIVE = "reducescatter+allgather"


def sequence_parallel_graph(graph: LayerGraph) -> LayerGraph:
    """The layer graph with sequence parallelism's collectives (Korthikanti et al. 2022, Sec. 4.2.2):
    every TP all-reduce of the residual stream (a payload as large as the hidden states of the
    microbatch) becomes a reduce-scatter into the sequence-parallel region plus an all-gather out of
    it (`collective` SP_COLLECTIVE, costed as that pair by the hardware model). The hidden states'
    size is the layer's floating input (a block, the head), or its output for the embedding, whose
    input is token ids: not the output of every layer, since a MoE block also returns its
    load-balancing loss. The vocabulary-parallel loss's smaller reductions stay all-reduces. Memory
    by SP is priced by `Layer.activation_bytes_for`; at t = 1 there is nothing to change."""
    if graph.tp == 1:
        return graph
    sizes = {layer.kind: layer.input_sequence_parallel_bytes or layer.boundary_bytes for layer in graph.layers}
    op_graphs = {}
    for kind, passes in graph.op_graphs.items():
        op_graphs[kind] = {}
        for name, og in passes.items():
            ops = tuple(dataclasses.replace(op, collective=SP_COLLECTIVE)
                        if op.collective == "allreduce" and op.comm_bytes == sizes.get(kind) else op for op in og.ops)
            op_graphs[kind][name] = dataclasses.replace(og, ops=ops)
    return dataclasses.replace(graph, op_graphs=op_graphs)


def _check_exact(model: ModelConfig, graph: LayerGraph) -> None:
    """Each field may be within its limit and the whole still too large: the placement adds every
    layer's bytes once per microbatch in flight, and float64 adds whole bytes exactly only below
    2^53 (8 PiB, far beyond any device's memory). Say which sizes did it, not a trial's traceback."""
    need = largest_memory_bytes(
        sum(layer.params for layer in graph.layers), MAX_STATE_BYTES_PER_PARAM, len(graph.layers),
        sum(layer.activation_bytes + layer.boundary_bytes + layer.input_bytes for layer in graph.layers),
    )
    if need >= EXACT_BYTES:
        raise PhazeError(
            f"{model.source or model.name}: 'layers' {model.layers}, 'hidden' {model.hidden} and sequence length "
            f"{graph.seq} at microbatch {graph.mbs}, TP {graph.tp} give {need / 2**50:,.0f} PiB of state and "
            f"activations per device, beyond the 8 PiB float64 counts exactly (no device holds that much); "
            f"use fewer layers or shorter sequences"
        )


# A cached graph's FLOPs may not fall below 6 x active parameters x tokens (Kaplan et al. 2020,
# Sec. 2.1: forward 2N, backward 4N per token) by more than this fraction; traced graphs sit at or above
# 1.0 (attention and the loss add to it).
FLOPS_FLOOR = 0.95
OP_NUMBERS = ("flops", "bytes_read", "bytes_written", "elements", "vector_ops", "comm_bytes")


def implausible(model: ModelConfig, tp: int, mbs: int, seq: int, graph: LayerGraph) -> str | None:
    """Why a graph read from the disk cache cannot be this model's at (tp, mbs, seq), or None.

    The file is data anyone who can write the folder can edit (seen: FLOPs cut by 5x raised a design's
    throughput fivefold, silently). Checked against the model's own shapes, without tracing: its
    identity and layer sequence, every op number finite and non-negative, each GEMM's FLOPs equal to
    at least 2 x batch x M x K x N of its shape, each layer's FLOPs the sum of its ops', the parameters those
    of the model's modules (`model_params`), and the FLOPs of a sequence at least `FLOPS_FLOOR` x
    6 x active parameters x tokens, for the graph as a whole and for its layers at this TP width."""
    from .kinds import layer_sequence

    if (graph.model, graph.tp, graph.mbs, graph.seq) != (model.name, tp, mbs, seq):
        return f"it is the graph of {graph.model} at TP {graph.tp}, microbatch {graph.mbs}, sequence {graph.seq}"
    kinds = [kind for _, kind in layer_sequence(model)]
    if [layer.kind for layer in graph.layers] != kinds:
        return "its layers are not the model's"
    for kind, passes in graph.op_graphs.items():
        totals = {}
        for name, og in passes.items():
            for op in og.ops:
                for f in OP_NUMBERS:
                    v = getattr(op, f, 0.0)
                    if isinstance(v, (int, float)) and not (math.isfinite(v) and v >= 0):
                        return f"op {op.name}: {f} {v}"
                if op.gemm and len(op.gemm) == 4 and op.flops < 2 * math.prod(op.gemm) * (1 - 1e-9):
                    return f"op {op.name}: {op.flops:g} FLOPs for a {op.gemm} GEMM"  # a fused bias may add more
            totals[name] = sum(op.flops for op in og.ops)
        for layer in graph.layers:
            if layer.kind == kind and not (math.isclose(layer.fwd_flops, totals.get("fwd", 0.0), rel_tol=1e-9)
                                           and math.isclose(layer.bwd_flops, totals.get("bwd", 0.0), rel_tol=1e-9)):
                return f"layer {layer.name}: its FLOPs are not those of its ops"
    params = model_params(model)
    if graph.total_params != params or sum(layer.params for layer in graph.layers) * tp < params:
        return f"its parameters are not the model's {params:,}"
    floor = FLOPS_FLOOR * 6 * active_params(model) * seq
    per_sequence = sum(layer.fwd_flops + layer.bwd_flops for layer in graph.layers) * tp / mbs
    if graph.train_flops_per_sequence < floor or per_sequence < floor:
        return f"{min(graph.train_flops_per_sequence, per_sequence):.4g} FLOPs a sequence, below 6 x active parameters x tokens"
    return None


def _read(path: Path, key: str) -> LayerGraph | None:
    """The cached graph of `key`, or None: a missing file silently, any unusable one logged."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # unreadable, not UTF-8, not JSON
        log.warning("graph cache %s: unreadable (%s); tracing again", path, exc)
        return None
    try:
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
            raise GraphFormatError(f"not a graph of this format and key (format {FORMAT!r})")
        # a file this cache did not write as it is (an edit of any number, e.g. bytes_read x1000 or
        # every GEMM moved to the vector units, passes the plausibility checks): traced again
        if not signed([key, data.get("graph")], data.get("signature")):
            raise GraphFormatError("its signature does not match its contents (edited, or signed with another "
                                   "cache folder's key)")
        graph = layer_graph_from_json(data.get("graph"))
    except (GraphFormatError, ValueError, TypeError, RecursionError) as exc:  # any content: a logged miss
        log.warning("graph cache %s: rejected, %s; tracing again", path, exc)
        return None
    graph.extra["source"] = "disk cache"
    return graph


def _write(path: Path, key: str, graph: LayerGraph) -> None:
    try:
        payload = layer_graph_to_json(graph)
        mark = signature([key, payload])
        if mark is None:  # no key (a read-only cache folder): a file nobody could trust is not written
            return
        text = json.dumps({"format": FORMAT, "key": key, "graph": payload, "signature": mark}, allow_nan=False)
    except (TypeError, ValueError) as exc:  # a value JSON cannot hold: keep the graph in memory only
        log.warning("graph cache %s: not written (%s)", path, exc)
        return
    if write_atomic(path, text):
        try:
            path.with_suffix(".pkl").unlink(missing_ok=True)  # the cache reads JSON only: a pickle is dead weight
        except OSError:
            pass


def trace_kinds(model: ModelConfig, tp: int, mbs: int, seq: int, fuse: bool | str = True,
                expert_weights: str = "combine") -> dict:
    """Build and trace one module per layer kind: {kind: LayerTrace}."""
    from .layers import build_layer, example_inputs, layer_kinds
    from .trace import trace_layer_details

    return {
        kind: trace_layer_details(build_layer(model, kind, tp, expert_weights), example_inputs(model, kind, mbs, seq),
                                  name=kind, fuse=fuse)
        for kind in layer_kinds(model)
    }


def model_params(model: ModelConfig) -> int:
    """Parameters of the whole model (no TP), with a tied embedding matrix counted once. Published
    sizes leave multi-token-prediction modules out (DeepSeek-V3's 671B; `mtp_params`), so does this."""
    return _kind_params(model, lambda kind: kind != "mtp")


def mtp_params(model: ModelConfig) -> int:
    """Parameters of the multi-token-prediction modules of their own (the shared embedding and
    output head not counted again); 0 without them."""
    return _kind_params(model, lambda kind: kind == "mtp")


def _kind_params(model: ModelConfig, counted) -> int:
    from .layers import build_layer, layer_sequence

    counts: dict[str, int] = {}
    for _, kind in layer_sequence(model):
        if counted(kind):
            counts[kind] = counts.get(kind, 0) + 1
    total = 0
    for kind, count in counts.items():
        module = build_layer(model, kind, 1)
        tied = {id(module.get_parameter(name)) for name in getattr(module, "tied_parameters", ())}
        total += count * sum(p.numel() for p in module.parameters() if id(p) not in tied)
    return total


def routed_expert_params(model: ModelConfig) -> int:
    """Parameters of one routed expert (both linears, no TP); 0 for a dense model. From the config,
    as `layers.MoE` shapes them (a test counts the module's): the first linear hidden x expert_ffn,
    twice that with SwiGLU's gate, the second expert_ffn x hidden. Counting the built module would
    import torch into a process that only prices graphs traced elsewhere."""
    if not model.moe:
        return 0
    return model.hidden * model.expert_ffn * (3 if model.activation == "swiglu" else 2)


def active_params(model: ModelConfig) -> int:
    """Parameters one token meets: the whole model less the routed experts it is not sent to,
    (experts - top_k) per MoE block (Mixtral's and DeepSeek-MoE's "active" counts; shared experts,
    router, attention and embeddings are all active)."""
    return model_params(model) - model.moe_layers * (model.experts - model.top_k) * routed_expert_params(model)


def _extract(model: ModelConfig, tp: int, mbs: int, seq: int, fuse: bool | str, cache: bool,
             expert_weights: str) -> LayerGraph:
    start = time.perf_counter()
    with phase(f"tracing {model.name}'s layer graphs (tp {tp}, mbs {mbs})"):
        traces = trace_kinds(model, tp, mbs, seq, fuse, expert_weights)
    from .kinds import layer_sequence

    names, kinds = (list(x) for x in zip(*layer_sequence(model)))
    edges = tuple((i, i + 1) for i in range(len(names) - 1))
    has_successor = {s for s, _ in edges}
    layers = []
    for i, (name, kind) in enumerate(zip(names, kinds)):
        tr = traces[kind]
        layers.append(Layer(
            name=name, kind=kind, params=tr.params, param_bytes=float(tr.param_bytes),
            activation_bytes=float(tr.activation_bytes),
            boundary_bytes=float(tr.output_bytes) if i in has_successor else 0.0,
            input_bytes=float(tr.input_bytes), fwd_flops=tr.fwd.flops, bwd_flops=tr.bwd.flops,
            tp=tp, attention_core_bytes=float(tr.attention_core_bytes),
            sequence_parallel_bytes=float(tr.sequence_parallel_bytes),
            input_sequence_parallel_bytes=float(tr.input_sequence_parallel_bytes),
            linear_input_bytes=float(tr.linear_input_bytes), linear_input_sp_bytes=float(tr.linear_input_sp_bytes),
            linear_shared_bytes=float(tr.linear_shared_bytes),
            linear_shared_sp_bytes=float(tr.linear_shared_sp_bytes),
            module_groups=_module_groups(tr),
            op_policy_bytes=float(tr.op_policy_bytes), op_policy_sp_bytes=float(tr.op_policy_sp_bytes),
        ))
    op_graphs = {kind: {"fwd": tr.fwd, "bwd": tr.bwd} for kind, tr in traces.items()}
    step_flops = sum(layer.fwd_flops + layer.bwd_flops for layer in layers)
    if tp == 1 and mbs == 1:
        flops_per_sequence = step_flops
    else:  # the model's own work: the unsharded graph of one sequence (cached like any other)
        flops_per_sequence = build_layer_graph(model, 1, 1, seq, fuse=fuse, cache=cache,
                                               expert_weights=expert_weights).train_flops_per_sequence
    return LayerGraph(
        model=model.name, tp=tp, mbs=mbs, seq=seq, bytes_per_element=model.bytes_per_element,
        layers=tuple(layers), edges=edges, op_graphs=op_graphs, total_params=model_params(model),
        train_flops_per_sequence=float(flops_per_sequence),
        extra={
            "source": "traced",
            "extract_s": time.perf_counter() - start,
            "trace_s": {kind: tr.trace_s for kind, tr in traces.items()},
            "vocab_rows_per_device": -(-model.vocab // tp),
            "tied_embeddings": model.tied_embeddings,
            "unmapped_ops": sorted({op for tr in traces.values() for op in tr.unmapped_ops}),
            "saved_tensors": {kind: tr.saved for kind, tr in traces.items()},
            # forward op name -> the recompute modules that made it ("a,b"), per kind (trace.py)
            "forward_modules": {kind: dict(tr.forward_modules) for kind, tr in traces.items()},
            # forward op names torchtitan's op-level checkpointing reruns, per kind (trace.py)
            "op_policy_rerun": {kind: list(tr.op_policy_rerun) for kind, tr in traces.items()},
        },
    )


def _module_groups(tr) -> tuple[tuple[str, float, float], ...]:
    """A trace's saved bytes made inside recompute modules, by module names (`Layer.module_groups`)."""
    from .trace import SEQUENCE_PARALLEL

    groups: dict[str, list[float]] = {}
    for entry, region, names in zip(tr.saved, tr.saved_regions, tr.saved_modules):
        if names:
            g = groups.setdefault(names, [0.0, 0.0])
            g[0] += entry[3]
            g[1] += entry[3] if region == SEQUENCE_PARALLEL else 0
    return tuple((names, float(b), float(sp)) for names, (b, sp) in sorted(groups.items()))
