"""Inputs and outputs of the device placement, independent of where the numbers came from.

`LayerCosts` is the whole model at one tensor-parallel width as plain per-layer arrays: forward and
backward time per microbatch (from the per-layer schedules, TP collectives included), parameters
and activation sizes per device. A `PlacementProblem` bundles one `LayerCosts` per TP width with the
system, the chip's HBM and peak, the microbatch and the recompute choice. The placement DP
(`dp.optimal_dense_placement`) and the independent evaluator (`placement.evaluate.evaluate_placement`)
both read only these values, so they can be tested on synthetic layers.

Units: seconds, bytes, parameters (counts), FLOP. Byte and parameter arrays are rounded up to whole
numbers on construction. Whole numbers below 2**53 add exactly in float64, so the DP and the
evaluator, which sum them in different orders, agree exactly on whether a stage fits in HBM.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping

import numpy as np

from ...errors import PhazeError
from ...system import System
from ...training import Layout, Training
from ...workload.kinds import BLOCK_KINDS
from ...workload.ops import EXACT_BYTES, largest_memory_bytes
from ...workload.precision import weight_copy_bytes


def _array(name: str, values, n: int | None, whole: bool) -> np.ndarray:
    arr = np.array(values, dtype=np.float64).reshape(-1)
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"LayerCosts.{name}: expected {n} entries, got {arr.shape[0]}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"LayerCosts.{name}: entries must be finite and non-negative")
    if whole:
        arr = np.ceil(arr)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class LayerCosts:
    """The model at TP width `tp`, one entry per layer, layers numbered in a topological order.

    - `fwd_s`, `bwd_s`: time of one microbatch's forward / backward pass of the layer on one device,
      including its TP collectives;
    - `params`: parameters held per device (the layer's 1/tp shard);
    - `activation_bytes`: what the layer stashes for its backward pass, per microbatch, without
      recompute;
    - `boundary_bytes`: the output tensor the layer sends to each consumer, per microbatch (what
      crosses a stage boundary after it, and its gradient on the way back);
    - `input_bytes`: the model input a source layer reads (token ids for an embedding); only used
      for layers without predecessors, whose stage input it is;
    - `edges`: the layer DAG as (producer, consumer) pairs with producer < consumer; default chain;
    - `flops`: forward + backward FLOP per device per microbatch (reported per stage only);
    - by recompute mode (Korthikanti et al. 2022, Table 2; `workload.ops.Layer`, already for the
      recipe's sequence parallelism): `selective_bytes` (kept per microbatch under selective: all
      but the attention core; default `activation_bytes`), `checkpoint_bytes` (kept under full: the
      layer's input; default the producers' `boundary_bytes`, or `input_bytes` for a source layer),
      `selective_work_bytes` (the attention core, rebuilt during the layer's backward; default 0),
      `full_work_bytes` (all of the layer's activations, rebuilt from the checkpoint during its
      backward; default `activation_bytes`);
    - `selective_s`: the forward time of the attention core, what selective recompute adds to the
      backward (default 0); full recompute adds `fwd_s`.
    - `block_ordinal`: a decoder block's 1-based place among the model's blocks, 0 for the embedding,
      the head and MTP modules (default: every layer a block, 1..n): which blocks `recompute_every`
      checkpoints (`Training.checkpointed`) and which torchtitan's op-level policy wraps;
    - `op_policy_bytes`, `op_policy_s`: a block under torchtitan's op-level selective checkpointing
      (`Training.recompute_ops`; workload/trace.py): its input and the kept ops' outputs, and the
      forward ops it reruns (defaults `activation_bytes` and 0: nothing dropped);
    - module-level selective recompute (`Training.recompute_modules`, beyond the attention core):
      `module_bytes`, the bytes the recipe's other modules stop keeping per microbatch, rebuilt
      during the layer's backward (so also working set), and `module_s`, those modules' forward
      time run again (defaults 0). With the attention core among the modules selective keeps
      `selective_bytes - module_bytes`, else `activation_bytes - module_bytes`. `module_moe`: 1
      where the recipe reruns the whole MoE layer (`moe`: Megatron-Core checkpoints its router,
      dispatch, experts and combine together, moe_layer.py), whose rerun then also holds the
      placement's terms of the layer's forward (its two all-to-alls, the busiest rank's experts at
      the EP width's shape in place of the traced `expert_fwd_s`, which `module_s` holds), else 0.

    Expert and context parallelism (the model in `placement.evaluate`), all default 0:
    `expert_params` (of `params`, the routed experts' share, divided over the EP group),
    `dispatch_bytes` (one all-to-all's payload per device: tokens x k x capacity factor x hidden x
    bytes), `expert_fwd_s` / `expert_bwd_s` (the experts' grouped GEMMs, scaled by the load
    imbalance), `core_fwd_s` / `core_bwd_s` (one attention block's core, what each further ring
    step of CP computes) and `kv_bytes` (the K and V block a CP ring step passes on); `cp`: the
    context-parallel width these costs were traced at (the layer works on seq / cp tokens);
    `a2a_hidden_s`, set only in the EP DP's effective costs (`expert.effective_costs`): the
    all-to-all time the EP overlap hides per paired forward and backward, already taken off
    `fwd_s` and `bwd_s` (half each), which the unpaired microbatches pay back; `gathered_kv_bytes`,
    likewise set only there: the other CP ranks' K/V blocks all-gather CP holds through the layer's
    attention (`Training.cp_comm`), working set in every recompute mode (`kernel.layer_terms`).
    `expert_ep`: (e, forward s, backward s) per EP width e > 1, the experts' grouped GEMMs as an
    EP-e rank runs them (E/e experts of e x the tokens each, `design.parallel.expert_parallel_op`);
    `experts_at(e)` reads them, the traced EP-1 `expert_fwd_s` / `expert_bwd_s` for a width not
    listed. The evaluator and the EP DP replace the EP-1 experts' time in `fwd_s` / `bwd_s` by it.
    """

    tp: int
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    params: np.ndarray
    activation_bytes: np.ndarray
    boundary_bytes: np.ndarray
    input_bytes: np.ndarray
    edges: tuple[tuple[int, int], ...] | None = None
    names: tuple[str, ...] = ()
    flops: np.ndarray | None = None
    selective_bytes: np.ndarray | None = None
    checkpoint_bytes: np.ndarray | None = None
    selective_work_bytes: np.ndarray | None = None
    full_work_bytes: np.ndarray | None = None
    selective_s: np.ndarray | None = None
    module_bytes: np.ndarray | None = None
    module_s: np.ndarray | None = None
    module_moe: np.ndarray | None = None
    block_ordinal: np.ndarray | None = None
    op_policy_bytes: np.ndarray | None = None
    op_policy_s: np.ndarray | None = None
    expert_params: np.ndarray | None = None
    dispatch_bytes: np.ndarray | None = None
    expert_fwd_s: np.ndarray | None = None
    expert_bwd_s: np.ndarray | None = None
    core_fwd_s: np.ndarray | None = None
    core_bwd_s: np.ndarray | None = None
    kv_bytes: np.ndarray | None = None
    cp: int = 1
    a2a_hidden_s: np.ndarray | None = None
    gathered_kv_bytes: np.ndarray | None = None
    expert_ep: tuple = ()

    def __post_init__(self):
        if isinstance(self.tp, bool) or not isinstance(self.tp, (int, np.integer)) or self.tp < 1:
            raise ValueError(f"LayerCosts.tp must be a positive integer, got {self.tp!r}")
        object.__setattr__(self, "tp", int(self.tp))
        fwd = _array("fwd_s", self.fwd_s, None, whole=False)
        n = fwd.shape[0]
        if n < 1:
            raise ValueError("LayerCosts: at least one layer is needed")
        object.__setattr__(self, "fwd_s", fwd)
        object.__setattr__(self, "bwd_s", _array("bwd_s", self.bwd_s, n, whole=False))
        for name in ("params", "activation_bytes", "boundary_bytes", "input_bytes"):
            object.__setattr__(self, name, _array(name, getattr(self, name), n, whole=True))
        flops = np.zeros(n) if self.flops is None else self.flops
        object.__setattr__(self, "flops", _array("flops", flops, n, whole=False))
        if self.edges is None:
            edges = tuple((i, i + 1) for i in range(n - 1))
        else:
            edges = tuple(sorted({(int(u), int(v)) for u, v in self.edges}))
            for u, v in edges:
                if not 0 <= u < v < n:
                    raise ValueError(f"LayerCosts.edges: ({u}, {v}) must satisfy 0 <= producer < consumer < {n}")
        object.__setattr__(self, "edges", edges)
        defaults = {
            "selective_bytes": self.activation_bytes,
            "selective_work_bytes": np.zeros(n),
            "full_work_bytes": self.activation_bytes,
            "checkpoint_bytes": None,
        }
        if self.checkpoint_bytes is None:
            inputs = np.array(self.input_bytes, dtype=np.float64)
            has_pred = np.zeros(n, dtype=bool)
            fed = np.zeros(n)
            for u, v in edges:
                has_pred[v] = True
                fed[v] += self.boundary_bytes[u]
            defaults["checkpoint_bytes"] = np.where(has_pred, fed, inputs)
        for name, default in defaults.items():
            value = getattr(self, name)
            object.__setattr__(self, name, _array(name, default if value is None else value, n, whole=True))
        sel_s = np.zeros(n) if self.selective_s is None else self.selective_s
        object.__setattr__(self, "selective_s", _array("selective_s", sel_s, n, whole=False))
        for name, whole in (("module_bytes", True), ("module_s", False), ("module_moe", False)):
            value = getattr(self, name)
            object.__setattr__(self, name, _array(name, np.zeros(n) if value is None else value, n, whole=whole))
        blocks = np.arange(1, n + 1) if self.block_ordinal is None else self.block_ordinal
        object.__setattr__(self, "block_ordinal", _array("block_ordinal", blocks, n, whole=True))
        kept = self.activation_bytes if self.op_policy_bytes is None else self.op_policy_bytes
        object.__setattr__(self, "op_policy_bytes", _array("op_policy_bytes", kept, n, whole=True))
        rerun = np.zeros(n) if self.op_policy_s is None else self.op_policy_s
        object.__setattr__(self, "op_policy_s", _array("op_policy_s", rerun, n, whole=False))
        if np.any(self.module_bytes > self.activation_bytes):
            raise ValueError("LayerCosts.module_bytes: more than the layer's activation_bytes")
        for name in PARALLEL_ARRAYS:
            value = getattr(self, name)
            whole = name.endswith("params") or name.endswith("bytes")
            object.__setattr__(self, name, _array(name, np.zeros(n) if value is None else value, n, whole=whole))
        if np.any(self.expert_params > self.params):
            raise ValueError("LayerCosts.expert_params: more than the layer's params")
        widths = []
        for entry in self.expert_ep:
            e, fwd_e, bwd_e = entry
            if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 2 or int(e) in widths:
                raise ValueError(f"LayerCosts.expert_ep: widths must be distinct integers above 1, got {e!r}")
            widths.append(int(e))
        object.__setattr__(self, "expert_ep", tuple(
            (int(e), _array("expert_ep", f, n, whole=False), _array("expert_ep", b, n, whole=False))
            for e, f, b in self.expert_ep))
        if isinstance(self.cp, bool) or not isinstance(self.cp, (int, np.integer)) or self.cp < 1:
            raise ValueError(f"LayerCosts.cp must be a positive integer, got {self.cp!r}")
        object.__setattr__(self, "cp", int(self.cp))
        names = tuple(self.names) if self.names else tuple(f"layer{i}" for i in range(n))
        if len(names) != n:
            raise ValueError(f"LayerCosts.names: expected {n} names, got {len(names)}")
        object.__setattr__(self, "names", names)

    def experts_at(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """The routed experts' grouped-GEMM (forward, backward) seconds per layer at EP width e."""
        for width, fwd_e, bwd_e in self.expert_ep:
            if width == e:
                return fwd_e, bwd_e
        return self.expert_fwd_s, self.expert_bwd_s

    def at_expert_width(self, e: int, v: int | None = None):
        """(forward, backward, experts' forward, experts' backward) of every layer (or of layer v)
        at EP width e: the layer times with the EP-1 experts' time replaced by that width's
        (`experts_at`), never below 0. The evaluator and the EP DP both read it."""
        fwd_e, bwd_e = self.experts_at(e)
        if v is None:
            return (np.maximum(0.0, self.fwd_s + (fwd_e - self.expert_fwd_s)),
                    np.maximum(0.0, self.bwd_s + (bwd_e - self.expert_bwd_s)), fwd_e, bwd_e)
        f, b = float(fwd_e[v]), float(bwd_e[v])
        return (max(0.0, float(self.fwd_s[v]) + (f - float(self.expert_fwd_s[v]))),
                max(0.0, float(self.bwd_s[v]) + (b - float(self.expert_bwd_s[v]))), f, b)

    @classmethod
    def from_layer_graph(cls, graph, fwd_s, bwd_s, selective_s=None, sequence_parallel: bool = False,
                         module_tags=frozenset(), module_s=None, module_moe=None, op_policy_s=None) -> "LayerCosts":
        """Per-layer arrays of a workload `LayerGraph` at its TP width, with each layer's forward
        and backward time (seconds per microbatch, e.g. from its kind's schedules), the attention
        core's forward time (selective recompute) and the memory of every recompute mode; with
        sequence parallelism the pipeline sends carry each rank's s/t share (`boundary_bytes_for`).
        `module_tags` (workload.stack.recompute_tags) and `module_s`: module-level recompute;
        `op_policy_s`: the forward ops torchtitan's op-level policy reruns (blocks only)."""
        layers = graph.layers
        sp = bool(sequence_parallel)
        ordinal = np.cumsum([l.kind in BLOCK_KINDS for l in layers]) * [l.kind in BLOCK_KINDS for l in layers]
        return cls(
            block_ordinal=ordinal,
            op_policy_bytes=[l.op_policy_kept_bytes(sp) if b else l.activation_bytes_for("none", sp)
                             for l, b in zip(layers, ordinal)],
            op_policy_s=op_policy_s,
            module_bytes=[l.module_bytes(module_tags, sp) for l in layers] if module_tags else None,
            module_s=module_s,
            module_moe=module_moe,
            selective_bytes=[l.activation_bytes_for("selective", sp) for l in layers],
            checkpoint_bytes=[l.checkpoint_bytes(sp) for l in layers],
            selective_work_bytes=[l.recompute_working_bytes("selective", sp) for l in layers],
            full_work_bytes=[l.recompute_working_bytes("full", sp) for l in layers],
            selective_s=selective_s,
            tp=graph.tp,
            fwd_s=fwd_s,
            bwd_s=bwd_s,
            params=[layer.params for layer in layers],
            activation_bytes=[layer.activation_bytes_for("none", sp) for layer in layers],
            boundary_bytes=[layer.boundary_bytes_for(sp) for layer in layers],
            input_bytes=[layer.input_bytes for layer in layers],
            edges=tuple(graph.edges),
            names=tuple(layer.name for layer in layers),
            flops=[layer.fwd_flops + layer.bwd_flops for layer in layers],
        )

    def with_times(self, fwd_s, bwd_s) -> "LayerCosts":
        """These layers with other forward and backward times: the sizes were checked when these
        costs were made and do not depend on the times, so only the times are checked again (the
        bounds price one graph's sizes with the layer times of thousands of designs)."""
        n = self.n_layers
        out = object.__new__(LayerCosts)
        out.__dict__.update(self.__dict__)
        object.__setattr__(out, "fwd_s", _array("fwd_s", fwd_s, n, whole=False))
        object.__setattr__(out, "bwd_s", _array("bwd_s", bwd_s, n, whole=False))
        return out

    @property
    def n_layers(self) -> int:
        return int(self.fwd_s.shape[0])

    def is_chain(self) -> bool:
        return self.edges == tuple((i, i + 1) for i in range(self.n_layers - 1))


def state_split(problem: "PlacementProblem") -> tuple[int, int, int]:
    """(weight, gradient, optimizer state) bytes per parameter: the System's state bytes split into
    the 16-bit (or fp32) weight, its gradient, and the rest (fp32 master weight and Adam's moments
    under mixed precision; ZeRO, Rajbhandari et al., SC'20, Sec. 3.1); a recipe's optimizer-state
    layout (`Training.optimizer_state`) replaces the rest with its own bytes. A low-precision
    recipe's weight copies are not state the optimizer shards: `weight_copies`."""
    system = problem.system
    e = system.bytes_per_element
    layout = problem.training.optimizer_state_bytes
    rest = system.state_bytes_per_param - e - system.grad_bytes_per_param if layout is None else layout
    # Parameters held in FP8 / MXFP8 (`Training.fp8_param_gather`): 1 byte each (MXFP8's scale,
    # 1/32 B, left out as for the copies); gradients and the optimizer's master stay as they are.
    return (1 if problem.training.fp8_param_gather else e), system.grad_bytes_per_param, rest


def reduce_bytes(problem: "PlacementProblem") -> int:
    """Bytes per parameter of every data-parallel gradient collective (all-reduce, reduce-scatter):
    the gradient's width, or the recipe's reduction format (`Training.reduce_dtype`, FSDP's mixed
    precision). The one rule the evaluator and both DPs read."""
    return problem.training.reduce_bytes(problem.system.grad_bytes_per_param)


def gather_bytes(problem: "PlacementProblem") -> int:
    """Bytes per parameter a ZeRO weight all-gather moves: the weight as held (`state_split`), or its
    FP8 cast with `Training.fp8_all_gather` (each rank casts its shard before the gather; torchao
    `enable_fsdp_float8_all_gather`)."""
    return 1 if problem.training.fp8_all_gather else state_split(problem)[0]


def optimizer_pass_bytes(problem: "PlacementProblem") -> tuple[int, int]:
    """HBM bytes per parameter of the once-per-batch work after the last backward, as two parts
    sharded differently: (over the optimizer's shard, over the gradient buffer).

    The first part is the optimizer step itself, a memory-bound pass (Adam's update reads the
    gradient and the optimizer state and writes the state and the weight: w + g + 2 o), plus the
    gradient-norm pass of gradient clipping, which reads the same gradients once more (Megatron-LM
    `clip_grad_norm_fp32` / `get_grad_norm_fp32`, a `multi_tensor_l2norm` over the gradients the
    optimizer updates; clipping is on by default, `--clip-grad 1.0`): the distributed optimizer
    (ZeRO-1 and up) runs both over its shard only. The second part is zeroing the gradient buffer
    for the next batch (Megatron-Core `DistributedDataParallel.zero_grad_buffer`, called by
    `train_step` every iteration), a write of every gradient the device holds: whole under ZeRO 0
    and 1, sharded as the gradients are under ZeRO-2 and 3. Both scale with the parameters per
    device, as their cause does; none is a fitted constant."""
    w, g, o = state_split(problem)
    return w + 2 * g + 2 * o, g


def weight_copies(problem: "PlacementProblem") -> int:
    """Bytes per parameter of a low-precision recipe's weight copies (workload/precision.py,
    `weight_copy_bytes`; 0 in BF16). They sit beside the 16-bit weight and are sharded as it is:
    Megatron-Core's distributed optimizer (ZeRO-1) distributes only the optimizer state, "[no]
    distribute model parameters" (Megatron-Core developer guide, "Distributed Optimizer"), and
    Transformer Engine quantizes each rank's whole local weight into its own FP8 workspace (TE
    user guide, "Performance Considerations", "Memory usage": weights kept in high precision and
    quantized before each GEMM), so under ZeRO 0 and 1 (and 2, which holds the weight whole too)
    every data-parallel rank holds all of its stage's copies. Under ZeRO-3 the weight is gathered
    per layer and the copies are made from the gathered weight: they live in that layer's working
    set beside it. A chip that reads FP8 column-wise as it is keeps no transposed copy
    (`fp8_transposed_copy`)."""
    copies = weight_copy_bytes(problem.training.precision, problem.fp8_transposed_copy)
    # With the parameters held in the format (`Training.fp8_param_gather`) the row-wise copy is the
    # parameter itself (`state_split`'s weight bytes).
    return copies - 1 if problem.training.fp8_param_gather else copies



# LayerCosts' expert- and context-parallel per-layer terms, zero by default (a dense model at a short sequence).
PARALLEL_ARRAYS = ("expert_params", "dispatch_bytes", "expert_fwd_s", "expert_bwd_s", "core_fwd_s", "core_bwd_s",
                   "kv_bytes", "a2a_hidden_s", "gathered_kv_bytes")


@dataclass(frozen=True, eq=False)
class PlacementProblem:
    """Everything the placement needs for one design trained by one recipe.

    `costs`: one LayerCosts per allowed TP width (same layers and edges in each);
    `hbm_bytes`: HBM capacity per accelerator; `peak_flops`: its peak FLOP/s (for MFU);
    `training`: the whole recipe (`training.Training`), already validated: the placement reads its
    microbatch, recompute mode, virtual stages (interleaved 1F1B), ZeRO stage, overlapped gradient
    reduction and load imbalance from it, and holds no copy of any of them; sequence parallelism
    and the attention kernel are already in the LayerCosts. `seq_len`: tokens per sequence (for
    tokens/s); `model_flops_per_sequence`: forward + backward FLOP of the whole model for one
    sequence, without recompute (the MFU numerator); `hbm_bandwidth` (bytes/s, the optimizer step's
    HBM traffic; 0: the step is not costed) and `interleave_layers` (the layer count Megatron's
    interleaving constraint divides by p*v; 0: all layers).
    """

    costs: tuple[LayerCosts, ...]
    system: System
    hbm_bytes: float
    peak_flops: float
    training: Training = Training()
    seq_len: int = 0
    model_flops_per_sequence: float = 0.0
    hbm_bandwidth: float = 0.0
    interleave_layers: int = 0
    # Lower-bound mode (design/upper_bound.placement_throughput): an overlapped data-parallel
    # reduction counts as wholly hidden (exposed 0). Its exposed part max(0, reduction - backward) is
    # the one time term that falls as layer times grow, so a bound on lower-bound layer times must not
    # charge it; every other term keeps its cost. Never set for an evaluation.
    reduction_hidden: bool = False
    # Expert and context parallelism: the widths searched and the LayerCosts traced at seq / c for
    # each c > 1 (their `cp` set; one per TP width).
    ep_widths: tuple = (1,)
    cp_widths: tuple = (1,)
    cp_costs: tuple = ()
    # Whether an FP8 recipe keeps a transposed FP8 weight copy beside the row-wise one: the chip's
    # tensor cores read FP8 K-major only (Hopper; not `Accelerator.tc_fp8_any_layout`). `weight_copies`.
    fp8_transposed_copy: bool = True
    # Experts per token (the router's top-k): the copies of each token a `dispatch_bytes` payload
    # holds, which DeepEP sends once per node (`System.alltoall_s`).
    top_k: int = 1
    # Group-limited routing, (router_groups, router_group_topk) of the model ((0, 0): none): fewer
    # nodes a token reaches, what DeepEP sends fewer copies to (`System.alltoall_s`).
    router_groups: tuple = (0, 0)

    def __post_init__(self):
        costs = self.costs.values() if isinstance(self.costs, Mapping) else self.costs
        costs = tuple(sorted(costs, key=lambda c: c.tp))
        if not costs:
            raise ValueError("PlacementProblem: costs for at least one TP width are needed")
        widths = [c.tp for c in costs]
        if len(set(widths)) != len(widths):
            raise ValueError(f"PlacementProblem: duplicate TP widths {widths}")
        first = costs[0]
        for c in costs[1:]:
            if c.n_layers != first.n_layers or c.edges != first.edges:
                raise ValueError(f"PlacementProblem: TP width {c.tp} has a different layer graph than {first.tp}")
        object.__setattr__(self, "costs", costs)
        if not (self.hbm_bytes >= 0 and math.isfinite(self.hbm_bytes)):
            raise ValueError(f"PlacementProblem.hbm_bytes must be finite and non-negative, got {self.hbm_bytes!r}")
        # Whole bytes, like every other memory figure (see the module docstring).
        object.__setattr__(self, "hbm_bytes", float(math.floor(self.hbm_bytes)))
        if not isinstance(self.training, Training):
            raise ValueError(f"PlacementProblem.training must be a Training recipe, got {self.training!r}")
        self._check_parallel(first)
        object.__setattr__(self, "reduction_hidden", bool(self.reduction_hidden))
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 1:
            raise ValueError(f"PlacementProblem.top_k must be a positive integer, got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "router_groups", tuple(int(x) for x in self.router_groups))
        if not (self.hbm_bandwidth >= 0 and math.isfinite(self.hbm_bandwidth)):
            raise ValueError(f"PlacementProblem.hbm_bandwidth must be finite and non-negative, got {self.hbm_bandwidth!r}")
        il = int(self.interleave_layers) or first.n_layers
        object.__setattr__(self, "interleave_layers", il)
        for c in costs:
            largest = largest_memory_bytes(
                float(np.sum(c.params)), sum(state_split(self)) + weight_copies(self), c.n_layers,
                float(np.sum(c.activation_bytes) + np.sum(c.boundary_bytes) + np.sum(c.input_bytes)),
            )
            if largest >= EXACT_BYTES:
                raise ValueError("PlacementProblem: byte counts too large to add exactly in float64")

    def _check_parallel(self, first: LayerCosts) -> None:
        for name in ("ep_widths", "cp_widths"):
            widths = tuple(sorted({int(w) for w in getattr(self, name)}))
            if not widths or widths[0] < 1 or 1 not in widths:
                raise ValueError(f"PlacementProblem.{name} must be positive integers including 1, got {getattr(self, name)!r}")
            object.__setattr__(self, name, widths)
        cp_costs = tuple(sorted(self.cp_costs, key=lambda c: (c.cp, c.tp)))
        for c in cp_costs:
            if c.n_layers != first.n_layers or c.edges != first.edges or c.cp < 2:
                raise ValueError("PlacementProblem.cp_costs: each must have cp > 1 and the same layer graph")
        keys = [(c.tp, c.cp) for c in cp_costs]
        if len(set(keys)) != len(keys):
            raise ValueError("PlacementProblem.cp_costs: one LayerCosts per (tp, cp)")
        object.__setattr__(self, "cp_costs", cp_costs)

    @property
    def parallel_dims(self) -> bool:
        """Whether expert or context parallelism (or a load imbalance, or experts folded onto their
        own grid) is in play: the placement is then searched by `solve/placement/expert.py` (the
        dense DP reduces every parameter over the dense replicas)."""
        return self.ep_widths != (1,) or self.cp_widths != (1,) or (
            self.training.load_imbalance != 1.0 and any(np.any(c.expert_fwd_s + c.expert_bwd_s > 0) for c in self.costs)
        ) or any(self.training.expert_tp(c.tp) != c.tp and c.expert_params is not None and np.any(c.expert_params > 0)
                 for c in self.costs)

    def costs_at(self, tp: int, cp: int = 1) -> LayerCosts:
        """The LayerCosts at TP width tp traced at seq / cp tokens (cp = 1: `costs_for`)."""
        if cp == 1:
            return self.costs_for(tp)
        for c in self.cp_costs:
            if c.tp == tp and c.cp == cp:
                return c
        raise PhazeError(f"no layer costs for TP width {tp} at context parallelism {cp}")

    @property
    def n_layers(self) -> int:
        return self.costs[0].n_layers

    @property
    def tp_widths(self) -> tuple[int, ...]:
        return tuple(c.tp for c in self.costs)

    def costs_for(self, tp: int) -> LayerCosts:
        for c in self.costs:
            if c.tp == tp:
                return c
        widths = ", ".join(map(str, self.tp_widths))
        raise PhazeError(f"no layer costs for TP width {tp}; available widths are {widths}")

    @property
    def simple(self) -> bool:
        """No option that makes memory or the per-batch term depend on the replica count or the
        stage count: the DP's fast path (see placement.py)."""
        tr = self.training
        return tr.virtual_stages == 1 and tr.zero == 0 and not tr.overlap_grad_reduce

    def interleaves(self, pp: int, dp: int) -> str:
        """'' when interleaving with this problem's v is allowed at pp stages and dp replicas, else
        why not (Megatron-Core: whole layers per virtual stage, `Training.interleave_split_ok`;
        microbatches a multiple of p; pp = 1 runs no pipeline, so v has no effect there)."""
        v = self.training.virtual_stages
        if v == 1 or pp == 1:
            return ""
        tr = self.training
        if not tr.interleave_split_ok(self.interleave_layers, pp):
            if tr.account_for_embedding or tr.account_for_loss:
                counted = self.interleave_layers + int(tr.account_for_embedding) + int(tr.account_for_loss)
                return (f"interleaving needs the {counted} layers counted in the pipeline split (embedding/loss "
                        f"included) divisible by pp x v = {pp * v}")
            return (f"interleaving needs the {self.interleave_layers} layers divisible by v = {v} and at least "
                    f"pp x v = {pp * v} (or the embedding/loss counted in the split)")
        m = self.microbatches(dp)
        if m % pp:
            return f"interleaving needs the {m} microbatches to be a multiple of pp {pp}"
        return ""

    def unpaired_microbatches(self, pp: int, dp: int) -> float:
        """Under the EP all-to-all overlap (`Training.moe_a2a_overlap`), the stage times' worth of
        all-to-all that the pipeline's unpaired microbatches leave exposed: u with
        time = bottleneck x (m + (p - 1)/v) + u x the overlap's hidden time per microbatch.

        Megatron-Core pairs the forward of one microbatch (model chunk) with the backward of
        another only in the steady 1F1B phase; its warm-up forwards and cool-down backwards run
        alone, and the overlap adds one warm-up microbatch (`get_pp_rank_microbatches` in
        megatron/core/pipeline_parallel/schedules.py: `num_warmup_microbatches + 1` when
        `overlap_moe_expert_parallel_comm`; with PP = 1 the first forward and last backward).
        On the first pipeline rank, W = 2 (p - 1) + (v - 1) p + 1 chunks warm up (at most all m v),
        so it runs W unpaired chunk forwards and backwards, m v - W pairs, and waits (p - 1)
        chunk times as without the overlap: with T (P) a stage's unpaired (paired) time per
        microbatch, time = (m v - W) P / v + (W + p - 1) T / v = (m + (p - 1)/v) P + u (T - P),
        u = (min(W, m v) + p - 1) / v; u = 1 at p = 1 (v plays no part there)."""
        m = self.microbatches(dp)
        if pp == 1:
            return 1.0
        v = self.training.virtual_stages
        warmup = min(2 * (pp - 1) + (v - 1) * pp + 1, m * v)
        return (warmup + pp - 1) / v

    def microbatches(self, dp: int) -> int:
        """Microbatches per pipeline per step: ceil(global batch / (microbatch * replicas))."""
        return -(-self.system.global_batch // (self.training.mbs * dp))


@dataclass(frozen=True)
class Placement:
    """A `Layout` (TP, DP, EP, CP; PP = the number of stages) with its pipeline stages as layer index
    tuples, first to last: what the evaluator prices and the DPs return.

    Each stage runs on `tp` devices of every one of the `dp` replicas.
    """

    tp: int
    dp: int
    stages: tuple[tuple[int, ...], ...]
    ep: int = 1  # expert parallelism: experts split over ep of the dp replicas (ep divides dp)
    cp: int = 1  # context parallelism: each stage's sequence split over cp groups of tp devices

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def layout(self) -> Layout:
        return Layout(self.tp, self.pp, self.dp, self.ep, self.cp)


@dataclass
class StageResult:
    index: int
    layers: list  # layer indices
    first_layer: str
    last_layer: str
    devices: int  # per replica (= tp)
    ranks: list  # [first, last] rank of this stage in replica 0 (see phaze_opt.system)
    inflight_microbatches: int  # stashed under 1F1B: min(stages from the end, microbatches)
    time_s: float  # per microbatch: compute + recompute + receives
    compute_s: float
    recompute_s: float
    comm_s: float
    params: float  # per device
    memory_bytes: float  # per device
    headroom_bytes: float  # HBM minus memory
    allreduce_s: float  # the exposed data-parallel gradient reduction per batch
    flops: float  # per device per microbatch
    optimizer_step_s: float = 0.0  # the optimizer step's HBM traffic per batch
    # EP all-to-all overlap: what the unpaired warm-up and cool-down microbatches expose per batch
    unpaired_a2a_s: float = 0.0
    # memory per device: parameters, gradients, optimizer_state, activations, recompute_working_set
    memory_split: dict = field(default_factory=dict)


@dataclass
class PlacementResult:
    feasible: bool
    reason: str
    tp: int
    pp: int
    dp: int
    microbatches: int
    devices_used: int
    time_per_batch_s: float  # inf when infeasible
    throughput: float  # sequences/s (global batch / time per batch)
    tokens_per_s: float
    bottleneck_s: float  # slowest stage per microbatch
    pipeline_s: float  # bottleneck x (microbatches + stages - 1)
    allreduce_s: float  # slowest stage's data-parallel gradient all-reduce
    bubble_fraction: float  # (stages - 1) / (microbatches + stages - 1)
    mfu: float
    hbm_bytes: float
    peak_memory_bytes: float  # the fullest stage's memory per device
    stages: list = field(default_factory=list)
    method: str = ""  # evaluated | dp-chain | dp-dag
    solve_s: float = 0.0
    min_memory_bytes: float | None = None  # when no placement fits: the least any placement needs
    info: dict = field(default_factory=dict)
    optimizer_step_s: float = 0.0  # the slowest stage's optimizer step
    ep: int = 1
    cp: int = 1

    def placement(self) -> Placement | None:
        if not self.stages:
            return None
        return Placement(self.tp, self.dp, tuple(tuple(s.layers) for s in self.stages), self.ep, self.cp)

    def placement_dict(self) -> dict:
        """The `placement` entry of a DesignResult."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "ep": self.ep,
            "cp": self.cp,
            "microbatches": self.microbatches,
            "devices_used": self.devices_used,
            "bubble_fraction": self.bubble_fraction,
            "allreduce_s": self.allreduce_s,
            "optimizer_step_s": self.optimizer_step_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "stages": [asdict(s) for s in self.stages],
        }

    def to_dict(self) -> dict:
        return asdict(self)


def infeasible_result(problem: PlacementProblem, reason: str, **fields) -> PlacementResult:
    values = dict(
        feasible=False, reason=reason, tp=0, pp=0, dp=0, microbatches=0, devices_used=0,
        time_per_batch_s=math.inf, throughput=0.0, tokens_per_s=0.0, bottleneck_s=math.inf,
        pipeline_s=math.inf, allreduce_s=0.0, bubble_fraction=0.0, mfu=0.0,
        hbm_bytes=problem.hbm_bytes, peak_memory_bytes=0.0,
    )
    values.update(fields)
    return PlacementResult(**values)


def check_placement_shape(problem: PlacementProblem, placement: Placement) -> None:
    """Reject placements that are not placements at all (a one-line PhazeError).

    Running out of devices or memory is not an error: the evaluator reports it as infeasible.
    """
    costs = problem.costs_for(placement.tp)
    n = costs.n_layers
    for key in ("ep", "cp"):
        value = getattr(placement, key)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise PhazeError(f"placement: {key} must be a positive integer, got {value!r}")
    if placement.cp > 1:
        problem.costs_at(placement.tp, placement.cp)
    if isinstance(placement.dp, bool) or not isinstance(placement.dp, (int, np.integer)) or placement.dp < 1:
        raise PhazeError(f"placement: dp must be a positive integer, got {placement.dp!r}")
    if not placement.stages:
        raise PhazeError("placement: at least one stage is needed")
    stage_of = [-1] * n
    for s, stage in enumerate(placement.stages):
        if not stage:
            raise PhazeError(f"placement: stage {s} has no layers")
        for v in stage:
            if not (isinstance(v, (int, np.integer)) and 0 <= v < n):
                raise PhazeError(f"placement: stage {s} names layer {v!r}; layers are 0..{n - 1}")
            if stage_of[v] != -1:
                raise PhazeError(f"placement: layer {v} is in stages {stage_of[v]} and {s}")
            stage_of[v] = s
    missing = [v for v in range(n) if stage_of[v] == -1]
    if missing:
        raise PhazeError(f"placement: layers {missing[:5]} are in no stage")
    for u, v in costs.edges:
        if stage_of[u] > stage_of[v]:
            raise PhazeError(
                f"placement: layer {u} (stage {stage_of[u]}) feeds layer {v} (stage {stage_of[v]}), "
                "an earlier stage; stages must follow the layer graph"
            )
