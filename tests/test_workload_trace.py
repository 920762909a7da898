"""Traced op graphs: backward structure from autograd, user modules, fusion and op invariants."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.layers import build_layer, example_inputs
from phaze_opt.workload.models import load_model, parse_model
from phaze_opt.workload.ops import NET, NONE, TC, VC, OpGraph
from phaze_opt.workload.trace import VECTOR_OP_FLOPS, trace_layer, trace_layer_details

MODELS = ("gpt3-175b", "gpt2-xl", "bert-large", "opt-1.3b", "llama2-7b", "llama2-70b", "megatron-8.3b")
HYP = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "workload-cache"))


def small_model(family="gpt", heads=4, head_dim=4, kv_heads=None, ffn=24, seq=8):
    llama = family == "llama"
    return parse_model({
        "name": f"small-{family}", "family": family, "layers": 2, "hidden": heads * head_dim, "heads": heads,
        "kv_heads": kv_heads or heads, "ffn": ffn, "seq": seq, "vocab": 29,
        "activation": {"llama": "swiglu", "opt": "relu"}.get(family, "gelu"),
        "norm": "rmsnorm" if llama else "layernorm", "position": "rotary" if llama else "learned",
        "tied_embeddings": not llama, "bias": not llama, "dropout": 0.0 if llama else 0.1,
        "expert_placement": {"tp": 1, "pp": 1, "dp": 1},
    }, "small")


def descendants(graph: OpGraph, start: int) -> set[int]:
    succ = {}
    for s, d in graph.edges:
        succ.setdefault(s, []).append(d)
    seen, stack = set(), [start]
    while stack:
        for nxt in succ.get(stack.pop(), []):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def check_backward_structure(trace):
    """Every forward GEMM gives two backward GEMMs; each linear's weight-gradient GEMM hangs off the
    data-gradient chain: nothing after it leads to the gradient of the layer's input."""
    fwd, bwd = trace.fwd, trace.bwd
    fwd_gemms = [op for op in fwd.ops if op.unit == TC]
    bwd_gemms = [i for i, op in enumerate(bwd.ops) if op.unit == TC]
    assert len(bwd_gemms) == 2 * len(fwd_gemms)
    (input_grad,) = trace.input_grad_ops
    param_grads = set(trace.param_grad_ops)
    off_chain = [i for i in bwd_gemms if input_grad not in descendants(bwd, i) and i != input_grad]
    on_chain = [i for i in bwd_gemms if i not in off_chain]
    linears = [op for op in fwd_gemms if op.kind == "gemm"]  # activation x weight
    batched = [op for op in fwd_gemms if op.kind == "bgemm"]  # activation x activation
    assert len(off_chain) == len(linears)
    for i in off_chain:  # weight gradients: they lead to a parameter gradient
        assert i in param_grads or descendants(bwd, i) & param_grads
    # shapes: Y[M,N] = X[M,K] W[K,N] gives dW = X^T dY (K x M x N) and dX = dY W^T (M x N x K)
    assert sorted(bwd.ops[i].gemm for i in off_chain) == sorted((1, n, m, k) for (_, m, k, n) in (o.gemm for o in linears))
    dgrads = Counter(bwd.ops[i].gemm for i in on_chain)
    for _, m, k, n in (o.gemm for o in linears):
        assert dgrads[(1, m, n, k)] > 0
    assert len(on_chain) == len(linears) + 2 * len(batched)  # both operands of a batched GEMM are activations


@pytest.mark.parametrize("name", MODELS)
def test_block_backward_follows_autograd(name):
    m = load_model(name)
    for t in sorted({1, max(m.tp_widths)}):
        check_backward_structure(trace_layer_details(build_layer(m, "block", t), example_inputs(m, "block", 1, 64)))


@pytest.mark.parametrize("family", ["gpt", "bert", "llama"])
def test_head_backward_follows_autograd(family):
    m = small_model(family)
    for t in (1, 2):
        check_backward_structure(trace_layer_details(build_layer(m, "head", t), example_inputs(m, "head", 2, m.seq)))


def test_backward_is_not_twice_forward():
    g = build_layer_graph(load_model("gpt3-175b"), 1, 1).op_graphs["block"]
    fwd_kinds = Counter(op.kind for op in g["fwd"].ops)
    bwd_vec = Counter(v for op in g["bwd"].ops for v in op.vector_ops)
    assert bwd_vec["gelu_bwd"] == 1 and bwd_vec["softmax_bwd"] == 1 and bwd_vec["layernorm_bwd"] == 2
    assert bwd_vec["dropout_bwd"] == 3 and "gelu" not in bwd_vec and "softmax" not in bwd_vec
    assert fwd_kinds["norm"] == 2 and sum(1 for op in g["bwd"].ops if op.kind == "reduction") == 4  # bias grads


def test_weight_gradients_are_the_parameter_gradients_of_the_embedding():
    m = small_model("gpt")
    tr = trace_layer_details(build_layer(m, "embedding", 2), example_inputs(m, "embedding", 2, m.seq))
    assert tr.input_grad_ops == ()  # token ids have no gradient
    kinds = [tr.bwd.ops[i].vector_ops for i in tr.param_grad_ops]
    assert kinds.count(("embedding_bwd",)) == 2  # word and position tables


@HYP
@given(family=st.sampled_from(["gpt", "bert", "opt", "llama"]), heads=st.sampled_from([2, 4]),
       head_dim=st.sampled_from([2, 4]), seq=st.integers(2, 8), mbs=st.integers(1, 3), tp=st.sampled_from([1, 2]),
       fuse=st.booleans())
def test_op_graph_invariants(family, heads, head_dim, seq, mbs, tp, fuse):
    m = small_model(family, heads, head_dim, seq=seq)
    for kind in ("embedding", "block", "head"):
        tr = trace_layer_details(build_layer(m, kind, tp), example_inputs(m, kind, mbs, seq), name=kind, fuse=fuse)
        for g in (tr.fwd, tr.bwd):
            assert g.layer == kind and len({op.name for op in g.ops}) == len(g.ops)
            assert all(0 <= s < d < len(g.ops) for s, d in g.edges)
            for op in g.ops:
                assert op.bytes_read >= 0 and op.bytes_written >= 0 and op.flops >= 0
                if op.unit == TC:
                    b, mm, k, n = op.gemm
                    assert min(op.gemm) > 0 and 2 * b * mm * k * n <= op.flops <= 2 * b * mm * k * n + b * mm * n
                    assert op.bytes_read > 0 and op.bytes_written > 0
                elif op.unit == VC:
                    assert op.elements > 0 and op.vector_ops and not op.gemm
                    assert all(v in VECTOR_OP_FLOPS for v in op.vector_ops)
                    assert (op.kind == "fused") == bool(op.contains)
                    if op.contains:
                        assert fuse and len(op.contains) == len(op.vector_ops) >= 2
                elif op.unit == NONE:
                    assert op.flops == op.bytes_read == op.bytes_written == 0
                else:
                    assert op.unit == NET and tp > 1 and op.group == tp and op.comm_bytes > 0
            if tp == 1:
                assert not any(op.unit == NET for op in g.ops)


def test_fusion_keeps_work_and_saves_traffic():
    m = small_model("gpt", heads=4, head_dim=8, seq=16)
    for kind in ("embedding", "block", "head"):
        args = (build_layer(m, kind, 2), example_inputs(m, kind, 2, 16))
        fused = trace_layer_details(*args, fuse=True)
        plain = trace_layer_details(build_layer(m, kind, 2), args[1], fuse=False)
        assert fused.activation_bytes == plain.activation_bytes
        for a, b in ((fused.fwd, plain.fwd), (fused.bwd, plain.bwd)):
            assert a.flops == pytest.approx(b.flops) and len(a.ops) <= len(b.ops)
            traffic = lambda g: sum(op.bytes_read + op.bytes_written for op in g.ops)  # noqa: E731
            assert traffic(a) <= traffic(b)
            assert Counter(op.unit for op in a.ops)[TC] == Counter(op.unit for op in b.ops)[TC]
    s, b, h = 16, 2, m.hidden
    block = trace_layer_details(build_layer(m, "block", 1), example_inputs(m, "block", b, s))
    plain = trace_layer_details(build_layer(m, "block", 1), example_inputs(m, "block", b, s), fuse=False)
    traffic = lambda g: sum(op.bytes_read + op.bytes_written for op in g.ops)  # noqa: E731
    assert traffic(block.fwd) < traffic(plain.fwd) and traffic(block.bwd) <= traffic(plain.bwd)
    # Megatron's bias + dropout + residual: reads the GEMM output, the bias and the residual; writes the
    # sum and the 1-byte dropout mask the backward keeps, never the two intermediates.
    (bda, _) = [op for op in block.fwd.ops if op.vector_ops == ("add", "dropout", "add")]
    assert bda.bytes_read == 2 * s * b * h + 2 * h + 2 * s * b * h
    assert bda.bytes_written == 2 * s * b * h + s * b * h
    assert bda.flops == s * b * h * (1 + VECTOR_OP_FLOPS["dropout"] + 1)


class TinyMLP(nn.Module):
    """A user's own layer: pre-norm MLP with a residual, on real CPU weights."""

    def __init__(self, h=16, f=64):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.up = nn.Linear(h, f)
        self.down = nn.Linear(f, h)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def test_user_module_is_traced_without_being_changed():
    module = TinyMLP()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    fwd, bwd = trace_layer(module, (torch.randn(8, 3, 16),), name="mine")
    assert fwd.layer == bwd.layer == "mine" and fwd.pass_name == "fwd" and bwd.pass_name == "bwd"
    assert [op.gemm for op in fwd.ops if op.unit == TC] == [(1, 24, 16, 64), (1, 24, 64, 16)]
    assert sum(op.unit == TC for op in bwd.ops) == 4
    assert any("gelu_bwd" in op.vector_ops for op in bwd.ops)
    for n, p in module.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[n])
    details = trace_layer_details(module, torch.randn(8, 3, 16))
    assert details.params == sum(p.numel() for p in module.parameters())
    assert details.param_bytes == 4 * details.params  # float32 weights stay float32
    check_backward_structure(details)


class UsesSDPA(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):  # x: [b, s, d], one head
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True), x.sum()


def test_user_module_with_sdpa_and_tuple_output():
    fwd, bwd = trace_layer(UsesSDPA(), (torch.randn(2, 5, 8, dtype=torch.bfloat16),))
    assert [op.kind for op in fwd.ops if op.unit == TC] == ["gemm", "bgemm", "bgemm"]
    assert sum(op.unit == TC for op in bwd.ops) == 6


def test_frozen_parameters_get_no_weight_gradient():
    module = TinyMLP()
    module.up.weight.requires_grad_(False)
    module.up.bias.requires_grad_(False)
    tr = trace_layer_details(module, (torch.randn(4, 2, 16),))
    assert sum(op.unit == TC for op in tr.bwd.ops) == 3  # no weight gradient for `up`


def test_module_without_differentiable_output_is_rejected():
    class Constant(nn.Module):
        def forward(self, x):
            return torch.zeros(3)

    with pytest.raises(ValueError, match="returns no tensor"):
        trace_layer(Constant(), (torch.randn(2),))
