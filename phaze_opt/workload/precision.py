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
- softmax, norms, activations and the loss: element-wise, in BF16/FP32 whatever the GEMM format.
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

Scaling recipes (`Training.fp8_scaling`, `Training.fp8_weight_recast`). What the paragraph above
prices is delayed scaling: the scale comes from an amax history, so the cast is one pass that also
records the tensor's amax (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", Sec. 4.3; TE
`DelayedScaling`). Dynamic scaling needs the tensor's own amax before its first element can be
cast: a reduction over the whole tensor, then the cast (torchao `hp_tensor_to_float8_dynamic`:
`tensor_to_scale` then `hp_tensor_and_scale_to_float8`; TE `Float8CurrentScaling`: "the amax is
computed from the current tensor", an extra pass the delayed recipe avoids, TE user guide, "FP8
Current Scaling"). So under `tensorwise` a cast can no longer be folded into the vector op producing
its operand (the producer must finish, and be reduced over, first): it is a kernel of its own,
reading the operand at its 16-bit width. Its amax is an op of its own before it, one more read of
the operand (and a kernel), except where a stack's vector kernel produces the operand: Transformer
Engine's norm kernels then compute the amax as they write ("Compute norm and amax in high
precision, then quantize to FP8", `FUSED_NORM_AMAX_FP8`, transformer_engine/pytorch/csrc/extensions/
normalization.cpp), a fusion `fused_casts` stacks get for any producing vector op. A cast still
writes both layouts of a gradient from one read (one scale for the tensor). `rowwise` scales each row of
each operand along the GEMM's reduction axis (torchao `Float8LinearRecipeName.ROWWISE`, axiswise
scaling): the two layouts of a tensor need scales along different axes, so no cast is shared, each
operand has its own amax pass and cast. A forward GEMM multiplies each output element by its row's
and its column's scale in its epilogue (`torch._scaled_mm` with per-row scales, a CUTLASS kernel;
two multiplies per output element on the vector path beside the tensor cores, `TCVC` in
hardware/latency.py). The backward GEMMs accumulate in full FP32 (torchao's `gemm_config_grad_input`
and `gemm_config_grad_weight`, `use_fast_accum=False`), where the CUTLASS row-wise kernel is slow, so
torchao runs cuBLAS's per-tensor GEMM at unit scales and rescales its output in an element-wise op
of its own (`addmm_float8_unwrapped`: `output = output * post_inverse_scale`; pytorch/ao PR 1325,
"circumvent the issue with the slow CUTLASS kernel by using the cuBLAS kernel + manual scaling";
pytorch/pytorch issue 147971: row-wise `_scaled_mm` "substantially slower than tensor-wise"): one
read and one write of each backward GEMM's output.
Weights: TE casts them once per step (above); torchao's `Float8Linear` holds the 16-bit weight and
casts it on every call, for the forward GEMM and again for the data-gradient GEMM from the 16-bit
copy it saved (float8_linear.py `matmul_with_hp_or_float8_args`). With `fp8_weight_recast` each
microbatch's forward and backward pass cast the layer's weights (an amax pass first unless delayed):
one op per pass ahead of its first low-precision GEMM, on the layer's own parameters per device.

Memory. TE keeps the weights in BF16 (the model's parameters) and quantizes them before the GEMMs
into an FP8 workspace it caches (TE user guide, "Performance Considerations", "Memory usage":
"2 MB (weight) + 1 MB (weight in FP8) + 1 MB (input in FP8 saved for backward)" for a 1024 x 1024
BF16 layer); the FP32 master weights and Adam's moments are the optimizer's, as in BF16. Each
weight is used row-wise (forward) and column-wise (data gradient); on Hopper an FP8 column-wise
tensor must be physically transposed, so two copies (same page, "Handling transposes"); MXFP8 and
NVFP4 scale along rows and along columns, two copies again. `weight_copy_bytes` per parameter:
FP8 2, MXFP8 2, NVFP4 1 (the scale bytes, at most 1/8 B, left out). On Blackwell per-tensor FP8
reads both usages from one copy ("Blackwell supports columnwise access natively"): a chip whose
tensor cores read either major order (`Accelerator.tc_fp8_any_layout`, archs/b200.yaml) keeps
1 B of FP8 copies per parameter. The copies are per
rank, not optimizer state: Megatron-Core's distributed optimizer (ZeRO-1) shards only the
optimizer state, so every data-parallel rank holds its stage's copies whole (solve/placement/types.py
`weight_copies`); under ZeRO-3 they are made from the gathered layer and live in its working set.
They are charged on every parameter (the embedding and output layer have none). FP8 primary
weights (`--fp8-param-gather`, `Training.fp8_param_gather`) drop the BF16 weight: the FP8 weight is
the parameter and its row-wise copy (solve/placement/types.py `state_split`, `weight_copies`).

Saved activations: TE saves the FP8 (column-wise) cast of each linear layer's input for the weight
gradient instead of the BF16 input (same page: "By default, TE saves the columnwise quantized input
for the backward pass"; `save_original_input` is off by default). `precision_layer` applies it to
the traced saved bytes (trace.py `_Mapper._linear_inputs`): a linear input only weight gradients
read (the norm outputs, the MLP activation, a MoE's dispatched tokens) is kept at the format's
bytes per element instead of BF16's; one other backward ops read too (the attention output, which
the fused attention backward also reads) keeps its BF16 tensor and gains the format's copy. The
sequence-parallel parts shrink the same way. The embedding and output layer stay BF16.

Communication: BF16 throughout. Megatron-Core's tensor-parallel all-reduces and the data-
parallel gradient reductions carry BF16/FP32; FP8 all-gathers happen only with
`--fp8-param-gather` (FP8 primary weights, `Training.fp8_param_gather`: the weight all-gather moves
1-byte weights) or TE's FP8 userbuffers overlap, off by default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..training import Numerics
from .ops import NONE, TC, TCVC, VC, Layer, LayerGraph, Op, OpGraph

BF16 = "bf16"


@dataclass(frozen=True)
class NumberFormat:
    name: str
    operand_bytes: float  # per element, scales included (OCP MX spec v1.0: one 8-bit scale per block)
    weight_copy_bytes: int  # low-precision weight copies per parameter (module docstring)
    # Significand bits, the hidden bit included: what a multiplier's array grows with (its energy
    # ~ bits^2; hardware/energy.py). E4M3 4 (the wider of FP8's two encodings; E5M2 has 3), E2M1 2.
    significand_bits: int = 8


BF16_SIGNIFICAND_BITS = 8  # 7 stored + the hidden bit (bfloat16)


# FP8 E4M3/E5M2 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"); MXFP8: blocks of 32
# with an E8M0 scale (OCP Microscaling Formats v1.0, 2023); NVFP4: E2M1 in blocks of 16 with an
# E4M3 scale (NVIDIA Blackwell architecture technical brief, 2024).
FORMATS = {
    "fp8": NumberFormat("fp8", 1.0, 2, significand_bits=4),
    "mxfp8": NumberFormat("mxfp8", 1.0 + 1.0 / 32, 2, significand_bits=4),
    "nvfp4": NumberFormat("nvfp4", 0.5 + 1.0 / 16, 1, significand_bits=2),
}
# Layer kinds whose GEMMs stay BF16 (module docstring: the embedding and Megatron-Core's output layer).
BF16_LAYER_KINDS = ("embedding", "head")
CAST_OPS = ("cast", "amax")
AMAX_OPS = ("abs", "amax")  # dynamic scaling's reduction pass before a cast
# A rowwise-scaled GEMM's epilogue: each output element times its row's and its column's scale.
ROWWISE_EPILOGUE = ("mul", "mul")
DELAYED = "delayed"
# Traced op kinds of linear layers: dense GEMMs and a MoE's grouped expert GEMMs (TE's GroupedLinear
# runs FP8 as its Linear does); "bgemm" (attention products) is left out on purpose.
LINEAR_GEMMS = ("gemm", "grouped_gemm")


def operand_bytes(datatype: str, bytes_per_element: float) -> float:
    """Bytes per element of a GEMM operand in `datatype` ("" or "bf16": the graph's own width)."""
    return float(bytes_per_element) if datatype in ("", BF16) else FORMATS[datatype].operand_bytes


def significand_ratio(datatype: str) -> float:
    """(significand bits / BF16's)^2 of a GEMM operand format ("" or "bf16": 1): the share of a BF16
    multiplier's array a multiplier of this format needs (hardware/energy.py)."""
    if datatype in ("", BF16):
        return 1.0
    return (FORMATS[datatype].significand_bits / BF16_SIGNIFICAND_BITS) ** 2


def weight_copy_bytes(precision: str, transposed_copy: bool = True) -> int:
    """Bytes per parameter of the low-precision weight copies a recipe keeps (0 for BF16).
    `transposed_copy` False: the chip reads a per-tensor FP8 operand column-wise as it is
    (`Accelerator.tc_fp8_any_layout`), so FP8 keeps one copy; MXFP8 and NVFP4 keep two on any chip,
    their scales running along rows in one and along columns in the other."""
    if precision == BF16:
        return 0
    copies = FORMATS[precision].weight_copy_bytes
    return copies // 2 if precision == "fp8" and not transposed_copy else copies


def runs_low(op: Op, layer_kind: str) -> bool:
    """Whether TE runs this op in the recipe's low-precision format: a linear layer's GEMM."""
    return op.kind in LINEAR_GEMMS and op.unit in (TC, TCVC) and len(op.gemm) == 4 and layer_kind not in BF16_LAYER_KINDS


def precision_ops(op_graph: OpGraph, layer_kind: str, precision: str, bytes_per_element: float,
                  fused_casts: bool = False, scaling: str = DELAYED, backward: bool = False) -> OpGraph:
    """`op_graph` with its linear-layer GEMMs in `precision` and a cast op before each; with
    `fused_casts` (a stack whose kernels cast where they produce, workload/stack.py) the cast is
    folded into the vector op producing the operand, and GEMMs whose operand comes from the same
    ops share one cast (written once per layout it is read in). `scaling` other than delayed folds no
    cast into its producer and reduces each operand before its cast (in the producing vector op
    under `fused_casts` per tensor, else in an amax pass of its own); rowwise shares no cast across
    layouts and scales each forward GEMM's output in its epilogue, each `backward` GEMM's in an
    element-wise op after it (module docstring, "Scaling recipes")."""
    if precision == BF16:
        return op_graph
    fmt = FORMATS[precision]
    e = float(bytes_per_element)
    dynamic = scaling != DELAYED
    ops: list[Op] = []
    index: dict[int, int] = {}  # old op -> new op
    casts: dict[int, int] = {}  # old GEMM -> its cast
    firsts: dict[int, int] = {}  # old GEMM -> the first op of its cast (the amax pass, else the cast)
    outs: dict[int, int] = {}  # old op -> the new op its consumers read (a rowwise rescale, else itself)
    # fused_casts: what the operand comes from -> (new op that casts it, layouts written, its first op)
    shared: dict = {}
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
            # The producer cannot cast before its output's amax is known: a cast kernel follows it;
            # per tensor, the producer computes that amax as it writes (`amax_producer`).
            amax_producer = None
            if dynamic and source is not None and source[0] == "op":
                amax_producer = source[1] if scaling == "tensorwise" else None
                source = ("ops", source[1])
            if scaling == "rowwise" and source is not None:
                source = source + (layout,)  # each layout's scales run along its own axis: no sharing
            if fused_casts and source in shared:
                at, layouts, first = shared[source]
                if layout not in layouts:  # another layout of the same operand (cast_transpose)
                    layouts.add(layout)
                    ops[at] = dataclasses.replace(ops[at], bytes_written=ops[at].bytes_written + written)
                if source[0] == "ops":  # a cast op of its own: this GEMM waits for it too
                    casts[i], firsts[i] = at, first
            elif fused_casts and source[0] == "op":
                at = index[source[1]]
                ops[at] = dataclasses.replace(ops[at], bytes_written=ops[at].bytes_written + written,
                                              vector_ops=tuple(ops[at].vector_ops) + CAST_OPS)
                shared[source] = (at, {layout}, at)
            else:
                if amax_producer is not None:
                    at = index[amax_producer]
                    ops[at] = dataclasses.replace(ops[at], bytes_written=ops[at].bytes_written + 4.0,
                                                  vector_ops=tuple(ops[at].vector_ops) + ("amax",))
                elif dynamic:
                    firsts[i] = len(ops)
                    ops.append(_amax_op(f"{op.name}.amax_{precision}", cast_elements, e, layout))
                casts[i] = len(ops)
                firsts.setdefault(i, casts[i])
                if fused_casts:
                    shared[source] = (len(ops), {layout}, firsts[i])
                ops.append(Op(name=f"{op.name}.cast_{precision}", kind="elementwise", unit=VC,
                              bytes_read=cast_elements * e, bytes_written=written,
                              elements=cast_elements, vector_ops=CAST_OPS, shape=layout))
            saved = b * (m * k + k * n) * (e - fmt.operand_bytes)
            op = dataclasses.replace(op, datatype=precision, bytes_read=max(0.0, op.bytes_read - saved))
            if scaling == "rowwise" and not backward:
                op = dataclasses.replace(op, unit=TCVC, elements=op.elements or int(b * m * n),
                                         vector_ops=tuple(op.vector_ops) + ROWWISE_EPILOGUE)
        index[i] = len(ops)
        ops.append(op)
        if scaling == "rowwise" and backward and op.datatype == precision:
            outs[i] = len(ops)
            out_elements = int(b * m * n)
            ops.append(Op(name=f"{op.name}.rescale", kind="elementwise", unit=VC, bytes_read=out_elements * e,
                          bytes_written=out_elements * e, elements=out_elements, vector_ops=ROWWISE_EPILOGUE,
                          shape=(int(b), int(m), int(n))))
    edges = {(outs.get(u, index[u]), index[v]) for u, v in op_graph.edges if v not in casts}
    # A GEMM sharing a cast made earlier may read it through ops placed after that cast (views of
    # the operand): those feed the GEMM itself, so every edge runs forward.
    edges |= {(outs.get(u, index[u]), firsts[v] if outs.get(u, index[u]) < firsts[v] else index[v])
              for u, v in op_graph.edges if v in casts}
    edges |= {(index[g], r) for g, r in outs.items()}
    edges |= {(c, index[g]) for g, c in casts.items()}
    edges |= {(firsts[g], c) for g, c in casts.items() if firsts[g] != c}
    return dataclasses.replace(op_graph, ops=tuple(ops), edges=tuple(sorted(edges)))


def _amax_op(name: str, elements: int, bytes_per_element: float, shape) -> Op:
    """Dynamic scaling's reduction: one read of the tensor at its 16-bit width, a scalar (or a
    vector of row scales) written."""
    return Op(name=name, kind="reduction", unit=VC, bytes_read=elements * bytes_per_element,
              bytes_written=4.0, elements=elements, vector_ops=AMAX_OPS, shape=shape)


def weight_recast_ops(op_graph: OpGraph, weight_elements: int, precision: str, bytes_per_element: float,
                      scaling: str = DELAYED) -> OpGraph:
    """`op_graph` (a low-precision pass) with the layer's weights cast ahead of its first
    low-precision GEMM (`Training.fp8_weight_recast`; an amax pass first unless delayed)."""
    gemms = [i for i, op in enumerate(op_graph.ops) if op.datatype == precision]
    if not gemms or weight_elements <= 0:
        return op_graph
    e = float(bytes_per_element)
    name = f"weights.cast_{precision}"
    new = [] if scaling == DELAYED else [_amax_op(f"weights.amax_{precision}", weight_elements, e, (weight_elements,))]
    new.append(Op(name=name, kind="elementwise", unit=VC, bytes_read=weight_elements * e,
                  bytes_written=weight_elements * FORMATS[precision].operand_bytes, elements=weight_elements,
                  vector_ops=CAST_OPS, shape=(weight_elements,)))
    shift = len(new)
    edges = {(u + shift, v + shift) for u, v in op_graph.edges}
    edges |= {(j, j + 1) for j in range(shift - 1)}
    edges.add((shift - 1, gemms[0] + shift))
    return dataclasses.replace(op_graph, ops=tuple(new) + tuple(op_graph.ops), edges=tuple(sorted(edges)))


def precision_layer(layer: Layer, precision: str, bytes_per_element: float) -> Layer:
    """`layer` with the saved inputs of its linear GEMMs as TE keeps them in `precision` (module
    docstring, "Saved activations"): those only weight gradients read at the format's width, an
    extra copy in the format of those other backward ops read too."""
    if precision == BF16 or layer.kind in BF16_LAYER_KINDS:
        return layer
    f = FORMATS[precision].operand_bytes / float(bytes_per_element)  # format bytes per BF16 byte

    def low(total, only, shared):
        return total - only * (1.0 - f) + shared * f

    return dataclasses.replace(
        layer,
        activation_bytes=low(layer.activation_bytes, layer.linear_input_bytes, layer.linear_shared_bytes),
        sequence_parallel_bytes=low(layer.sequence_parallel_bytes, layer.linear_input_sp_bytes,
                                    layer.linear_shared_sp_bytes))


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


def precision_graph(graph: LayerGraph, numerics: Numerics | str, fused_casts: bool = False) -> LayerGraph:
    """The layer graph trained with `numerics` (a precision's name: its defaults; see the module
    docstring; `fused_casts`: `precision_ops`); BF16: `graph` itself."""
    if isinstance(numerics, str):
        numerics = Numerics(precision=numerics)
    precision = numerics.precision
    if precision == BF16:
        return graph
    weights = {layer.kind: layer.params for layer in graph.layers}
    op_graphs = {}
    for kind, passes in graph.op_graphs.items():
        op_graphs[kind] = {}
        for name, og in passes.items():
            og = precision_ops(og, kind, precision, graph.bytes_per_element, fused_casts, numerics.fp8_scaling,
                               backward=name == "bwd")
            if numerics.fp8_weight_recast:
                og = weight_recast_ops(og, weights.get(kind, 0), precision, graph.bytes_per_element,
                                       numerics.fp8_scaling)
            op_graphs[kind][name] = og
    layers = tuple(precision_layer(layer, precision, graph.bytes_per_element) for layer in graph.layers)
    return dataclasses.replace(graph, op_graphs=op_graphs, layers=layers)
