"""The tracer's saved-activation count against what a real H100 kept (truth/h100-saved-bytes-2026.json,
made by truth/measure_saved_bytes.py): the project's own block, run eagerly on CUDA with PyTorch's
fused attention, fused and separate QKV projections."""

from __future__ import annotations

import dataclasses
import json

import pytest

from phaze_opt.configs import shipped_dir
from phaze_opt.workload.graphs import trace_kinds
from phaze_opt.workload.models import load_model

TRUTH = json.loads((shipped_dir() / "validation" / "truth" / "h100-saved-bytes-2026.json").read_text())


def _case_id(case):
    return f"{case['model']}-tp{case['tp']}-{case['qkv_projection']}"


@pytest.mark.parametrize("case", TRUTH["cases"], ids=_case_id)
def test_what_the_gpu_kept_is_what_the_tracer_counts(case):
    """Autograd's saved storages on the GPU = the tracer's count (layer input included) + the two
    things the tracer leaves out on purpose or never sees: the rotary cos/sin tables (constants
    that do not grow with the microbatch), SDPA's random-number state (a seed and an offset, two
    int64), where a device holds several KV groups the copy of Q the measurement's SDPA adapter
    makes to reach SDPA's [b, heads, s, d] layout (not the model's), and in a MoE block the weighted
    expert outputs [T k, h] its combine (`index_add`) adds back: eager autograd keeps index_add's
    source because PyTorch's derivative formula reads it for its shape (derivatives.yaml,
    `index_add`: `grad.index_select(dim, index).expand_as(source)`), which the backward does not
    need and Megatron's unpermute (a scatter-add, which keeps only its indices) does not keep."""
    model = dataclasses.replace(load_model(case["model"]), seq=case["seq"], qkv_projection=case["qkv_projection"],
                                attention="flash")
    tp, seq, mbs = case["tp"], case["seq"], case["mbs"]
    traced = trace_kinds(model, tp, mbs, seq, fuse=False)["block"]
    counted = traced.activation_bytes + sum(r[3] for r in traced.rebuilt)
    rotary = 2 * seq * model.head_dim * 2
    adapter_q = seq * mbs * model.heads // tp * model.head_dim * 2 if model.local_kv_heads(tp) > 1 else 0
    combine_source = seq * mbs * model.top_k * model.hidden * 2 if model.moe else 0
    assert case["hook_bytes"] == counted + rotary + 16 + adapter_q + combine_source
    # the allocator holds those storages, but the input (allocated before the forward), each rounded
    # up to its 512-byte blocks (the two 8-byte tensors take a block each)
    assert 0 <= case["allocated_bytes"] - (case["hook_bytes"] - seq * mbs * model.hidden * 2) < 4096


def test_separate_projections_free_q_and_k_on_the_gpu_as_counted():
    by = {(c["model"], c["tp"], c["qkv_projection"]): c for c in TRUTH["cases"]}
    for (name, tp, layout), fused in by.items():
        if layout != "fused":
            continue
        separate = by[(name, tp, "separate")]
        model = load_model(name)
        q_and_k = fused["seq"] * (model.heads + model.local_kv_heads(tp) * tp) // tp * model.head_dim * 2
        if model.qk_norm:  # the QK-norms save Q and K themselves: the layouts keep the same bytes
            q_and_k = 0
        for key in ("traced_bytes", "hook_bytes", "allocated_bytes"):
            assert fused[key] - separate[key] == q_and_k, (name, tp, key)
