"""Model configs: the few numbers that define a transformer, read from `configs/models/*.yaml`.

A model is named by its short name (`gpt3-175b`) or by a path to the user's own YAML file. Every
field is validated on load; a mistake is a one-line `PhazeError` naming the file, the field and
what is allowed, because these files are edited by hand and a traceback from deep inside the tracer
would not say which number was wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import configs
from ..errors import PhazeError, config_error, unknown_choice
from ..system import LIMITS as SYSTEM_LIMITS
from ..training import Layout

FAMILIES = ("gpt", "bert", "opt", "llama")
ACTIVATIONS = ("gelu", "relu", "swiglu", "squared_relu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}  # name -> bytes per element
DEFAULT_TP_CANDIDATES = (1, 2, 4, 8)

REQUIRED = (
    "name", "family", "layers", "hidden", "heads", "ffn", "seq", "vocab",
    "activation", "norm", "position", "tied_embeddings",
)
# Upper limits, checked on load so that a size no model has never reaches the tracer or the
# placement's byte arithmetic. Each is 10-100x beyond the largest dense transformers published.
LIMITS = {
    # The deepest trained transformers have ~1,000 layers (DeepNet); LLMs ~100 (Llama 3 405B: 126).
    "layers": configs.Limit(10_000, "10x the deepest transformer trained, ~1,000 layers"),
    # Widest: PaLM 540B 18,432, MT-NLG 530B 20,480, Megatron's 1T-parameter configuration 25,600.
    "hidden": configs.Limit(2**20, "40x the widest model, ~25,600"),
    # Most attention heads: 128 (Llama 3 405B); GPT-3 has 96.
    "heads": configs.Limit(2**14, "128x the most heads of any model, 128"),
    # Widest feed-forward: 73,728 (PaLM 540B); Llama 3 405B 53,248.
    "ffn": configs.Limit(2**22, "57x the widest feed-forward, 73,728"),
    # Longest training contexts: 128k-1M tokens; 2^20 covers them all.
    "seq": configs.Limit(2**20, "no model trains on more than ~1M tokens per sequence"),
    # Largest vocabularies: ~256k (Gemma 256,000).
    "vocab": configs.Limit(2**24, "64x the largest vocabulary, ~256k"),
}
# Widest attention head: 256 (PaLM, Gemma); DeepSeek-V3's query/key heads are 192.
LIMITS["head_dim"] = configs.Limit(2**14, "64x the widest attention head, 256")
# DeepSeek-V3 predicts one extra token (D = 1, arXiv:2412.19437 Sec. 2.2); its paper tries up to D = 2.
MTP_LIMIT = configs.Limit(64, "32x the deepest multi-token prediction published, 2")
# The position table holds at least `seq` rows and the token-type table is a small vocabulary.
LIMITS["positions"] = LIMITS["seq"]
LIMITS["type_vocab"] = LIMITS["vocab"]

# The hand-tuned placement's degrees each use at most every accelerator a system may have.
EXPERT_LIMIT = SYSTEM_LIMITS["accelerators"]

# How `phaze-opt evaluate` runs the model when the command names no chip, system or ILP time limit
# (see `ModelConfig.default_arch`); they change no graph, so they are not part of the identity.
DEFAULT_FIELDS = ("default_arch", "default_system", "default_ilp_time_limit")
# A per-pass schedule limit beyond an hour buys nothing: the MIP phases of a pass stop long before.
ILP_LIMIT = configs.Limit(3600, "an hour per layer pass; the solver's phases stop far sooner")

OPTIONAL = ("kv_heads", "tp_widths", "positions", "dropout", "bias", "dtype", "type_vocab", "norm_eps", "attention",
            "expert_placement", *DEFAULT_FIELDS,
            *("head_dim", "qk_norm", "window", "global_every", "parallel_block", "mtp_layers", "qkv_projection",
              "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
            *("experts", "top_k", "expert_ffn", "shared_experts", "dense_layers", "gate_renorm", "aux_loss_coef",
              "capacity_factor", "router_groups", "router_group_topk"))
# Mixture-of-experts fields (see `ModelConfig`): absent means a dense model, and a dense model's
# identity (hence every cache key) leaves them out, so it depends only on what a dense model has.
MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_experts", "dense_layers", "gate_renorm", "aux_loss_coef",
              "capacity_factor")
# Most experts of any published MoE: 2,048 (GShard 600B); Switch-C has 2,048 too.
MOE_LIMIT = configs.Limit(2**16, "32x the most experts of any published MoE, 2,048")
ATTENTIONS = ("unfused", "flash")  # flash: one fused attention kernel per pass (layers.py, trace.py)
QKV_PROJECTIONS = ("fused", "separate")  # see ModelConfig.qkv_projection
# The architecture fields of models trained since 2023 (see `ModelConfig`), with the value that means
# "not used". At that value a field is left out of the model's identity, so every older model hashes
# (and caches) as it did before the field existed.
MODERN_DEFAULTS = {"head_size": 0, "qk_norm": False, "window": 0, "global_every": 0, "parallel_block": False,
                   "mtp_layers": 0, "q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0,
                   "qk_rope_head_dim": 0, "v_head_dim": 0, "router_groups": 0, "router_group_topk": 0,
                   "qkv_projection": "fused"}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class ModelConfig:
    """A transformer as Megatron would build it; every size is a count, not bytes.

    `family` fixes what the config does not spell out: BERT is a bidirectional encoder with
    post-norm blocks, a masked-LM head and token-type embeddings; GPT, OPT and Llama are causal
    decoders with pre-norm blocks and an LM head.
    """

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int
    activation: str
    norm: str
    position: str
    tied_embeddings: bool
    tp_widths: tuple[int, ...]
    # {"tp": t, "pp": p, "dp": d}: the hand-tuned placement the baselines use; None when the file
    # gives none (the baselines then use the optimal placement and say so: design/evaluate.py)
    expert_placement: Layout | None
    positions: int = 0  # rows of the learned position table (OPT keeps 2 extra); 0 for rotary
    dropout: float = 0.1
    bias: bool = True  # biases on the linear layers (Llama has none)
    dtype: str = "bf16"
    type_vocab: int = 0  # BERT's token-type (segment) embeddings
    norm_eps: float = 1e-5
    attention: str = "unfused"  # or "flash": FlashAttention (Dao et al. 2022), see layers.py
    # Mixture of experts (layers.MoE): `experts` routed experts of SwiGLU/GELU width `expert_ffn`
    # per block, `top_k` of them per token, `shared_experts` always-on experts of the same width
    # (DeepSeek-MoE, Dai et al. 2024), the first `dense_layers` blocks dense with width `ffn`;
    # `gate_renorm`: the top-k gate weights renormalised to sum to 1 (Mixtral) or not (DeepSeek-MoE);
    # `aux_loss_coef`: alpha of the load-balancing loss (Fedus et al. 2022, Switch Transformer eq. 4);
    # `capacity_factor`: each expert's buffer holds capacity_factor x the mean tokens per expert
    # (Fedus et al. 2022, eq. 3), set from the training recipe. experts = 0: a dense model.
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    gate_renorm: bool = True
    aux_loss_coef: float = 0.01
    capacity_factor: float = 1.0
    # Architecture of the models trained since 2023 (each at its MODERN_DEFAULTS value: not used).
    # `head_size`: the attention head width when it is not hidden / heads (PaLM, Chowdhery et al.
    # 2022: 48 heads of 256 on d_model 18432; Qwen3 and GPT-OSS model cards); 0: hidden / heads.
    head_size: int = 0
    # `qk_norm`: RMSNorm over each query and key head before the dot product (Dehghani et al. 2023,
    # ViT-22B; used by OLMo 2 and the Qwen3 model cards), one learned scale of head_dim per norm.
    qk_norm: bool = False
    # `window`: sliding-window attention over the last `window` tokens (Beltagy et al. 2020,
    # Longformer; Mistral 7B, Jiang et al. 2023); `global_every` n: every n-th block attends over the
    # whole sequence and the others over the window (GPT-OSS alternates, n = 2, per its model card;
    # Gemma 3 has 5 local per global, n = 6); 0: every block is local. window = 0: no window.
    window: int = 0
    global_every: int = 0
    # `parallel_block`: attention and MLP read the same normalised input and their outputs are added
    # to the residual together (GPT-J, Wang & Komatsuzaki 2021; PaLM, Chowdhery et al. 2022, Sec. 2)
    parallel_block: bool = False
    # `qkv_projection`: how the implementation lays out the attention's input projection. `fused`:
    # one GEMM whose output holds Q, K and V side by side (Megatron's `linear_qkv`); `separate`:
    # three GEMMs with outputs of their own (`wq`, `wk`, `wv` in Meta's published Llama code,
    # github.com/meta-llama/llama3 `llama/model.py`, and in torchtitan's Llama 3; `q_proj`,
    # `k_proj`, `v_proj` in Hugging Face's). Same weights and GEMM FLOPs (backward adds the three
    # input gradients); what differs is memory: autograd keeps a saved view's whole storage, so an
    # attention that saves V keeps the fused output (Q, K and V) through it, and only V's own bytes
    # when V has its own storage.
    qkv_projection: str = "fused"
    # `mtp_layers`: DeepSeek-V3's multi-token-prediction modules (DeepSeek-AI 2024, arXiv:2412.19437,
    # Sec. 2.2): each a projection of [norm(h); norm(emb)] then one transformer block, the embedding
    # and output head shared with the main model.
    mtp_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, Sec. 2.1; DeepSeek-V3): queries
    # through a rank-`q_lora_rank` bottleneck (0: a plain projection), keys and values through one
    # rank-`kv_lora_rank` latent; each head's query/key is `qk_nope_head_dim` content dims plus
    # `qk_rope_head_dim` rotary dims (the rotary key shared by all heads), values `v_head_dim`.
    # kv_lora_rank = 0: no MLA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Group-limited routing (DeepSeek-V3 report, arXiv:2412.19437, Sec. 2.1.2 "Node-Limited Routing":
    # each token is sent to at most M nodes; model card config.json n_group 8, topk_group 4;
    # Megatron-Core `--moe-router-num-groups`, `--moe-router-group-topk`): the routed experts fall into
    # `router_groups` equal groups and a token's top-k experts come from its best `router_group_topk`
    # of them. It changes no graph, only what DeepEP sends between nodes (System.alltoall_s).
    # 0: not used.
    router_groups: int = 0
    router_group_topk: int = 0
    source: str = field(default="", compare=False)  # the file it came from; not part of its identity
    # The chip and system `phaze-opt evaluate` uses when none is named (a preset name each; "": the
    # command's own defaults), and its per-pass schedule limit in seconds (0: the command's). A model
    # of 10^11 parameters does not fit the command's generic defaults (a 32 GiB TPUv4 die), so a new
    # user's first command would otherwise be an infeasible one. None changes a graph or a cost, so
    # none is part of the identity (or of any cache key).
    default_arch: str = field(default="", compare=False)
    default_system: str = field(default="", compare=False)
    default_ilp_time_limit: float = field(default=0.0, compare=False)

    @property
    def head_dim(self) -> int:
        """The width of one query/key head (with MLA: content plus rotary dims)."""
        if self.mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_size or self.hidden // self.heads

    @property
    def value_dim(self) -> int:
        """The width of one value head (MLA's v_head_dim; otherwise the head width)."""
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def local_kv_heads(self, t: int) -> int:
        """KV heads one device of a TP group of t holds: kv_heads / t, or one replicated KV head when
        t exceeds them (each KV head copied onto the t / kv_heads devices that hold its query heads,
        as vLLM's QKVParallelLinear and Megatron-LM's replicated-KV GQA do). MLA has no shared K/V:
        each device holds its heads / t heads' keys and values."""
        kv = self.heads if self.mla else self.kv_heads
        return kv // t if kv >= t else 1

    def kv_elements_per_token(self, t: int) -> int:
        """K and V elements of one token on one device of a TP group of t (what context
        parallelism passes around the ring)."""
        return self.local_kv_heads(t) * (self.head_dim + self.value_dim)

    def global_block(self, i: int) -> bool:
        """Whether block i attends over the whole sequence (see `window`, `global_every`)."""
        return not self.window or (self.global_every > 0 and (i + 1) % self.global_every == 0)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """Blocks with routed experts (the first `dense_layers` blocks are dense)."""
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def causal(self) -> bool:
        return self.family != "bert"

    @property
    def post_norm(self) -> bool:
        return self.family == "bert"

    @property
    def bytes_per_element(self) -> int:
        return DTYPES[self.dtype]

    def identity(self) -> dict:
        """Everything that changes the graphs (the file it came from does not)."""
        d = asdict(self)
        d.pop("source")
        for key in DEFAULT_FIELDS:
            d.pop(key)
        if d["attention"] == "unfused":  # the default stays out of the identity (and cache keys)
            d.pop("attention")
        if not self.moe:  # a dense model's hash holds no MoE field
            for key in MOE_FIELDS:
                d.pop(key)
        for key, default in MODERN_DEFAULTS.items():
            if d[key] == default:
                d.pop(key)
        d["tp_widths"] = list(d["tp_widths"])
        return d

    def __hash__(self):
        return hash(json.dumps(self.identity(), sort_keys=True))


def model_features(model: ModelConfig) -> list[str]:
    """The attention and block variants a model uses, in words (empty for a classic transformer)."""
    out = []
    if model.mla:
        out.append(f"MLA (q latent {model.q_lora_rank or 'none'}, KV latent {model.kv_lora_rank}, "
                   f"head {model.qk_nope_head_dim}+{model.qk_rope_head_dim} rotary, value {model.v_head_dim})")
    elif model.kv_heads == 1 and model.heads > 1:
        out.append("multi-query attention")
    elif model.kv_heads < model.heads:
        out.append(f"grouped-query attention ({model.kv_heads} KV heads)")
    if model.head_size:
        out.append(f"head size {model.head_size}")
    if model.qk_norm:
        out.append("QK-norm")
    if model.window:
        out.append(f"sliding window {model.window}"
                   + (f", one block in {model.global_every} global" if model.global_every else ""))
    if model.parallel_block:
        out.append("parallel attention + MLP blocks")
    if model.qkv_projection != "fused":
        out.append("separate Q, K and V projections")
    if model.moe and model.shared_experts:
        out.append(f"{model.shared_experts} shared experts")
    if model.moe and model.dense_layers:
        out.append(f"first {model.dense_layers} blocks dense")
    if model.mtp_layers:
        out.append(f"{model.mtp_layers} MTP module(s)")
    return out


def attention_kind(model: ModelConfig) -> str:
    """mla, mqa (one KV head), gqa (fewer KV heads than query heads) or mha."""
    if model.mla:
        return "mla"
    if model.kv_heads == 1 and model.heads > 1:
        return "mqa"
    return "gqa" if model.kv_heads < model.heads else "mha"


def load_model(name_or_path: str | os.PathLike | ModelConfig) -> ModelConfig:
    """Read and validate a model config by short name or path; a ModelConfig passes through."""
    if isinstance(name_or_path, ModelConfig):
        return name_or_path
    data, path = configs.load("models", name_or_path)
    return parse_model(data, path)


def parse_model(data: dict, file: str | Path = "<model>") -> ModelConfig:
    """Validate a model mapping; the first problem found is raised as a one-line PhazeError."""
    configs.check_keys(data, file, REQUIRED, OPTIONAL)

    name = data["name"]
    if not isinstance(name, str) or not name.strip():
        raise config_error(file, "name", f"must be a non-empty string, got {name!r}")
    family = configs.one_of(data, "family", file, FAMILIES)
    layers = configs.positive_int(data, "layers", file, limit=LIMITS["layers"])
    hidden = configs.positive_int(data, "hidden", file, limit=LIMITS["hidden"])
    heads = configs.positive_int(data, "heads", file, limit=LIMITS["heads"])
    mla = _mla_fields(data, file)
    if "head_dim" in data and mla["kv_lora_rank"]:
        raise config_error(file, "head_dim", "an MLA model's head sizes are qk_nope_head_dim + qk_rope_head_dim")
    head_size = configs.positive_int(data, "head_dim", file, limit=LIMITS["head_dim"]) if "head_dim" in data else 0
    if not head_size and not mla["kv_lora_rank"] and hidden % heads:
        raise config_error(file, "heads", f"must divide hidden ({hidden}) unless head_dim is given, got {heads}")
    if "kv_heads" in data and mla["kv_lora_rank"]:
        raise config_error(file, "kv_heads", "an MLA model has no shared KV heads (its keys and values come from one latent)")
    kv_heads = configs.positive_int(data, "kv_heads", file, default=heads)
    if heads % kv_heads:
        raise config_error(file, "kv_heads", f"must divide heads ({heads}), got {kv_heads}")
    ffn = configs.positive_int(data, "ffn", file, limit=LIMITS["ffn"])
    seq = configs.positive_int(data, "seq", file, limit=LIMITS["seq"])
    vocab = configs.positive_int(data, "vocab", file, limit=LIMITS["vocab"])
    activation = configs.one_of(data, "activation", file, ACTIVATIONS)
    norm = configs.one_of(data, "norm", file, NORMS)
    position = configs.one_of(data, "position", file, POSITIONS)
    tied = _boolean(data, "tied_embeddings", file)
    bias = _boolean(data, "bias", file, default=True)
    dtype = configs.one_of(data, "dtype", file, tuple(DTYPES), default="bf16")
    norm_eps = configs.positive_number(data, "norm_eps", file, default=1e-5)
    attention = configs.one_of(data, "attention", file, ATTENTIONS, default="unfused")

    dropout = data.get("dropout", 0.1)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise config_error(file, "dropout", f"must be a number in [0, 1), got {dropout!r}")

    head_dim = head_size or hidden // heads
    if mla["kv_lora_rank"] and position != "rotary":
        raise config_error(file, "position", "MLA's decoupled keys are rotary (position: rotary)")
    if position == "rotary":
        if mla["kv_lora_rank"]:
            if mla["qk_rope_head_dim"] % 2:
                raise config_error(file, "qk_rope_head_dim", f"rotary needs an even size, got {mla['qk_rope_head_dim']}")
        elif head_dim % 2:
            raise config_error(file, "position", f"rotary needs an even head size, got {head_dim}")
        if "positions" in data:
            raise config_error(file, "positions", "only learned position embeddings have a table size")
        positions = 0
    else:
        positions = configs.positive_int(data, "positions", file, default=seq, limit=LIMITS["positions"])
        if positions < seq:
            raise config_error(file, "positions", f"must be at least seq ({seq}), got {positions}")

    type_vocab = data.get("type_vocab", 2 if family == "bert" else 0)
    if isinstance(type_vocab, bool) or not isinstance(type_vocab, int) or type_vocab < 0:
        raise config_error(file, "type_vocab", f"must be a non-negative integer, got {type_vocab!r}")
    too_many = LIMITS["type_vocab"].exceeded(type_vocab)
    if too_many:
        raise config_error(file, "type_vocab", too_many)

    moe = _moe_fields(data, file, ffn, layers, family)
    modern = _modern_fields(data, file, family, layers, mla["kv_lora_rank"])

    def divides_all(t: int) -> bool:
        # KV heads split over the group or, when t exceeds them, each is replicated on t / kv_heads
        # devices (ModelConfig.local_kv_heads); the query heads must still split evenly.
        kv_ok = kv_heads % t == 0 or t % kv_heads == 0
        return heads % t == 0 and kv_ok and ffn % t == 0 and moe["expert_ffn"] % t == 0

    if "tp_widths" in data:
        raw = data["tp_widths"]
        if not isinstance(raw, list) or not raw:
            raise config_error(file, "tp_widths", f"must be a non-empty list of positive integers, got {raw!r}")
        for t in raw:
            if isinstance(t, bool) or not isinstance(t, int) or t <= 0:
                raise config_error(file, "tp_widths", f"must hold positive integers, got {t!r}")
            if not divides_all(t):
                raise config_error(
                    file, "tp_widths",
                    f"width {t} must divide heads ({heads}) and ffn ({ffn}), and divide or be a multiple of "
                    f"kv_heads ({kv_heads})"
                    + (f" and expert_ffn ({moe['expert_ffn']})" if moe["experts"] else ""),
                )
        if len(set(raw)) != len(raw):
            raise config_error(file, "tp_widths", f"has repeated widths: {raw}")
        tp_widths = tuple(sorted(raw))
    else:
        tp_widths = tuple(t for t in DEFAULT_TP_CANDIDATES if divides_all(t))

    graph_layers = layers + 2 + modern["mtp_layers"]  # blocks + embedding + head (+ MTP modules)
    return ModelConfig(
        name=name.strip(), family=family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        ffn=ffn, seq=seq, vocab=vocab, activation=activation, norm=norm, position=position,
        tied_embeddings=tied, tp_widths=tp_widths,
        expert_placement=_expert_placement(data, file, tp_widths, graph_layers),
        positions=positions, dropout=float(dropout), bias=bias, dtype=dtype, type_vocab=type_vocab,
        norm_eps=norm_eps, attention=attention, source=str(file), head_size=head_size, **moe, **modern, **mla,
        **_default_fields(data, file),
    )


def _default_fields(data: dict, file) -> dict:
    """`default_arch`, `default_system` (preset names, checked to exist now, so that a misspelt one is
    reported against this file rather than as an unknown --arch the user never typed) and
    `default_ilp_time_limit` (seconds)."""
    out = {}
    for key, kind, noun in (("default_arch", "archs", "an arch"), ("default_system", "systems", "a system")):
        value = data.get(key, "")
        if key not in data:
            out[key] = ""
            continue
        if not isinstance(value, str) or not value.strip():
            raise config_error(file, key, f"must be the name of {noun} preset, got {value!r}")
        if configs.find(kind, value.strip()) is None:
            raise config_error(file, key, unknown_choice(kind[:-1], value, configs.available(kind)))
        out[key] = value.strip()
    out["default_ilp_time_limit"] = (configs.positive_number(data, "default_ilp_time_limit", file, limit=ILP_LIMIT)
                                     if "default_ilp_time_limit" in data else 0.0)
    return out


def _expert_placement(data: dict, file, tp_widths: tuple[int, ...], graph_layers: int) -> Layout | None:
    """The hand-tuned placement, checked; None when the file gives none (it is optional: a new
    model need not invent one, and the baselines fall back to the optimal placement)."""
    if "expert_placement" not in data:
        return None
    expert = data["expert_placement"]
    if not isinstance(expert, dict):
        raise config_error(file, "expert_placement", f"must be a mapping with tp, pp and dp, got {expert!r}")
    configs.check_keys(expert, file, ("tp", "pp", "dp"), ("ep", "cp"))  # ep, cp: expert / context parallelism
    for key in ("tp", "pp", "dp", *(k for k in ("ep", "cp") if k in expert)):
        configs.positive_int(expert, key, file, limit=EXPERT_LIMIT, field=f"expert_placement.{key}")
    if expert["tp"] not in tp_widths:
        raise config_error(
            file, "expert_placement.tp",
            f"must be one of the model's TP widths ({', '.join(map(str, tp_widths))}), got {expert['tp']}",
        )
    if expert["pp"] > graph_layers:
        raise config_error(
            file, "expert_placement.pp",
            f"cannot exceed the {graph_layers} layers of the layer graph (blocks + embedding + head), got {expert['pp']}",
        )
    return Layout(**{k: expert[k] for k in ("tp", "pp", "dp", "ep", "cp") if k in expert})


def _non_negative_int(data: dict, key: str, file, limit: configs.Limit) -> int:
    value = data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise config_error(file, key, f"must be a non-negative integer, got {value!r}")
    too_many = limit.exceeded(value)
    if too_many:
        raise config_error(file, key, too_many)
    return value


def _mla_fields(data: dict, file) -> dict:
    """Multi-head latent attention's sizes (DeepSeek-V2, Sec. 2.1), checked; all 0 without MLA."""
    present = [k for k in MLA_FIELDS if k in data]
    if "kv_lora_rank" not in data:
        if present:
            raise config_error(file, present[0], "only an MLA model (one that sets kv_lora_rank) takes it")
        return {k: 0 for k in MLA_FIELDS}
    out = {"kv_lora_rank": configs.positive_int(data, "kv_lora_rank", file, limit=LIMITS["hidden"]),
           "q_lora_rank": _non_negative_int(data, "q_lora_rank", file, LIMITS["hidden"])}
    for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if key not in data:
            raise config_error(file, key, "missing required field (an MLA model sets kv_lora_rank)")
        out[key] = configs.positive_int(data, key, file, limit=LIMITS["head_dim"])
    return out


def _modern_fields(data: dict, file, family: str, layers: int, mla: int) -> dict:
    """QK-norm, sliding windows, parallel blocks and MTP modules, checked (see `ModelConfig`)."""
    qk_norm = _boolean(data, "qk_norm", file, default=False)
    if qk_norm and mla:
        raise config_error(file, "qk_norm", "MLA normalises its latents instead; not both")
    window = _non_negative_int(data, "window", file, LIMITS["seq"])
    global_every = _non_negative_int(data, "global_every", file, LIMITS["layers"])
    if global_every and not window:
        raise config_error(file, "global_every", "only a model with a sliding window (window > 0) takes it")
    if window and family == "bert":
        raise config_error(file, "window", "sliding windows are built for the decoder families only")
    parallel = _boolean(data, "parallel_block", file, default=False)
    if parallel and family == "bert":
        raise config_error(file, "parallel_block", "parallel blocks are pre-norm; BERT's blocks are post-norm")
    if parallel and "experts" in data:
        raise config_error(file, "parallel_block", "parallel blocks are built for dense MLPs only, not experts")
    mtp = _non_negative_int(data, "mtp_layers", file, MTP_LIMIT)
    if mtp and family == "bert":
        raise config_error(file, "mtp_layers", "multi-token prediction is built for the decoder families only")
    qkv = configs.one_of(data, "qkv_projection", file, QKV_PROJECTIONS, default="fused")
    if qkv != "fused" and mla:
        raise config_error(file, "qkv_projection", "MLA projects its queries and latents with projections of its own")
    return {"qk_norm": qk_norm, "window": window, "global_every": global_every, "parallel_block": parallel,
            "mtp_layers": mtp, "qkv_projection": qkv}


def _moe_fields(data: dict, file, ffn: int, layers: int, family: str) -> dict:
    """The mixture-of-experts fields, checked; all defaults (a dense model) when `experts` is absent."""
    present = [k for k in MOE_FIELDS + ("router_groups", "router_group_topk") if k in data]
    if "experts" not in data:
        if present:
            raise config_error(file, present[0], "only a mixture-of-experts model (one that sets experts) takes it")
        return {"experts": 0, "top_k": 0, "expert_ffn": ffn, "shared_experts": 0, "dense_layers": 0,
                "gate_renorm": True, "aux_loss_coef": 0.01, "capacity_factor": 1.0,
                "router_groups": 0, "router_group_topk": 0}
    if family == "bert":
        raise config_error(file, "experts", "mixture-of-experts blocks are built for the decoder families only")
    experts = configs.positive_int(data, "experts", file, limit=MOE_LIMIT)
    if experts < 2:
        raise config_error(file, "experts", f"a mixture of experts needs at least 2 experts, got {experts}")
    if "top_k" not in data:
        raise config_error(file, "top_k", "missing required field (experts per token)")
    top_k = configs.positive_int(data, "top_k", file)
    if top_k > experts:
        raise config_error(file, "top_k", f"must be at most experts ({experts}), got {top_k}")
    expert_ffn = configs.positive_int(data, "expert_ffn", file, default=ffn, limit=LIMITS["ffn"])
    shared = data.get("shared_experts", 0)
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= MOE_LIMIT.maximum:
        raise config_error(file, "shared_experts", f"must be a non-negative integer, got {shared!r}")
    dense = data.get("dense_layers", 0)
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense < layers:
        raise config_error(file, "dense_layers", f"must be an integer in [0, layers = {layers}), got {dense!r}")
    alpha = data.get("aux_loss_coef", 0.01)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < 1e6:
        raise config_error(file, "aux_loss_coef", f"must be a non-negative number, got {alpha!r}")
    groups = _non_negative_int(data, "router_groups", file, MOE_LIMIT)
    if groups and experts % groups:
        raise config_error(file, "router_groups", f"must divide experts ({experts}), got {groups}")
    group_topk = _non_negative_int(data, "router_group_topk", file, MOE_LIMIT)
    if bool(groups) != bool(group_topk):
        raise config_error(file, "router_group_topk" if groups else "router_groups",
                           "router_groups and router_group_topk come together (group-limited routing)")
    if groups and not (group_topk <= groups and top_k <= group_topk * (experts // groups)):
        raise config_error(file, "router_group_topk", f"must be at most router_groups ({groups}) and leave room "
                           f"for top_k ({top_k}) experts in its groups, got {group_topk}")
    return {"experts": experts, "top_k": top_k, "expert_ffn": expert_ffn, "shared_experts": shared,
            "router_groups": groups, "router_group_topk": group_topk,
            "dense_layers": dense, "gate_renorm": _boolean(data, "gate_renorm", file, default=True),
            "aux_loss_coef": float(alpha),
            "capacity_factor": check_capacity_factor(data.get("capacity_factor", 1.0), f"{file}: capacity_factor")}


CAPACITY_LIMIT = 64.0  # an expert's buffer at most 64x the mean load (every token on one of 64 experts)


def check_capacity_factor(value, name: str) -> float:
    """A capacity factor: a number in (0, 64]; below 1 tokens are dropped (Fedus et al. 2022, Sec. 2.2)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= CAPACITY_LIMIT:
        raise PhazeError(f"{name} must be a number in (0, {CAPACITY_LIMIT:g}], got {value!r}")
    return float(value)


def _boolean(data: dict, key: str, file, default=None) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise config_error(file, key, f"must be true or false, got {value!r}")
    return value


def check_tp(model: ModelConfig, tp) -> int:
    """A TP width the model allows, or a one-line error listing the allowed ones."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp not in model.tp_widths:
        allowed = ", ".join(map(str, model.tp_widths))
        raise PhazeError(f"model {model.name}: TP width {tp!r} not allowed; choose one of {allowed}")
    return tp
