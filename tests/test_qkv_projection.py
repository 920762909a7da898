"""The attention's input projection as one fused GEMM (Megatron's `linear_qkv`) or three (Meta's
published Llama code, torchtitan, Hugging Face): the same layer, different memory. Autograd keeps
a saved view's whole storage, so a fused projection keeps Q, K and V through the V the attention
saves; separate projections keep V alone."""

from __future__ import annotations

import pytest
import torch

from phaze_opt.errors import PhazeError
from phaze_opt.workload.layers import build_layer, example_inputs
from phaze_opt.workload.models import QKV_PROJECTIONS, parse_model
from phaze_opt.workload.trace import trace_layer_details

TINY = {"name": "tiny-llama", "family": "llama", "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 2, "ffn": 96,
        "seq": 16, "vocab": 64, "activation": "swiglu", "norm": "rmsnorm", "position": "rotary",
        "tied_embeddings": False, "bias": False, "dropout": 0.0, "tp_widths": [1, 2, 4], "attention": "flash"}


def _real(model, seed=0):
    block = build_layer(model, "block", 1).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block


def _split_into(fused, separate, model):
    """Copy the fused block's weights into the separate one: per KV group, the fused rows are its g
    query heads, then its key, then its value (Megatron's layout)."""
    kv, d = model.kv_heads, model.head_dim
    g = model.heads // kv
    own = dict(separate.named_parameters())
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if not name.endswith("qkv.weight"):
                own[name].copy_(p)
                continue
            rows = p.view(kv, (g + 2) * d, model.hidden)
            prefix = name[: -len("qkv.weight")]
            own[prefix + "q.weight"].copy_(rows[:, : g * d].reshape(-1, model.hidden))
            own[prefix + "k.weight"].copy_(rows[:, g * d: (g + 1) * d].reshape(-1, model.hidden))
            own[prefix + "v.weight"].copy_(rows[:, (g + 1) * d:].reshape(-1, model.hidden))


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (8, 8), (8, 1)])  # GQA, MHA, MQA
def test_both_layouts_compute_the_same_layer(heads, kv_heads):
    fused_model = parse_model({**TINY, "heads": heads, "kv_heads": kv_heads})
    separate_model = parse_model({**TINY, "heads": heads, "kv_heads": kv_heads, "qkv_projection": "separate"})
    fused, separate = _real(fused_model), _real(separate_model, seed=1)
    _split_into(fused, separate, fused_model)
    x = torch.randn(fused_model.seq, 2, fused_model.hidden, generator=torch.Generator().manual_seed(5))
    grads = []
    for block in (fused, separate):
        xi = x.clone().requires_grad_(True)
        out = block(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        grads.append((out.detach(), xi.grad))
    (o1, g1), (o2, g2) = grads
    torch.testing.assert_close(o1, o2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fuse", [False, True])
def test_separate_projections_keep_v_alone_instead_of_the_whole_fused_output(tp, fuse):
    """Same parameters and forward FLOPs, and backward adds the three input gradients (two adds of
    [s, b, h]); the fused layout keeps [s, b, (q + 2 kv) d / t] through V's view, the separate one
    [s, b, kv d / t]: the difference is exactly Q's and K's columns."""
    mbs = 2
    traces = {}
    for layout in QKV_PROJECTIONS:
        model = parse_model({**TINY, "qkv_projection": layout})
        traces[layout] = trace_layer_details(build_layer(model, "block", tp), example_inputs(model, "block", mbs,
                                                                                           model.seq), fuse=fuse)
    fused, separate = traces["fused"], traces["separate"]
    assert fused.params == separate.params
    model = parse_model(TINY)
    assert fused.fwd.flops == separate.fwd.flops
    assert separate.bwd.flops - fused.bwd.flops == 2 * model.seq * mbs * model.hidden
    q_and_k = model.seq * mbs * (model.heads + model.local_kv_heads(tp) * tp) * model.head_dim // tp
    assert fused.activation_bytes - separate.activation_bytes == q_and_k * 2  # BF16


def test_the_default_leaves_every_cache_key_as_it_was():
    assert "qkv_projection" not in parse_model(TINY).identity()
    assert parse_model({**TINY, "qkv_projection": "separate"}).identity()["qkv_projection"] == "separate"


@pytest.mark.parametrize("change, words", [
    ({"qkv_projection": "split"}, "must be one of fused, separate"),
    ({"qkv_projection": "separate", "kv_lora_rank": 32, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
      "v_head_dim": 8}, "MLA"),
])
def test_a_bad_layout_is_refused_in_one_line(change, words):
    data = {**TINY, **change}
    if "kv_lora_rank" in change:
        data.pop("kv_heads")
    with pytest.raises(PhazeError) as info:
        parse_model(data)
    message = str(info.value)
    assert "\n" not in message and "qkv_projection" in message and words in message


META_ROW = {"model": "llama3-70b", "tp": 8, "pp": 4, "gpus": 64, "batch": 64, "microbatch": 1, "recompute": "none",
            "sequence_parallel": True, "per_gpu_tflops": 400, "source": {"paper": "p", "table": "t", "row": "meta"}}


def test_suite_rows_carry_it_to_the_model_and_the_report(tmp_path):
    from test_validation_modern import _suite

    from phaze_opt.validation.runner import row_config, row_model
    from phaze_opt.validation.suites import load_suite

    suite = load_suite(_suite(tmp_path, {**META_ROW, "qkv_projection": "separate"}))
    (row,) = suite.rows
    assert row_model(row).qkv_projection == "separate" and row_config(row, suite)["qkv_projection"] == "separate"
    plain_suite = load_suite(_suite(tmp_path, META_ROW, name="plain.yaml"))
    (plain,) = plain_suite.rows
    assert row_model(plain).qkv_projection == "fused" and "qkv_projection" not in row_config(plain, plain_suite)


@pytest.mark.parametrize("change, words", [
    ({"qkv_projection": "split"}, "must be one of fused, separate"),
    ({"model": "deepseek-v3", "tp": 8, "qkv_projection": "separate"}, "MLA"),
])
def test_suite_rows_refuse_a_bad_layout_in_one_line(tmp_path, change, words):
    from test_validation_modern import assert_row_refused_in_one_line

    assert_row_refused_in_one_line(tmp_path, {**META_ROW, **change}, "qkv_projection", words)


def test_meta_rows_use_their_published_codes_separate_projections():
    from phaze_opt.validation.suites import load_suite

    from dataclasses import replace

    from phaze_opt.validation.runner import evaluate_row

    suite = load_suite("megatron-core-h100")
    rows = [(i, r) for i, r in enumerate(suite.rows) if r.source.paper == "llama3"]
    assert len(rows) == 3 and all(r.qkv_projection == "separate" for _, r in rows)
    # the layout decides the 8,192-GPU run: fused, V's view keeps the whole projection output
    index, row = next((i, r) for i, r in rows if r.gpus == 8192)
    assert evaluate_row(suite, row, index).feasible
    fused = evaluate_row(suite, replace(row, qkv_projection=None), index)
    assert not fused.feasible and "GiB per device" in fused.reason
