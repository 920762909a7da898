"""How a model is trained on a design: the training recipe, validated once.

`Training` is the noun every layer that needs the recipe takes, whole: an evaluator
(`design.protocols.Evaluator`), the placement problem (`PlacementProblem.training`, no copies of its
fields), the level-1 bounds, the study's baseline and the published comparison. A space's or a
suite's values become a recipe in one place (`Training.from_point`); `recipe_points` lists every
recipe a space offers, so a reference can be given each one a trial may get. It sits at the bottom
of the package stack (it imports only `errors`), so every layer can take it without importing upward.

It holds

- `mbs`: sequences per microbatch (a positive integer);
- `recompute`: the activation recompute mode, `none | selective | full` (Korthikanti et al. 2022);
  a bool is accepted for the old on/off recipe (True -> "full", False -> "none");
- `placement`: "optimal" (the placement DP chooses TP/PP/DP and the stages), "expert" (the
  model config's own TP/PP/DP, layers split evenly) or a fixed "tp=T,pp=P,dp=D";
- `sequence_parallel`: Megatron's sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2): the
  norm and dropout regions sharded over the TP group;
- `virtual_stages`: v model chunks per pipeline device, interleaved 1F1B (Narayanan et al., SC'21);
- `zero`: optimizer sharding over data parallelism, 0 (none), 1 (ZeRO-1 / Megatron's distributed
  optimizer), 2 or 3 (ZeRO-3 / FSDP; Rajbhandari et al., SC'20). Stage 2 shards the optimizer
  state and the gradients and holds the 16-bit weights whole through the step (ZeRO P_os+g, Sec.
  5.2; PyTorch FSDP `SHARD_GRAD_OP`, FSDP2 `reshard_after_forward=False`; Llama 3 405B: "Our use
  of FSDP for Llama 3 shards optimizer states and gradients, but for model shards we do not
  reshard after forward computation", Llama Team, arXiv 2407.21783, Sec. 3.3.2). A sharded
  gradient cannot wait for the last microbatch, so each microbatch's backward reduce-scatters the
  stage's gradients (DeepSpeed ZeRO-2 reduces after every backward: "each rank retains only the
  accumulated gradients of its partition", deepspeedai/DeepSpeed issue 2252; FSDP reduce-scatters
  after each backward unless `no_sync`, which keeps whole gradients); the updated weights are
  all-gathered once per iteration after the optimizer step (`solve.placement.evaluate`);
- `overlap_grad_reduce`: the data-parallel gradient reduction runs beside the backward pass
  (Megatron `--overlap-grad-reduce`, PyTorch DDP buckets);
- `attention`: the attention kernel, `unfused | flash` (Dao et al. 2022, 2023); None keeps the
  model config's own choice;
- `capacity_factor`: a mixture of experts' expert buffers hold capacity_factor x the mean tokens
  per expert (Fedus et al. 2022, Switch Transformer, eq. 3); the traced expert GEMMs and the
  all-to-all bytes carry the padded buffers (default 1.0, balanced);
- `load_imbalance`: tokens received by the busiest expert-parallel rank over the mean (>= 1); the
  synchronous all-to-all and the experts' compute wait for that rank (default 1.0, balanced).
- `account_for_embedding`, `account_for_loss`: the pipeline split counts the embedding (the loss)
  as one more decoder layer (Megatron-Core `--account-for-embedding-in-pipeline-split`,
  `--account-for-loss-in-pipeline-split`), which is what lets interleaving split a layer count
  that p x v does not divide (Llama 3 405B: 126 + 2 = 128 layers at PP 16 x VP 8); they change
  which (pp, v) interleave (`interleave_split_ok`), not any time or byte (the embedding and the
  loss are already nodes of the layer graph, priced in their stages). Default off.
- `optimizer_state`: the optimizer-state layout, bytes per parameter beyond the weight and its
  gradient: None (default) keeps the system's own accounting; `fp32-adam` an fp32 master weight and
  fp32 Adam moments, 12 B (16 B with 16-bit weight and gradient; Rajbhandari et al., SC'20,
  Sec. 3.1, K = 12); `bf16-moments` an fp32 master weight and BF16 moments, 8 B (Megatron-Core's
  precision-aware optimizer, `--use-precision-aware-optimizer --exp-avg-dtype bf16
  --exp-avg-sq-dtype bf16`); `bf16-adamw` BF16 moments and no master copy, 4 B (pure BF16 AdamW,
  8 B per parameter in all; Zamirai et al. 2020, "Revisiting BFloat16 Training"). It sets the
  state each device holds (sharded as ZeRO says) and the bytes the optimizer step streams.
- `precision`: the number format of the transformer blocks' linear-layer GEMMs, `bf16` (default,
  every GEMM in BF16), `fp8` (Transformer Engine's per-tensor delayed scaling, E4M3 forward / E5M2
  gradients, Megatron-Core `--fp8-format hybrid --fp8-recipe delayed`), `mxfp8` (OCP MX blocks of
  32 elements with an E8M0 scale, `--fp8-recipe mxfp8`) or `nvfp4` (blocks of 16 with an E4M3
  scale). What runs in the format, the casts and the FP8 weight copies: `workload/precision.py`;
  a chip whose tensor cores lack the format makes the design infeasible (`Accelerator.mac_rate`).

- `fp8_param_gather`: the model's parameters are held in the recipe's low-precision format
  instead of BF16 (Megatron-Core `--fp8-param-gather`, Transformer Engine's `fp8_model_init`;
  Megatron-Bridge sets it in its FP8 and MXFP8 mixed-precision recipes,
  training/mixed_precision.py): no 16-bit weight, the FP8 (MXFP8) weight is itself the row-wise
  copy (the column-wise one stays where the chip needs it), and the distributed optimizer's
  all-gather and a ZeRO-3 gather move 1-byte weights; the FP32 master stays in the optimizer
  state (`solve/placement/types.py` `state_split`, `weight_copies`). Needs precision fp8 or
  mxfp8. Default off.
- `overlap_param_gather`: under ZeRO-1 (the distributed optimizer) the all-gather of the updated
  weights runs under the next iteration's forward pass (Megatron `--overlap-param-gather`, which
  needs `--use-distributed-optimizer`): each bucket's gather is issued ahead of the layers that
  use it, so what it cannot hide is the part longer than the stage's forward of the first
  microbatch; ZeRO-2's once-per-iteration gather of the weights hides the same way (FSDP with
  `SHARD_GRAD_OP` gathers them layer by layer in the first forward, prefetched); with ZeRO-0
  there is no such gather and with ZeRO-3 the gathers are per layer already, so it changes
  nothing there. Default off.
- `overlap_p2p_comm`: the interleaved schedule's pipeline sends and receives run beside compute
  (Megatron-LM's default with interleaving, `--no-overlap-p2p-communication` turns it off; NeMo and
  Megatron-Bridge set it whenever the virtual pipeline size is above 1): each step posts its
  transfers asynchronously and waits for them only before the step that needs them, so in the
  steady state a stage's messages hide under its compute; in the warm-up and flush (without
  `--overlap-p2p-communication-warmup-flush`) they do not (`solve/placement/evaluate.py`). No
  effect without interleaving (virtual_stages 1), where Megatron-LM turns it off. Not sampled by a
  space. None (the default): the stack's own default (`overlaps_p2p`: on under `megatron-te`, whose
  Megatron-Core, NeMo and Megatron-Bridge turn it on with interleaving; off under `megatron-lm`, the
  2021-22 Megatron-LM whose schedule sent in batches, and `eager`).
- `tp_comm_overlap`: with sequence parallelism, each layer's TP reduce-scatters and all-gathers
  run beside its GEMMs (Megatron-Core `--tp-comm-overlap`: Transformer Engine's userbuffers split
  each collective into chunks pipelined with the GEMM that produces or consumes them; Wang et al.,
  "Overlap Communication with Dependent Computation via Decomposition", ASPLOS 2023): a layer pass
  of time T with TP collectives C takes max(T - C + x C, C), the part of C longer than the rest of
  the pass exposed, and x C for what the overlap costs itself: a pipelined reduce-scatter's last
  chunk runs after its GEMM and the collective kernels take SMs from the GEMMs beside them (x from
  the userbuffers plan NVIDIA ships for H100: 0.20 forward, 0.06 backward; `design.evaluate.UB_EXPOSED`,
  `layer_costs`). Without SP the all-reduces stay exposed (the
  overlap needs SP). Not sampled by a space: the sweep's level-0 bounds take layer times as they
  are. Default off.
- `stack`: the software stack's kernel fusion, which sets how many kernels a layer launches and
  the bytes they move (`workload/stack.py`, each fusion with its source): `eager` (one kernel per
  PyTorch operator, as the `layers-h100` truth ran), `megatron-lm` (default: chains of pointwise
  operators fused, Megatron-LM's fused bias+GeLU, bias+dropout+add and scale+mask+softmax;
  Narayanan et al., SC'21, Sec. 4.2) or `megatron-te` (Megatron-Core with Transformer Engine:
  also LayerNorm/RMSNorm and RoPE as one kernel each, FP8 casts inside the kernel that produces
  the operand). Not sampled by a space, like `tp_comm_overlap`.

- `expert_tensor_parallel`: the MoE layers' own tensor-parallel width ETP, with MoE parallel
  folding (Liu et al. 2025, "MoE Parallel Folding: Heterogeneous Parallelism Mappings for
  Efficient Large-Scale MoE Model Training with Megatron Core", arXiv 2504.14960; Megatron-Core
  `--expert-tensor-parallel-size`, whose default is the TP size, and its MoE README, "MoE Parallel
  Folding"): the attention layers keep the TP x CP x DP x PP grid, the MoE layers take ETP x EP x
  EDP x PP over the same ranks (ETP x EP x EDP = TP x CP x DP, ranks ordered etp, ep, edp), so the
  EP group may span TP and CP ranks, not only DP replicas. EP x ETP must divide TP x CP x DP; the
  all-to-all runs over EP ranks ETP apart, the expert GEMMs shard by ETP, expert gradients reduce
  over EDP (`expert_replicas`). None (default): the unfolded layout of today, ETP = TP and EP
  a sub-group of the DP replicas (EP divides DP, ranks tp, cp, ep/dp, pp). Not sampled by a space.

- `moe_a2a_overlap`: Megatron-Core v0.14's batch-level EP all-to-all overlap
  (`--overlap-moe-expert-parallel-comm --delay-wgrad-compute`; Megatron-LM
  megatron/core/transformer/moe/README.md, "EP A2A Overlap: overlaps All-to-All with computation
  by merging FWD-BWD passes of adjacent microbatches"; the same idea as DeepSeek-V3's DualPipe,
  arXiv 2412.19437 Sec. 3.2.1): in the steady 1F1B phase the forward of one microbatch runs
  merged with the backward of another, each of the four all-to-alls under one compute phase of the
  other microbatch (Megatron-Core's `schedule_layer_1f1b`), so an MoE layer's paired forward +
  backward takes the sum over phases of max(phase compute, all-to-all): at least max(compute,
  all-to-alls), at most their sum; the warm-up forwards and cool-down backwards run unpaired,
  exposed (`placement.evaluate`).
  Megatron-Core refuses it with full recompute and, when PP > 1, without interleaving
  (`TransformerConfig.__post_init__`: "virtual_pipeline_model_parallel_size must be specified when
  pipeline_model_parallel_size > 1"; "disable full recomputation"): the first is refused here,
  the second makes such a placement infeasible. No effect at EP = 1. Not sampled by a space.
  Default off.
- `moe_dispatcher`: how the EP all-to-all moves tokens: `alltoall` (default, Megatron-Core's
  `--moe-token-dispatcher-type alltoall`: every token copy to its expert's rank) or `deepep`
  (`--moe-token-dispatcher-type flex --moe-enable-deepep`, DeepSeek's DeepEP: a token crosses
  the inter-node network once per destination node and is forwarded to its experts there over
  NVLink; DeepSeek-V3 tech report, arXiv 2412.19437, Sec. 3.2.2). Priced by `System.alltoall_s`;
  inside one node the two are the same. Not sampled by a space.
- `recompute_modules`: Megatron-Core's module-level selective recompute (`--recompute-granularity
  selective --recompute-modules ...`, Megatron-Core v0.13, "Fine-grained recomputation";
  `TransformerConfig.recompute_modules` and the MoE README, "Fine-grained Recomputation"), a tuple
  of module names, only with `recompute = "selective"`. None (default) is Megatron's default
  `["core_attn"]`, today's `selective`. `core_attn` recomputes the attention core (standard
  checkpointing); `layernorm` the blocks' input and pre-MLP norms (output-discarding: their outputs
  and statistics are dropped after their consumers ran and rebuilt before those consumers'
  backward); `moe_act` the routed experts' activation (output-discarding: the SwiGLU product that
  FC2 reads); `mlp` a dense block's MLP, `moe` a MoE layer, `shared_experts` its shared experts
  (standard checkpointing: the module keeps only its input); `mla_up_proj` multi-head latent
  attention's up-projections and RoPE (output-discarding: the Q, K and V the core attention reads,
  MLASelfAttention `qkv_up_proj_and_rope_apply`). Which saved tensors each drops and the ops it
  reruns are read off the trace (`workload/trace.py`, "Module-level recompute"). A module a layer
  lacks changes nothing in that layer,
  as in Megatron-Core, where each flag acts only inside its module: one recipe serves a model
  that mixes dense and MoE blocks (DeepSeek-V3's first blocks: `mlp` acts there, `moe` on the
  rest), so a module the whole model lacks (`moe_act` on a dense model) is accepted as a no-op.
- `expert_weights`: where a MoE layer applies its router's gate weights: `combine` (each expert
  output row scaled as it is added back to its token: GShard, Switch Transformer, Megatron-Core
  before 0.13, whose unpermute keeps the second linear's output for the weights' gradient) or
  `activation` (the expert MLP scales its activation's output before the second linear:
  Megatron-Core from 0.13, TEGroupedMLP's fused `weighted_bias_swiglu`, which keeps only its input
  and the weights). None (default): the stack's (`workload/stack.py`; `activation` under
  `megatron-te`, else `combine`). Changes a MoE layer's saved bytes and its element-wise work; no
  effect on a dense model.
- `cp_comm`: how context parallelism moves K and V (Megatron-Core `--cp-comm-type`): `p2p`
  (default: ring attention, each of the c - 1 K/V blocks passed to the ring neighbour while the
  attention core of the block before runs; Liu et al. 2023) or `all_gather` (Megatron-Core /
  Transformer Engine `AttnFuncWithCPAndKVAllGather`, whose docstring says the "KV all-gather
  between CP ranks is exposed": the whole sequence's K and V are all-gathered over the CP group
  before the attention and dK, dV reduce-scattered after its backward, neither under compute).
  Meta trains Llama 3 405B's long-context stage so: "we first all-gather the key (K) and value
  (V) tensors, and then compute attention output for the local query (Q) tensor chunk ...
  Although the all-gather communication latency is exposed in the critical path ... the
  communicated K and V tensors are much smaller than Q tensor due to the use of GQA" (Llama Team,
  arXiv 2407.21783, Sec. 3.3.2, "Context parallelism"). Priced in `solve.placement.evaluate`;
  Megatron-Core's `a2a` and `a2a+p2p` are not modelled. No effect at CP 1. Not sampled by a space.

A new field gets a default that means today's behaviour (so every caller and stored study keeps
working), its check in `__post_init__`, and, when a search space may sample it, its name in
`SAMPLED_FIELDS`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import PhazeError

# Training fields a search space samples (a space must list each; a one-item list fixes it).
SAMPLED_FIELDS = ("mbs", "recompute")
# Recipe fields a space may also sample (each optional in a space; absent means the default below).
OPTIONAL_FIELDS = ("sequence_parallel", "virtual_stages", "zero", "overlap_grad_reduce", "attention",
                   "optimizer_state", "precision", "overlap_param_gather")
# Every recipe field a space can sample, in the order a point lists them.
RECIPE_FIELDS = SAMPLED_FIELDS + OPTIONAL_FIELDS
RECOMPUTE_MODES = ("none", "selective", "full")
# Megatron-Core's `--recompute-modules` names (TransformerConfig.recompute_modules); the default
# list is Megatron's own, the attention core.
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mlp", "moe", "shared_experts", "mla_up_proj")
DEFAULT_RECOMPUTE_MODULES = ("core_attn",)
ZERO_STAGES = (0, 1, 2, 3)
# Stacks whose interleaved schedule overlaps its pipeline sends unless told not to: Megatron-Core
# (Megatron-LM's `--no-overlap-p2p-communication` is a store_false flag, megatron/training/
# arguments.py), NeMo and Megatron-Bridge (CommOverlapConfig: on wherever VP > 1).
P2P_OVERLAP_STACKS = ("megatron-te",)
# Optimizer-state bytes per parameter beyond the weight and gradient, by layout (module docstring).
OPTIMIZER_STATES = {"fp32-adam": 12, "bf16-moments": 8, "bf16-adamw": 4}
ATTENTIONS = ("unfused", "flash")
# GEMM number formats a recipe may ask for; bf16 is the template's own (workload/precision.py).
PRECISIONS = ("bf16", "fp8", "mxfp8", "nvfp4")
# Formats whose elements are whole bytes, so parameters may be held in them (`fp8_param_gather`).
LOW_PRECISION_PARAMS = ("fp8", "mxfp8")
PLACEMENTS = ("optimal", "expert")
# Software stacks by kernel fusion (workload/stack.py); the first is the default, today's graph.
STACKS = ("megatron-lm", "eager", "megatron-te")
# EP token dispatchers (`System.alltoall_s`); the first is the default, today's all-to-all.
MOE_DISPATCHERS = ("alltoall", "deepep")
# Where a MoE layer applies its router's gate weights (`expert_weights`, workload/layers.py MoE).
EXPERT_WEIGHTS = ("combine", "activation")
# Context-parallel K/V exchanges (Megatron-Core `--cp-comm-type`, of which a2a and a2a+p2p are not
# modelled); the first is the default, today's ring.
CP_COMMS = ("p2p", "all_gather")
# Model chunks per pipeline device: published interleaved schedules use 2-8 (Narayanan et al.,
# SC'21); 64 is far beyond any, so only a typo reaches it.
MAX_VIRTUAL_STAGES = 64
MOE_FACTOR_LIMIT = 64.0  # capacity factor / load imbalance: at most every token on one of 64 experts  # besides a fixed "tp=T,pp=P,dp=D"


def is_mbs(value: Any) -> bool:
    """A valid microbatch size: a positive integer (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= 1


def check_mbs(value: Any, name: str = "microbatch size", error: type[Exception] = PhazeError) -> int:
    """The microbatch check, the one every layer uses: `value` as an int, or `error` naming `name`
    (the flag, field or argument the caller knows it by)."""
    if not is_mbs(value):
        raise error(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def recompute_mode(value: Any) -> str:
    """The recompute mode of a recipe value: a mode name, or the old on/off forms (on -> "full",
    off -> "none"). The one reading of a recompute value: "selective" stays "selective"."""
    if isinstance(value, str) and value.strip().lower() in RECOMPUTE_MODES:
        return value.strip().lower()
    try:
        return "full" if bool_flag(value, "recompute") else "none"
    except PhazeError:
        raise ValueError(f"recompute value {value!r} is not one of {', '.join(RECOMPUTE_MODES)} or on/off") from None


def check_recompute_modules(value: Any, recompute: str) -> tuple[str, ...] | None:
    """`recompute_modules` as a sorted tuple of distinct known names (None: Megatron's default), or
    a one-line PhazeError: a list (or "a,b" text) of RECOMPUTE_MODULES, only with selective recompute."""
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise PhazeError(f"recompute_modules must be a list of module names ({', '.join(RECOMPUTE_MODULES)}), "
                         f"got {value!r}")
    names = [n.strip().lower() for n in names if n.strip()]
    if not names:
        raise PhazeError(f"recompute_modules must name at least one of {', '.join(RECOMPUTE_MODULES)}")
    for n in names:
        if n not in RECOMPUTE_MODULES:
            raise PhazeError(f"recompute_modules: unknown module {n!r}; allowed: {', '.join(RECOMPUTE_MODULES)}")
    if recompute != "selective":
        raise PhazeError(f"recompute_modules needs recompute selective (Megatron's --recompute-granularity "
                         f"selective), got recompute {recompute}")
    return tuple(sorted(set(names), key=RECOMPUTE_MODULES.index))


def bool_flag(value: Any, name: str) -> bool:
    """A yes/no recipe field: a bool, 0/1 or on/off/true/false/yes/no."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("on", "true", "yes", "1"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("off", "false", "no", "0"):
        return False
    if isinstance(value, (int, float, np.integer)) and value in (0, 1):
        return bool(value)
    raise PhazeError(f"{name} must be on/off (a boolean), got {value!r}")


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout: TP x PP x DP, with EP (routed experts split over ep of the dp
    replicas) and CP (each sequence split over cp groups of tp devices). The one noun for what a user
    fixes (`--placement tp=8,pp=16,dp=8`), what a model's hand-tuned `expert_placement` names and what
    a validation row published; a `solve.placement.types.Placement` adds the split of the layers into
    the pp stages, and a PlacementResult reports its `layout()`."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    cp: int = 1

    @classmethod
    def from_spec(cls, text: str) -> "Layout":
        """`tp=8,pp=16,dp=8` (`ep=E`, `cp=C` may follow) -> Layout; a one-line PhazeError otherwise."""
        allowed = ("tp", "pp", "dp", "ep", "cp")
        out: dict[str, int] = {}
        for part in str(text).split(","):
            key, sep, value = part.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in allowed:
                raise PhazeError(f"placement {text!r}: expected tp=T,pp=P,dp=D[,ep=E,cp=C] (positive integers), "
                                 f"got {part.strip()!r}")
            if key in out:
                raise PhazeError(f"placement {text!r}: {key} given twice")
            try:
                number = int(value.strip())
            except ValueError:
                number = 0
            if number < 1:
                raise PhazeError(f"placement {text!r}: {key} must be a positive integer, got {value.strip()!r}")
            out[key] = number
        missing = [k for k in ("tp", "pp", "dp") if k not in out]
        if missing:
            raise PhazeError(f"placement {text!r}: missing {', '.join(missing)}; expected tp=T,pp=P,dp=D")
        return cls(**out)

    def fields(self) -> dict:
        """tp, pp, dp, and ep and cp where they are not 1 (how configs and reports write a layout)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp,
                **{k: v for k, v in (("ep", self.ep), ("cp", self.cp)) if v != 1}}

    def spec(self) -> str:
        """The `--placement` text that `from_spec` reads back."""
        return ",".join(f"{k}={v}" for k, v in self.fields().items())

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def recipe_names(params: Mapping[str, Sequence]) -> list[str]:
    """The recipe fields beyond the microbatch that `params` (a space's choices) sample, in grid order."""
    return ["recompute"] + [f for f in OPTIONAL_FIELDS if f in params]


def recipe_choices(params: Mapping[str, Sequence]) -> list[dict]:
    """Every combination of the space's choices of recompute and of each further recipe field it
    samples, as the space's own values (so a point built from one is a point of the space): the
    product in `recipe_names` order, the first field slowest. A field the space does not sample is
    absent, meaning its `Training` default, as for a trial."""
    names = recipe_names(params)
    return [dict(zip(names, values)) for values in itertools.product(*(params[n] for n in names))]


def recipe_points(params: Mapping[str, Sequence]) -> list[dict]:
    """Every recipe a study over `params` can run (microbatch x `recipe_choices`), as point values.

    What a fair reference is searched over: anything a trial may choose, the reference may too."""
    return [{"mbs": mbs, **choice} for mbs in params["mbs"] for choice in recipe_choices(params)]


def check_recipe_value(name: str, value: Any) -> Any:
    """`value` as a recipe field `name` may hold, checked by `Training` itself (so a space, a suite
    and the CLI accept exactly what a recipe accepts); a PhazeError naming the field otherwise."""
    if name not in RECIPE_FIELDS:
        raise PhazeError(f"{name} is not a recipe field; recipe fields are {', '.join(RECIPE_FIELDS)}")
    recipe = Training(**{name: value})
    return value if name == "recompute" else getattr(recipe, name)


@dataclass(frozen=True)
class Training:
    """The recipe for running a model on a design (see the module docstring); immutable, hashable."""

    mbs: int = 1
    recompute: str = "none"
    placement: str = "optimal"
    sequence_parallel: bool = False
    virtual_stages: int = 1
    zero: int = 0
    overlap_grad_reduce: bool = False
    attention: str | None = None
    capacity_factor: float = 1.0
    load_imbalance: float = 1.0
    account_for_embedding: bool = False
    account_for_loss: bool = False
    optimizer_state: str | None = None
    precision: str = "bf16"
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    expert_tensor_parallel: int | None = None
    stack: str = "megatron-lm"
    fp8_param_gather: bool = False
    moe_a2a_overlap: bool = False
    moe_dispatcher: str = "alltoall"
    recompute_modules: tuple[str, ...] | None = None
    cp_comm: str = CP_COMMS[0]
    expert_weights: str | None = None
    overlap_p2p_comm: bool | None = None
    # "expert", or the Layout of a fixed placement; None for "optimal"
    fixed: "str | Layout | None" = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "mbs", check_mbs(self.mbs))
        try:
            object.__setattr__(self, "recompute", recompute_mode(self.recompute))
        except ValueError as exc:
            raise PhazeError(str(exc)) from None
        object.__setattr__(self, "sequence_parallel", bool_flag(self.sequence_parallel, "sequence_parallel"))
        object.__setattr__(self, "overlap_grad_reduce", bool_flag(self.overlap_grad_reduce, "overlap_grad_reduce"))
        for name in ("account_for_embedding", "account_for_loss", "overlap_param_gather", "tp_comm_overlap",
                     "fp8_param_gather"):
            object.__setattr__(self, name, bool_flag(getattr(self, name), name))
        if self.overlap_p2p_comm is not None:
            object.__setattr__(self, "overlap_p2p_comm", bool_flag(self.overlap_p2p_comm, "overlap_p2p_comm"))
        self._choose("optimizer_state", OPTIMIZER_STATES, optional=True)
        precision = self._choose("precision", PRECISIONS)
        if self.fp8_param_gather and precision not in LOW_PRECISION_PARAMS:
            raise PhazeError(f"fp8_param_gather needs precision {' or '.join(LOW_PRECISION_PARAMS)} "
                             f"(1-byte parameters), got precision {precision}")
        if self.expert_tensor_parallel is not None:
            object.__setattr__(self, "expert_tensor_parallel",
                               check_mbs(self.expert_tensor_parallel, "expert_tensor_parallel"))
        self._choose("stack", STACKS)
        object.__setattr__(self, "moe_a2a_overlap", bool_flag(self.moe_a2a_overlap, "moe_a2a_overlap"))
        self._choose("moe_dispatcher", MOE_DISPATCHERS)
        self._choose("cp_comm", CP_COMMS)
        self._choose("expert_weights", EXPERT_WEIGHTS, optional=True)
        object.__setattr__(self, "recompute_modules", check_recompute_modules(self.recompute_modules, self.recompute))
        object.__setattr__(self, "virtual_stages", check_mbs(self.virtual_stages, "virtual_stages"))
        if self.virtual_stages > MAX_VIRTUAL_STAGES:
            raise PhazeError(f"virtual_stages must be at most {MAX_VIRTUAL_STAGES}, got {self.virtual_stages}")
        zero = self.zero
        if isinstance(zero, str) and zero.strip().isdigit():
            zero = int(zero.strip())
        if isinstance(zero, bool) or not isinstance(zero, (int, np.integer)) or int(zero) not in ZERO_STAGES:
            raise PhazeError(f"zero must be one of {', '.join(map(str, ZERO_STAGES))}, got {self.zero!r}")
        object.__setattr__(self, "zero", int(zero))
        self._choose("attention", ATTENTIONS, optional=True)
        for name, low in (("capacity_factor", 0.0), ("load_imbalance", 1.0)):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not (value > low or (low == 1.0 and value == 1.0)) or not value <= MOE_FACTOR_LIMIT:
                need = "a number in (0, 64]" if low == 0.0 else "a number in [1, 64]"
                raise PhazeError(f"{name} must be {need}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, float(value))
        if self.moe_a2a_overlap and self.recompute == "full":  # Megatron-Core's TransformerConfig refuses it
            raise PhazeError("moe_a2a_overlap cannot run with full recompute (Megatron-Core: disable full "
                             "recomputation when enabling overlap_moe_expert_parallel_comm)")
        placement = str(self.placement)
        object.__setattr__(self, "placement", placement)
        if placement == "expert":
            object.__setattr__(self, "fixed", "expert")
        elif placement != "optimal":
            object.__setattr__(self, "fixed", Layout.from_spec(placement))

    @classmethod
    def from_point(cls, point: Mapping[str, Any], placement: str = "optimal") -> "Training":
        """The recipe of a search-space point (its sampled training fields): the one conversion from a
        space's values, lossless (a mode stays the mode, every sampled field is kept)."""
        extra = {k: point[k] for k in OPTIONAL_FIELDS if k in point and point[k] is not None}
        return cls(mbs=int(point["mbs"]), recompute=point["recompute"], placement=placement, **extra)

    @property
    def recomputes(self) -> bool:
        """Whether any activations are recomputed."""
        return self.recompute != "none"

    def _choose(self, name: str, choices, optional: bool = False):
        """Field `name` normalised (stripped, lower case) and checked against `choices`: a one-line
        error naming the field and what is allowed; None stays None where the field is `optional`."""
        value = getattr(self, name)
        if value is None and optional:
            return None
        chosen = str(value).strip().lower()
        if chosen not in choices:
            raise PhazeError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        object.__setattr__(self, name, chosen)
        return chosen

    def recipe(self) -> dict:
        """The recipe's fields as plain values (for reports and tracking)."""
        return {"mbs": self.mbs, "recompute": self.recompute, "placement": self.placement,
                "sequence_parallel": self.sequence_parallel, "virtual_stages": self.virtual_stages,
                "zero": self.zero, "overlap_grad_reduce": self.overlap_grad_reduce, "attention": self.attention,
                # the MoE fields only when set, so every earlier recipe (and resumed point key) is unchanged
                **({"capacity_factor": self.capacity_factor} if self.capacity_factor != 1.0 else {}),
                **({"load_imbalance": self.load_imbalance} if self.load_imbalance != 1.0 else {}),
                **{name: True for name in ("account_for_embedding", "account_for_loss") if getattr(self, name)},
                **({"optimizer_state": self.optimizer_state} if self.optimizer_state is not None else {}),
                # only when not the default, so every earlier recipe (and resumed point key) is unchanged
                **({"precision": self.precision} if self.precision != "bf16" else {}),
                **({"overlap_param_gather": True} if self.overlap_param_gather else {}),
                **({"tp_comm_overlap": True} if self.tp_comm_overlap else {}),
                **({"fp8_param_gather": True} if self.fp8_param_gather else {}),
                **({"expert_tensor_parallel": self.expert_tensor_parallel}
                   if self.expert_tensor_parallel is not None else {}),
                **({"stack": self.stack} if self.stack != STACKS[0] else {}),
                **({"moe_a2a_overlap": True} if self.moe_a2a_overlap else {}),
                **({"moe_dispatcher": self.moe_dispatcher} if self.moe_dispatcher != MOE_DISPATCHERS[0] else {}),
                **({"recompute_modules": list(self.recompute_modules)} if self.recompute_modules is not None else {}),
                **({"cp_comm": self.cp_comm} if self.cp_comm != CP_COMMS[0] else {}),
                **({"expert_weights": self.expert_weights} if self.expert_weights is not None else {}),
                **({"overlap_p2p_comm": self.overlap_p2p_comm} if self.overlap_p2p_comm is not None else {})}

    def layer_key(self) -> tuple:
        """The recipe fields that change a layer's traced graph, times or memory (the microbatch, sequence
        parallelism, the attention kernel, the GEMM format, TP communication overlap, the stack's
        kernel fusion): what keys `design.evaluate.layer_costs`' memo; the rest (placement, ZeRO,
        recompute...) act later."""
        return (self.mbs, bool(self.sequence_parallel), self.attention) + \
            ((("precision", self.precision),) if self.precision != "bf16" else ()) + \
            ((("tp_comm_overlap", True),) if self.tp_comm_overlap else ()) + \
            ((("stack", self.stack),) if self.stack != STACKS[0] else ()) + \
            ((("recompute_modules", self.recomputed_modules),) if self.recompute_modules is not None else ()) + \
            ((("expert_weights", self.expert_weights),) if self.expert_weights is not None else ())

    @property
    def overlaps_p2p(self) -> bool:
        """Whether the interleaved schedule's pipeline sends run beside compute: the recipe's
        `overlap_p2p_comm`, else its stack's default (P2P_OVERLAP_STACKS)."""
        return self.overlap_p2p_comm if self.overlap_p2p_comm is not None else self.stack in P2P_OVERLAP_STACKS

    @property
    def recomputed_modules(self) -> tuple[str, ...]:
        """The modules selective recompute reruns (Megatron's default, the attention core, when
        `recompute_modules` is None); empty unless the mode is `selective`."""
        if self.recompute != "selective":
            return ()
        return DEFAULT_RECOMPUTE_MODULES if self.recompute_modules is None else self.recompute_modules

    @property
    def optimizer_state_bytes(self) -> int | None:
        """Optimizer-state bytes per parameter of this recipe's layout; None: the system's own."""
        return None if self.optimizer_state is None else OPTIMIZER_STATES[self.optimizer_state]

    def interleave_split_ok(self, layers: int, pp):
        """Whether Megatron-Core can split `layers` decoder layers over `pp` pipeline ranks (an int or
        an integer array) into this recipe's v virtual stages per rank, each of whole layers.

        Megatron-Core requires every pipeline rank's layer count to be a multiple of v, also when the
        first and last ranks are given other counts (`--decoder-first-pipeline-num-layers`,
        `--decoder-last-pipeline-num-layers`), and the middle ranks to share one count; accounting
        for the embedding or the loss in the split forbids those two flags, so the counted layers
        (decoder layers + 1 for each) are then split evenly (Megatron-Core MR 2795, "flexible
        asymmetric VPP with custom PP layout", which lists both restrictions). Hence, with either
        accounted: (layers + accounted) divisible by pp x v; with neither: layers divisible by v and
        at least pp x v (first/last ranks of a x v and b x v layers, the middle ones v each, cover
        every multiple of v from pp x v up). A custom layout (`--pipeline-model-parallel-layout`)
        allows any split, but virtual stages of unequal size break the 1/v chunk pricing of
        `placement.evaluate`, so it is not offered. pp = 1 runs no pipeline: always allowed."""
        v = self.virtual_stages
        pp = np.asarray(pp, dtype=np.int64)
        extra = int(self.account_for_embedding) + int(self.account_for_loss)
        if extra:
            ok = (layers + extra) % (pp * v) == 0
        else:
            ok = (layers % v == 0) & (layers >= pp * v)
        ok = (pp == 1) | (v == 1) | ok
        return bool(ok) if ok.ndim == 0 else ok

    def expert_tp(self, t: int) -> int:
        """The MoE layers' tensor-parallel width at attention TP width t: ETP, or t unfolded."""
        return t if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def expert_stride(self, t: int, c: int) -> int:
        """Ranks between neighbouring members of an EP group (what the all-to-all's links depend
        on): ETP when folded (ranks etp, ep, edp), t x c unfolded (ranks tp, cp, ep/dp)."""
        return t * c if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def expert_fits(self, t, c, d, e):
        """Whether EP width e fits a t x c x d grid (ints or integer arrays): e divides d unfolded;
        e x ETP divides t x c x d folded (Megatron-Core's parallel-state check for the expert grid)."""
        if self.expert_tensor_parallel is None:
            return d % e == 0
        return (t * c * d) % (e * self.expert_tensor_parallel) == 0

    def expert_fit_reason(self, t: int, c: int, d: int, e: int) -> str:
        """The one-line reason `expert_fits` is false."""
        if self.expert_tensor_parallel is None:
            return f"expert parallelism {e} must divide the data-parallel degree {d}"
        etp = self.expert_tensor_parallel
        return (f"expert parallelism {e} x expert tensor parallelism {etp} ({e * etp}) must divide "
                f"tp x cp x dp ({t} x {c} x {d} = {t * c * d})")

    def expert_replicas(self, t, c, d, e):
        """EDP: the ranks holding the same routed-expert shard, over which its gradients reduce and
        ZeRO-1 and 2 shard its state, ZeRO-2 its gradients too (ints or integer arrays; e must fit,
        `expert_fits`): t c d / (e ETP) folded, d c / e unfolded (at least 1)."""
        if self.expert_tensor_parallel is None:
            return np.maximum(1, d * c // e)
        return np.maximum(1, t * c * d // (e * self.expert_tensor_parallel))

    def data_step(self, t: int, c: int, e: int) -> int:
        """The least d step keeping EP width e fitting a t x c x d grid: every allowed d is a
        multiple of it (e unfolded; lcm(e ETP, t c) / (t c) folded)."""
        if self.expert_tensor_parallel is None:
            return e
        need = e * self.expert_tensor_parallel
        return need // math.gcd(need, t * c)

    def with_placement(self, placement: str) -> "Training":
        return replace(self, placement=placement)
