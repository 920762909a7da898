"""Layer graphs against independent counts: published formulas, PyTorch's own FLOP counter and
the tensors the autograd engine really saves, plus sharding, structure and the disk cache."""

import dataclasses
import math
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from phaze_opt.errors import PhazeError
from phaze_opt.workload import graphs
from phaze_opt.workload.graphs import build_layer_graph, model_params
from phaze_opt.workload.layers import build_layer, example_inputs
from phaze_opt.workload.models import load_model, parse_model
from phaze_opt.workload.ops import NET, TC
from phaze_opt.workload.trace import trace_layer_details

MODELS = ("gpt3-175b", "gpt2-xl", "bert-large", "opt-1.3b", "llama2-7b", "llama2-70b", "megatron-8.3b")
GPT_STYLE = ("gpt3-175b", "gpt2-xl", "megatron-8.3b", "opt-1.3b")
HYP = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "workload-cache"))


def small_model(family="gpt", heads=4, head_dim=4, kv_heads=None, ffn=24, vocab=37, seq=8, dropout=0.1,
                qkv_projection="fused"):
    llama = family == "llama"
    data = {
        "name": f"small-{family}", "family": family, "layers": 3, "hidden": heads * head_dim, "heads": heads,
        "kv_heads": kv_heads or heads, "ffn": ffn, "seq": seq, "vocab": vocab,
        "activation": {"llama": "swiglu", "opt": "relu"}.get(family, "gelu"),
        "norm": "rmsnorm" if llama else "layernorm", "position": "rotary" if llama else "learned",
        "tied_embeddings": not llama, "bias": not llama, "dropout": 0.0 if llama else dropout,
        "expert_placement": {"tp": 1, "pp": 1, "dp": 1}, "qkv_projection": qkv_projection,
    }
    return parse_model(data, "small")


# --- FLOPs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GPT_STYLE)
def test_training_flops_match_narayanan(name):
    """72 s l h^2 (1 + s/6h + V/12lh) per sequence (Narayanan et al. 2021, eq. 3 without recompute)."""
    m = load_model(name)
    s, l, h, v = m.seq, m.layers, m.hidden, m.vocab
    expected = 72 * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))
    got = build_layer_graph(m, 1, 1).train_flops_per_sequence
    assert abs(got / expected - 1) < 0.02, (name, got, expected)


def test_training_flops_do_not_depend_on_tp_or_mbs():
    m = load_model("megatron-8.3b")
    ref = build_layer_graph(m, 1, 1).train_flops_per_sequence
    assert build_layer_graph(m, 8, 2).train_flops_per_sequence == ref


def _torch_counted_flops(module, inputs):
    """PyTorch's own count of matmul FLOPs for one forward + backward on meta tensors."""
    xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    with FlopCounterMode(display=False) as counter:
        out = module(*xs)
        out.backward(torch.empty_like(out))
    return counter.get_total_flops()


@pytest.mark.parametrize("name", MODELS)
def test_gemm_flops_equal_torch_flop_counter_full_size(name):
    m = load_model(name)
    t = max(m.tp_widths)
    graph = build_layer_graph(m, t, 1)
    for kind in ("block", "head"):
        ops = graph.op_graphs[kind]["fwd"].ops + graph.op_graphs[kind]["bwd"].ops
        ours = sum(2 * b * mm * k * n for op in ops if op.unit == TC for (b, mm, k, n) in [op.gemm])
        assert ours == _torch_counted_flops(build_layer(m, kind, t), example_inputs(m, kind, 1, m.seq))


@HYP
@given(family=st.sampled_from(["gpt", "bert", "opt", "llama"]), heads=st.sampled_from([2, 4]),
       head_dim=st.sampled_from([2, 4, 8]), seq=st.integers(2, 9), mbs=st.integers(1, 3),
       tp=st.sampled_from([1, 2]), ffn_mult=st.integers(1, 4), vocab=st.integers(5, 41))
def test_gemm_flops_closed_form_and_torch_counter(family, heads, head_dim, seq, mbs, tp, ffn_mult, vocab):
    kv = heads // 2 if family == "llama" else heads
    if kv % tp:
        kv = heads
    m = small_model(family, heads, head_dim, kv, ffn=4 * ffn_mult, vocab=vocab, seq=seq)
    s, b, h, d, f = seq, mbs, m.hidden, head_dim, m.ffn
    mlp_cols = 2 * f if family == "llama" else f
    # per device: QKV, output projection, two batched attention GEMMs, MLP in and out
    fwd = 2 * s * b * h * (heads + 2 * kv) * d // tp + 2 * s * b * heads * d * h // tp
    fwd += 2 * 2 * b * (heads // tp) * s * s * d
    fwd += 2 * s * b * h * mlp_cols // tp + 2 * s * b * f * h // tp
    trace = trace_layer_details(build_layer(m, "block", tp), example_inputs(m, "block", mbs, seq))
    fwd_gemm = sum(2 * x * y * z * w for op in trace.fwd.ops if op.unit == TC for (x, y, z, w) in [op.gemm])
    bwd_gemm = sum(2 * x * y * z * w for op in trace.bwd.ops if op.unit == TC for (x, y, z, w) in [op.gemm])
    assert fwd_gemm == fwd and bwd_gemm == 2 * fwd
    assert fwd_gemm + bwd_gemm == _torch_counted_flops(build_layer(m, "block", tp), example_inputs(m, "block", mbs, seq))
    for op in trace.fwd.ops + trace.bwd.ops:
        if op.unit == TC:
            bt, mm, k, n = op.gemm
            assert 2 * bt * mm * k * n <= op.flops <= 2 * bt * mm * k * n + bt * mm * n  # at most a bias epilogue


# --- activations -------------------------------------------------------------------------------


def megatron_activation_bytes(m, mbs, t):
    """Korthikanti et al. 2022, Sec. 4: s b h (10 + 24/t + 5 a s / (h t)) bytes per layer with TP
    (34 + 5as/h at t = 1), plus what that count leaves out: the float32 mean and 1/std of the two
    LayerNorms (2 x 2 x 4 bytes per token)."""
    s, b, h, a = m.seq, mbs, m.hidden, m.heads
    return s * b * h * (10 + 24 / t) + 5 * a * s * s * b / t + 16 * s * b


@pytest.mark.parametrize("name", ("gpt3-175b", "gpt2-xl", "megatron-8.3b", "bert-large"))
@pytest.mark.parametrize("mbs", (1, 2))
def test_activation_bytes_within_ten_percent_of_megatron(name, mbs):
    m = load_model(name)
    s, b, h, a = m.seq, mbs, m.hidden, m.heads
    published = s * b * h * (34 + 5 * a * s / h)
    block = build_layer_graph(m, 1, mbs).layers[1]
    assert abs(block.activation_bytes / published - 1) < 0.10
    assert block.activation_bytes == megatron_activation_bytes(m, mbs, 1)  # the detailed count is exact


@pytest.mark.parametrize("t", (2, 4, 8))
def test_activation_bytes_with_tensor_parallelism(t):
    m = load_model("gpt3-175b")
    assert build_layer_graph(m, t, 1).layers[1].activation_bytes == megatron_activation_bytes(m, 1, t)


def _autograd_saved_bytes(module, inputs):
    """Bytes of the distinct storages the autograd engine saves, parameters excluded."""
    from phaze_opt.validation.measure import saved_storage_bytes

    xs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    return saved_storage_bytes(module, lambda: module(*xs))[0]


@HYP
@given(family=st.sampled_from(["gpt", "bert", "opt", "llama"]), heads=st.sampled_from([2, 4]),
       head_dim=st.sampled_from([2, 4]), seq=st.integers(2, 8), mbs=st.integers(1, 3),
       tp=st.sampled_from([1, 2]), kind=st.sampled_from(["embedding", "block", "head"]),
       qkv=st.sampled_from(["fused", "separate"]))
def test_activation_bytes_equal_what_autograd_saves(family, heads, head_dim, seq, mbs, tp, kind, qkv):
    """Our count from the traced graph against the autograd engine's saved tensors, minus the
    constants our count leaves out on purpose (they do not grow with the microbatch): the causal
    mask, the rotary tables and the position ids. Fused or separate QKV projections: which storage
    a saved V keeps alive is autograd's to say."""
    kv = heads // 2 if family == "llama" and (heads // 2) % tp == 0 else heads
    m = small_model(family, heads, head_dim, kv, seq=seq, qkv_projection=qkv)
    inputs = example_inputs(m, kind, mbs, seq)
    traced = trace_layer_details(build_layer(m, kind, tp), inputs)
    # what a fused kernel rebuilds in backward (trace._Mapper._rebuilt_in_backward) eager autograd keeps
    ours = traced.activation_bytes + sum(r[3] for r in traced.rebuilt)
    engine = _autograd_saved_bytes(build_layer(m, kind, tp), inputs)
    constants = 0
    if kind == "block" and m.causal:
        constants += seq * seq * (heads // kv)  # bool mask, one row per query row
    if kind == "block" and m.position == "rotary":
        constants += 2 * seq * head_dim * 2  # cos and sin
    if kind == "embedding" and m.position == "learned":
        constants += seq * 8  # int64 position ids
    assert ours == engine - constants


# --- sharding ----------------------------------------------------------------------------------


SHARDED = ("attention.qkv.weight", "attention.qkv.bias", "attention.proj.weight", "mlp.fc1.weight",
           "mlp.fc1.bias", "mlp.fc2.weight")


@pytest.mark.parametrize("name", MODELS)
def test_sharded_parameters_are_one_over_t(name):
    m = load_model(name)
    full_block = dict(build_layer(m, "block", 1).named_parameters())
    for t in m.tp_widths:
        block = dict(build_layer(m, "block", t).named_parameters())
        assert block.keys() == full_block.keys()
        for pname, p in block.items():
            if pname in SHARDED:
                assert p.numel() * t == full_block[pname].numel(), (pname, t)
            else:  # norms and the row-parallel output biases are replicated, as in Megatron
                assert p.numel() == full_block[pname].numel(), (pname, t)
        full = sum(p.numel() for p in full_block.values())
        replicated = sum(p.numel() for n, p in full_block.items() if n not in SHARDED)
        if t not in (1, max(m.tp_widths)):
            continue
        per_device = build_layer_graph(m, t, 1).layers[1].params
        assert per_device == (full - replicated) // t + replicated
        assert abs(per_device * t / full - 1) < 0.01
        emb = build_layer(m, "embedding", t)
        assert emb.word.shape[0] == math.ceil(m.vocab / t)  # vocabulary-parallel, padded to t


# --- structure ---------------------------------------------------------------------------------


def test_gpt3_layer_graph_structure():
    m = load_model("gpt3-175b")
    g = build_layer_graph(m, 1, 1)
    s, b, h = m.seq, 1, m.hidden
    assert len(g.layers) == 98 and g.is_chain() and g.kinds == ["embedding", "block", "head"]
    assert [layer.kind for layer in g.layers[1:-1]] == ["block"] * 96
    assert len({dataclasses.replace(layer, name='') for layer in g.layers[1:-1]}) == 1  # identical blocks
    assert {layer.params for layer in g.layers[1:-1]} == {12 * h * h + 13 * h}
    assert all(layer.boundary_bytes == s * b * h * 2 for layer in g.layers[:-1]) and g.layers[-1].boundary_bytes == 0
    assert g.layers[0].input_bytes == s * b * 8  # token ids
    assert g.layers[1].input_bytes == s * b * h * 2
    assert g.layers[-1].input_bytes == s * b * h * 2 + s * b * 8  # hidden state + labels
    tied = m.vocab * h
    assert sum(layer.params for layer in g.layers) - tied == g.total_params == model_params(m)


def test_untied_model_counts_everything():
    m = load_model("llama2-7b")
    g = build_layer_graph(m, 1, 1)
    assert sum(layer.params for layer in g.layers) == g.total_params


@pytest.mark.parametrize("name", MODELS)
def test_collectives_present_iff_tensor_parallel(name):
    m = load_model(name)
    for t in sorted({1, max(m.tp_widths)}):
        g = build_layer_graph(m, t, 1)
        # Megatron's all-reduces per layer kind (forward, backward): the vocabulary-parallel embedding
        # sums its look-ups (its backward needs none); a block has g after attention and after the MLP,
        # and f before each in backward; the head has f and the loss's max, target and sum reductions.
        expected = {"embedding": (1, 0), "block": (2, 2), "head": (3, 1)}
        for kind in g.kinds:
            for i, pass_name in enumerate(("fwd", "bwd")):
                nets = [op for op in g.op_graphs[kind][pass_name].ops if op.unit == NET]
                assert len(nets) == (expected[kind][i] if t > 1 else 0), (kind, pass_name, t)
                assert all(op.collective == "allreduce" and op.group == t and op.comm_bytes > 0 for op in nets)
        if t > 1:  # each block all-reduce carries the full [s, b, h] activation
            block = g.op_graphs["block"]
            assert [op.comm_bytes for op in block["fwd"].ops if op.unit == NET] == [m.seq * m.hidden * 2] * 2
            assert [op.comm_bytes for op in block["bwd"].ops if op.unit == NET] == [m.seq * m.hidden * 2] * 2


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(PhazeError, match="TP width 2 not allowed; choose one of 1"):
        build_layer_graph("gpt2-xl", 2, 1)
    with pytest.raises(PhazeError, match="microbatch size must be a positive integer"):
        build_layer_graph("gpt2-xl", 1, 0)
    with pytest.raises(PhazeError, match="exceeds its 1024 learned positions"):
        build_layer_graph("gpt2-xl", 1, 1, seq=2048)


# --- cache -------------------------------------------------------------------------------------


def test_disk_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(graphs, "_MEMO", {})
    m = small_model("gpt")
    first = build_layer_graph(m, 2, 1)
    files = sorted((tmp_path / "graphs").glob("*.json"))
    assert len(files) == 2  # this graph and the t=1, mbs=1 one behind its FLOP count
    assert first.extra["source"] == "traced"
    monkeypatch.setattr(graphs, "_MEMO", {})
    again = build_layer_graph(m, 2, 1)
    assert again.extra["source"] == "disk cache"
    assert again.layers == first.layers
    for kind in first.kinds:
        for p in ("fwd", "bwd"):
            assert again.op_graphs[kind][p].content_key == first.op_graphs[kind][p].content_key
    assert build_layer_graph(m, 2, 1) is again  # in-memory hit


def test_disk_cache_round_trip_keeps_fused_attention_and_memory_regions(tmp_path, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(graphs, "_MEMO", {})
    m = small_model("gpt")
    first = build_layer_graph(m, 2, 1, attention="flash")
    monkeypatch.setattr(graphs, "_MEMO", {})
    again = build_layer_graph(m, 2, 1, attention="flash")
    assert again.extra["source"] == "disk cache"
    assert again.layers == first.layers
    assert any(layer.attention_core_bytes > 0 or layer.sequence_parallel_bytes > 0 for layer in again.layers)
    fused = [op for og in again.op_graphs["block"].values() for op in og.ops if op.gemms]
    assert fused and fused == [op for og in first.op_graphs["block"].values() for op in og.ops if op.gemms]
    assert all(isinstance(g, tuple) for op in fused for g in op.gemms)


def test_cache_key_separates_shapes_and_configs():
    m = small_model("gpt")
    keys = {graphs.graph_key(m, 1, 1, 8), graphs.graph_key(m, 2, 1, 8), graphs.graph_key(m, 1, 2, 8),
            graphs.graph_key(m, 1, 1, 4), graphs.graph_key(small_model("gpt", ffn=28), 1, 1, 8)}
    assert len(keys) == 5
    assert graphs.graph_key(m, 1, 1, 8) == graphs.graph_key(small_model("gpt"), 1, 1, 8)


def test_corrupt_cache_file_is_extracted_again(tmp_path, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(graphs, "_MEMO", {})
    m = small_model("bert")
    path = tmp_path / "graphs" / f"{graphs.graph_key(m, 1, 1, m.seq)}.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a graph")
    g = build_layer_graph(m, 1, 1)
    assert g.extra["source"] == "traced"
    assert isinstance(graphs._read(path, graphs.graph_key(m, 1, 1, m.seq)), type(g))


def test_no_cache_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(graphs, "_MEMO", {})
    build_layer_graph(small_model("opt"), 1, 1, cache=False)
    assert not (tmp_path / "graphs").exists()


class _Planted:
    """Unpickling this runs code: it creates the marker file named in its state."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _same_graph(a, b):
    assert (a.model, a.tp, a.mbs, a.seq, a.layers, a.edges, a.total_params, a.train_flops_per_sequence) == \
        (b.model, b.tp, b.mbs, b.seq, b.layers, b.edges, b.total_params, b.train_flops_per_sequence)
    assert a.op_graphs == b.op_graphs
    for kind in a.kinds:
        for p in ("fwd", "bwd"):
            assert a.op_graphs[kind][p].content_key == b.op_graphs[kind][p].content_key


def test_a_planted_pickle_in_the_graph_cache_never_runs(tmp_path, monkeypatch, caplog):
    """The cache is data: a pickle that would run code, at the old (.pkl) and the new (.json) path,
    is never executed; the new-path file is a logged miss, rewritten with the fresh trace."""
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(graphs, "_MEMO", {})
    m = small_model("gpt")
    key = graphs.graph_key(m, 1, 1, m.seq)
    folder = tmp_path / "cache" / "graphs"
    folder.mkdir(parents=True)
    markers = {suffix: tmp_path / f"ran-{suffix}" for suffix in ("pkl", "json")}
    for suffix, marker in markers.items():
        (folder / f"{key}.{suffix}").write_bytes(pickle.dumps(_Planted(marker)))
    pickle.loads(pickle.dumps(_Planted(tmp_path / "self-check")))  # the payload does run when unpickled
    assert (tmp_path / "self-check").exists()
    with caplog.at_level("WARNING", logger="phaze_opt.workload.graphs"):
        g = build_layer_graph(m, 1, 1)
    assert not any(marker.exists() for marker in markers.values())
    assert g.extra["source"] == "traced"
    assert any("rejected" in r.message or "unreadable" in r.message for r in caplog.records)
    assert not (folder / f"{key}.pkl").exists()  # the old format's file is gone, the new one rewritten
    monkeypatch.setattr(graphs, "_MEMO", {})
    again = build_layer_graph(m, 1, 1)
    assert again.extra["source"] == "disk cache"
    _same_graph(again, build_layer_graph(m, 1, 1, cache=False))
    assert not any(marker.exists() for marker in markers.values())


def _scaled(node, factor):
    """Every FLOP count in a graph's JSON times `factor`: an edit consistent in itself."""
    if isinstance(node, dict):
        return {k: (v * factor if k in ("flops", "fwd_flops", "bwd_flops", "train_flops_per_sequence")
                    and isinstance(v, (int, float)) else _scaled(v, factor)) for k, v in node.items()}
    if isinstance(node, list):
        return [_scaled(v, factor) for v in node]
    return node


@pytest.mark.parametrize("damage", ["truncate", "empty list", "wrong key", "bad op field", "bool for int",
                                    "missing kind", "not utf-8", "flops cut", "negative bytes", "params cut",
                                    "bytes x1000", "flops x2", "tc ops to vc", "zeroed bytes"])
def test_a_damaged_graph_cache_file_is_a_logged_miss_and_rewritten(tmp_path, monkeypatch, caplog, damage):
    import json

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    monkeypatch.setattr(graphs, "_MEMO", {})
    m = small_model("llama")
    fresh = build_layer_graph(m, 1, 1)
    key = graphs.graph_key(m, 1, 1, m.seq)
    path = tmp_path / "graphs" / f"{key}.json"
    good = path.read_text()
    data = json.loads(good)
    if damage == "truncate":
        text = good[: len(good) // 2]
    elif damage == "empty list":
        text = "[]"
    elif damage == "wrong key":
        text = json.dumps(dict(data, key="0" * 32))
    elif damage == "bad op field":
        data["graph"]["op_graphs"]["block"]["fwd"]["ops"][0]["flops"] = "lots"
        text = json.dumps(data)
    elif damage == "bool for int":
        data["graph"]["tp"] = True
        text = json.dumps(data)
    elif damage == "missing kind":
        del data["graph"]["op_graphs"]["head"]
        text = json.dumps(data)
    elif damage == "flops cut":  # well-formed, and a design five times faster
        text = json.dumps(_scaled(data, 0.2))
    elif damage == "negative bytes":
        data["graph"]["op_graphs"]["block"]["fwd"]["ops"][0]["bytes_read"] = -1.0
        text = json.dumps(data)
    elif damage == "params cut":
        data["graph"]["total_params"] //= 2
        text = json.dumps(data)
    elif damage in ("bytes x1000", "flops x2", "tc ops to vc", "zeroed bytes"):
        # edits the plausibility checks pass (seen: 21.87 seq/s instead of 2743.19); the signature does not
        for kind in data["graph"]["op_graphs"].values():
            for og in kind.values():
                for op in og["ops"]:
                    if damage == "bytes x1000":
                        op["bytes_read"] *= 1000
                    elif damage == "tc ops to vc" and op["unit"] == "tc":
                        op["unit"] = "vc"
        if damage == "flops x2":
            data["graph"] = _scaled(data["graph"], 2.0)
        for layer in data["graph"]["layers"] if damage == "zeroed bytes" else ():
            layer["activation_bytes"] = layer["params"] = 0
        text = json.dumps(data)
    else:
        text = None
        path.write_bytes(b"\xff\xfe" + good.encode())
    if text is not None:
        path.write_text(text)
    monkeypatch.setattr(graphs, "_MEMO", {})
    with caplog.at_level("WARNING", logger="phaze_opt.workload.graphs"):
        g = build_layer_graph(m, 1, 1)
    assert g.extra["source"] == "traced"
    assert any(str(path) in r.getMessage() for r in caplog.records)
    _same_graph(g, fresh)
    monkeypatch.setattr(graphs, "_MEMO", {})
    assert build_layer_graph(m, 1, 1).extra["source"] == "disk cache"  # rewritten


def test_the_json_field_tables_name_every_dataclass_field():
    from phaze_opt.workload import ops

    assert set(ops.OP_FIELDS) == {f.name for f in dataclasses.fields(ops.Op)}
    assert set(ops.LAYER_FIELDS) == {f.name for f in dataclasses.fields(ops.Layer)}
    assert set(ops.GRAPH_FIELDS) | {"layers", "edges", "op_graphs", "extra"} == \
        {f.name for f in dataclasses.fields(ops.LayerGraph)}


def test_sizes_beyond_the_limits_are_refused_before_tracing():
    with pytest.raises(PhazeError, match=r"sequence length must be at most 1,048,576 .*got 10,000,000"):
        build_layer_graph(small_model("llama"), 1, 1, seq=10_000_000)
    with pytest.raises(PhazeError, match=r"microbatch size must be at most 16,777,216"):
        build_layer_graph(small_model("llama"), 1, 2**30)


def test_sizes_within_their_limits_but_too_large_together_are_one_line_naming_them():
    data = {
        "name": "deep-long", "family": "llama", "layers": 10_000, "hidden": 16, "heads": 4, "ffn": 24,
        "seq": 2**20, "vocab": 37, "activation": "swiglu", "norm": "rmsnorm", "position": "rotary",
        "tied_embeddings": False, "bias": False, "dropout": 0.0, "expert_placement": {"tp": 1, "pp": 1, "dp": 1},
    }
    with pytest.raises(PhazeError, match=r"^deep.yaml: 'layers' 10000, 'hidden' 16 and sequence length 1048576 .*"
                                         r"beyond the 8 PiB float64 counts exactly"):
        build_layer_graph(parse_model(data, "deep.yaml"), 1, 1, cache=False)


def test_a_graph_file_from_another_cache_folder_is_traced_again(tmp_path, monkeypatch, caplog):
    """Each cache folder signs with its own key: a file copied in from elsewhere (or made by hand with
    the right format and key) is not trusted, however plausible its numbers."""
    import shutil

    m = small_model("gpt")
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "a"))
    monkeypatch.setattr(graphs, "_MEMO", {})
    build_layer_graph(m, 1, 1)
    name = f"{graphs.graph_key(m, 1, 1, m.seq)}.json"
    (tmp_path / "b" / "graphs").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "graphs" / name, tmp_path / "b" / "graphs" / name)
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "b"))
    monkeypatch.setattr(graphs, "_MEMO", {})
    with caplog.at_level("WARNING", logger="phaze_opt.workload.graphs"):
        assert build_layer_graph(m, 1, 1).extra["source"] == "traced"
    assert any("signature" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(graphs, "_MEMO", {})
    assert build_layer_graph(m, 1, 1).extra["source"] == "disk cache"  # rewritten under b's key
