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

OPTIONAL = ("kv_heads", "tp_widths", "positions", "dropout", "bias", "dtype", "type_vocab", "norm_eps", "attention")
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
    source: str = field(default="", compare=False)  # the file it came from; not part of its identity

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

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

    def divides_all(t: int) -> bool:
        return heads % t == 0 and kv_heads % t == 0 and ffn % t == 0

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
                    f"width {t} must divide heads ({heads}), kv_heads ({kv_heads}) and ffn ({ffn})",
                )
        if len(set(raw)) != len(raw):
            raise config_error(file, "tp_widths", f"has repeated widths: {raw}")
        tp_widths = tuple(sorted(raw))
    else:
        tp_widths = tuple(t for t in DEFAULT_TP_CANDIDATES if divides_all(t))

    expert = data["expert_placement"]
    if not isinstance(expert, dict):
        raise config_error(file, "expert_placement", f"must be a mapping with tp, pp and dp, got {expert!r}")
    configs.check_keys(expert, file, ("tp", "pp", "dp"))
    for key in ("tp", "pp", "dp"):
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
        expert_placement={"tp": expert["tp"], "pp": expert["pp"], "dp": expert["dp"]},
        positions=positions, dropout=float(dropout), bias=bias, dtype=dtype, type_vocab=type_vocab,
        norm_eps=norm_eps, attention=attention, source=str(file),
    )


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
