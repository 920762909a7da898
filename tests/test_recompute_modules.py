"""Module-level selective recompute (`Training.recompute_modules`, Megatron-Core's `--recompute-modules`):
the recipe's checks, the trace's module tags against hand counts, sequence parallelism's share, and
that adding a module never raises memory nor lowers time on every preset model, through the same
LayerCosts the evaluator and the DPs read (their agreement: the oracle tests in test_placement_dp.py
and test_expert_parallel.py draw the module arrays too)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from phaze_opt import configs
from phaze_opt.design.evaluate import recomputed_s
from phaze_opt.design.parallel import attention_core_s
from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.types import LayerCosts, Placement, PlacementProblem
from phaze_opt.system import load_system
from phaze_opt.training import RECOMPUTE_MODULES, Training
from phaze_opt.validation.suites import load_suite
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.layers import expert_capacity
from phaze_opt.workload.models import load_model
from phaze_opt.workload.stack import recompute_tags

from test_validation_modern import MIXTRAL, _suite

# One model of each block structure on every run (dense GQA + SwiGLU, GPT, MoE); the rest `slow`.
QUICK = ("llama3-8b", "megatron-gpt-1.7b", "qwen3-30b-a3b")
SEQ = 256  # the tags and the inequalities do not depend on the sequence length


def _tp(model) -> int:
    return next((t for t in model.tp_widths if t > 1), 1)


def _graph(name: str):
    model = load_model(name)
    return model, build_layer_graph(model, _tp(model), 1, SEQ)


# --- the recipe ----------------------------------------------------------------------------------

def test_recompute_modules_are_checked_in_one_line():
    with pytest.raises(PhazeError, match="recompute_modules needs recompute selective .* got recompute none"):
        Training(recompute_modules=["layernorm"])
    with pytest.raises(PhazeError, match=r"unknown module 'norm'; allowed: core_attn, layernorm, moe_act, mlp, moe, "
                                         r"shared_experts, mla_up_proj$"):
        Training(recompute="selective", recompute_modules=["norm"])
    with pytest.raises(PhazeError, match="at least one"):
        Training(recompute="selective", recompute_modules=[])
    t = Training(recompute="selective", recompute_modules=["moe", "layernorm", "moe"])
    assert t.recompute_modules == ("layernorm", "moe") == Training(recompute="selective",
                                                                   recompute_modules="moe,layernorm").recompute_modules
    assert t.recomputed_modules == ("layernorm", "moe") and "core_attn" not in t.recomputed_modules
    assert Training(recompute="selective").recomputed_modules == ("core_attn",)  # Megatron's default
    assert Training(recompute="full").recomputed_modules == ()
    # the recipe and the layer memo key carry it only when set, so every earlier key is unchanged
    assert "recompute_modules" not in Training(recompute="selective").recipe()
    assert t.recipe()["recompute_modules"] == ["layernorm", "moe"]
    assert t.layer_key() != Training(recompute="selective").layer_key() == Training().layer_key()


def test_layernorm_leaves_the_norms_fused_into_a_linear_under_transformer_engine():
    lm = Training(recompute="selective", recompute_modules=["layernorm"])
    te = Training(recompute="selective", recompute_modules=["layernorm"], stack="megatron-te")
    assert recompute_tags(lm) == {"layernorm", "layernorm_linear"} and recompute_tags(te) == {"layernorm"}
    assert recompute_tags(Training(recompute="selective")) == frozenset()


def test_a_suite_row_carries_its_modules_and_a_wrong_one_is_one_line(tmp_path):
    row = {**MIXTRAL, "recompute": "selective", "recompute_modules": ["moe_act", "layernorm"]}
    (loaded,) = load_suite(_suite(tmp_path, row)).rows
    assert loaded.training.recompute_modules == ("layernorm", "moe_act")
    for change, words in (({"recompute": "none"}, "needs recompute selective"),
                          ({"recompute_modules": ["attn"]}, "unknown module 'attn'"),
                          ({"recompute_modules": "moe"}, "must be a list")):
        path = _suite(tmp_path, {**row, **change}, name="bad.yaml")
        with pytest.raises(PhazeError) as info:
            load_suite(path)
        message = str(info.value)
        assert "\n" not in message and "field 'rows[0].recompute_modules'" in message and words in message


# --- what each module drops, from the trace -------------------------------------------------------

def _group(layer, names: str) -> float:
    return sum(b for n, b, _ in layer.module_groups if n == names)


def test_moe_act_and_layernorm_drop_the_tensors_megatron_discards():
    """Qwen3-30B-A3B block at TP 2: `moe_act` drops the experts' SwiGLU product (FC2's input,
    E x capacity x expert_ffn / t); `layernorm` (the pre-MLP norm, read by the router and the
    dispatch) its output and 1/rms; the attention's input norm, fused into QKV under TE, is tagged apart."""
    model, graph = _graph("qwen3-30b-a3b")
    t, e = graph.tp, model.bytes_per_element
    block = next(l for l in graph.layers if l.kind == "block")
    capacity = expert_capacity(model, SEQ)
    assert _group(block, "moe,moe_act") == model.experts * capacity * model.expert_ffn // t * e
    assert _group(block, "layernorm") == SEQ * model.hidden * e + SEQ * e
    assert _group(block, "layernorm_linear") == SEQ * model.hidden * e + SEQ * e
    # `moe` keeps the MoE layer's input (the norm's output, made outside it) and drops the rest
    assert block.module_bytes({"moe"}) == sum(b for n, b, _ in block.module_groups if "moe" in n.split(","))
    assert block.module_bytes({"moe"}) >= block.module_bytes({"moe_act"}) > 0


def test_mlp_drops_a_dense_mlps_saved_tensors_and_sequence_parallelism_shards_the_norms():
    """Llama 3 8B block at TP 2: `mlp` drops FC1's output (gate and up) and the SwiGLU product,
    keeps its input; with SP the norm's output and statistics are split over t, the MLP's inner
    tensors (already 1/t) are not."""
    model, graph = _graph("llama3-8b")
    t, e = graph.tp, model.bytes_per_element
    block = next(l for l in graph.layers if l.kind == "block")
    assert _group(block, "mlp") == SEQ * 3 * model.ffn // t * e
    assert block.module_bytes({"mlp"}, True) == block.module_bytes({"mlp"}, False)
    norms = 2 * (SEQ * model.hidden * e + SEQ * e)  # both norms: output and 1/rms
    assert block.module_bytes({"layernorm_linear"}) == norms
    assert block.module_bytes({"layernorm_linear"}, True) == norms // t
    # a module the layer lacks is a no-op (Megatron-Core: each flag acts only inside its module)
    assert all(layer.module_bytes({"moe", "moe_act", "shared_experts"}, sp) == 0
               for layer in graph.layers for sp in (False, True))


def test_mla_up_proj_drops_the_heads_q_k_v_and_keeps_the_latents():
    """DeepSeek-V3 at TP 2 with flash attention: `mla_up_proj` drops what the up-projections and
    RoPE make, the Q, K and V the attention kernel keeps (H/t heads x s x (nope + rope) for Q and K,
    x v_head_dim for V), and keeps the latents they are made from (made outside it)."""
    model, graph = _graph("deepseek-v3")
    t, e = graph.tp, model.bytes_per_element
    block = next(l for l in graph.layers if l.kind == "block")
    heads = model.heads // t
    qkv = SEQ * heads * (2 * (model.qk_nope_head_dim + model.qk_rope_head_dim) + model.v_head_dim) * e
    assert qkv <= _group(block, "mla_up_proj") <= qkv + SEQ * heads * model.qk_nope_head_dim * e  # V: a view of KV's
    names = [entry[0] for entry, tags in zip(graph.extra["saved_tensors"]["block"], _saved_tags(model, t))
             if tags == "mla_up_proj"]
    assert names and block.module_bytes({"mla_up_proj"}) < block.activation_bytes  # the latents and the rest stay


def _saved_tags(model, t):
    from phaze_opt.workload.layers import build_layer, example_inputs
    from phaze_opt.workload.trace import trace_layer_details

    return trace_layer_details(build_layer(model, "block", t), example_inputs(model, "block", 1, SEQ)).saved_modules


# --- monotone on every preset model ----------------------------------------------------------------

def _split(op_graph):
    """Synthetic positive per-op latencies (the real ones need an arch): enough for the order."""
    return [1e-12 * (op.flops + op.bytes_read + op.bytes_written) + 1e-9 for op in op_graph.ops]


def _costs(graph, training: Training) -> LayerCosts:
    """LayerCosts as design.evaluate.layer_costs assembles them, on synthetic times."""
    sp = training.sequence_parallel
    tags = recompute_tags(training)
    fwd = {k: _split(graph.op_graphs[k]["fwd"]) for k in graph.kinds}
    core = {k: attention_core_s(graph.op_graphs[k]["fwd"], fwd[k]) for k in graph.kinds}
    module = {k: recomputed_s(graph.op_graphs[k]["fwd"], fwd[k], graph.extra["forward_modules"][k], tags)
              for k in graph.kinds}
    layers = graph.layers
    return LayerCosts.from_layer_graph(
        graph, [sum(fwd[l.kind]) for l in layers], [2 * sum(fwd[l.kind]) for l in layers],
        selective_s=[core[l.kind] if l.attention_core_bytes > 0 else 0.0 for l in layers], sequence_parallel=sp,
        module_tags=tags, module_s=[module[l.kind] for l in layers])


def _chains():
    """Recipes from none, adding one module at a time: with and without the attention core first."""
    for first in (0, 1):
        chain = [None]
        for k in range(first + 1, len(RECOMPUTE_MODULES) + 1):
            chain.append(RECOMPUTE_MODULES[first:k])
        yield chain


@pytest.mark.parametrize("name", [m if m in QUICK else pytest.param(m, marks=pytest.mark.slow)
                                  for m in configs.available("models")])
def test_adding_a_module_never_raises_memory_nor_lowers_time(name):
    model, graph = _graph(name)
    n = len(graph.layers)
    # one stage of every layer, and a stage per layer (one microbatch: each block alone in its
    # stage, where a module's rebuilt bytes meet its dropped ones one for one)
    placements = (Placement(graph.tp, 1, (tuple(range(n)),)), Placement(graph.tp, 1, tuple((v,) for v in range(n))))
    system = replace(load_system("dgx-h100"), accelerators=graph.tp * n, global_batch=1)
    for stack in ("megatron-lm", "megatron-te"):
        for sp in (False, True) if graph.tp > 1 else (False,):
            for chain in _chains():
                previous = None
                for modules in chain:
                    training = Training(mbs=1, recompute="none" if modules is None else "selective",
                                        recompute_modules=modules, sequence_parallel=sp, stack=stack)
                    problem = PlacementProblem(costs=(_costs(graph, training),), system=system, hbm_bytes=2.0**50,
                                               peak_flops=1.0, training=training, seq_len=SEQ)
                    now = [evaluate_placement(problem, p) for p in placements]
                    assert all(r.feasible for r in now), [r.reason for r in now]
                    if previous is not None:
                        for before, after in zip(previous, now):
                            where = (stack, sp, modules)
                            assert after.time_per_batch_s >= before.time_per_batch_s * (1 - 1e-12), where
                            for b, a in zip(before.stages, after.stages):
                                assert a.memory_bytes <= b.memory_bytes, where
                    previous = now
            # the whole list drops something on every model with a block (at least the MLP or MoE)
            full = Training(recompute="selective", recompute_modules=RECOMPUTE_MODULES, sequence_parallel=sp,
                            stack=stack)
            assert np.sum(_costs(graph, full).module_bytes) > 0 and np.sum(_costs(graph, full).module_s) > 0
            assert math.isfinite(float(np.sum(_costs(graph, full).module_s)))
