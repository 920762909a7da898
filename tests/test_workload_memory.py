"""Activation memory by recompute mode and sequence parallelism, and the opt-in fused attention:
against Korthikanti et al. 2022 (Table 2), against the unfused graph, and numerically on CPU."""

import dataclasses
import math

import pytest
import torch

from phaze_opt.errors import PhazeError
from phaze_opt.workload.graphs import build_layer_graph, graph_key
from phaze_opt.workload.layers import SelfAttention, build_layer, example_inputs
from phaze_opt.workload.models import load_model, parse_model
from phaze_opt.workload.ops import FLASH_ATTENTION, TCVC, Layer
from phaze_opt.workload.trace import (
    ATTENTION_CORE, REPLICATED, SEQUENCE_PARALLEL, TENSOR_PARALLEL, trace_layer_details,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "workload-cache"))


def gpt(heads=4, head_dim=16, seq=32, dropout=0.1, attention="unfused", family="gpt", dtype="bf16"):
    """A small GPT as Korthikanti et al. assume it: GELU MLP of 4h, LayerNorm, dropout, biases."""
    h = heads * head_dim
    return parse_model({
        "name": f"tiny-{family}", "family": family, "layers": 2, "hidden": h, "heads": heads, "ffn": 4 * h,
        "seq": seq, "vocab": 64, "activation": "gelu", "norm": "layernorm", "position": "learned",
        "tied_embeddings": True, "dropout": dropout, "attention": attention, "dtype": dtype,
        "expert_placement": {"tp": 1, "pp": 1, "dp": 1},
    }, "tiny")


def llama(attention="unfused", seq=16):
    return parse_model({
        "name": "tiny-llama", "family": "llama", "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 2,
        "ffn": 96, "seq": seq, "vocab": 64, "activation": "swiglu", "norm": "rmsnorm", "position": "rotary",
        "tied_embeddings": False, "bias": False, "dropout": 0.0, "attention": attention,
        "expert_placement": {"tp": 1, "pp": 1, "dp": 1},
    }, "tiny")


def korthikanti(m, b, t):
    """Korthikanti et al. 2022, Table 2: activation bytes per transformer layer (16-bit values,
    1-byte dropout masks), by configuration."""
    s, h, a = m.seq, m.hidden, m.heads
    core = 5 * a * s / h
    return {
        "none": s * b * h * (34 + core) if t == 1 else s * b * h * (10 + 24 / t + core / t),
        "none+sp": s * b * h / t * (34 + core),
        "selective": s * b * h * (10 + 24 / t),
        "selective+sp": s * b * h / t * 34,
        "full": 2 * s * b * h,
        "full+sp": 2 * s * b * h / t,
    }


def block(m, t, b, **kw) -> Layer:
    return build_layer_graph(m, t, b, **kw).layers[1]


# --- memory by mode against Korthikanti et al. 2022 -----------------------------------------------

# The one difference left (Korthikanti et al. 2022, Sec. 4.1 count only the 16-bit tensors): each
# LayerNorm also keeps its float32 mean and 1/std for the backward, 2 x 4 bytes per token, 16 s b
# bytes per layer (sharded with SP, like the norms' inputs) -- 16 / (34 h) of the total, under 0.1 %
# at h = 12288, 0.7 % for the h = 64 model below. The dropout masks are 1-byte bools, as the paper
# assumes, and the softmax output is kept in 16 bits (no float32 copy), so nothing else differs.
@pytest.mark.parametrize("t,b", [(1, 1), (2, 1), (4, 2), (8, 1), (8, 3)])
def test_gpt3_175b_block_matches_korthikanti_table_2(t, b):
    m = load_model("gpt3-175b")
    layer = block(m, t, b)
    expected = korthikanti(m, b, t)
    got = layer.activation_bytes_by_mode()
    for mode, value in expected.items():
        assert got[mode] == pytest.approx(value, rel=0.02), (mode, t, b)
    assert got["none"] == layer.activation_bytes  # the old field is the `none` value, unchanged
    assert got["full"] == 2 * m.seq * b * m.hidden and got["full+sp"] == got["full"] // t  # exactly


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("b", [1, 3])
def test_small_gpt_block_matches_korthikanti_table_2_and_splits_exactly(t, b):
    m = gpt()
    layer = block(m, t, b)
    s, h, a = m.seq, m.hidden, m.heads
    for mode, value in korthikanti(m, b, t).items():
        assert layer.activation_bytes_for(mode.split("+")[0], mode.endswith("+sp")) == pytest.approx(value, rel=0.02)
    # the exact split by region, term by term of Korthikanti's Sec. 4.1 (plus the norms' statistics)
    assert layer.attention_core_bytes == 5 * a * s * s * b // t
    assert layer.sequence_parallel_bytes == 10 * s * b * h + 16 * s * b
    assert layer.activation_bytes == 10 * s * b * h + 16 * s * b + 24 * s * b * h // t + 5 * a * s * s * b // t
    assert layer.checkpoint_bytes() == 2 * s * b * h and layer.checkpoint_bytes(True) == 2 * s * b * h // t


def test_regions_follow_the_graph_not_sizes():
    """Which op produced each saved tensor decides its region: the softmax, the probabilities' dropout
    mask and output are the core; the norms' inputs/outputs/statistics, the residual dropouts' masks
    and the layer input are outside the TP region; Q/K/V, the context and the MLP's inner tensors inside."""
    m = gpt(seq=16)
    tr = trace_layer_details(build_layer(m, "block", 2), example_inputs(m, "block", 2, 16), name="block")
    by_region = {}
    for (name, shape, dtype, _), region in zip(tr.saved, tr.saved_regions):
        by_region.setdefault(region, []).append((name, shape, dtype))
    core = by_region[ATTENTION_CORE]
    assert sorted(dtype for _, _, dtype in core) == ["bfloat16", "bfloat16", "bool"]  # softmax, dropout out, mask
    assert all(shape[-2:] == (16, 16) for _, shape, _ in core)
    assert any(name.startswith("_softmax") for name, _, _ in core)
    sp = by_region[SEQUENCE_PARALLEL]
    assert sum(dtype == "float32" for _, _, dtype in sp) == 4  # two norms' mean and 1/std
    assert sum(dtype == "bool" for _, _, dtype in sp) == 2  # the two residual dropouts' masks
    assert any(name.startswith("xs") for name, _, _ in sp)  # the layer input (the first norm's input)
    assert all(shape[-1] == m.hidden or shape[-1] == 1 for _, shape, _ in sp)  # never the sharded width
    tp_names = [name for name, _, _ in by_region[TENSOR_PARALLEL]]
    assert any(n.startswith("gelu") for n in tp_names) and REPLICATED not in by_region


def test_sequence_parallel_part_is_independent_of_tp_and_the_rest_shrinks_by_t():
    m = gpt()
    layers = {t: block(m, t, 2) for t in (1, 2, 4)}
    assert len({layer.sequence_parallel_bytes for layer in layers.values()}) == 1
    inner = {t: layer.activation_bytes - layer.sequence_parallel_bytes for t, layer in layers.items()}
    assert inner[1] == 2 * inner[2] == 4 * inner[4]


def test_llama_block_regions():
    m = llama()
    layer = block(m, 2, 2)
    s, a = m.seq, m.heads
    assert layer.attention_core_bytes == 2 * a * s * s * 2 // 2  # the softmax alone: no dropout in Llama
    assert layer.activation_bytes_for("selective") == layer.activation_bytes - layer.attention_core_bytes
    assert layer.activation_bytes_for("none", True) < layer.activation_bytes


def test_embedding_and_head_have_no_core_and_keep_integer_tensors_whole():
    m = gpt()
    g = build_layer_graph(m, 2, 1)
    emb, head = g.layers[0], g.layers[-1]
    for layer in (emb, head):
        assert layer.attention_core_bytes == 0
        assert layer.activation_bytes_for("selective") == layer.activation_bytes
    # the token ids (int64) are not split by sequence parallelism; the embedding's dropout mask is
    ids = m.seq * 8
    assert emb.checkpoint_bytes(True) == emb.checkpoint_bytes() == ids
    saved = dict(zip([s[0] for s in g.extra["saved_tensors"]["embedding"]], g.extra["saved_tensors"]["embedding"]))
    assert emb.activation_bytes_for("none", True) == emb.activation_bytes - emb.sequence_parallel_bytes / 2
    assert any(s[2] == "int64" for s in saved.values())


def test_layer_api_modes_and_defaults():
    layer = Layer(name="l", kind="k", params=1, param_bytes=2.0, activation_bytes=1000.0, boundary_bytes=10.0,
                  input_bytes=100.0, fwd_flops=1.0, bwd_flops=2.0)  # a hand-made layer: nothing to save
    assert [layer.activation_bytes_for(r, sp) for r in ("none", "selective") for sp in (False, True)] == [1000] * 4
    assert layer.activation_bytes_for("full") == layer.checkpoint_bytes() == 100
    split = dataclasses.replace(layer, tp=4, attention_core_bytes=300.0, sequence_parallel_bytes=400.0,
                                input_sequence_parallel_bytes=100.0)
    assert split.activation_bytes_for("none", True) == 1000 - 400 + 100
    assert split.activation_bytes_for("selective", True) == 1000 - 300 - 400 + 100
    assert split.activation_bytes_for("full", True) == split.checkpoint_bytes(True) == 25
    assert split.recompute_working_bytes("none") == 0
    assert split.recompute_working_bytes("selective") == 300
    assert split.recompute_working_bytes("full", True) == split.activation_bytes_for("none", True)
    with pytest.raises(ValueError, match="recompute must be one of"):
        layer.activation_bytes_for("some")
    with pytest.raises(ValueError, match="recompute must be one of"):
        layer.recompute_working_bytes("some")


# --- fused attention ---------------------------------------------------------------------------------


def _core_gemm_flops(graph):
    return sum(op.flops for op in graph.ops if op.kind == "bgemm")


def _flash_ops(graph):
    return [op for op in graph.ops if op.kind == FLASH_ATTENTION]


@pytest.mark.parametrize("family", ["gpt", "bert"])  # causal and not: the same count (whole square)
@pytest.mark.parametrize("t", [1, 2])
def test_flash_flops_equal_the_unfused_core_matmuls(family, t):
    unfused = build_layer_graph(gpt(family=family), t, 2).op_graphs["block"]
    flash = build_layer_graph(gpt(family=family, attention="flash"), t, 2).op_graphs["block"]
    (fwd,), (bwd,) = _flash_ops(flash["fwd"]), _flash_ops(flash["bwd"])
    assert fwd.unit == bwd.unit == TCVC
    gemm_flops = lambda op: 2.0 * sum(math.prod(g) for g in op.gemms)  # noqa: E731
    fwd_core, bwd_core = _core_gemm_flops(unfused["fwd"]), _core_gemm_flops(unfused["bwd"])
    assert gemm_flops(fwd) == fwd_core  # Q K^T and P V
    assert gemm_flops(bwd) == bwd_core + fwd_core / 2  # dV, dP, dQ, dK and Q K^T again
    assert gemm_flops(bwd) == 2.5 * gemm_flops(fwd)
    m = gpt()
    assert gemm_flops(fwd) == 4 * 2 * m.seq**2 * m.hidden / t  # 4 b s^2 h / t
    for op in (fwd, bwd):  # the MAC-equivalent GEMM carries the same work
        assert 2.0 * math.prod(op.gemm) == gemm_flops(op) and op.flops > gemm_flops(op)
    assert not _flash_ops(unfused["fwd"]) and not _flash_ops(unfused["bwd"])
    assert not [op for op in flash["fwd"].ops + flash["bwd"].ops if op.kind == "bgemm"]


@pytest.mark.parametrize("model", [gpt(seq=80, attention="flash"), llama("flash", seq=80)], ids=["gpt", "llama-gqa"])
def test_flash_graph_has_no_square_tensor(model):
    s = model.seq
    g = build_layer_graph(model, 2, 1)
    ops = g.op_graphs["block"]
    for op in ops["fwd"].ops + ops["bwd"].ops:
        if op.kind == FLASH_ATTENTION:  # HBM traffic: [B, M, d] and [B, N, d] tensors only, no [M, N]
            B, M, d, N = op.gemms[0]
            q, kv, o, lse = 2 * B * M * d, 2 * 2 * B * N * d, 2 * B * M * d, 4 * B * M
            if op.bytes_written == o + lse:  # forward: Q, K, V in; O and the log-sum-exp out
                assert op.bytes_read == q + kv
            else:  # backward: Q, K, V, O, dO and the log-sum-exp in; dQ, dK, dV out
                assert (op.bytes_read, op.bytes_written) == (q + kv + 2 * o + lse, q + kv)
        else:
            assert list(op.shape).count(s) <= 1, op
    assert all(list(shape).count(s) <= 1 for _, shape, _, _ in g.extra["saved_tensors"]["block"])
    assert g.layers[1].attention_core_bytes == 0


@pytest.mark.parametrize("t,b", [(1, 1), (4, 2), (8, 1)])
def test_flash_block_keeps_korthikanti_selective_set(t, b):
    """What a flash block keeps is the selective-recompute set, s b h (10 + 24/t), plus the float32
    log-sum-exp (4 a s b / t) and the norms' statistics: within 2 %, and 34 s b h / t with SP."""
    m = load_model("gpt3-175b")
    flash = block(m, t, b, attention="flash")
    unfused = block(m, t, b)
    expected = korthikanti(m, b, t)
    assert flash.activation_bytes == pytest.approx(expected["selective"], rel=0.02)
    assert flash.activation_bytes_for("none", True) == pytest.approx(expected["selective+sp"], rel=0.02)
    lse = 4 * m.heads * m.seq * b // t
    assert flash.activation_bytes == unfused.activation_bytes_for("selective") + lse
    assert flash.activation_bytes_for("selective") == flash.activation_bytes


# --- Megatron's fused kernels: GQA, SwiGLU, RoPE, RMSNorm, no dropout --------------------------------


@pytest.mark.parametrize("t,b", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_llama_block_keeps_what_megatrons_fused_kernels_keep(t, b):
    """A Llama block with flash attention, counted tensor by tensor as Megatron-Core keeps it (fused
    RMSNorm: input and 1/rms; fused SwiGLU: its input; RoPE'd Q and K and the QKV output that V is a
    view of, as the attention kernel reads them; the flash output and its float32 log-sum-exp; the
    GEMMs' inputs; no dropout): exactly."""
    m = llama("flash")
    s, h, a, kv, d, f = m.seq, m.hidden, m.heads, m.kv_heads, m.head_dim, m.ffn
    tr = trace_layer_details(build_layer(m, "block", t), example_inputs(m, "block", b, s), name="block")
    outside = 4 * (2 * s * b * h) + 2 * (2 * s * b)  # two norms' inputs and outputs, their 1/rms
    qkv = 2 * s * b * (a + 2 * kv) * d // t + 2 * s * b * a * d // t + 2 * s * b * kv * d // t
    attention = 2 * s * b * a * d // t + 4 * b * a * s // t
    mlp = 2 * s * b * 2 * f // t + 2 * s * b * f // t  # gate and up, and their product
    assert tr.sequence_parallel_bytes == outside
    assert tr.activation_bytes == outside + qkv + attention + mlp
    # what the fused kernels rebuild: each norm's x / rms before its scale, and silu(gate)
    assert sorted(shape for _, shape, _, _ in tr.rebuilt) == sorted([(s, b, h), (s, b, h), (s, b, f // t)])


def test_gpt_block_rebuilds_nothing():
    """LayerNorm (one aten op) and GELU already keep what Megatron's fused kernels keep (Table 2)."""
    m = gpt()
    assert trace_layer_details(build_layer(m, "block", 2), example_inputs(m, "block", 1, m.seq)).rebuilt == ()


def test_llama3_405b_block_with_sp_is_megatrons_count():
    """Megatron-LM's own estimate (megatron/training/theoretical_memory_usage.py,
    `compute_activation_memory`: s b h (18 + 4 ffn / h) / t with SP, after Korthikanti et al. 2022,
    Table 2) for Llama 3 405B at TP 8: 0.484 GiB per microbatch (it leaves GQA's narrower K and V
    and the float32 log-sum-exp out and counts dropout masks). Ours keeps in addition the QKV output
    that V is a view of (34 MiB, 7 %): 0.530 GiB, where eager autograd keeps 0.694."""
    m = load_model("llama3-405b")
    layer = build_layer_graph(m, 8, 1).layers[1]
    megatron = m.seq * m.hidden * (18 + 4 * m.ffn / m.hidden) / 8
    got = layer.activation_bytes_for("none", True)
    assert megatron <= got <= 1.10 * megatron
    assert got < 0.55 * 2**30


def test_flash_traces_gpt_and_llama_gqa_blocks():
    for model in (gpt(attention="flash"), llama("flash")):
        g = build_layer_graph(model, 2, 1)
        fwd, bwd = g.op_graphs["block"]["fwd"], g.op_graphs["block"]["bwd"]
        assert len(_flash_ops(fwd)) == len(_flash_ops(bwd)) == 1 and not g.extra["unmapped_ops"]
    (op,) = _flash_ops(build_layer_graph(llama("flash"), 2, 1).op_graphs["block"]["fwd"])
    m = llama()
    B, M, N = 1 * m.kv_heads // 2, m.seq * (m.heads // m.kv_heads), m.seq  # GQA: a KV head's g query heads stacked
    assert op.gemms[0] == (B, M, m.head_dim, N)
    e = 2
    assert op.bytes_read == e * B * (M + 2 * N) * m.head_dim  # Q, and K and V once per KV head
    assert op.bytes_written == e * B * M * m.head_dim + 4 * B * M  # O and the float32 log-sum-exp


def test_flash_matches_unfused_attention_numerically():
    """The reference kernels (used off the meta device) compute exact attention and its gradients."""
    torch.manual_seed(0)
    for model in (gpt(heads=2, head_dim=4, seq=6, dropout=0.0), llama(seq=6)):
        mods = {}
        for attention in ("unfused", "flash"):  # float64 on the CPU (the log-sum-exp is float32)
            mod = SelfAttention(dataclasses.replace(model, attention=attention), 1, torch.float64).to_empty(device="cpu")
            mods[attention] = mod
        with torch.no_grad():
            for p in mods["unfused"].parameters():
                p.normal_(std=0.3)  # scores of order one: a softmax far from saturation
        mods["flash"].load_state_dict(mods["unfused"].state_dict())
        x = torch.randn(model.seq, 2, model.hidden, dtype=torch.float64)
        results = {}
        for attention, mod in mods.items():
            xi = x.clone().requires_grad_(True)
            out, bias = mod(xi)
            (out.sum() + (0 if bias is None else bias.sum())).backward()
            results[attention] = (out, xi.grad, [p.grad for p in mod.parameters()])
        (o1, g1, p1), (o2, g2, p2) = results["unfused"], results["flash"]
        torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-5)
        for a, b in zip(p2, p1):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# Content keys (op costs and edges, names left out) of unfused graphs as they were before fused
# attention and the memory regions were added; change them only with a change meant to alter the
# unfused graphs.
UNFUSED_KEYS = {
    ("gpt", 2, 2): {
        "embedding": ("0eb0080b18dfecfcc4bef4225937b477", "dfcaec6908c3c0ce785674720da5762c"),
        "block": ("3d9c65d1c38601cdd4c89b58c47cd296", "71e3eaa0d5f53aa9a2828eea2d3fcad4"),
        "head": ("9943a69d987fceb055329de897845277", "3e124bba1f673872d934b1f5f47c9259"),
    },
    ("llama", 2, 1): {
        "embedding": ("f1f8a096d3ed151782ee3e3a38e7850f", "e6b49dec00e2a45ece0a3b0efc181cb6"),
        "block": ("1a1d11ca035efd52012fd354a9d6909a", "85b746ace75386bf3851cda00661c2bc"),
        "head": ("ac2469288d2712cf6d1d51c1ef146e9d", "c897550baf81a86484a460c521b47475"),
    },
}


def _small(family, kv_heads=None):
    llama_ = family == "llama"
    return parse_model({
        "name": f"small-{family}", "family": family, "layers": 3, "hidden": 16, "heads": 4,
        "kv_heads": kv_heads or 4, "ffn": 24, "seq": 8, "vocab": 37,
        "activation": "swiglu" if llama_ else "gelu", "norm": "rmsnorm" if llama_ else "layernorm",
        "position": "rotary" if llama_ else "learned", "tied_embeddings": not llama_, "bias": not llama_,
        "dropout": 0.0 if llama_ else 0.1, "expert_placement": {"tp": 1, "pp": 1, "dp": 1},
    }, "small")


@pytest.mark.parametrize("family,t,b", list(UNFUSED_KEYS))
def test_unfused_graphs_are_unchanged(family, t, b):
    g = build_layer_graph(_small(family, 2 if family == "llama" else None), t, b, cache=False)
    got = {kind: (p["fwd"].content_key, p["bwd"].content_key) for kind, p in g.op_graphs.items()}
    assert got == UNFUSED_KEYS[(family, t, b)]
    assert all("gemms" not in op.cost_fields() for p in g.op_graphs.values() for gr in p.values() for op in gr.ops)


def test_attention_choice_is_part_of_the_identity_and_validated():
    m = gpt()
    assert "attention" not in m.identity()  # the default leaves identities (and cache keys) as they were
    flash = dataclasses.replace(m, attention="flash")
    assert flash.identity()["attention"] == "flash"
    assert graph_key(m, 1, 1, m.seq) != graph_key(flash, 1, 1, m.seq)
    assert build_layer_graph(m, 1, 1, attention="flash") is build_layer_graph(flash, 1, 1)
    assert build_layer_graph(flash, 1, 1, attention="unfused") is build_layer_graph(m, 1, 1)
    with pytest.raises(PhazeError, match="attention must be one of"):
        build_layer_graph(m, 1, 1, attention="ring")
    with pytest.raises(PhazeError, match="attention"):
        gpt(attention="paged")


@pytest.mark.parametrize("t, b", [(1, 1), (2, 2)])
def test_llama_block_linear_inputs_as_transformer_engine_saves_them(t, b):
    """Which saved tensors are linear-GEMM inputs (workload/precision.py keeps them in FP8): the two
    norm outputs (QKV and FC1 inputs) and the SwiGLU product (FC2 input) only their weight gradients
    read; the flash output (the output projection's input) the attention backward reads too."""
    m = llama("flash")
    s, h, a, d, f = m.seq, m.hidden, m.heads, m.head_dim, m.ffn
    tr = trace_layer_details(build_layer(m, "block", t), example_inputs(m, "block", b, s), name="block")
    assert tr.linear_input_sp_bytes == 2 * (2 * s * b * h)  # the norm outputs, outside the TP region
    assert tr.linear_input_bytes == 2 * (2 * s * b * h) + 2 * s * b * f // t
    assert tr.linear_shared_bytes == 2 * s * b * a * d // t and tr.linear_shared_sp_bytes == 0


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_low_precision_keeps_linear_inputs_in_its_format(fmt):
    """FP8 (1 B), MXFP8 (1 + 1/32 B) or NVFP4 (0.5 + 1/16 B) per element of each linear input only
    its weight gradient reads, the BF16 tensor plus a copy in the format where other ops read it;
    the sequence-parallel part shrinks alike; the embedding and output layer stay as in BF16."""
    from phaze_opt.workload.precision import FORMATS, precision_graph

    m = llama("flash")
    graph = build_layer_graph(m, 2, 1)
    low = precision_graph(graph, fmt)
    q = FORMATS[fmt].operand_bytes / 2
    for before, after in zip(graph.layers, low.layers):
        if before.kind in ("embedding", "head"):
            assert after == before
            continue
        assert before.linear_input_bytes > 0 and before.linear_shared_bytes > 0
        assert after.activation_bytes == pytest.approx(
            before.activation_bytes - before.linear_input_bytes * (1 - q) + before.linear_shared_bytes * q)
        assert after.sequence_parallel_bytes == pytest.approx(
            before.sequence_parallel_bytes - before.linear_input_sp_bytes * (1 - q) + before.linear_shared_sp_bytes * q)
        assert after.activation_bytes_for("full", True) == before.activation_bytes_for("full", True)  # the checkpoint
    assert precision_graph(graph, "bf16") is graph
