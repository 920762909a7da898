"""A model's layer kinds and their order: its structure, without PyTorch.

The modules of each kind are built in layers.py (which imports PyTorch, seconds on a loaded
machine); what a study's processes need of the structure (which layers hold experts, which run
attention, their order) is here, so a process that never traces a layer never imports PyTorch.
"""

from __future__ import annotations

from .models import ModelConfig

# dense_block: the dense first blocks of a MoE model; local_*: blocks with sliding-window attention
# (ModelConfig.window); mtp: a multi-token-prediction module (ModelConfig.mtp_layers).
BLOCK_KINDS = ("dense_block", "local_dense_block", "local_block", "block")
KINDS = ("embedding", *BLOCK_KINDS, "mtp", "head")
# The `recompute_module` tag of a norm whose output only a column-parallel linear reads (layers.py
# sets it; workload/stack.py reads it without building a layer): Megatron-Core's Transformer Engine
# spec fuses such a norm into the linear, where `layernorm` recompute does not act.
LAYERNORM_LINEAR = "layernorm_linear"


def layer_kinds(model: ModelConfig) -> tuple[str, ...]:
    """The layer kinds a model has, in order of first appearance (a dense model has no `dense_block`)."""
    return tuple(dict.fromkeys(kind for _, kind in layer_sequence(model)))


def block_kind(model: ModelConfig, i: int) -> str:
    """The kind of block i: dense first blocks of a MoE model, sliding-window (local) blocks."""
    kind = "dense_block" if model.moe and i < model.dense_layers else "block"
    return kind if model.global_block(i) else f"local_{kind}"


def layer_sequence(model: ModelConfig) -> list[tuple[str, str]]:
    """(name, kind) of every layer in order: embedding, the blocks, the MTP modules, head."""
    return ([("embedding", "embedding")]
            + [(f"block.{i}", block_kind(model, i)) for i in range(model.layers)]
            + [(f"mtp.{i}", "mtp") for i in range(model.mtp_layers)]
            + [("head", "head")])


def routed_kind(model: ModelConfig, kind: str) -> bool:
    """Whether layers of this kind hold routed experts."""
    return model.moe and kind in ("block", "local_block", "mtp")


def attention_kind(kind: str) -> bool:
    """Whether layers of this kind run attention (every block and MTP module)."""
    return kind in BLOCK_KINDS or kind == "mtp"
