"""Low-precision GEMMs: which ops of a layer graph run in a recipe's number format, and what it adds.

`precision_graph(graph, precision)` rewrites a layer graph the way NVIDIA Transformer Engine (TE)
with Megatron-Core trains in FP8 (`--fp8-format hybrid`); BF16 returns the graph itself, so every
BF16 number stays what it was.

Which GEMMs. TE runs FP8 only inside its linear modules (`te.Linear`, `LayerNormLinear`,
`LayerNormMLP`: "FP8 ... is supported for the GEMMs of the linear layers"; TE user guide, "Using
FP8 with Transformer Engine"), for all three GEMMs of each (forward, data gradient, weight
gradient). Kept in BF16:
- the attention score and context products (`bgemm`, `flash_attention` ops): TE's
  `DotProductAttention` runs them in BF16 unless FP8 attention is asked for (`fp8_dpa`, off by
  default in TE's `DelayedScaling` recipe and in Megatron-Core);
- the output layer (`head`) and the embedding: Megatron-Core builds the output layer as a
  `tensor_parallel.ColumnParallelLinear`, not a TE module, so `fp8_autocast` leaves it in BF16, and
  the embedding is a lookup (Megatron-Core GPTModel);
- softmax, norms, activations and the loss: element-wise, BF16/FP32 as before.
The traced `gemm` and `grouped_gemm` ops of every other layer kind (the decoder blocks, MoE
experts and MTP modules) run in the format. A MoE router's small GEMM is a `gemm` too and is priced in the format
(Megatron-Core keeps it in FP32 with `--moe-router-dtype fp32`; a few MFLOP per token, left as is).

What an FP8 GEMM costs (hardware/latency.py): its two operands are read at the format's width
(`FORMATS`: 1 byte for FP8/MXFP8 plus MXFP8's one E8M0 scale byte per 32 elements; half a byte for
NVFP4 plus one E4M3 scale per 16), its output is written in BF16 (TE's default output type), and
the tensor cores run it at the chip's MAC rate in the format (`Accelerator.mac_rate`).

Casts and scaling bookkeeping. Before each FP8 GEMM the operand that is not the weight is cast
from BF16 to the format, in a vector op of its own (`cast` + `amax`: TE's cast kernels compute the
tensor's absolute maximum, or each block's for MX formats, in the same pass; delayed scaling
then reads the amax history, a few scalars per tensor, not priced): it reads 2 bytes and writes the
format's bytes per element. TE fuses three of the four forward casts of a block into the LayerNorm
or the activation before them (`LayerNormLinear`, `LayerNormMLP`) and casts each gradient once for
both backward GEMMs (`cast_transpose`); one cast per GEMM operand, what the `megatron-lm` and
`eager` stacks get, is therefore an upper bound on the cast traffic. The `megatron-te` stack
(`Training.stack`, workload/stack.py) prices those fusions: `fused_casts`. Weights are cast once per iteration, not per
microbatch (TE's `is_first_microbatch` caches the FP8 weights over a step's microbatches): that
traffic is in the optimizer step (`weight_copy_bytes`).

Memory. TE keeps an FP8 copy of each weight and its transpose beside the BF16 weight and the FP32
master copy (Hopper's FP8 GEMMs take only the TN layout, so dgrad needs W^T in FP8; MXFP8 keeps a
row-wise and a column-wise copy): `weight_copy_bytes` per parameter, added to the optimizer-state
term of `solve.placement.types.state_split` (so the optimizer step streams it too: the cast writes
it once per step). Limits: it is charged on every parameter (the embedding and output layer have
none), and under ZeRO-1 it is sharded with the optimizer state, which understates it (each data-
parallel rank holds its own copy). The scale bytes of the copies are left out (at most 1/16 B).

Saved activations: TE saves the FP8 cast of each linear layer's input for the weight gradient
instead of the BF16 one, but it also keeps the BF16 tensors its norms and activations need, so
the traced saved bytes (BF16) are kept as they are: an upper bound on the activation memory.

Communication: BF16 throughout. Megatron-Core's tensor-parallel all-reduces and the data-
parallel gradient reductions carry BF16/FP32; FP8 all-gathers happen only with
`--fp8-param-gather` (FP8 primary weights, not modelled) or TE's FP8 userbuffers overlap, off by
default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .ops import NONE, TC, TCVC, VC, LayerGraph, Op, OpGraph

BF16 = "bf16"


@dataclass(frozen=True)
class NumberFormat:
    name: str
    operand_bytes: float  # per element, scales included (OCP MX spec v1.0: one 8-bit scale per block)
    weight_copy_bytes: int  # low-precision weight copies per parameter (module docstring)


# FP8 E4M3/E5M2 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"); MXFP8: blocks of 32
# with an E8M0 scale (OCP Microscaling Formats v1.0, 2023); NVFP4: E2M1 in blocks of 16 with an
# E4M3 scale (NVIDIA Blackwell architecture technical brief, 2024).
FORMATS = {
    "fp8": NumberFormat("fp8", 1.0, 2),
    "mxfp8": NumberFormat("mxfp8", 1.0 + 1.0 / 32, 2),
    "nvfp4": NumberFormat("nvfp4", 0.5 + 1.0 / 16, 1),
}
# Layer kinds whose GEMMs stay BF16 (module docstring: the embedding and Megatron-Core's output layer).
BF16_LAYER_KINDS = ("embedding", "head")
CAST_OPS = ("cast", "amax")
# Traced op kinds of linear layers: dense GEMMs and a MoE's grouped expert GEMMs (TE's GroupedLinear
# runs FP8 as its Linear does); "bgemm" (attention products) is left out on purpose.
LINEAR_GEMMS = ("gemm", "grouped_gemm")


def weight_copy_bytes(precision: str) -> int:
    """Bytes per parameter of the low-precision weight copies a recipe keeps (0 for BF16)."""
    return 0 if precision == BF16 else FORMATS[precision].weight_copy_bytes


def runs_low(op: Op, layer_kind: str) -> bool:
    """Whether TE runs this op in the recipe's low-precision format: a linear layer's GEMM."""
    return op.kind in LINEAR_GEMMS and op.unit in (TC, TCVC) and len(op.gemm) == 4 and layer_kind not in BF16_LAYER_KINDS


def precision_ops(op_graph: OpGraph, layer_kind: str, precision: str, bytes_per_element: float,
                  fused_casts: bool = False) -> OpGraph:
    """`op_graph` with its linear-layer GEMMs in `precision` and a cast op before each; with
    `fused_casts` (a stack whose kernels cast where they produce, workload/stack.py) the cast is
    folded into the vector op producing the operand, and GEMMs whose operand comes from the same
    ops share one cast (written once per layout it is read in)."""
    if precision == BF16:
        return op_graph
    fmt = FORMATS[precision]
    e = float(bytes_per_element)
    ops: list[Op] = []
    index: dict[int, int] = {}  # old op -> new op
    casts: dict[int, int] = {}  # old GEMM -> its cast
    shared: dict = {}  # fused_casts: what the operand comes from -> (new op that casts it, layouts written)
    preds: dict[int, list[int]] = {}
    for u, v in op_graph.edges:
        preds.setdefault(v, []).append(u)
    for i, op in enumerate(op_graph.ops):
        if runs_low(op, layer_kind):
            b, m, k, n = (float(x) for x in op.gemm)
            cast_elements = int(b * m * k)
            written = cast_elements * fmt.operand_bytes
            layout = (int(b), int(m), int(k))
            source = _operand_source(op_graph, preds.get(i, ()), cast_elements) if fused_casts else None
            if fused_casts and source in shared:
                at, layouts = shared[source]
                if layout not in layouts:  # another layout of the same operand (cast_transpose)
                    layouts.add(layout)
                    ops[at] = dataclasses.replace(ops[at], bytes_written=ops[at].bytes_written + written)
                if source[0] == "ops":  # a cast op of its own: this GEMM waits for it too
                    casts[i] = at
            elif fused_casts and source[0] == "op":
                at = index[source[1]]
                ops[at] = dataclasses.replace(ops[at], bytes_written=ops[at].bytes_written + written,
                                              vector_ops=tuple(ops[at].vector_ops) + CAST_OPS)
                shared[source] = (at, {layout})
            else:
                casts[i] = len(ops)
                if fused_casts:
                    shared[source] = (len(ops), {layout})
                ops.append(Op(name=f"{op.name}.cast_{precision}", kind="elementwise", unit=VC,
                              bytes_read=cast_elements * e, bytes_written=written,
                              elements=cast_elements, vector_ops=CAST_OPS, shape=layout))
            saved = b * (m * k + k * n) * (e - fmt.operand_bytes)
            op = dataclasses.replace(op, datatype=precision, bytes_read=max(0.0, op.bytes_read - saved))
        index[i] = len(ops)
        ops.append(op)
    edges = {(index[u], index[v]) for u, v in op_graph.edges if v not in casts}
    edges |= {(index[u], casts[v]) for u, v in op_graph.edges if v in casts}
    edges |= {(c, index[g]) for g, c in casts.items()}
    return dataclasses.replace(op_graph, ops=tuple(ops), edges=tuple(sorted(edges)))


def _operand_source(op_graph: OpGraph, preds, elements: int) -> tuple:
    """Where a GEMM's cast operand comes from, looking through views and layout no-ops: ("op", i)
    for the vector op producing it (the producing vector op with the most elements, at least the
    operand's), else ("ops", ...) the ops producing the GEMM's inputs, which GEMMs reading the same
    operand share."""
    producers, stack, seen = set(), list(preds), set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if op_graph.ops[u].unit == NONE:
            stack.extend(p for p, v in op_graph.edges if v == u)
        else:
            producers.add(u)
    vector = [u for u in producers if op_graph.ops[u].unit == VC and op_graph.ops[u].elements >= elements]
    if vector:
        return ("op", max(vector, key=lambda u: (op_graph.ops[u].elements, u)))
    return ("ops",) + tuple(sorted(producers))


def precision_graph(graph: LayerGraph, precision: str, fused_casts: bool = False) -> LayerGraph:
    """The layer graph trained in `precision` (see the module docstring; `fused_casts`:
    `precision_ops`); BF16: `graph` itself."""
    if precision == BF16:
        return graph
    op_graphs = {kind: {name: precision_ops(og, kind, precision, graph.bytes_per_element, fused_casts)
                        for name, og in passes.items()}
                 for kind, passes in graph.op_graphs.items()}
    return dataclasses.replace(graph, op_graphs=op_graphs)



