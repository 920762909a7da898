"""The software stack's kernel fusion: how many kernels a layer launches and the bytes they move.

    recipe_graph(model, tp, training) -> LayerGraph   (the layer graph as `training` runs it)

The same block costs different element-wise work under different stacks, and the per-kernel
efficiencies of a calibrated arch (`hardware/efficiency.py`: the achieved HBM fraction, the fixed
cost per kernel) are properties of the kernels, not of how many there are. So the stack is a recipe
field (`Training.stack`) that picks the kernels, and the efficiencies stay one set per arch:

- `eager`: one kernel per PyTorch operator (`trace.py` with `fuse=False`): what the `layers-h100`
  truth ran (eager PyTorch 2.11 autograd, `presets/validation/truth/measure_blocks.py`), on which
  h100-sxm's HBM fraction and per-kernel cost were fitted.
- `megatron-lm` (the default, every earlier number unchanged): chains of pointwise operators fused
  into one kernel (`fuse=True`), each reading what enters the chain and writing what leaves it. This
  is what Megatron-LM of 2021-22 ran: "we fused some elementwise operations: bias + GeLU, bias +
  dropout + add, and scale + mask + softmax" (Narayanan et al., SC'21, Sec. 4.2, "Computation
  optimizations"; the same code base ran Korthikanti et al. 2022). Norms are separate kernels
  (reduction, then the scaling chain), RoPE's rotated halves a concatenation of their own, and
  each FP8 GEMM operand has a cast kernel of its own (`precision.py`).
- `megatron-te`: Megatron-Core with Transformer Engine (TE), what NeMo and Megatron-Bridge ran in
  2024-26. Besides the pointwise chains (Megatron-Core `fusions`: fused_bias_dropout,
  fused_bias_gelu, fused_bias_swiglu; docs.nvidia.com/megatron-core/developer-guide, "fusions
  package"): each LayerNorm / RMSNorm is one kernel (its statistics and scaling in one pass: TE
  `LayerNorm`, `RMSNorm`, `LayerNormLinear`), RoPE is one kernel (Megatron-Core
  `--apply-rope-fusion`, TE's fused rotary embedding; Megatron-Bridge enables it where
  `can_enable_apply_rope_fusion`), and an activation's backward is one kernel with its bias
  gradient (TE's dbias + dact kernels), all by the trace's `ROW_FUSION`. In FP8 the cast of a GEMM
  operand is done by the kernel that produces it: TE's `LayerNormLinear` and `LayerNormMLP` write
  the norm's (and the activation's) output directly in FP8 ("Fused TE Modules", TE user guide,
  Getting Started), and a gradient is cast once for both of its GEMMs, in both layouts
  (`cast_transpose`; Hopper's FP8 GEMMs take only the TN layout); `precision.precision_graph` with
  `fused_casts`. An operand no vector kernel produces (an attention output, a GEMM's gradient) keeps
  a cast kernel, shared by the GEMMs that read it. A MoE's grouped GEMM is one kernel per local
  expert (`per_group_kernels`): Megatron-Core's `--moe-grouped-gemm` runs TE's `GroupedLinear`
  (TEGroupedMLP), which issues one cuBLASLt GEMM per expert over a few CUDA streams rather than one
  grouped kernel (NVIDIA/TransformerEngine PR #853, "Grouped GEMM via multi-stream cuBLAS";
  NVIDIA/TransformerEngine issue #1386, a maintainer: multi-stream cuBLASLt beat cuBLAS's
  grouped-batched GEMM and CUTLASS on the MoE shapes they tried; NVIDIA/TransformerEngine issue #1499:
  per-GEMM host work, `torch.split` and two `torch.empty` per GEMM), so each expert's GEMM pays the arch's fixed cost per kernel. The other stacks run the
  traced batched GEMM: one kernel (`torch.bmm`, as the layer truth measured it).
- `torch-compile`: a PyTorch-native trainer compiling its blocks with `torch.compile` (TorchInductor;
  torchtitan's `compile.enable`, per transformer block). Inductor generates Triton kernels for
  everything but the matrix multiplies and the attention kernel: its scheduler fuses pointwise ops
  with the reductions they feed or follow (a norm's statistics and scaling, softmax, a bias
  gradient) and across consumers, so a value read by several fused ops is computed once (Ansel et
  al., "PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode Transformation and Graph
  Compilation", ASPLOS 2024, Sec. 5.3; the trace's `INDUCTOR_FUSION`). Beyond `megatron-te` it
  therefore fuses a residual add into the norm that reads it, RoPE with what surrounds it, and
  softmax with its scale and mask; unlike it, one kernel runs one loop nest, so tensors of other
  sizes share one only as the pointwise parts of a concatenation (GQA's Q and K norms and RoPE run
  apart; the trace's `_INDUCTOR_FUSABLE` comment cites Inductor's rule), and a norm is never fused
  into the GEMM it feeds (GEMMs
  stay cuBLAS calls unless `max-autotune` picks a Triton template), and FlashAttention runs only
  where the model calls SDPA (the recipe's `attention`; Inductor does not rewrite an unfused
  attention in training here). In FP8 the casts fuse into the kernels that produce their operands
  (torchao's float8 training: "torch.compile ... is required to get good performance", the scale
  and cast fused with the producer; pytorch/ao, torchao/float8/README.md), as under `megatron-te`.
  MoE gate weights on the combine, as torchtitan's MoE applies them by default.

Every fusion only merges kernels (a merged kernel reads what enters it and writes what leaves it),
so a stack never moves more bytes than `eager` (tested for every preset model).
"""

from __future__ import annotations

from ..training import Training
from .graphs import build_layer_graph, sequence_parallel_graph
from .kinds import LAYERNORM_LINEAR
from .models import ModelConfig
from .ops import INDUCTOR_FUSION, ROW_FUSION, LayerGraph
from .precision import precision_graph

# The trace's fusion level of each stack (`graphs.build_layer_graph`'s `fuse`).
TRACE_FUSION = {"eager": False, "megatron-lm": True, "megatron-te": ROW_FUSION, "torch-compile": INDUCTOR_FUSION}
# Where each stack's MoE layers apply the router's gate weights unless the recipe says
# (`Training.expert_weights`): Megatron-Core moved them from the combine into the expert MLP's
# activation in 0.13 (2025-07, commit 2659630721 "Memory efficient token permutation"), which the
# `megatron-te` stack stands for (NeMo 25.09 and later). Not a fusion: it changes which tensors a
# layer keeps, so it is a graph key of its own.
STACK_EXPERT_WEIGHTS = {"eager": "combine", "megatron-lm": "combine", "megatron-te": "activation",
                        "torch-compile": "combine"}


def expert_weights(training: Training) -> str:
    """Where the recipe's MoE layers apply their gate weights (training.EXPERT_WEIGHTS)."""
    return training.expert_weights or STACK_EXPERT_WEIGHTS[training.stack]


# Stacks that issue a grouped GEMM as one kernel per group (the module docstring).
PER_GROUP_KERNELS = ("megatron-te",)


# Stacks whose kernels cast a GEMM operand to FP8 where it is produced.
FUSED_CASTS = ("megatron-te", "torch-compile")


# Stacks whose layer specs fuse a norm read only by a column-parallel linear into that linear
# (Megatron-Core's TE spec: TELayerNormColumnParallelLinear, the norm slot IdentityOp), where
# `layernorm` recompute does not act (kinds.LAYERNORM_LINEAR).
NORM_LINEAR_FUSION = ("megatron-te",)


def recompute_tags(training: Training) -> frozenset:
    """The `recompute_module` names (layers.py) whose saved tensors the recipe's module-level
    recompute drops, besides the attention core (`Training.recomputed_modules`): each module by
    its own name, `layernorm` also the norms fused into a linear on a stack that does not fuse them."""
    modules = set(training.recomputed_modules) - {"core_attn"}
    if "layernorm" in modules and training.stack not in NORM_LINEAR_FUSION:
        modules.add(LAYERNORM_LINEAR)
    return frozenset(modules)


def recipe_graph(model: ModelConfig | str, tp: int, training: Training, sequence_parallel: bool = False) -> LayerGraph:
    """The layer graph at TP width `tp` as `training` runs it: its microbatch, attention kernel,
    stack's fusion and GEMM number format (`precision.py`); with `sequence_parallel` (the recipe's,
    where the caller prices its collectives) the SP collectives in place of the all-reduces."""
    graph = build_layer_graph(model, tp, training.mbs, attention=training.attention,
                              fuse=TRACE_FUSION[training.stack], expert_weights=expert_weights(training),
                              per_group_kernels=training.stack in PER_GROUP_KERNELS)
    if sequence_parallel:
        graph = sequence_parallel_graph(graph)
    return precision_graph(graph, training.numerics, fused_casts=training.stack in FUSED_CASTS)
