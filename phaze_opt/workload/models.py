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
from ..errors import PhazeError, config_error
from ..system import LIMITS as SYSTEM_LIMITS

FAMILIES = ("gpt", "bert", "opt", "llama")
ACTIVATIONS = ("gelu", "relu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("learned", "rotary")
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}  # name -> bytes per element
DEFAULT_TP_CANDIDATES = (1, 2, 4, 8)

REQUIRED = (
    "name", "family", "layers", "hidden", "heads", "ffn", "seq", "vocab",
    "activation", "norm", "position", "tied_embeddings", "expert_placement",
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
# The position table holds at least `seq` rows and the token-type table is a small vocabulary.
LIMITS["positions"] = LIMITS["seq"]
LIMITS["type_vocab"] = LIMITS["vocab"]

# The hand-tuned placement's degrees each use at most every accelerator a system may have.
EXPERT_LIMIT = SYSTEM_LIMITS["accelerators"]

OPTIONAL = ("kv_heads", "tp_widths", "positions", "dropout", "bias", "dtype", "type_vocab", "norm_eps", "attention",
            *("experts", "top_k", "expert_ffn", "shared_experts", "dense_layers", "gate_renorm", "aux_loss_coef",
              "capacity_factor"))
# Mixture-of-experts fields (see `ModelConfig`): absent means a dense model, and a dense model's
# identity (hence every cache key) is what it was before they existed.
MOE_FIELDS = ("experts", "top_k", "expert_ffn", "shared_experts", "dense_layers", "gate_renorm", "aux_loss_coef",
              "capacity_factor")
# Most experts of any published MoE: 2,048 (GShard 600B); Switch-C has 2,048 too.
MOE_LIMIT = configs.Limit(2**16, "32x the most experts of any published MoE, 2,048")
ATTENTIONS = ("unfused", "flash")  # flash: one fused attention kernel per pass (layers.py, trace.py)


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
    expert_placement: dict  # {"tp": t, "pp": p, "dp": d}: the hand-tuned placement the baselines use
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
    source: str = field(default="", compare=False)  # the file it came from; not part of its identity

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

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
        if d["attention"] == "unfused":  # the default leaves the identity (and cache keys) as they were
            d.pop("attention")
        if not self.moe:  # a dense model hashes as it did before MoE fields existed
            for key in MOE_FIELDS:
                d.pop(key)
        d["tp_widths"] = list(d["tp_widths"])
        return d

    def __hash__(self):
        return hash(json.dumps(self.identity(), sort_keys=True))


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
    if hidden % heads:
        raise config_error(file, "heads", f"must divide hidden ({hidden}), got {heads}")
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

    head_dim = hidden // heads
    if position == "rotary":
        if head_dim % 2:
            raise config_error(file, "position", f"rotary needs an even head size, got hidden/heads = {head_dim}")
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

    def divides_all(t: int) -> bool:
        return heads % t == 0 and kv_heads % t == 0 and ffn % t == 0 and moe["expert_ffn"] % t == 0

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
                    f"width {t} must divide heads ({heads}), kv_heads ({kv_heads}), ffn ({ffn})"
                    + (f" and expert_ffn ({moe['expert_ffn']})" if moe["experts"] else ""),
                )
        if len(set(raw)) != len(raw):
            raise config_error(file, "tp_widths", f"has repeated widths: {raw}")
        tp_widths = tuple(sorted(raw))
    else:
        tp_widths = tuple(t for t in DEFAULT_TP_CANDIDATES if divides_all(t))

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
    if expert["pp"] > layers + 2:
        raise config_error(
            file, "expert_placement.pp",
            f"cannot exceed the {layers + 2} layers of the layer graph (blocks + embedding + head), got {expert['pp']}",
        )

    return ModelConfig(
        name=name.strip(), family=family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
        ffn=ffn, seq=seq, vocab=vocab, activation=activation, norm=norm, position=position,
        tied_embeddings=tied, tp_widths=tp_widths,
        expert_placement={k: expert[k] for k in ("tp", "pp", "dp", "ep", "cp") if k in expert},
        positions=positions, dropout=float(dropout), bias=bias, dtype=dtype, type_vocab=type_vocab,
        norm_eps=norm_eps, attention=attention, source=str(file), **moe,
    )


def _moe_fields(data: dict, file, ffn: int, layers: int, family: str) -> dict:
    """The mixture-of-experts fields, checked; all defaults (a dense model) when `experts` is absent."""
    present = [k for k in MOE_FIELDS if k in data]
    if "experts" not in data:
        if present:
            raise config_error(file, present[0], "only a mixture-of-experts model (one that sets experts) takes it")
        return {"experts": 0, "top_k": 0, "expert_ffn": ffn, "shared_experts": 0, "dense_layers": 0,
                "gate_renorm": True, "aux_loss_coef": 0.01, "capacity_factor": 1.0}
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
    return {"experts": experts, "top_k": top_k, "expert_ffn": expert_ffn, "shared_experts": shared,
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
