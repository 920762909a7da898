"""The software stack's kernel fusion (`Training.stack`, workload/stack.py): it keys the layer costs,
a fused stack never moves more bytes than eager PyTorch, TE's FP8 casts live in the kernels that
produce the operands, and validation suites carry the stack of the software that ran them."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from phaze_opt import configs
from phaze_opt.design.evaluate import layer_costs
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.system import load_system
from phaze_opt.training import STACKS, Training
from phaze_opt.validation.suites import load_suite
from phaze_opt.workload.models import load_model
from phaze_opt.workload.ops import NONE, VC
from phaze_opt.workload.stack import recipe_graph

# One model of each block structure is traced on every run; the rest of the presets with `slow`.
QUICK = ("llama3-8b", "megatron-gpt-1.7b", "qwen3-30b-a3b")


def test_default_stack_keeps_every_earlier_key():
    """The default adds nothing to the recipe or the layer-cost key (stored studies and memo keys
    stay what they were); any other stack changes both."""
    base = Training(mbs=2, sequence_parallel=True)
    assert base.stack == STACKS[0] == "megatron-lm"
    assert base.layer_key() == (2, True, None) and "stack" not in base.recipe()
    for stack in ("eager", "megatron-te"):
        other = Training(mbs=2, sequence_parallel=True, stack=stack)
        assert other.layer_key() != base.layer_key() and other.recipe()["stack"] == stack


def test_bad_stack_is_one_line():
    with pytest.raises(PhazeError, match="stack must be one of megatron-lm, eager, megatron-te, torch-compile, got 'te'"):
        Training(stack="te")


def _traffic(graph, kind, pass_name):
    ops = [op for op in graph.op_graphs[kind][pass_name].ops if op.unit != NONE]
    return sum(op.bytes_read + op.bytes_written for op in ops), len(ops)


@pytest.mark.parametrize("model", [m if m in QUICK else pytest.param(m, marks=pytest.mark.slow)
                                   for m in configs.available("models")])
def test_fused_stacks_never_move_more_bytes_than_eager(model):
    """Fusion only merges kernels: per layer kind and pass, megatron-te <= megatron-lm <= eager and
    torch-compile <= megatron-lm in bytes moved and kernels launched, in BF16 and in FP8 (where TE's
    and Inductor's casts are fused too): Inductor fuses every same-size chain Megatron-LM's fusion
    does, and more, but not every pair TE's kernels do (TE's RoPE and norms span tensors of other
    sizes, one Inductor loop nest does not). Compared with the router's weights in one place: they
    are not a fusion (`expert_weights`)."""
    moe = load_model(model).moe
    for precision in ("bf16", "fp8"):
        graphs = {s: recipe_graph(model, 1, Training(stack=s, precision=precision)) for s in STACKS}
        same = {"expert_weights": "combine"} if moe else {}
        lm_combine = recipe_graph(model, 1, Training(stack="megatron-lm", precision=precision, **same))
        for kind in graphs["eager"].kinds:
            for pass_name in ("fwd", "bwd"):
                eager, lm, te, inductor = (_traffic(graphs[s], kind, pass_name)
                                           for s in ("eager", "megatron-lm", "megatron-te", "torch-compile"))
                lm_same = _traffic(lm_combine, kind, pass_name)
                assert inductor[0] <= lm_same[0] * (1 + 1e-12) and inductor[1] <= lm_same[1], (kind, pass_name, precision)
                assert te[0] <= lm[0] * (1 + 1e-12) and lm[0] <= eager[0] * (1 + 1e-12), (kind, pass_name, precision)
                assert te[1] <= lm[1] <= eager[1], (kind, pass_name, precision)


def test_inductor_fuses_the_residual_add_into_the_norm_and_softmax_with_its_scale_and_mask():
    """What Inductor's fusion adds to TE's row fusion on a GPT block (LayerNorm, unfused attention):
    the residual add that feeds both the next norm and the next residual (two consumers) joins the
    norm's kernel, and the scores' scale, mask and softmax are one kernel; the GEMMs stay alone, so
    the GEMM count is every stack's."""
    graphs = {s: recipe_graph("megatron-gpt-1.7b", 1, Training(stack=s, attention="unfused"))
              for s in ("megatron-te", "torch-compile")}
    fwd = {s: g.op_graphs["block"]["fwd"].ops for s, g in graphs.items()}
    inductor = fwd["torch-compile"]
    assert any(op.unit == VC and "add" in op.vector_ops and "layernorm" in op.vector_ops for op in inductor)
    assert not any(op.unit == VC and "add" in op.vector_ops and "layernorm" in op.vector_ops
                   for op in fwd["megatron-te"])
    assert any(op.unit == VC and "softmax" in op.vector_ops and "masked_fill" in op.vector_ops for op in inductor)
    gemms = {s: sum(op.unit in ("tc", "tc+vc") for op in ops) for s, ops in fwd.items()}
    assert gemms["torch-compile"] == gemms["megatron-te"] > 0
    for s, graph in graphs.items():  # a topological order of the fused kernels
        for pass_name in ("fwd", "bwd"):
            assert all(a < b for a, b in graph.op_graphs["block"][pass_name].edges), s


def test_inductor_kernels_iterate_over_one_size():
    """Inductor runs one loop nest a kernel: under torch-compile a fused kernel's vector ops run over
    its largest op's points or over a smaller tensor one of its ops touches (a norm's per-row
    statistic, a pointwise part of a concatenation). So GQA's Q and K (32 and 4 heads in
    Qwen3-30B-A3B, 32 and 8 in Llama 3 8B) never share a reduction's kernel (Qwen3's Q and K norms,
    either pass) nor a forward kernel (RoPE of Q and of K), while each RMSNorm (pow, mean, rsqrt,
    scale) stays one kernel. Without the rule Qwen3's Q and K norm backward passes fuse into one."""
    reductions = ("reduction", "norm", "softmax")
    for model in ("llama3-8b", "qwen3-30b-a3b"):
        m = load_model(model)
        q, k = m.seq * m.heads * m.head_dim, m.seq * m.kv_heads * m.head_dim
        training = Training(stack="torch-compile", attention="flash")
        graph = recipe_graph(model, 1, training)
        eager = recipe_graph(model, 1, dataclasses.replace(training, stack="eager"))
        for pass_name in ("fwd", "bwd"):
            node = {op.name: op for op in eager.op_graphs["block"][pass_name].ops}  # one op a traced node
            for op in graph.op_graphs["block"][pass_name].ops:
                members = [node[name] for name in op.contains if name in node]
                reduced = {n.elements for n in members if n.kind in reductions}
                assert not {q, k} <= reduced, (model, pass_name, op.name)
                if pass_name == "fwd":
                    assert not {q, k} <= {n.elements for n in members}, (model, op.name)
        fwd = graph.op_graphs["block"]["fwd"].ops
        assert sum(op.unit == VC and {"pow", "mean", "rsqrt"} <= set(op.vector_ops) for op in fwd) >= 2


def test_te_fuses_norm_and_rope_into_one_kernel_each():
    """Llama's forward under TE: RMSNorm is one kernel (pow, mean, rsqrt, scale), RoPE of Q and of K
    one kernel each; the default stack keeps the norm's reduction apart."""
    te = recipe_graph("llama3-8b", 1, Training(stack="megatron-te", attention="flash")).op_graphs["block"]["fwd"]
    lm = recipe_graph("llama3-8b", 1, Training(attention="flash")).op_graphs["block"]["fwd"]
    norms = [op for op in te.ops if op.unit == VC and {"pow", "mean", "rsqrt"} <= set(op.vector_ops)]
    ropes = [op for op in te.ops if op.unit == VC and {"neg", "copy", "mul"} <= set(op.vector_ops)]
    assert len(norms) == 2 and len(ropes) == 2
    assert not any(op.unit == VC and {"pow", "mean"} <= set(op.vector_ops) for op in lm.ops)


def test_te_casts_fp8_in_the_producing_kernel():
    """Under TE three of a Llama block's four forward casts go into the norms and the SwiGLU
    product (TE's LayerNormLinear / LayerNormMLP); the attention output keeps a cast of its own.
    The default stack has a cast kernel per FP8 GEMM."""
    def casts(stack):
        graph = recipe_graph("llama3-8b", 1, Training(stack=stack, precision="fp8", attention="flash"))
        ops = graph.op_graphs["block"]["fwd"].ops
        alone = [op for op in ops if op.vector_ops == ("cast", "amax")]
        fused = [op for op in ops if "cast" in op.vector_ops and len(op.vector_ops) > 2]
        return len(alone), len(fused)

    assert casts("megatron-lm") == (4, 0)
    assert casts("megatron-te") == (1, 3)


def test_stack_changes_layer_costs():
    """Two stacks give two memo entries and two sets of layer times; eager is the slowest."""
    arch, system = load_arch("h100-sxm"), load_system("dgx-h100")
    model = load_model("megatron-gpt-1.7b")
    times = {}
    for stack in STACKS:
        costs = layer_costs(model, arch, Training(mbs=1, stack=stack), system, 1, ilp_time_limit_s=10.0)
        times[stack] = sum(costs.costs.fwd_s) + sum(costs.costs.bwd_s)
        assert ("stack", stack) in costs.key or stack == STACKS[0]
    assert times["eager"] > times["megatron-lm"] > times["megatron-te"] > times["torch-compile"]


def test_suites_name_the_stack_of_their_software(tmp_path):
    """The A100 papers ran Megatron-LM (the default); the NeMo / Megatron-Core suites TE, except
    Meta's Llama 3 rows, which say their own; a suite's stack reaches the row's recipe."""
    assert {r.training.stack for r in load_suite("narayanan-sc21").rows} == {"megatron-lm"}
    assert {r.training.stack for r in load_suite("nemo-fp8-h100").rows} == {"megatron-te"}
    core = load_suite("megatron-core-h100")
    assert {r.training.stack for r in core.rows if r.model == "llama3-405b"} == {"megatron-lm"}
    assert {r.training.stack for r in core.rows if r.model != "llama3-405b"} == {"megatron-te"}
    assert core.rows[0].training.stack == "megatron-te"
    data = yaml.safe_load(open(core.path))
    data["stack"] = "fused"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PhazeError, match="stack.*megatron-lm, eager, megatron-te"):
        load_suite(path)


@pytest.mark.parametrize("kv_heads", [2, 8])
def test_te_attention_keeps_its_own_v_not_the_fused_qkv_output(kv_heads):
    """Transformer Engine's attention takes contiguous copies of Q, K, V whose strides match no packed
    layout, so under `megatron-te` a grouped-query block keeps V alone and the fused QKV projection's
    output is freed; eager PyTorch keeps V as a view, hence the whole QKV output. The difference is
    exactly that output less V, with one KV head per query head too (RoPE has copied Q and K, so V's
    strides still match no packed layout)."""
    from phaze_opt.workload.layers import build_layer, example_inputs
    from phaze_opt.workload.models import parse_model
    from phaze_opt.workload.ops import ROW_FUSION
    from phaze_opt.workload.trace import trace_layer_details

    heads, hidden, seq = 8, 64, 16
    model = parse_model({"name": "tiny-gqa", "family": "llama", "layers": 2, "hidden": hidden, "heads": heads,
                         "kv_heads": kv_heads, "ffn": 128, "seq": seq, "vocab": 96, "activation": "swiglu",
                         "norm": "rmsnorm", "position": "rotary", "tied_embeddings": False, "bias": False,
                         "dropout": 0.0, "attention": "flash"})
    block = build_layer(model, "block", 1)
    eager, te = (trace_layer_details(block, example_inputs(model, "block", 1, seq), name="block", fuse=fuse)
                 for fuse in (True, ROW_FUSION))
    d = hidden // heads
    qkv_out, v = seq * (heads + 2 * kv_heads) * d * 2, seq * kv_heads * d * 2
    assert eager.activation_bytes - te.activation_bytes == qkv_out - v
    assert any(n == "mm" and b == qkv_out for n, _, _, b in eager.saved)
    assert not any(b == qkv_out for _, _, _, b in te.saved)
