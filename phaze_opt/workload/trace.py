"""Tracing one layer's forward and backward passes into operator graphs.

The layer is run once on meta tensors inside `make_fx` (torch.fx) by a function that calls the module
and then `torch.autograd.grad`, so the traced graph holds the forward ops followed by exactly the
ops the autograd engine runs for the backward pass: every GEMM's data-gradient and weight-gradient
GEMMs, each activation's derivative, the gradient accumulations, and Megatron's all-reduces. Nothing
about the backward is assumed; it is what PyTorch's derivative formulas produce.

The traced aten graph is then mapped onto `Op`s:

- GEMMs (mm, addmm, bmm, baddbmm) run on tensor cores with `gemm=(batch, M, K, N)`, 2 FLOP per MAC;
- elementwise, normalisation, softmax, dropout, reductions, embedding look-ups and the loss run on
  vector cores with `elements` and `vector_ops` (kinds the hardware model keeps a cost per element for);
- `phaze::allreduce` becomes a collective (unit NET) whose payload is the tensor it reduces;
- views, transposes and layout copies are zero-cost no-ops (unit NONE); ops on constants only
  (masks, rotary tables, zero-filled buffers) are folded away.

Chains of pointwise vector ops are fused (one pass over memory, as fused kernels do); a fused op
lists the traced nodes it contains, reads only what enters the chain and writes only what leaves it
(including tensors the backward pass keeps). Chains of no-ops are merged the same way.

The bytes of activations a layer keeps for its backward pass are read off the same trace: every
forward value (or layer input) that a backward op consumes, counted once per underlying storage
(views of one tensor share it), excluding parameters and constants, and excluding what Megatron's
fused kernels rebuild in backward instead of keeping (`_Mapper._rebuilt_in_backward`: the interior
of a pointwise chain, e.g. RMSNorm's x / rms before its scale and SwiGLU's silu(gate); listed in
`LayerTrace.rebuilt`). For a Llama block this is Megatron's own count (fused RMSNorm, SwiGLU, RoPE,
GQA, no dropout); for Megatron's GPT block nothing is rebuilt (Table 2 below).

Activation memory by recompute mode and sequence parallelism. Each saved tensor gets a region from
the op that produced it and where that op sits in the graph (never from its size):

- `attention_core`: between an activation x activation batched GEMM (Q K^T) and the next one (P V):
  the scores' softmax, the probabilities' dropout mask and output, the a s^2 terms;
- `tensor_parallel`: the rest of Megatron's tensor-parallel region, from the output of a GEMM whose
  weight is column-parallel to the row-parallel GEMM that closes it (modules say which through a
  `parallel` attribute; layers.py): Q, K, V, the attention context, the MLP's inner activations;
- `sequence_parallel`: outside that region: the layer input, the norms' inputs, outputs and
  statistics (which are the column-parallel GEMMs' inputs), the residual dropouts' masks;
- `replicated`: tensors of integer inputs only (token ids, labels, masks made from them).

From these, for the placement (`ops.Layer.activation_bytes_for(recompute, sequence_parallel)`,
`Layer.checkpoint_bytes(sequence_parallel)`, `Layer.recompute_working_bytes`), following Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023 (arXiv 2205.05198):

- `none`: all saved tensors (`activation_bytes`, unchanged); `selective` (Sec. 5): all but the
  attention core, which is recomputed from the kept Q, K, V; `full`: only the layer's inputs (the
  checkpoint), the `none` set existing again only during the layer's own backward;
- sequence parallelism (Sec. 4.2.2) splits the `sequence_parallel` tensors and the checkpoint's
  floating inputs over the TP group (each device keeps s/t of the sequence; the gathered input of a
  column-parallel GEMM is gathered again in backward, not kept); integer tensors stay whole.

For Megatron's GPT block (GELU MLP of 4h, LayerNorm, dropout on the probabilities and after both
row-parallel GEMMs, 1-byte masks, 16-bit values) this reproduces Table 2 term by term:
s b h (10 + 24/t + 5 a s / (h t)) with TP, s b h / t (34 + 5 a s / h) with SP, s b h (10 + 24/t) and
34 s b h / t with selective recompute, 2 s b h (/ t) for the full-recompute checkpoint. The one
addition is each LayerNorm's float32 mean and 1/std (16 s b bytes per layer, split by SP), which
the paper leaves out; the softmax output is kept in 16 bits and the masks are bools, as it assumes.

Module-level recompute (`Training.recompute_modules`, Megatron-Core's `--recompute-modules`): a
module of the layer with a `recompute_module` name (layers.py) is followed while it runs its
forward inside the trace (a forward pre-hook and hook on it note the nodes traced in between), so
every forward value and op is tagged with the names of the modules whose forward produced it
(`LayerTrace.saved_modules`, `forward_modules`). A recompute of module m drops the saved tensors
tagged m (an output-discarding one the module's outputs and statistics, a standard checkpoint
everything inside the module; the module's input was made outside it and stays) and reruns the
forward ops tagged m (`ops.Layer.module_bytes`, `design.evaluate.layer_costs`).

Op-level selective checkpointing (`Training.recompute_ops`): PyTorch's selective activation
checkpointing with torchtitan's policy (torchtitan `_save_list` and `_custom_policy`, used through
`torch.utils.checkpoint.create_selective_checkpoint_contexts`): inside a checkpointed block the
outputs of `aten.mm` are kept but every second one (the policy counts the block's matmuls and
recomputes the even-numbered ones), the attention kernel's outputs are kept (SDPA's flash and
efficient kernels are on the list; here `phaze::flash_attention`), so are the TP collectives'
(torchtitan runs TP with sequence parallelism, whose `reduce_scatter_tensor` is on the list), and
every other forward op is rerun before the block's backward. The checkpoint caches a kept op's
output whether or not autograd would have saved it (`_CachingTorchDispatchMode` stores every
MUST_SAVE output), so a block keeps its inputs plus those outputs (`LayerTrace.op_policy_bytes`,
of which the collectives' `op_policy_sp_bytes` shard under SP) and reruns the forward ops that
made none of them (`op_policy_rerun`). A linear with a bias is an `addmm`, not on the list.

Fused attention (`ModelConfig.attention = "flash"`; layers.flash_attention): the FlashAttention
kernels (Dao et al., NeurIPS 2022; Dao, FlashAttention-2, 2023) trace as one node per pass and map
to one "tc+vc" op each (`_flash_cost`). FLOPs count the whole s x s square even for causal models
(the kernels skip the tiles above the diagonal, about half the work): the unfused graph and
Megatron's FLOP formula (Narayanan et al. 2021) count the square too, so both graphs carry the same
model FLOPs per sequence, and the tensor-core model has no triangular GEMM to cost the skipped
tiles with. Causal flash latencies are hence conservative by up to the attention core's share.
"""

from __future__ import annotations

import operator
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils._pytree import tree_flatten

from . import collectives  # noqa: F401  (registers phaze::allreduce)
from .ops import FLASH_ATTENTION, INDUCTOR_FUSION, NET, NONE, ROW_FUSION, TC, TCVC, VC, Op, OpGraph

# Regions of the saved tensors (see the module docstring).
ATTENTION_CORE = "attention_core"
TENSOR_PARALLEL = "tensor_parallel"
SEQUENCE_PARALLEL = "sequence_parallel"
REPLICATED = "replicated"
REGIONS = (ATTENTION_CORE, TENSOR_PARALLEL, SEQUENCE_PARALLEL, REPLICATED)


@torch.library.custom_op("phaze::pass_boundary", mutates_args=())
def _pass_boundary(x: torch.Tensor) -> torch.Tensor:
    """A marker traced between the forward and the backward pass; never costed."""
    return x.clone()


@_pass_boundary.register_fake
def _pass_boundary_fake(x):
    return torch.empty_like(x)


# Approximate operations per element of each vector-op kind (our assumption, used for FLOP counts only;
# the hardware model keeps its own cycles-per-element table keyed by the same names).
VECTOR_OP_FLOPS = {
    "add": 1, "sub": 1, "mul": 1, "div": 1, "neg": 1, "where": 1, "masked_fill": 1, "compare": 1,
    "exp": 1, "log": 1, "rsqrt": 1, "sqrt": 1, "pow": 1, "tanh": 1, "sigmoid": 1, "cast": 1,
    "gelu": 8, "gelu_bwd": 12, "relu": 1, "relu_bwd": 1, "silu": 4, "silu_bwd": 6,
    "dropout": 2, "dropout_bwd": 2, "layernorm": 8, "layernorm_bwd": 16,
    "softmax": 5, "softmax_bwd": 4, "log_softmax": 5, "log_softmax_bwd": 4,
    "sum": 1, "mean": 1, "amax": 1, "embedding": 0, "embedding_bwd": 1, "gather": 0, "scatter": 1,
    "nll_loss": 1, "nll_loss_bwd": 1, "copy": 0, "topk": 1, "sort": 1,
}

# aten op name -> (op kind, vector-op kind). Anything pointwise is fusable.
_VECTOR = {
    "add": ("elementwise", "add"), "add_": ("elementwise", "add"), "sub": ("elementwise", "sub"),
    "rsub": ("elementwise", "sub"), "mul": ("elementwise", "mul"), "mul_": ("elementwise", "mul"),
    "div": ("elementwise", "div"), "div_": ("elementwise", "div"), "neg": ("elementwise", "neg"),
    "where": ("elementwise", "where"), "masked_fill": ("elementwise", "masked_fill"),
    "masked_fill_": ("elementwise", "masked_fill"), "exp": ("elementwise", "exp"), "log": ("elementwise", "log"),
    "rsqrt": ("elementwise", "rsqrt"), "sqrt": ("elementwise", "sqrt"), "pow": ("elementwise", "pow"),
    "tanh": ("activation", "tanh"), "sigmoid": ("activation", "sigmoid"), "_to_copy": ("elementwise", "cast"),
    "eq": ("elementwise", "compare"), "ne": ("elementwise", "compare"), "lt": ("elementwise", "compare"),
    "le": ("elementwise", "compare"), "gt": ("elementwise", "compare"), "ge": ("elementwise", "compare"),
    "logical_or": ("elementwise", "compare"), "logical_and": ("elementwise", "compare"),
    "bitwise_or": ("elementwise", "compare"), "bitwise_and": ("elementwise", "compare"),
    "logical_not": ("elementwise", "compare"), "bitwise_not": ("elementwise", "compare"),
    "gelu": ("activation", "gelu"), "gelu_backward": ("activation", "gelu_bwd"),
    "relu": ("activation", "relu"), "threshold_backward": ("activation", "relu_bwd"),
    "silu": ("activation", "silu"), "silu_backward": ("activation", "silu_bwd"),
    "tanh_backward": ("activation", "tanh"), "sigmoid_backward": ("activation", "sigmoid"),
    "native_dropout": ("dropout", "dropout"), "native_dropout_backward": ("dropout", "dropout_bwd"),
}
_POINTWISE = frozenset(_VECTOR)
# `fuse=ROW_FUSION` (a stack with Transformer Engine's kernels, workload/stack.py): a chain may also
# take in a row reduction (a norm's mean of squares, a bias gradient's sum), a LayerNorm and the
# concatenation of RoPE's rotated halves, whatever their element counts (a per-row statistic is
# broadcast back over its row inside one kernel): TE's fused LayerNorm/RMSNorm and RoPE kernels, and
# its activation-backward + bias-gradient kernels.
_ROW_FUSABLE = _POINTWISE | {"mean", "sum", "cat", "slice_backward", "native_layer_norm", "native_layer_norm_backward"}
# `fuse=INDUCTOR_FUSION` (torch.compile, workload/stack.py): TorchInductor's scheduler fuses any two
# pointwise or reduction nodes joined by a data edge whose iteration spaces are compatible (a
# reduction with the pointwise ops before and after it), not only a single-consumer chain: a value
# read by several fused consumers is computed once in their kernel and written only where something
# outside reads it, and a fusion that would close a cycle through another kernel is refused (Ansel
# et al., "PyTorch 2", ASPLOS 2024, Sec. 5.3, "vertical and horizontal fusion";
# torch/_inductor/scheduler.py `can_fuse`, `will_fusion_create_cycle`). Softmax is decomposed into
# its reductions and pointwise ops there, so it fuses too. Matrix multiplies stay library calls
# (cuBLAS; Triton GEMM templates only with `max-autotune`), never fused with their neighbours.
# Compatible iteration spaces (`_Mapper._iteration_fits`): one kernel runs one loop nest of numel x
# rnumel points, so its nodes iterate over the same number of points, or over the reduced size of a
# reduction in it (a norm's rsqrt on its per-row statistic): torch/_inductor/codegen/simd.py
# `SIMDScheduling.can_fuse` requires equal (numel, rnumel) groups, or a pointwise numel equal to
# numel x rnumel. Two reductions over one tensor in different orders (a norm backward's dx over the
# hidden size and dw over the tokens) fuse by Inductor's mix-order reduction (pytorch/pytorch
# PR 165370, "[inductor] generate fused rms/layer norm bwd", 2025-10; on by default outside fbcode in
# torch/_inductor/config.py `triton.mix_order_reduction`): both iterate over the tensor's points.
# Otherwise tensors of different sizes share a kernel only as the pointwise parts of one
# concatenation (`_Mapper._iteration_fits`): under GQA, Q's and K's RoPE forward and their norms
# (PR 168209 also keeps two norms' backward passes apart) run in kernels of their own.
_INDUCTOR_FUSABLE = _ROW_FUSABLE | {"_softmax", "_safe_softmax", "_softmax_backward_data", "_log_softmax",
                                    "_log_softmax_backward_data", "amax", "max"}
_OTHER_VECTOR = {
    "native_layer_norm": ("norm", "layernorm"), "native_layer_norm_backward": ("norm", "layernorm_bwd"),
    "_softmax": ("softmax", "softmax"), "_safe_softmax": ("softmax", "softmax"),
    "_softmax_backward_data": ("softmax", "softmax_bwd"), "_log_softmax": ("softmax", "log_softmax"),
    "_log_softmax_backward_data": ("softmax", "log_softmax_bwd"),
    "sum": ("reduction", "sum"), "mean": ("reduction", "mean"), "amax": ("reduction", "amax"),
    "max": ("reduction", "amax"),
    "embedding": ("embedding", "embedding"), "embedding_dense_backward": ("embedding", "embedding_bwd"),
    "gather": ("gather", "gather"), "scatter": ("gather", "scatter"), "scatter_add": ("gather", "scatter"),
    "scatter_": ("gather", "scatter"), "scatter_add_": ("gather", "scatter"),
    "nll_loss_forward": ("loss", "nll_loss"), "nll_loss_backward": ("loss", "nll_loss_bwd"),
    "cat": ("elementwise", "copy"), "stack": ("elementwise", "copy"), "slice_backward": ("elementwise", "copy"),
    "select_backward": ("elementwise", "copy"), "slice_scatter": ("elementwise", "copy"),
    "select_scatter": ("elementwise", "copy"), "constant_pad_nd": ("elementwise", "copy"),
    "index_select": ("gather", "gather"), "index_add": ("gather", "scatter"), "index_add_": ("gather", "scatter"),
    # A MoE router's top-k over the experts and the sort of the routed slots by expert: one pass each
    # over their input (our assumption: E <= 64 logits per token, k <= 8, kept in registers).
    "topk": ("reduction", "topk"), "sort": ("reduction", "sort"), "repeat": ("elementwise", "copy"), "copy": ("elementwise", "copy"),
    "copy_": ("elementwise", "copy"),
}
_GEMMS = {"mm": "gemm", "addmm": "gemm", "bmm": "bgemm", "baddbmm": "bgemm"}
# Ops whose output is (a view of) an input: no work, and the same storage when saved for backward.
_ALIASES = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach", "as_strided",
    "narrow", "diagonal", "view_as", "unfold", "_reshape_alias",
})
# Layout copies: real copies, but folded into addressing like transposes (zero cost, own storage).
_LAYOUT_COPIES = frozenset({"clone", "contiguous", "lift_fresh_copy", "_unsafe_index"})
# Ops that only read their arguments' shapes: their results are constants.
_FACTORIES = frozenset({
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "arange", "scalar_tensor", "new_zeros", "new_ones", "new_empty", "new_full",
    "new_empty_strided", "rand", "rand_like", "randn", "randn_like", "eye", "linspace", "tensor",
})


@dataclass(frozen=True)
class LayerTrace:
    """One layer traced at one shape: its op graphs and the memory facts the placement needs.

    `activation_bytes` is what the backward pass keeps alive per microbatch (no recompute);
    `saved` lists those tensors as (traced name, shape, dtype, bytes). `input_grad_ops` and
    `param_grad_ops` index the backward ops producing the input and parameter gradients.
    """

    fwd: OpGraph
    bwd: OpGraph
    params: int
    param_bytes: int
    activation_bytes: int
    input_bytes: int  # every tensor the layer receives: activations, token ids, labels
    output_bytes: int
    saved: tuple[tuple[str, tuple[int, ...], str, int], ...]
    input_grad_ops: tuple[int, ...]
    param_grad_ops: tuple[int, ...]
    unmapped_ops: tuple[str, ...] = ()  # aten ops without a rule, costed as generic vector ops
    trace_s: float = 0.0
    # The region of each `saved` tensor (one of REGIONS) and the bytes by region; see the module docstring.
    saved_regions: tuple[str, ...] = ()
    attention_core_bytes: int = 0
    sequence_parallel_bytes: int = 0
    input_sequence_parallel_bytes: int = 0  # the floating inputs: what SP shards of a full-recompute checkpoint
    # What eager autograd saves beyond `saved`: values a fused kernel rebuilds in backward
    # (`_Mapper._rebuilt_in_backward`), same form as `saved`; not in `activation_bytes`.
    rebuilt: tuple[tuple[str, tuple[int, ...], str, int], ...] = ()
    # Of `activation_bytes`: the saved inputs of linear GEMMs (a weight operand) that only their weight
    # gradients read in the backward, and those other backward ops read too (`_Mapper._linear_inputs`);
    # each with its sequence-parallel part. A low-precision recipe keeps the first in its format
    # instead and adds a copy of the second (workload/precision.py).
    linear_input_bytes: int = 0
    linear_input_sp_bytes: int = 0
    linear_shared_bytes: int = 0
    linear_shared_sp_bytes: int = 0
    # Module-level recompute (module docstring): per `saved` tensor the recompute modules whose
    # forward produced it ("a,b", "" for none), and the forward ops made inside such modules, as
    # (op name, "a,b").
    saved_modules: tuple[str, ...] = ()
    forward_modules: tuple[tuple[str, str], ...] = ()
    # Op-level selective checkpointing (module docstring): the kept ops' output bytes (beyond the
    # layer's inputs), of which sequence-parallel, and the forward ops (by name) rerun.
    op_policy_bytes: int = 0
    op_policy_sp_bytes: int = 0
    op_policy_rerun: tuple[str, ...] = ()


class _ModuleScopes:
    """The traced forward nodes of each module with a `recompute_module` name (layers.py): hooks
    note the graph's length when the module's forward starts and tag what it added by its end."""

    def __init__(self, module: nn.Module):
        self.tags: dict[str, set] = defaultdict(set)
        self.open: list = []
        self.handles = []
        for sub in module.modules():
            tag = getattr(sub, "recompute_module", None)
            if tag:
                self.handles.append(sub.register_forward_pre_hook(self._enter))
                self.handles.append(sub.register_forward_hook(lambda m, args, out, tag=tag: self._leave(tag)))

    def _enter(self, module, args):
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        self.open.append((graph, len(graph.nodes) if graph is not None else 0))

    def _leave(self, tag: str):
        graph, start = self.open.pop()
        if graph is not None:
            for node in list(graph.nodes)[start:]:
                self.tags[node.name].add(tag)

    def of(self, name: str) -> str:
        return ",".join(sorted(self.tags.get(name, ())))

    def close(self):
        for h in self.handles:
            h.remove()


def trace_layer(module: nn.Module, example_inputs, *, name: str = "layer", fuse: bool | str = True) -> tuple[OpGraph, OpGraph]:
    """Trace a user's own `nn.Module` layer: (forward OpGraph, backward OpGraph) for one device."""
    result = trace_layer_details(module, example_inputs, name=name, fuse=fuse)
    return result.fwd, result.bwd


def trace_layer_details(module: nn.Module, example_inputs, *, name: str = "layer", fuse: bool | str = True) -> LayerTrace:
    """Trace `module(*example_inputs)` and its backward on meta tensors; see the module docstring.

    The module is not changed: its parameters are replaced by meta tensors of the same shape and
    dtype for the trace (`torch.func.functional_call`), and the inputs are copied to meta. Floating
    inputs and parameters that require grad get gradients; integer inputs (token ids) do not.
    """
    start = time.perf_counter()
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    frozen = {n: _to_meta(p, False) for n, p in module.named_parameters() if not p.requires_grad}
    buffers = {n: _to_meta(b, False) for n, b in module.named_buffers()}
    params = [_to_meta(p, True) for _, p in named]
    names = [n for n, _ in named]
    inputs = [_to_meta(x, x.is_floating_point()) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    grad_inputs = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]

    def forward(ps, xs):
        state = {**dict(zip(names, ps)), **frozen, **buffers}
        out = torch.func.functional_call(module, state, tuple(xs))
        leaves, _ = tree_flatten(out)
        return [o for o in leaves if isinstance(o, torch.Tensor) and o.requires_grad]

    outs0 = forward(params, inputs)  # output shapes, so that the incoming gradients are trace inputs
    if not outs0:
        raise ValueError(f"{name}: the module returns no tensor that depends on its parameters or inputs")
    grads_in = [torch.empty_like(o, device="meta") for o in outs0]

    def joint(ps, xs, gs):
        outs = forward(ps, xs)
        _pass_boundary(outs[0])
        wrt = [xs[i] for i in grad_inputs] + list(ps)
        grads = torch.autograd.grad(outs, wrt, gs, allow_unused=True)
        return (*outs, *grads)

    scopes = _ModuleScopes(module)
    try:
        # make_fx records each traced tensor's metadata in a FakeTensorMode; on meta tensors it finds
        # none and builds a new one per tensor, whose constructor captures the Python stack (half of a
        # block's trace time). One mode for the whole trace, where torch._guards.detect_fake_mode
        # looks first, gives the same metadata.
        with torch._guards.tracing(torch._guards.TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
            gm = make_fx(joint)(params, inputs, grads_in)
    finally:
        scopes.close()
    mapped = _Mapper(gm, n_params=len(params), n_inputs=len(inputs), n_outs=len(outs0),
                     n_grad_inputs=len(grad_inputs), name=name, fuse=fuse,
                     param_roles=_parallel_roles(module, names)).run()
    fwd_ops = mapped["fwd"].ops
    forward_modules = tuple((op.name, tag) for op in fwd_ops
                            if (tag := scopes.of(op.contains[-1] if op.contains else op.name)))
    kept_ops = mapped["op_policy"]
    rerun = tuple(op.name for op in fwd_ops if op.unit != NONE and not set(op.contains or (op.name,)) <= kept_ops["names"])

    param_count = sum(p.numel() for p in module.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    return LayerTrace(
        fwd=mapped["fwd"], bwd=mapped["bwd"], params=param_count, param_bytes=param_bytes,
        activation_bytes=mapped["activation_bytes"],
        input_bytes=sum(_nbytes(x) for x in inputs if isinstance(x, torch.Tensor)),
        output_bytes=sum(_nbytes(o) for o in outs0),
        saved=mapped["saved"], input_grad_ops=mapped["input_grad_ops"], param_grad_ops=mapped["param_grad_ops"],
        unmapped_ops=mapped["unmapped"], trace_s=time.perf_counter() - start,
        saved_regions=mapped["saved_regions"], rebuilt=mapped["rebuilt"],
        attention_core_bytes=_region_bytes(mapped, ATTENTION_CORE),
        sequence_parallel_bytes=_region_bytes(mapped, SEQUENCE_PARALLEL),
        saved_modules=tuple(scopes.of(entry[0]) for entry in mapped["saved"]), forward_modules=forward_modules,
        op_policy_bytes=kept_ops["bytes"], op_policy_sp_bytes=kept_ops["sp_bytes"], op_policy_rerun=rerun,
        input_sequence_parallel_bytes=sum(_nbytes(x) for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()),
        **mapped["linear"],
    )


def _region_bytes(mapped, region: str) -> int:
    return sum(s[3] for s, r in zip(mapped["saved"], mapped["saved_regions"]) if r == region)


def _parallel_roles(module: nn.Module, names: list[str]) -> list[str]:
    """"column" / "row" / "" per trainable parameter: a module's `parallel` attribute says how it is
    split over the TP group, either for all its own parameters (a string) or per name (a mapping)."""
    roles = {}
    for prefix, sub in module.named_modules():
        mode = getattr(sub, "parallel", None)
        if not mode:
            continue
        for pname, _ in sub.named_parameters(recurse=False):
            role = mode.get(pname, "") if isinstance(mode, dict) else mode
            roles[f"{prefix}.{pname}" if prefix else pname] = role
    return [roles.get(n, "") for n in names]


def _to_meta(x: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return t.requires_grad_(requires_grad and (x.is_floating_point() or x.is_complex()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_attention_backward(node) -> bool:
    return node.op == "call_function" and _namespace(node) == "phaze" and _op_name(node) == "flash_attention_backward"


def _op_name(node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


def _namespace(node) -> str:
    return getattr(node.target, "namespace", "")


def _vals(node):
    """The tensors a node produces (tuple outputs flattened)."""
    val = node.meta.get("val")
    leaves, _ = tree_flatten(val)
    return [v for v in leaves if isinstance(v, torch.Tensor)]


def _arg_nodes(node):
    leaves, _ = tree_flatten((node.args, node.kwargs))
    seen, out = set(), []
    for a in leaves:
        if isinstance(a, torch.fx.Node) and a not in seen:
            seen.add(a)
            out.append(a)
    return out


class _Mapper:
    """Turns the joint fx graph into forward/backward OpGraphs and the saved-activation bytes."""

    def __init__(self, gm, *, n_params, n_inputs, n_outs, n_grad_inputs, name, fuse, param_roles=()):
        self.graph = gm.graph
        self.name, self.fuse = name, fuse
        self.nodes = list(self.graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        self.param_ph = set(placeholders[:n_params])
        self.param_role = dict(zip(placeholders[:n_params], param_roles))
        self.input_ph = set(placeholders[n_params:n_params + n_inputs])
        out_node = next(n for n in self.nodes if n.op == "output")
        flat, _ = tree_flatten(out_node.args)
        self.outputs = flat
        self.n_outs, self.n_grad_inputs = n_outs, n_grad_inputs
        self.boundary = next(n for n in self.nodes if n.op == "call_function" and _op_name(n) == "pass_boundary")
        self.unmapped: list[str] = []

    # --- classification -------------------------------------------------------------------------
    def _classify(self):
        const, act_dep, param_only = set(), set(), set()
        for n in self.nodes:
            if n.op == "get_attr":
                const.add(n)
            elif n.op == "call_function":
                args = _arg_nodes(n)
                if _op_name(n) in _FACTORIES or all(a in const for a in args):
                    const.add(n)
                    continue
                if any(a in act_dep or a in self.input_ph for a in args):
                    act_dep.add(n)
                elif all(a in const or a in self.param_ph or a in param_only for a in args):
                    param_only.add(n)
        self.const, self.act_dep, self.param_only = const, act_dep, param_only

    def _param_grad_bases(self) -> set:
        """The nodes whose values (or views of them) are the parameter gradients."""
        if not hasattr(self, "_pgrad"):
            start = self.n_outs + self.n_grad_inputs
            self._pgrad = {self._alias_base(g) for g in self.outputs[start:] if isinstance(g, torch.fx.Node)}
        return self._pgrad

    def _producer(self, node):
        """The op node that computes a value: getitems stand for their multi-output parent."""
        while node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]
        return node

    def _alias_base(self, node):
        while node.op == "call_function":
            name = _op_name(node)
            if name in _ALIASES:
                node = node.args[0]
            elif name == "getitem" and _op_name(node.args[0]) in _ALIASES:
                node = node.args[0].args[0]
            else:
                break
        return node

    def _saved(self):
        """Forward values (or layer inputs) that backward ops read, one entry per storage.

        With Transformer Engine's kernels (`fuse=ROW_FUSION`) a storage the backward reads only as
        views handed to the attention kernel is kept as those views alone: TE's DotProductAttention
        makes Q, K and V contiguous when their strides match none of its packed layouts
        (`get_qkv_layout`), as a V sliced out of the fused QKV projection's output does once RoPE
        has copied Q and K, so the attention saves its own copy and the projection's output is
        freed. Views that partition the storage (Q, K, V of an unrotated block) keep the same bytes.
        Eager PyTorch's attention keeps the views, hence their whole storage."""
        bpos = self.pos[self.boundary]
        bases, readers = {}, {}
        for n in self.nodes[bpos + 1:]:
            if n.op != "call_function":
                continue
            for a in _arg_nodes(n):
                if not (a in self.input_ph or (a.op == "call_function" and self.pos[a] < bpos)):
                    continue
                base = self._alias_base(a)
                if base in self.param_ph or base in self.const or base in self.param_only:
                    continue
                if not (base in self.input_ph or base in self.act_dep):
                    continue
                bases[base] = None
                seen = readers.setdefault(base, {})  # per view read: read only by the attention backward
                seen[a] = seen.get(a, True) and _is_attention_backward(n)
        rebuilt = self._rebuilt_in_backward(bases)
        saved, dropped = [], []
        for base in bases:
            vals = _vals(base)
            if len(vals) != 1:
                continue
            views = readers[base]
            if self.fuse == ROW_FUSION and base not in views and all(views.values()):
                kept = [(a, _vals(a)[0]) for a in views if len(_vals(a)) == 1]
            else:
                kept = [(base, vals[0])]
            for node, v in kept:
                entry = (node.name, tuple(v.shape), str(v.dtype).replace("torch.", ""), _nbytes(v))
                (dropped if base in rebuilt else saved).append(entry)
        return tuple(saved), tuple(dropped)

    def _forward_consumers(self, node) -> list:
        """The forward ops that read `node`'s value, looking through views of it."""
        bpos = self.pos[self.boundary]
        out, stack = [], [node]
        while stack:
            for u in stack.pop().users:
                if u.op != "call_function" or self.pos[u] >= bpos:
                    continue
                if _op_name(u) in _ALIASES or (u.target is operator.getitem and _op_name(u.args[0]) in _ALIASES):
                    stack.append(u)
                else:
                    out.append(u)
        return out

    def _rebuilt_in_backward(self, bases) -> set:
        """The saved values a fused pointwise kernel recomputes in its backward instead of keeping.

        Megatron's fused kernels keep only what enters a pointwise chain (and a norm's per-row
        statistics) and rebuild the chain's interior in backward: Transformer Engine's and Apex's
        fused RMSNorm/LayerNorm save the input and 1/rms, not the normalised value before its scale
        (TE `LayerNormLinear`, Apex `FusedRMSNormAffineFunction`); Megatron-Core's fused SwiGLU
        (`megatron/core/fusions/fused_bias_swiglu.py`, `SwiGLUFunction`) saves its input, not
        silu(gate); the same holds for the fused bias-GeLU, whose input and output the traced GPT
        block already keeps as Korthikanti et al. 2022, Table 2, count them. A value is rebuilt when
        (1) a pointwise op other than dropout produced it (a dropout mask needs the random stream),
        (2) only pointwise ops read it in the forward (a GEMM's, an attention kernel's, a norm's or
        a softmax's input is materialised and kept by that op), and (3) every activation it is made
        of is itself kept or rebuilt. The op graphs (time) are unchanged: this is memory only."""
        bpos = self.pos[self.boundary]
        kept_anyway = self.param_ph | self.const | self.param_only
        memo: dict = {}

        def available(node) -> bool:
            base = self._alias_base(node)
            if base in kept_anyway or base in bases:
                return True
            if base not in memo:
                memo[base] = (base.op == "call_function" and self.pos[base] < bpos and _rebuildable(base)
                              and all(available(a) for a in _arg_nodes(base)))
            return memo[base]

        def _rebuildable(node) -> bool:
            return _op_name(node) in _POINTWISE and _op_name(node) != "native_dropout"

        rebuilt = set()
        for base in bases:
            if (base.op == "call_function" and _rebuildable(base)
                    and all(_op_name(u) in _POINTWISE for u in self._forward_consumers(base))
                    and all(available(a) for a in _arg_nodes(base))):
                rebuilt.add(base)
        return rebuilt

    def _linear_role(self, node) -> str:
        """"column" / "row" for a GEMM whose weight is a parameter split that way over the TP group."""
        if _op_name(node) not in ("mm", "addmm", "bmm"):  # bmm: a MoE's grouped expert GEMMs
            return ""
        return self.param_role.get(self._alias_base(node.args[-1]), "")

    def _regions(self) -> dict[str, str]:
        """The region (one of REGIONS) of every forward value and layer input, by traced name.

        - attention core: what lies between an activation x activation batched GEMM (Q K^T) and the
          next one (P V): the scores, softmax, the probabilities' dropout mask and output;
        - tensor parallel: the rest of Megatron's TP region, from a column-parallel GEMM's output up
          to the row-parallel GEMM that closes it (sharded over t already);
        - sequence parallel: values outside the TP region that depend on a floating input or a
          parameter: norms, dropouts, residual adds, the column-parallel GEMMs' inputs, the layer input;
        - replicated: values of integer inputs only (token ids, labels, masks made from them).
        """
        bpos = self.pos[self.boundary]
        fwd = [n for n in self.nodes[:bpos] if n.op == "call_function"]
        floating = {x for x in self.input_ph if all(v.is_floating_point() for v in _vals(x))}
        inside, float_dep = set(), set(self.param_ph) | floating
        for n in fwd:
            args = _arg_nodes(n)
            role = self._linear_role(n)
            if role == "column" or (role != "row" and any(a in inside for a in args)):
                inside.add(n)
            if any(a in float_dep for a in args):
                float_dep.add(n)
        # The attention core: descendants of an activation x activation batched GEMM that are also
        # strict ancestors of one.
        acts = self.act_dep | self.input_ph
        pairs = [n for n in fwd if _op_name(n) in ("bmm", "baddbmm")
                 and all(self._alias_base(a) in acts for a in n.args[-2:])]
        after = set(pairs)
        for n in fwd:
            if any(a in after for a in _arg_nodes(n)):
                after.add(n)
        before, stack = set(), [a for n in pairs for a in _arg_nodes(n)]
        while stack:
            n = stack.pop()
            if n not in before and n.op == "call_function":
                before.add(n)
                stack.extend(_arg_nodes(n))
        core = after & before
        regions = {}
        for n in list(self.input_ph) + fwd:
            prod = self._producer(n)
            if prod in core:
                regions[n.name] = ATTENTION_CORE
            elif prod in inside:
                regions[n.name] = TENSOR_PARALLEL
            else:
                regions[n.name] = SEQUENCE_PARALLEL if n in float_dep else REPLICATED
        return regions

    # --- op construction ------------------------------------------------------------------------
    def _describe(self, n) -> "_Cost":
        """What one traced node costs on its own (fusion combines these)."""
        name = _op_name(n)
        vals = _vals(n)
        if _namespace(n) == "phaze" and name == "allreduce":
            return _Cost(NET, "collective")
        if _namespace(n) == "phaze" and name in ("flash_attention", "flash_attention_backward"):
            return _flash_cost(n, backward=name.endswith("backward"))
        if name in _ALIASES or name in _LAYOUT_COPIES:
            return _Cost(NONE, "noop")
        if name in _GEMMS:
            a, b = n.args[-2].meta["val"], n.args[-1].meta["val"]
            if a.dim() == 2:
                dims = (1, a.shape[0], a.shape[1], b.shape[1])
            else:
                dims = (a.shape[0], a.shape[1], a.shape[2], b.shape[2])
            bt, m, k, cols = (int(x) for x in dims)
            epilogue = bt * m * cols if name in ("addmm", "baddbmm") else 0  # bias add into the accumulators
            kind = _GEMMS[name]
            if name == "bmm" and (any(self._alias_base(x) in self.param_ph for x in n.args[-2:])
                                  or n in self._param_grad_bases()):
                kind = "grouped_gemm"  # a MoE's experts (and their weight gradients), batched; not attention
            return _Cost(TC, kind, gemm=(bt, m, k, cols), flops=2.0 * bt * m * k * cols + epilogue)
        kind, vkind = _VECTOR.get(name) or _OTHER_VECTOR.get(name) or (None, None)
        if kind is None:
            self.unmapped.append(str(n.target))
            kind, vkind = "elementwise", name
        reads = writes = None
        if name == "embedding":  # reads only the looked-up rows, not the whole table
            elements = vals[0].numel()
            reads = _nbytes(vals[0]) + _nbytes(n.args[1].meta["val"])
        elif name == "embedding_dense_backward":
            elements = n.args[0].meta["val"].numel()
            reads = _nbytes(n.args[0].meta["val"]) + _nbytes(n.args[1].meta["val"])
        elif name == "gather":
            elements = vals[0].numel()
            reads = 2 * _nbytes(vals[0]) + _nbytes(n.args[2].meta["val"])
        elif name in ("scatter", "scatter_add", "scatter_", "scatter_add_"):
            src = n.args[3].meta["val"] if len(n.args) > 3 and isinstance(n.args[3], torch.fx.Node) else vals[0]
            elements = src.numel()
            reads = _nbytes(src) + _nbytes(n.args[2].meta["val"])
            if name.endswith("_"):  # in place: only the scattered elements are written
                writes = _nbytes(src)
        else:
            arg_vals = [v for a in _arg_nodes(n) for v in _vals(a)]
            elements = max([v.numel() for v in vals + arg_vals] or [0])
        flops = float(elements * VECTOR_OP_FLOPS.get(vkind, 1))
        return _Cost(VC, kind, vkind, flops=flops, elements=int(elements), reads=reads, writes=writes)

    def run(self):
        self._classify()
        saved, rebuilt = self._saved()
        bpos = self.pos[self.boundary]
        passes = {"fwd": [], "bwd": []}
        for n in self.nodes:
            if n.op != "call_function" or n in self.const or n is self.boundary or n.target is operator.getitem:
                continue
            passes["fwd" if self.pos[n] < bpos else "bwd"].append(n)
        activation_bytes = sum(s[3] for s in saved)
        regions = self._regions()
        saved_regions = tuple(regions[name] for name, *_ in saved)
        roles = self._linear_inputs()
        linear = {f"linear_{role}{'_sp' if sp else ''}_bytes": sum(
            e[3] for e, r in zip(saved, saved_regions)
            if roles.get(e[0]) == role and (not sp or r == SEQUENCE_PARALLEL)) for role in ("input", "shared")
            for sp in (False, True)}

        graphs = {}
        extra = {}
        for pname, pnodes in passes.items():
            graphs[pname], extra[pname] = self._build_pass(pname, pnodes)

        n_in = self.n_grad_inputs
        grad_vals = self.outputs[self.n_outs:]
        in_nodes = [g for g in grad_vals[:n_in] if isinstance(g, torch.fx.Node)]
        par_nodes = [g for g in grad_vals[n_in:] if isinstance(g, torch.fx.Node)]
        op_of = extra["bwd"]
        return {
            "fwd": graphs["fwd"], "bwd": graphs["bwd"], "activation_bytes": activation_bytes, "saved": saved,
            "rebuilt": rebuilt,
            "input_grad_ops": tuple(sorted({i for g in in_nodes if (i := op_of(g)) is not None})),
            "param_grad_ops": tuple(sorted({i for g in par_nodes if (i := op_of(g)) is not None})),
            "unmapped": tuple(dict.fromkeys(self.unmapped)),
            "saved_regions": saved_regions,
            "linear": linear,
            "op_policy": self._op_policy(),
        }

    def _op_policy(self) -> dict:
        """What torchtitan's op-level selective checkpointing keeps of this forward (module docstring):
        the output bytes of the kept ops, of which the collectives' (sharded under SP), and the traced
        names of those ops."""
        bpos = self.pos[self.boundary]
        out = {"bytes": 0, "sp_bytes": 0, "names": set()}
        matmuls = 0
        for n in self.nodes[:bpos]:
            if n.op != "call_function" or n in self.const:
                continue
            name, space = _op_name(n), _namespace(n)
            if space == "aten" and name == "mm":
                matmuls += 1
                if matmuls % 2 == 0:  # `_custom_policy`: "Saves output of all compute ops, except every second mm"
                    continue
            elif not (space == "phaze" and name in ("flash_attention", "allreduce")):
                continue
            size = sum(_nbytes(v) for v in _vals(n))
            out["bytes"] += size
            out["sp_bytes"] += size if name == "allreduce" else 0
            out["names"].add(n.name)
        return out

    def _linear_inputs(self) -> dict[str, str]:
        """Forward values that are a linear GEMM's activation operand (the other operand a weight),
        by traced name: "input" when in the backward only weight-gradient GEMMs (producing a
        parameter gradient) read them, else "shared" (e.g. the attention output, which the
        attention backward reads too). Transformer Engine saves the first in FP8 in place of the
        BF16 tensor and keeps an FP8 copy beside the second (TE user guide, "Performance
        Considerations", "Memory usage": it saves the column-wise quantized input of each linear
        layer for its weight gradient)."""
        bpos = self.pos[self.boundary]
        linear_in = set()
        for n in self.nodes[:bpos]:
            if n.op == "call_function" and _op_name(n) in _GEMMS:
                bases = [self._alias_base(a) for a in n.args[-2:] if isinstance(a, torch.fx.Node)]
                if any(b in self.param_ph for b in bases):
                    linear_in.update(b for b in bases if b not in self.param_ph)
        wgrads = self._param_grad_bases()
        shared = set()
        for n in self.nodes[bpos + 1:]:
            if n.op != "call_function" or _op_name(n) in _ALIASES or (
                    n.target is operator.getitem and _op_name(n.args[0]) in _ALIASES):
                continue
            if _op_name(n) in _GEMMS and n in wgrads:
                continue
            shared.update(b for a in _arg_nodes(n) if (b := self._alias_base(a)) in linear_in)
        return {b.name: "shared" if b in shared else "input" for b in linear_in}

    def _build_pass(self, pname, pnodes):
        in_pass = set(pnodes)
        desc = {n: self._describe(n) for n in pnodes}
        preds = {n: {p for a in _arg_nodes(n) if (p := self._producer(a)) in in_pass and p is not n} for n in pnodes}

        # Drop no-ops that start from nothing computed in this pass (views of weights, inputs, saved
        # tensors) or lead to nothing computed in it (views of results): they order nothing and cost
        # nothing.
        dropped = set()
        for n in pnodes:
            if desc[n].unit == NONE and all(p in dropped for p in preds[n]):
                dropped.add(n)
        succ = defaultdict(set)
        for n in pnodes:
            for p in preds[n]:
                succ[p].add(n)
        for n in reversed(pnodes):
            if desc[n].unit == NONE and all(u in dropped for u in succ[n]):
                dropped.add(n)
        live = [n for n in pnodes if n not in dropped]
        succ = defaultdict(set)
        for n in live:
            preds[n] -= dropped
            for p in preds[n]:
                succ[p].add(n)

        # Fusion: union a producer into its only consumer when both are pointwise vector ops of the
        # same size, or both are no-ops.
        group = {n: n for n in live}

        def find(x):
            while group[x] is not x:
                group[x] = group[group[x]]
                x = group[x]
            return x

        def fusable(a, b):
            da, db = desc[a], desc[b]
            if da.unit == NONE and db.unit == NONE:
                return True
            if not self.fuse:
                return False
            if self.fuse in (ROW_FUSION, INDUCTOR_FUSION):
                kinds = _ROW_FUSABLE if self.fuse == ROW_FUSION else _INDUCTOR_FUSABLE
                return da.unit == VC and db.unit == VC and _op_name(a) in kinds and _op_name(b) in kinds
            return (da.unit == VC and db.unit == VC and _op_name(a) in _POINTWISE and _op_name(b) in _POINTWISE
                    and da.elements == db.elements)

        fits = self._iteration_fits(live, desc, find)
        for n in live:
            if len(succ[n]) == 1:
                (b,) = succ[n]
                if fusable(n, b) and fits({find(n), find(b)}):
                    group[find(n)] = find(b)
        if self.fuse == INDUCTOR_FUSION:
            self._fuse_across_consumers(live, succ, desc, fusable, find, group, fits)
        members = defaultdict(list)
        for n in live:
            members[find(n)].append(n)
        order = sorted(members, key=lambda r: max(self.pos[m] for m in members[r]))
        if self.fuse == INDUCTOR_FUSION:  # a kernel fused across consumers may feed one traced before its last node
            order = _topological(order, {r: {find(p) for m in members[r] for p in preds[m]} - {r} for r in order})
        index = {r: i for i, r in enumerate(order)}

        ops, edges = [], set()
        for r in order:
            ms = sorted(members[r], key=self.pos.get)
            ops.append(self._make_op(ms, desc))
            for m in ms:
                for p in preds[m]:
                    pr = find(p)
                    if pr is not r:
                        edges.add((index[pr], index[r]))
        graph = OpGraph(layer=self.name, pass_name=pname, ops=tuple(ops), edges=tuple(sorted(edges)))

        def op_index(node):
            """The op computing a traced value, looking through views; None if not in this pass."""
            node = self._producer(node)
            while node in dropped or (node.op == "call_function" and _op_name(node) in _ALIASES):
                node = self._producer(node.args[0])
            return index[find(node)] if node in group else None

        return graph, op_index

    def _iteration_fits(self, live, desc, find):
        """Whether the groups `roots` (union-find roots) may share one kernel: always, but under
        `INDUCTOR_FUSION`, where every vector op among them iterates over the group's points (its
        largest op's `elements`) or over a smaller size one of its ops reads or writes within those
        points (a reduction's result, a row statistic broadcast back, the half a slice takes):
        `_INDUCTOR_FUSABLE`'s comment. A concatenation computes a part of another size in its own
        kernel only where no reduction runs over that size (Inductor's `pointwise_cat`, as RoPE's
        rotated halves; a part a reduction computes, such as a norm's gradient, is written into its
        slice by its own kernel, `ConcatKernel`: torch/_inductor/lowering.py `cat`)."""
        if self.fuse != INDUCTOR_FUSION:
            return lambda roots: True

        def smaller(m, nodes):
            return {v.numel() for a in nodes for v in _vals(a) if v.numel() < desc[m].elements}

        def fits(roots) -> bool:
            ops = [m for m in live if desc[m].unit == VC and find(m) in roots]
            top = max((desc[m].elements for m in ops), default=0)
            cats = [m for m in ops if _op_name(m) == "cat"]
            parts = {n for m in ops for n in smaller(m, (m,) if m in cats else (m, *_arg_nodes(m)))}
            reduced = {desc[m].elements for m in ops if m not in cats and smaller(m, (m,))}
            inlined = {n for m in cats for n in smaller(m, _arg_nodes(m))} - reduced
            return all(desc[m].elements in (top, *parts, *inlined) for m in ops)
        return fits

    def _fuse_across_consumers(self, live, succ, desc, fusable, find, group, fits) -> None:
        """TorchInductor's fusion beyond single-consumer chains (`_INDUCTOR_FUSABLE`): each fusable
        producer-consumer pair, directly or through views (which cost nothing and join the kernel),
        merges their groups unless a path between them runs through a group left out (the merged
        kernel would both feed and wait for it) or their iteration spaces do not fit (`fits`)."""
        for n in live:
            if desc[n].unit != VC:
                continue
            paths, stack = [], [(b, ()) for b in succ[n]]
            while stack:  # the vector ops n reaches, each with the views passed on the way
                b, views = stack.pop()
                if desc[b].unit == NONE:
                    stack.extend((c, views + (b,)) for c in succ[b])
                elif desc[b].unit == VC and fusable(n, b):
                    paths.append((b, views))
            for b, views in sorted(paths, key=lambda p: self.pos[p[0]]):
                merged = {find(m) for m in (n, b, *views)}
                if len(merged) == 1 or not fits(merged):
                    continue
                after = defaultdict(set)  # group -> the groups it feeds
                for m in live:
                    after[find(m)].update(find(u) for u in succ[m])
                seen = set(merged)
                frontier = [g for r in merged for g in after[r] if g not in merged]
                while frontier and not merged & after[frontier[-1]]:  # back into the kernel through another?
                    g = frontier.pop()
                    if g not in seen:
                        seen.add(g)
                        frontier.extend(after[g] - seen)
                if not frontier:
                    root = find(b)
                    for r in merged:
                        group[r] = root

    def _read_bytes(self, node) -> int:
        """Bytes an op reads from an argument: a broadcast view reads only its source."""
        size = sum(_nbytes(v) for v in _vals(node))
        base = self._alias_base(node)
        if base is not node:
            size = min(size, sum(_nbytes(v) for v in _vals(base)) or size)
        return size

    def _make_op(self, ms, desc):
        mset = set(ms)
        last = desc[ms[-1]]
        name = ms[-1].name if len(ms) == 1 else "+".join(m.name for m in ms)
        contains = tuple(m.name for m in ms) if len(ms) > 1 else ()
        out_vals = [v for m in ms for v in _vals(m)]
        shape = tuple(int(x) for x in out_vals[-1].shape) if out_vals else ()
        if last.unit == NONE:
            return Op(name=name, kind="noop", unit=NONE, contains=contains, shape=shape)
        if last.unit == NET:
            n = ms[0]
            payload = float(_nbytes(n.args[0].meta["val"]))
            return Op(name=name, kind="collective", unit=NET, bytes_read=payload, bytes_written=payload,
                      collective="allreduce", comm_bytes=payload, group=int(n.args[1]), shape=shape)
        # A group reads what enters it and writes what leaves it (to later ops, to the backward pass
        # or as a result); values passed between its members stay on chip.
        reads, seen = 0, set()
        for m in ms:
            if desc[m].reads is not None:
                reads += desc[m].reads
                continue
            for a in _arg_nodes(m):
                if self._producer(a) in mset or a in seen:
                    continue
                seen.add(a)
                reads += self._read_bytes(a)
        writes = 0
        for m in ms:
            if desc[m].writes is not None:
                writes += desc[m].writes
                continue
            for users, size in _outputs(m):
                if not users or any(u not in mset for u in users):
                    writes += size
        flops = float(sum(desc[m].flops for m in ms))
        if last.unit == TC:
            return Op(name=name, kind=last.kind, unit=TC, flops=flops, bytes_read=float(reads),
                      bytes_written=float(writes), gemm=last.gemm, shape=shape)
        if last.unit == TCVC:
            return Op(name=name, kind=last.kind, unit=TCVC, flops=flops, bytes_read=float(reads),
                      bytes_written=float(writes), gemm=last.gemm, gemms=last.gemms, elements=last.elements,
                      vector_ops=last.vector_ops, shape=shape)
        return Op(name=name, kind="fused" if len(ms) > 1 else last.kind, unit=VC, flops=flops,
                  bytes_read=float(reads), bytes_written=float(writes), elements=max(desc[m].elements for m in ms),
                  vector_ops=tuple(desc[m].vkind for m in ms if desc[m].unit != NONE), contains=contains, shape=shape)


def _topological(order: list, needs: dict) -> list:
    """`order` rearranged so that every item comes after the items it `needs`, otherwise as early
    as `order` has it (Kahn's algorithm, ready items taken in their place in `order`)."""
    import heapq

    place = {r: i for i, r in enumerate(order)}
    waiting = {r: len(needs[r]) for r in order}
    feeds = defaultdict(list)
    for r in order:
        for p in needs[r]:
            feeds[p].append(r)
    ready = [place[r] for r in order if waiting[r] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        r = order[heapq.heappop(ready)]
        out.append(r)
        for c in feeds[r]:
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(ready, place[c])
    return out


def _outputs(node):
    """(users, bytes) per tensor a node produces; a multi-output node's users are its getitems'."""
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)):
        return [(set(node.users), _nbytes(val))] if isinstance(val, torch.Tensor) else []
    items = {g.args[1]: g for g in node.users if g.target is operator.getitem}
    return [(set(items[i].users) if i in items else set(), _nbytes(v))
            for i, v in enumerate(val) if isinstance(v, torch.Tensor)]


def _flash_cost(n, backward: bool) -> "_Cost":
    """One FlashAttention kernel (layers.flash_attention): its GEMMs on a tensor core, the softmax
    on a vector core, over [B, M, N] scores (B = batch x KV heads, M = query rows, N = keys).

    Forward: S = Q K^T and O = P V, 4 B M N d FLOP, the online softmax (and the dropout) on the
    vector core. Backward (Dao 2023, Algorithm 2): S = Q K^T again, dV = P^T dO, dP = dO V^T,
    dQ = dS K, dK = dS^T Q, 10 B M N d FLOP (2.5 x the forward); P = exp(S - L) and
    dS = P * (dP - D) on the vector core. The whole square is counted for causal models too, as
    the unfused graph and Megatron's FLOP formula count it (see the module docstring).

    With a sliding window of w keys (ModelConfig.window) the kernel visits only the tiles of the
    band: each query row meets min(w, N) keys and each key min(w, N) x g query rows (g query heads
    per KV head), so every GEMM's key or query extent shrinks to the band's; a window of at least
    the sequence is full attention. Values may be narrower than queries and keys (MLA's v_head_dim).
    """
    q, k, v, p = (n.args[1], n.args[2], n.args[3], n.args[9]) if backward else n.args[0:3] + (n.args[6],)
    at = 11 if backward else 8  # the trailing window argument, when the graph has one
    window = n.args[at] if len(n.args) > at else n.kwargs.get("window", 0)
    B, M, d = (int(x) for x in q.meta["val"].shape)
    N = int(k.meta["val"].shape[1])
    dv = int(v.meta["val"].shape[-1])
    keys = min(int(window), N) if window else N  # keys each query row meets
    rows = M * keys // N  # query rows each key meets
    score = (B, M, d, keys)
    if backward:
        gemms = (score, (B, N, rows, dv), (B, M, dv, keys), (B, M, keys, d), (B, N, rows, d))
        vector = ("sub", "exp", "sub", "mul") + (("dropout", "dropout_bwd") if p else ())
    else:
        gemms = (score, (B, M, keys, dv))
        vector = ("softmax",) + (("dropout",) if p else ())
    macs = sum(b * m * kk * c for b, m, kk, c in gemms)
    elements = B * M * keys
    flops = 2.0 * macs + elements * sum(VECTOR_OP_FLOPS[v] for v in vector)
    return _Cost(TCVC, FLASH_ATTENTION, gemm=(B, M, macs // elements, keys), gemms=gemms, flops=flops,
                 elements=elements, vector_ops=vector)


@dataclass(frozen=True)
class _Cost:
    unit: str
    kind: str
    vkind: str = ""
    gemm: tuple = ()
    flops: float = 0.0
    elements: int = 0
    reads: int | None = None  # overrides the sum of argument sizes (look-ups touch only some rows)
    writes: int | None = None  # overrides the output size (in-place scatters)
    gemms: tuple = ()  # a fused attention op's GEMMs
    vector_ops: tuple = ()  # a fused attention op's vector kinds
