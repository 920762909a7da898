"""Where a MoE layer applies its router's gate weights (`Training.expert_weights`): at the combine
(Megatron-Core before 0.13) or inside the experts' activation (0.13 on, the `megatron-te` stack's).
The two compute the same function; the second keeps less for backward."""

from __future__ import annotations

import pytest
import torch

from phaze_opt.errors import PhazeError
from phaze_opt.training import EXPERT_WEIGHTS, Training
from phaze_opt.workload.layers import MoE, build_layer, example_inputs
from phaze_opt.workload.models import parse_model
from phaze_opt.workload.stack import expert_weights, recipe_graph
from phaze_opt.workload.trace import trace_layer_details

TINY_MOE = {"name": "tiny-moe", "family": "llama", "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48,
            "seq": 16, "vocab": 64, "activation": "swiglu", "norm": "rmsnorm", "position": "rotary",
            "tied_embeddings": False, "bias": False, "dropout": 0.0, "tp_widths": [1, 2],
            "experts": 4, "top_k": 2, "expert_ffn": 24, "attention": "flash"}


def _real_block(model, weights: str, seed: int):
    """The MoE block on the CPU in float32 with seeded random parameters."""
    block = build_layer(model, "block", 1, weights).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block


@pytest.mark.parametrize("capacity_factor", [1.0, 1.5, 0.5])  # exact, padded and dropping capacity
@pytest.mark.parametrize("seed", [0, 1])
def test_both_placements_of_the_weights_compute_the_same_layer(capacity_factor, seed):
    """(a W2) * g = (a * g) W2 row by row: the outputs and every gradient agree (float32)."""
    model = parse_model({**TINY_MOE, "capacity_factor": capacity_factor})
    x = torch.randn(model.seq, 2, model.hidden, generator=torch.Generator().manual_seed(seed + 10))
    results = []
    for weights in EXPERT_WEIGHTS:
        block = _real_block(model, weights, seed)
        assert all(m.weights_in_mlp == (weights == "activation") for m in block.modules() if isinstance(m, MoE))
        xi = x.clone().requires_grad_(True)
        out, aux = block(xi)
        (out.square().sum() + aux).backward()
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in block.named_parameters()}))
    (o1, g1, p1), (o2, g2, p2) = results
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)
    assert p1.keys() == p2.keys()
    for name in p1:
        torch.testing.assert_close(p1[name], p2[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("fuse", [False, True])
def test_weights_in_the_activation_keep_less_by_exactly_the_second_linears_output(fuse):
    """The combine keeps the experts' output rows for the weights' gradient ([T k, h] in BF16); the
    weighted activation keeps nothing new: its unweighted output is rebuilt from the first linear's
    output, which backward keeps anyway (trace.py `_rebuilt_in_backward`)."""
    model = parse_model(TINY_MOE)
    mbs = 2
    saved = {w: trace_layer_details(build_layer(model, "block", 1, w), example_inputs(model, "block", mbs, model.seq),
                                    name="block", fuse=fuse).activation_bytes for w in EXPERT_WEIGHTS}
    slots = model.seq * mbs * model.top_k  # capacity factor 1: every slot kept, no padding
    assert saved["combine"] - saved["activation"] == slots * model.hidden * 2


def test_the_stack_picks_the_placement_and_the_recipe_overrides_it():
    assert expert_weights(Training()) == "combine" and expert_weights(Training(stack="eager")) == "combine"
    assert expert_weights(Training(stack="megatron-te")) == "activation"
    assert expert_weights(Training(stack="megatron-te", expert_weights="combine")) == "combine"
    model = parse_model(TINY_MOE)
    te = recipe_graph(model, 1, Training(stack="megatron-te"))
    te_combine = recipe_graph(model, 1, Training(stack="megatron-te", expert_weights="combine"))
    te_activation = recipe_graph(model, 1, Training(stack="megatron-te", expert_weights="activation"))
    assert te is te_activation and te is not te_combine  # same graph key, memoised; a different one
    assert te.layers[1].activation_bytes < te_combine.layers[1].activation_bytes
    dense = parse_model({k: v for k, v in TINY_MOE.items() if k not in ("experts", "top_k", "expert_ffn")})
    assert recipe_graph(dense, 1, Training(expert_weights="activation")) is recipe_graph(dense, 1, Training())


def test_recipe_and_layer_key_list_it_only_when_set():
    assert "expert_weights" not in Training().recipe() and Training().layer_key() == Training(stack="megatron-lm").layer_key()
    assert Training(expert_weights=" Activation ").recipe()["expert_weights"] == "activation"
    assert Training(expert_weights="combine").layer_key() != Training().layer_key()


@pytest.mark.parametrize("field, bad", [("expert_weights", v) for v in ("unpermute", "", "probs")] +
                         [("cp_comm", v) for v in ("a2a", "a2a+p2p", "ring", 3)])
def test_a_bad_choice_is_one_line_naming_the_field_and_the_choices(field, bad):
    choices = {"expert_weights": "combine, activation", "cp_comm": "p2p, all_gather"}[field]
    with pytest.raises(PhazeError) as info:
        Training(**{field: bad})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{field} must be one of {choices}")


def test_evaluate_cli_flag():
    from phaze_opt.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["evaluate", "--expert-weights", "combine"]).expert_weights == "combine"
    assert parser.parse_args(["evaluate"]).expert_weights is None
    with pytest.raises(SystemExit):
        parser.parse_args(["evaluate", "--expert-weights", "unpermute"])


QWEN_ROW = {"model": "qwen3-30b-a3b", "tp": 1, "pp": 2, "ep": 8, "gpus": 16, "batch": 512, "microbatch": 1,
            "virtual_stages": 12, "recompute": "none", "stack": "megatron-te", "per_gpu_tflops": 200,
            "source": {"paper": "p", "table": "t", "row": "qwen"}}


def test_suite_rows_carry_it_to_the_recipe(tmp_path):
    from test_validation_modern import assert_row_field_reaches_the_recipe

    assert_row_field_reaches_the_recipe(tmp_path, QWEN_ROW, "expert_weights", "combine", None)


@pytest.mark.parametrize("change, words", [
    ({"expert_weights": "unpermute"}, "must be one of combine, activation"),
    ({"model": "llama3-8b", "ep": 1, "virtual_stages": 1, "expert_weights": "combine"}, "has no experts"),
])
def test_suite_rows_refuse_a_bad_value_in_one_line(tmp_path, change, words):
    from test_validation_modern import assert_row_refused_in_one_line

    assert_row_refused_in_one_line(tmp_path, {**QWEN_ROW, **change}, "expert_weights", words)


def test_shipped_mixtral_row_keeps_the_combine_of_its_megatron_core():
    from phaze_opt.validation.suites import load_suite

    rows = load_suite("megatron-core-h100").rows
    assert [r.model for r in rows if r.training.expert_weights == "combine"] == ["mixtral-8x7b"]
    assert rows[0].model == "mixtral-8x7b" and rows[0].training.stack == "megatron-te"  # the rest of the TE stack stays


def test_evaluate_prices_time_memory_and_energy_on_the_same_graph():
    """`evaluate` of a MoE model under megatron-te: its energy is computed on the graph the recipe
    runs (the weighted activation), not on one rebuilt from loose recipe fields (whose op count
    differs from the schedules' and once failed), and the two placements of the weights differ."""
    import dataclasses as dc

    from phaze_opt.design.evaluate import evaluate
    from phaze_opt.hardware.arch import load_arch
    from phaze_opt.system import load_system

    model = parse_model(TINY_MOE)
    system = dc.replace(load_system("dgx-h100"), accelerators=8, global_batch=16)
    results = {w: evaluate(model, load_arch("h100-sxm"), Training(1, stack="megatron-te", expert_weights=w,
                                                                    placement="tp=1,pp=1,dp=8"), system, 1.0)
               for w in EXPERT_WEIGHTS}
    for r in results.values():
        assert r.feasible and r.energy_j is not None and r.energy_j > 0
    memory = {w: r.placement["peak_memory_bytes"] for w, r in results.items()}
    assert memory["activation"] < memory["combine"]
