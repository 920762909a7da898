"""Validation suites: published results to check the cost models against, from `configs/validation/`.

A suite is one YAML file. Its top-level fields:

    suite           the suite's name (the file's stem for a shipped suite)
    description     one line
    arch            the accelerator the results were measured on (a name in configs/archs)
    system          the cluster (a name in configs/systems); required for training runs
    metric          what each row publishes and a validation compares:
                      per_gpu_tflops    achieved teraFLOP/s per GPU, counted by `flops_formula`
                      iteration_time_s  seconds per training iteration (optimizer step)
                      layer_seconds     forward and backward seconds of one layer's TP shard (compute only)
    flops_formula   for the training metrics: which FLOP count the paper used (see FLOPS_FORMULAS)
    stack           optional, training metrics: the software stack's kernel fusion the runs used
                    (`Training.stack`: eager, megatron-lm, megatron-te, torch-compile; default megatron-lm), which
                    a row's own `stack` overrides
    papers          {key: citation}; every row's source names one of the keys
    rows            training metrics: the published runs (see below)
    data, source    layer_seconds: a JSON file of measurements (relative to the suite file), and the
                    {paper, table} its rows come from (each row's `row` is made from its fields)

A training row is one published run:

    model                       a name in configs/models
    heads, hidden, layers       optional: the paper's numbers, checked against the model config
    tp, pp, gpus                tensor and pipeline widths and the device count; dp = gpus / (tp pp cp)
    cp, ep                      optional: context and expert parallel widths (default 1; ep divides dp,
                                or with expert_tensor_parallel ep x it divides tp x cp x dp)
    seq                         optional: tokens per sequence (default the model's)
    batch, microbatch           global batch and microbatch in sequences; batch = microbatch x dp x m
    virtual_stages              model chunks per device of the interleaved 1F1B schedule (default 1)
    account_for_embedding, account_for_loss
                                optional: the pipeline split counts the embedding (the loss) as one
                                more layer (Megatron-Core `--account-for-embedding-in-pipeline-split`,
                                `--account-for-loss-in-pipeline-split`; default false), which lets a
                                layer count that pp x virtual_stages does not divide interleave
    recompute                   none | selective | full (activation recomputation)
    sequence_parallel           true | false (default false; needs tp > 1)
    zero, overlap_grad_reduce   optional recipe fields (training.Training): 1 = Megatron's distributed
                                optimizer, 2 = gradients sharded too (FSDP without resharding after
                                forward), 3 = FSDP; the gradient reduction beside the backward
    overlap_param_gather        optional: ZeRO-1's weight all-gather under the next forward
                                (Megatron `--overlap-param-gather`; default false)
    tp_comm_overlap             optional: SP's TP collectives pipelined with the GEMMs
                                (Megatron `--tp-comm-overlap`; default false)
    overlap_p2p_comm            optional: the interleaved schedule's pipeline sends and receives
                                beside compute (Training.overlap_p2p_comm; default: the stack's, on
                                under megatron-te); true needs virtual_stages > 1
    fp8_param_gather            optional: parameters held in the fp8 / mxfp8 GEMM format, no BF16
                                weight (Megatron-Core `--fp8-param-gather`; default false)
    fp8_scaling                 optional, with precision fp8: delayed | tensorwise | rowwise, how the
                                scales are found (TE delayed scaling, current scaling, torchao rowwise)
    fp8_weight_recast           optional: the weights cast in every microbatch (torchao Float8Linear),
                                not once per step (TE); default false
    expert_tensor_parallel      optional: the MoE layers' TP width with MoE parallel folding
                                (Megatron-Core `--expert-tensor-parallel-size`, whose default is tp;
                                then ep x it must divide tp x cp x dp); absent: unfolded, ep divides dp
    moe_a2a_overlap             optional: the EP all-to-all overlap (Megatron-Core
                                `--overlap-moe-expert-parallel-comm`; default false; needs ep > 1)
    moe_dispatcher              optional: the EP token dispatcher, alltoall | deepep (default alltoall)
    expert_weights              optional: where MoE layers apply the router's weights (Training.expert_weights),
                                combine | activation (default: the stack's); only on a MoE model
    optimizer_state             optional: the optimizer-state layout (Training.optimizer_state), fp32-adam |
                                bf16-moments | bf16-adamw (default: the system's accounting)
    cp_comm                     optional: how CP moves K and V (Megatron-Core `--cp-comm-type`,
                                Training.cp_comm), p2p | all_gather (default p2p); needs cp > 1
    recompute_modules           optional, with recompute selective: the modules Megatron-Core recomputes
                                (`--recompute-modules`, Training.recompute_modules; default core_attn)
    flops_formula               optional: the row's own FLOP count, when its source counts otherwise
    pending_model               optional: why the model config may be missing (e.g. another branch
                                adds it); such a row is skipped with that reason until it exists
    pending_recipe              optional: what of the published recipe the Training recipe cannot
                                write yet (an activation-checkpointing policy, a parallel layout the
                                placement refuses); the row loads in full, every field checked, and is
                                skipped with that reason, never priced under a nearest recipe
    system, arch                optional: this row's cluster and chip (names in configs/systems and
                                configs/archs), in place of the suite's (runs on different machines)
    stack                       optional: this row's software stack, in place of the suite's
    precision                   optional: the GEMM datatype of the run, one of ROW_PRECISIONS (default
                                bf16); one outside MODELLED_PRECISIONS is skipped with that reason
    attention                   optional: the run's attention kernel, unfused | flash (default: the
                                model config's own), e.g. flash for a stack whose fused attention
                                kernels keep no s x s scores for the backward
    qkv_projection              optional: the run's code lays out the attention's input projection as
                                one fused GEMM or three (ModelConfig.qkv_projection, fused | separate;
                                default: the model config's own); not on an MLA model
    per_gpu_tflops, iteration_time_s
                                the suite's metric is required; the other is optional
    published                   optional: the paper's other numbers for the row (PUBLISHED_FIELDS)
    source                      {paper, table, row}: where the row is printed
    note                        optional free text

Models, archs and systems are named by their shipped configs (configs/models, archs, systems). A row's
sequence length and vocabulary are its model's. A layer suite's rows come from its JSON file's `layers`
(model, tp, mbs, flash, fwd_s, bwd_s, fwd_bwd_s), its `gemm` timings become `Suite.gemms`.

Comparing a prediction with a row: per_gpu_tflops = iteration_flops(suite.flops_formula, model, batch)
/ (predicted iteration seconds x gpus); iteration_time_s compares seconds directly, and the published
MFU uses flops_formula (megatron-model) over the arch's peak.

Every mistake is a one-line PhazeError naming the file, the field and what is allowed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import configs
from ..errors import PhazeError, config_error, unknown_choice
from ..training import FIELDS, PRECISIONS, Layout, RecipeError, Training, check_for, recipe_from_mapping
from ..workload.models import QKV_PROJECTIONS, ModelConfig, load_model

KIND = "validation"
TRAINING_METRICS = ("per_gpu_tflops", "iteration_time_s")
LAYER_METRICS = ("layer_seconds",)
METRICS = TRAINING_METRICS + LAYER_METRICS
RECOMPUTE = ("none", "selective", "full")
PUBLISHED_FIELDS = (
    "percent_of_peak",  # achieved FLOP/s as a percentage of the GPU's peak
    "aggregate_pflops",  # achieved petaFLOP/s over all GPUs
    "mfu_percent",  # model FLOPs utilisation
    "hfu_percent",  # hardware FLOPs utilisation
    "throughput_increase_percent",  # speed-up over the paper's baseline
    "tokens_per_s_per_gpu",  # training tokens per second per GPU (NeMo / Megatron-Bridge tables)
    "tokens_per_s",  # training tokens per second over all GPUs (DGX Cloud Benchmarking tables)
)
# The GEMM datatype a published run trained in. NVIDIA's NeMo / Megatron-Bridge tables name bf16, fp8
# (per-tensor scaling, delayed or current), mxfp8 (1 x 32 blocks with an E8M0 scale) and nvfp4. The
# Training recipe prices only what MODELLED_PRECISIONS holds; a row in any other precision loads in
# full (every field checked) and is skipped with that reason, so that it is never priced as BF16.
ROW_PRECISIONS = ("bf16", "fp8", "mxfp8", "nvfp4")
MODELLED_PRECISIONS = PRECISIONS  # every format the Training recipe prices

TOP_REQUIRED = ("suite", "description", "arch", "metric")
# A training suite may also name recipe fields at its top: every row's default, a row's own overriding it.
SUITE_RECIPE = tuple(f for f in FIELDS if f not in ("mbs", "placement"))
TOP_OPTIONAL = ("system", "flops_formula", "papers", "rows", "data", "source", *SUITE_RECIPE)
ROW_REQUIRED = ("model", "tp", "pp", "gpus", "batch", "microbatch", "recompute", "source")
# Beyond the layout and the numbers, a row may name any recipe field (training.FIELDS; the microbatch is
# `microbatch`, the placement the layout).
ROW_OPTIONAL = ("heads", "hidden", "layers", "published", "note", *TRAINING_METRICS, "cp", "ep", "seq",
                "flops_formula", "pending_model", "pending_recipe", "system", "arch", "qkv_projection",
                *(f for f in FIELDS if f not in ("mbs", "placement", *ROW_REQUIRED)))
LAYER_KEYS = ("model", "tp", "mbs", "flash", "fwd_s", "bwd_s", "fwd_bwd_s")
LAYER_OPTIONAL = ("kernels",)  # measure's KERNELS; absent = eager (the shipped H100 truth)
LAYER_KERNELS = ("eager", "inductor")
GEMM_KEYS = ("M", "N", "K", "s", "tflops")


# FLOPs per iteration of a GPT (B sequences of s tokens, l layers, hidden h, vocabulary V), as the
# Megatron papers count them (matrix multiplications only; 2 FLOPs per multiply-add).
def _hardware_full_recompute(m: ModelConfig, B, s):
    # Narayanan et al., SC'21, eq. (3): the forward pass counted twice (full recomputation).
    l, h, V = m.layers, m.hidden, m.vocab
    return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def _model(m: ModelConfig, B, s):
    # Korthikanti et al. 2022, sec. 6: forward + backward, no recomputation (model FLOPs, for MFU).
    l, h, V = m.layers, m.hidden, m.vocab
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def _hardware_selective(m: ModelConfig, B, s):
    # Korthikanti et al. 2022: model FLOPs + the recomputed attention core (QK^T, softmax-V).
    l, h, V = m.layers, m.hidden, m.vocab
    return 72 * B * s * l * h**2 * (1 + s / (3 * h) + V / (12 * l * h))


def _megatron_core(m: ModelConfig, B, s):
    # Megatron-LM megatron/training/training.py `num_floating_point_operations` as of Megatron-Core
    # v0.8 (2024), what its logs' "TFLOP/s/GPU" and the MoE README's figures divide: model FLOPs,
    # 12 B s l h^2 [(1 + g/a + s/h) q/h + (f/h) k (3/2 with SwiGLU) + V/(2 l h)], a heads of which g
    # key/value groups, query projection q = a x head size, FFN (expert) width f, k experts per token.
    # Full (not causal) attention; every layer counted as a MoE layer with f = the expert width.
    l, h, V = m.layers, m.hidden, m.vocab
    q = m.heads * m.head_dim
    k = m.top_k if m.moe else 1
    f = m.expert_ffn if m.moe else m.ffn
    gated = 1.5 if m.activation == "swiglu" else 1.0
    return 12 * B * s * l * h**2 * ((1 + m.kv_heads / m.heads + s / h) * q / h + f / h * k * gated
                                    + V / (2 * l * h))


FLOPS_FORMULAS: dict[str, tuple[str, Callable[..., float]]] = {
    "megatron-hardware-full-recompute": ("96 B s l h^2 (1 + s/(6h) + V/(16 l h))", _hardware_full_recompute),
    "megatron-model": ("72 B s l h^2 (1 + s/(6h) + V/(12 l h))", _model),
    "megatron-hardware-selective": ("72 B s l h^2 (1 + s/(3h) + V/(12 l h))", _hardware_selective),
    "megatron-core": ("12 B s l h^2 ((1 + g/a + s/h) q/h + k f/h x 3/2 + V/(2 l h))", _megatron_core),
}


def iteration_flops(formula: str, model: ModelConfig | str, batch: int, seq: int | None = None) -> float:
    """FLOPs of one iteration of `batch` sequences of `seq` tokens (default the model's) by one of
    FLOPS_FORMULAS."""
    if formula not in FLOPS_FORMULAS:
        raise PhazeError(f"unknown FLOP formula '{formula}': choose one of {', '.join(FLOPS_FORMULAS)}")
    m = load_model(model)
    return float(FLOPS_FORMULAS[formula][1](m, batch, seq or m.seq))


@dataclass(frozen=True)
class Source:
    paper: str  # a key of the suite's `papers`
    table: str
    row: str


@dataclass(frozen=True)
class Row:
    """One published training run: its layout, its recipe (a whole `Training`, the placement fixed
    to the layout) and what it published."""

    model: str
    tp: int
    pp: int
    gpus: int
    batch: int
    training: Training
    value: float  # the suite's metric
    source: Source
    per_gpu_tflops: float | None = None
    iteration_time_s: float | None = None
    published: Mapping[str, float] = field(default_factory=dict)
    note: str = ""
    cp: int = 1
    ep: int = 1
    seq: int | None = None  # None: the model's
    flops_formula: str | None = None  # None: the suite's
    skip: str = ""  # why the row cannot run yet (its model config or its recipe is pending); "" runs
    system: str | None = None  # None: the suite's
    arch: str | None = None  # None: the suite's
    qkv_projection: str | None = None  # the code's QKV projection layout (ModelConfig.qkv_projection); None: the model's

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def microbatches(self) -> int:
        """Microbatches each pipeline runs per iteration."""
        return self.batch // (self.training.mbs * self.dp)


@dataclass(frozen=True)
class LayerRow:
    """One layer's TP shard timed on one device (compute only, no collectives)."""

    model: str
    tp: int
    microbatch: int
    flash: bool  # FlashAttention kernels; false = unfused attention, as the project's graphs
    fwd_s: float
    bwd_s: float
    source: Source
    kernels: str = "eager"  # eager (one kernel per operator) or inductor (torch.compile's fused kernels)

    @property
    def fwd_bwd_s(self) -> float:
        return self.fwd_s + self.bwd_s


@dataclass(frozen=True)
class Gemm:
    """A plain bf16 GEMM (M x K) @ (K x N) timed on the suite's device."""

    m: int
    n: int
    k: int
    seconds: float
    tflops: float


@dataclass(frozen=True)
class Suite:
    name: str
    description: str
    path: str
    arch: str
    system: str | None
    metric: str
    flops_formula: str | None
    papers: Mapping[str, str]
    rows: tuple  # of Row (training metrics) or LayerRow (layer_seconds)
    gemms: tuple[Gemm, ...] = ()
    data: str | None = None  # the measurements file of a layer suite

    @property
    def flops_expression(self) -> str | None:
        return FLOPS_FORMULAS[self.flops_formula][0] if self.flops_formula else None


def with_system(suite: Suite, system: str) -> Suite:
    """The suite with every training row on `system` (a name in configs/systems), its own and its
    rows' systems set aside: the same published runs priced on another network."""
    if system not in configs.available("systems"):
        raise PhazeError(unknown_choice("system", system, configs.available("systems")))
    if suite.metric not in TRAINING_METRICS:
        return suite
    return replace(suite, system=system, rows=tuple(replace(r, system=None) for r in suite.rows))


def list_suites() -> list[str]:
    return configs.available(KIND)


def suite_path(name_or_path: str | os.PathLike) -> Path:
    """A suite's name (`validation/<name>.yaml` in the user's config folders or the shipped ones) or a
    path to a suite file."""
    return configs.resolve(KIND, name_or_path)


def load_suite(name_or_path: str | os.PathLike) -> Suite:
    """Read and validate a suite; the first problem found is a one-line PhazeError."""
    path = suite_path(name_or_path)
    data = configs.read_yaml(path)
    if not isinstance(data, dict):
        raise PhazeError(f"{path}: expected a mapping of fields at the top level, got {type(data).__name__}")
    return suite_from_mapping(data, path)


def suite_from_mapping(data: Mapping[str, Any], file) -> Suite:
    configs.check_keys(data, file, TOP_REQUIRED, TOP_OPTIONAL)
    name = _text(data, "suite", file)
    description = _text(data, "description", file)
    metric = configs.one_of(data, "metric", file, METRICS)
    arch = _config_name(data, "arch", "archs", file)
    training = metric in TRAINING_METRICS
    needed = ("system", "flops_formula", "papers", "rows") if training else ("papers", "data", "source")
    banned = ("data", "source") if training else ("rows", "flops_formula", *SUITE_RECIPE)
    for key in needed:
        if key not in data:
            raise config_error(file, key, f"missing required field (metric {metric})")
    for key in banned:
        if key in data:
            raise config_error(file, key, f"not allowed with metric {metric}")
    system = _config_name(data, "system", "systems", file) if "system" in data else None
    formula = configs.one_of(data, "flops_formula", file, FLOPS_FORMULAS) if training else None
    papers = _papers(data, file)
    if training:
        defaults = {k: data[k] for k in SUITE_RECIPE if k in data}
        try:
            recipe_from_mapping(defaults)
        except RecipeError as exc:
            raise config_error(file, exc.field, exc.detail) from None
        rows = _training_rows(data["rows"], metric, papers, file, defaults)
        return Suite(name=name, description=description, path=str(file), arch=arch, system=system, metric=metric,
                     flops_formula=formula, papers=papers, rows=rows)
    source = _mapping(data["source"], "source", file, ("paper", "table"))
    paper = _paper(source, "source", papers, file)
    table = _text(source, "table", file, "source.table", numbers=True)
    data_path = Path(file).parent / _text(data, "data", file)
    rows, gemms = _layer_rows(data_path, file, paper, table)
    return Suite(name=name, description=description, path=str(file), arch=arch, system=system, metric=metric,
                 flops_formula=None, papers=papers, rows=rows, gemms=gemms, data=str(data_path))


def _text(data: Mapping[str, Any], key: str, file, label: str | None = None, numbers: bool = False) -> str:
    value = data.get(key)
    if numbers and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # a table or row number may be written bare
    if not isinstance(value, str) or not value.strip():
        raise config_error(file, label or key, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _mapping(value: Any, label: str, file, required=(), optional=()) -> Mapping[str, Any]:
    """A nested mapping with only the given keys; errors name the key by its full path (`rows[2].tp`)."""
    if not isinstance(value, dict):
        raise config_error(file, label, f"must be a mapping, got {value!r}")
    allowed = (*required, *optional)
    for key in value:
        if allowed and key not in allowed:
            raise config_error(file, f"{label}.{key}",
                               f"unknown field; allowed fields are {', '.join(sorted(allowed))}")
    for key in required:
        if key not in value:
            raise config_error(file, f"{label}.{key}", "missing required field")
    return value


def _config_name(data: Mapping[str, Any], key: str, kind: str, file, label: str | None = None) -> str:
    name = _text(data, key, file, label)
    choices = configs.available(kind)
    if name not in choices:
        raise config_error(file, label or key, unknown_choice(kind[:-1], name, choices))
    return name


def _papers(data: Mapping[str, Any], file) -> dict[str, str]:
    papers = _mapping(data.get("papers"), "papers", file)
    if not papers:
        raise config_error(file, "papers", "must name at least one paper as {key: citation}")
    return {str(k): _text(papers, k, file, f"papers.{k}") for k in papers}


def _source(value: Any, label: str, papers: Mapping[str, str], file) -> Source:
    src = _mapping(value, label, file, ("paper", "table", "row"))
    table, row = (_text(src, k, file, f"{label}.{k}", numbers=True) for k in ("table", "row"))
    return Source(paper=_paper(src, label, papers, file), table=table, row=row)


def _paper(src: Mapping[str, Any], label: str, papers: Mapping[str, str], file) -> str:
    paper = _text(src, "paper", file, f"{label}.paper")
    if paper not in papers:
        raise config_error(file, f"{label}.paper",
                           f"must be one of the suite's papers ({', '.join(papers)}), got {paper!r}")
    return paper


def _number(data: Mapping[str, Any], key: str, file, label: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise config_error(file, label, f"must be a positive number, got {value!r}")
    return float(value)


def _int(data: Mapping[str, Any], key: str, file, label: str, default: Any = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise config_error(file, label, f"must be a positive integer, got {value!r}")
    return value


def _model(name: Any, label: str, file, cache: dict[str, ModelConfig]) -> ModelConfig:
    if not isinstance(name, str) or not name.strip():
        raise config_error(file, label, f"must be a model name, got {name!r}")
    if name not in cache:
        choices = configs.available("models")
        if name not in choices:
            raise config_error(file, label, unknown_choice("model", name, choices))
        cache[name] = load_model(name)
    return cache[name]


def _training_rows(raw: Any, metric: str, papers: Mapping[str, str], file, defaults: Mapping[str, Any]) -> tuple[Row, ...]:
    """The rows, each row's recipe on top of the suite's `defaults` (its top-level recipe fields)."""
    if not isinstance(raw, list) or not raw:
        raise config_error(file, "rows", f"must be a non-empty list of runs, got {raw!r}")
    models: dict[str, ModelConfig] = {}
    return tuple(_training_row({**defaults, **r} if isinstance(r, dict) else r, f"rows[{i}]", metric, papers, file,
                               models) for i, r in enumerate(raw))


def _pending_row(row: Mapping[str, Any], at: str, metric: str, papers, file, names: dict) -> Row | None:
    """A row whose model config is missing but declared pending: kept, to be skipped with its reason."""
    pending = row.get("pending_model")
    name = row.get("model")
    if pending is None or not isinstance(name, str) or name in configs.available("models"):
        return None
    if not isinstance(pending, str) or not pending.strip():
        raise config_error(file, f"{at}.pending_model", f"must say why the model may be missing, got {pending!r}")
    ints = {k: _int(row, k, file, f"{at}.{k}", default=1 if k in ("cp", "ep") else None)
            for k in ("tp", "pp", "gpus", "batch", "microbatch", "cp", "ep")}
    training = _recipe(row, file, at, mbs=ints["microbatch"])
    return Row(model=name, tp=ints["tp"], pp=ints["pp"], gpus=ints["gpus"], batch=ints["batch"], training=training,
               cp=ints["cp"], ep=ints["ep"], seq=row.get("seq"),
               skip=f"model config '{name}' not in configs/models yet ({pending.strip()})",
               **_row_numbers(row, at, metric, papers, file), **names)


def _recipe(row: Mapping[str, Any], file, at: str, model: ModelConfig | None = None, batch: int | None = None,
            **given) -> Training:
    """The row's recipe: every recipe field it names, read and checked by the recipe's declaration
    (training.py), with `given` (the microbatch, the published layout) on top; the recipe's rules
    against `model` and the row's batch too. A one-line error at `rows[i].<field>` otherwise."""
    try:
        training = recipe_from_mapping(row, **given)
        if model is not None:
            check_for(training, model, batch)
    except RecipeError as exc:
        raise config_error(file, f"{at}.{exc.field}", exc.detail) from None
    return training


def _training_row(raw: Any, at: str, metric: str, papers, file, models) -> Row:
    row = _mapping(raw, at, file, ROW_REQUIRED + (metric,), ROW_OPTIONAL)
    names = {k: _config_name(row, k, f"{k}s", file, f"{at}.{k}") for k in ("system", "arch") if k in row}
    pending = _pending_row(row, at, metric, papers, file, names)
    if pending is not None:
        return pending
    model = _model(row["model"], f"{at}.model", file, models)
    for key in ("heads", "hidden", "layers"):
        if key in row and row[key] != getattr(model, key):
            raise config_error(file, f"{at}.{key}",
                               f"is {row[key]!r} but model {model.name} has {getattr(model, key)}")
    tp, pp, gpus, batch, mbs = (_int(row, k, file, f"{at}.{k}") for k in ("tp", "pp", "gpus", "batch", "microbatch"))
    cp, ep = (_int(row, k, file, f"{at}.{k}", default=1) for k in ("cp", "ep"))
    seq = _int(row, "seq", file, f"{at}.seq", default=model.seq)
    if tp not in model.tp_widths:
        raise config_error(file, f"{at}.tp", _tp_choices(model, tp))
    if pp > model.layers:
        raise config_error(file, f"{at}.pp", f"cannot exceed the model's {model.layers} layers, got {pp}")
    if gpus % (tp * pp * cp):
        raise config_error(file, f"{at}.tp", f"tp x pp x cp ({tp} x {pp} x {cp} = {tp * pp * cp}) must divide gpus ({gpus})")
    dp = gpus // (tp * pp * cp)
    if cp > 1 and seq % (2 * cp):
        raise config_error(file, f"{at}.cp", f"2 x cp ({2 * cp}) must divide the sequence ({seq} tokens)")
    if ep > 1 and (not model.moe or model.experts % ep):
        raise config_error(file, f"{at}.ep", f"must divide {model.name}'s routed experts ({model.experts}), got {ep}"
                           if model.moe else f"{model.name} has no experts; use ep 1")
    if batch % (mbs * dp):
        raise config_error(file, f"{at}.batch",
                           f"must be a multiple of microbatch x dp ({mbs} x {dp} = {mbs * dp}), got {batch}")
    formula = _choice(row, "flops_formula", tuple(FLOPS_FORMULAS), file, at) if "flops_formula" in row else None
    qkv = None
    if "qkv_projection" in row:
        if model.mla:
            raise config_error(file, f"{at}.qkv_projection",
                               f"{model.name} uses MLA, whose projections are its own; leave it out")
        qkv = _choice(row, "qkv_projection", QKV_PROJECTIONS, file, at)
    # The recipe whole, its placement the published layout.
    training = _recipe(row, file, at, model, batch, mbs=mbs, placement=Layout(tp, pp, dp, ep, cp))
    return Row(model=model.name, tp=tp, pp=pp, gpus=gpus, batch=batch, training=training, cp=cp, ep=ep,
               seq=seq if seq != model.seq else None, flops_formula=formula, qkv_projection=qkv,
               skip=_pending_recipe(row, file, at), **_row_numbers(row, at, metric, papers, file), **names)


def _pending_recipe(row: Mapping[str, Any], file, at: str) -> str:
    """Why the row is skipped for a recipe the Training recipe cannot write yet ("" runs)."""
    if "pending_recipe" not in row:
        return ""
    reason = row["pending_recipe"]
    if not isinstance(reason, str) or not reason.strip():
        raise config_error(file, f"{at}.pending_recipe",
                           f"must say what of the published recipe cannot be written yet, got {reason!r}")
    return f"recipe not expressible yet: {reason.strip()}"


def _row_numbers(row: Mapping[str, Any], at: str, metric: str, papers, file) -> dict:
    """The row's published numbers, source and note: what needs no model config."""
    values = {k: _number(row, k, file, f"{at}.{k}") for k in TRAINING_METRICS if k in row}
    published = _mapping(row.get("published", {}), f"{at}.published", file, (), PUBLISHED_FIELDS)
    published = {k: _number(published, k, file, f"{at}.published.{k}") for k in published}
    note = row.get("note", "")
    if not isinstance(note, str):
        raise config_error(file, f"{at}.note", f"must be a string, got {note!r}")
    return dict(value=values[metric], source=_source(row["source"], f"{at}.source", papers, file),
                per_gpu_tflops=values.get("per_gpu_tflops"), iteration_time_s=values.get("iteration_time_s"),
                published=published, note=note)










def _flag(row: Mapping[str, Any], key: str, file, at: str) -> bool:
    """A layer row's switch `key` (false when absent): true or false, else a one-line error."""
    value = row.get(key, False)
    if not isinstance(value, bool):
        raise config_error(file, f"{at}.{key}", f"must be true or false, got {value!r}")
    return value


def _tp_choices(model: ModelConfig, tp: int) -> str:
    return f"must be one of {model.name}'s TP widths ({', '.join(map(str, model.tp_widths))}), got {tp}"


def _choice(row: Mapping[str, Any], key: str, choices, file, at: str) -> str:
    value = row.get(key)
    if value not in choices:
        raise config_error(file, f"{at}.{key}", f"must be one of {', '.join(choices)}, got {value!r}")
    return value


def _layer_rows(path: Path, file, paper: str, table: str) -> tuple[tuple[LayerRow, ...], tuple[Gemm, ...]]:
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise config_error(file, "data", f"cannot read {path}") from None
    except json.JSONDecodeError as exc:
        raise PhazeError(f"{path}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
    if not isinstance(data, dict) or not isinstance(data.get("layers"), list) or not data["layers"]:
        raise config_error(path, "layers", "must be a non-empty list of layer timings")
    models: dict[str, ModelConfig] = {}
    rows = []
    for i, raw in enumerate(data["layers"]):
        at = f"layers[{i}]"
        entry = _mapping(raw, at, path, LAYER_KEYS, LAYER_OPTIONAL)
        model = _model(entry["model"], f"{at}.model", path, models)
        tp, mbs = _int(entry, "tp", path, f"{at}.tp"), _int(entry, "mbs", path, f"{at}.mbs")
        if tp not in model.tp_widths:
            raise config_error(path, f"{at}.tp", _tp_choices(model, tp))
        flash = _flag(entry, "flash", path, at)
        fwd, bwd, both = (_number(entry, k, path, f"{at}.{k}") for k in ("fwd_s", "bwd_s", "fwd_bwd_s"))
        if abs(fwd + bwd - both) > 1e-6 * both:
            raise config_error(path, f"{at}.bwd_s", f"fwd_s + bwd_s ({fwd + bwd}) must equal fwd_bwd_s ({both})")
        kernels = entry.get("kernels", "eager")
        if kernels not in LAYER_KERNELS:
            raise config_error(path, f"{at}.kernels", f"must be one of {', '.join(LAYER_KERNELS)}, got {kernels!r}")
        label = f"{model.name} tp {tp} mbs {mbs} {'flash' if flash else 'unfused'}" + (f" {kernels}" if kernels != "eager" else "")
        rows.append(LayerRow(model=model.name, tp=tp, microbatch=mbs, flash=flash, fwd_s=fwd, bwd_s=bwd, kernels=kernels,
                             source=Source(paper=paper, table=table, row=label)))
    gemms = []
    for i, raw in enumerate(data.get("gemm", [])):
        entry = _mapping(raw, f"gemm[{i}]", path, GEMM_KEYS)
        m, n, k = (_int(entry, key, path, f"gemm[{i}].{key}") for key in ("M", "N", "K"))
        gemms.append(Gemm(m=m, n=n, k=k, seconds=_number(entry, "s", path, f"gemm[{i}].s"),
                          tflops=_number(entry, "tflops", path, f"gemm[{i}].tflops")))
    return tuple(rows), tuple(gemms)
