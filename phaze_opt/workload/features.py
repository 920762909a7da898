"""A model's shape and features as flat fields (its MLflow params and tags): beside the model config
and the traced parameter counts it reads, so `models` stays free of the tracer."""

from __future__ import annotations

import os

from .graphs import active_params, model_params
from .models import ModelConfig, attention_kind, load_model


def feature_fields(model: str | os.PathLike | ModelConfig) -> dict[str, str]:
    """A model's shape and features under short keys that stay the same from model to model (a
    study's MLflow run logs them as `model.<key>`, so runs of different models compare column by
    column): every key is present for every model, 0 or false when the feature is absent; MLA's
    latent ranks only for MLA models. Sizes count parameters as `workload --json` does."""
    model = load_model(model)
    out = {
        "family": model.family, "layers": model.layers, "hidden": model.hidden, "seq": model.seq,
        "attention": attention_kind(model), "heads": model.heads,
        "kv_heads": model.heads if model.mla else model.kv_heads, "head_dim": model.head_dim,
        "qk_norm": model.qk_norm, "window": model.window, "global_every": model.global_every,
        "parallel_block": model.parallel_block, "moe_experts": model.experts, "moe_top_k": model.top_k,
        "shared_experts": model.shared_experts, "dense_layers": model.dense_layers if model.moe else 0,
        "mtp_layers": model.mtp_layers, "qkv_projection": model.qkv_projection,
        "params": model_params(model), "active_params": active_params(model),
    }
    if model.mla:
        out.update({"q_lora_rank": model.q_lora_rank, "kv_lora_rank": model.kv_lora_rank})
    return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in out.items()}
