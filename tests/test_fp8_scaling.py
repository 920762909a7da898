"""FP8 scaling recipes and per-microbatch weight casts (workload/precision.py, "Scaling recipes"),
and the PyTorch-native suites that use them: each recipe's extra traffic equals what an independent
count from the GEMM shapes says, the recipes order delayed < tensorwise < rowwise in bytes and time,
the recipe rules name their field, and a row whose published recipe cannot be written yet is
skipped with its reason."""

from __future__ import annotations

import copy

import pytest
import yaml

from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.latency import estimate
from phaze_opt.training import RecipeError, Training
from phaze_opt.validation.runner import run_suite
from phaze_opt.validation.suites import load_suite
from phaze_opt.workload.models import load_model
from phaze_opt.workload.ops import TC, Op, OpGraph
from phaze_opt.workload.precision import FORMATS, precision_ops
from phaze_opt.workload.stack import recipe_graph

from test_validate import _Result

E = 2.0  # BF16 bytes per element
GEMMS = ((1, 512, 256, 768), (1, 512, 768, 256), (1, 256, 512, 768))  # (b, m, k, n)


def chain(n_gemms=len(GEMMS)) -> OpGraph:
    """A norm feeding a chain of linear GEMMs."""
    ops = [Op("ln", "norm", "vc", bytes_read=E * 512 * 256, bytes_written=E * 512 * 256, elements=512 * 256,
              vector_ops=("layernorm",))]
    for j, (b, m, k, n) in enumerate(GEMMS[:n_gemms]):
        ops.append(Op(f"mm{j}", "gemm", TC, flops=2 * b * m * k * n, bytes_read=E * b * (m * k + k * n),
                      bytes_written=E * b * m * n, gemm=(b, m, k, n)))
    return OpGraph("block", "bwd", tuple(ops), tuple((i, i + 1) for i in range(len(ops) - 1)))


def traffic(graph: OpGraph) -> float:
    return sum(op.bytes_read + op.bytes_written for op in graph.ops)


def topological(graph: OpGraph) -> bool:
    """Every edge points forward and every op but the first has a predecessor (one connected DAG)."""
    heads = {v for _, v in graph.edges}
    return all(u < v for u, v in graph.edges) and heads == set(range(1, len(graph.ops)))


@pytest.mark.parametrize("backward", [False, True])
def test_tensorwise_adds_one_read_of_each_cast_operand(backward):
    """Dynamic per-tensor scaling reads each cast operand once more (its amax) and writes a scale:
    b x m x k x 2 B + 4 B per low-precision GEMM over delayed scaling, one op more per GEMM, run
    between the GEMM's producer and its cast."""
    delayed = precision_ops(chain(), "block", "fp8", E, backward=backward)
    dynamic = precision_ops(chain(), "block", "fp8", E, scaling="tensorwise", backward=backward)
    expected = sum(b * m * k * E + 4.0 for b, m, k, _ in GEMMS)
    assert traffic(dynamic) - traffic(delayed) == pytest.approx(expected)
    assert len(dynamic.ops) - len(delayed.ops) == len(GEMMS)
    assert topological(dynamic)
    for j in range(len(GEMMS)):
        names = [op.name for op in dynamic.ops]
        amax, cast, gemm = names.index(f"mm{j}.amax_fp8"), names.index(f"mm{j}.cast_fp8"), names.index(f"mm{j}")
        assert (amax, cast) in dynamic.edges and (cast, gemm) in dynamic.edges


def test_a_fusing_stack_computes_the_amax_in_the_producing_kernel():
    """With casts fused where their operand is produced (megatron-te), delayed scaling writes the
    norm's FP8 output from the norm itself; per-tensor dynamic scaling keeps the amax there (TE's
    norm-and-amax kernel, no extra read) but casts in a kernel of its own: one read of the norm's
    output at 2 B and a write at 1 B more than delayed, for the GEMM the norm feeds."""
    delayed = precision_ops(chain(1), "block", "fp8", E, fused_casts=True)
    dynamic = precision_ops(chain(1), "block", "fp8", E, fused_casts=True, scaling="tensorwise")
    b, m, k, _ = GEMMS[0]
    assert "cast" in delayed.ops[0].vector_ops and len(delayed.ops) == 2
    assert "amax" in dynamic.ops[0].vector_ops and "cast" not in dynamic.ops[0].vector_ops
    assert [op.name for op in dynamic.ops] == ["ln", "mm0.cast_fp8", "mm0"]
    # delayed's norm writes the FP8 copy beside its BF16 output; dynamic's cast reads BF16, writes FP8
    assert traffic(dynamic) - traffic(delayed) == pytest.approx(b * m * k * E + 4.0)


def test_rowwise_rescales_each_backward_gemm_output_and_scales_forward_ones_in_the_epilogue():
    """Row-wise: a forward GEMM carries the two scale multiplies in its epilogue (no bytes); a
    backward GEMM's output is read and written once more by its rescale (b x m x n x 2 x 2 B)."""
    tensorwise = precision_ops(chain(), "block", "fp8", E, scaling="tensorwise", backward=True)
    rowwise = precision_ops(chain(), "block", "fp8", E, scaling="rowwise", backward=True)
    assert traffic(rowwise) - traffic(tensorwise) == pytest.approx(sum(2 * b * m * n * E for b, m, _, n in GEMMS))
    assert topological(rowwise)
    fwd = precision_ops(chain(), "block", "fp8", E, scaling="rowwise")
    assert traffic(fwd) == pytest.approx(traffic(precision_ops(chain(), "block", "fp8", E, scaling="tensorwise")))
    assert all(op.vector_ops[-2:] == ("mul", "mul") and op.unit == "tc+vc" for op in fwd.ops if op.datatype)


def test_the_layer_graph_orders_the_recipes_in_bytes_and_time():
    """Llama 3 8B's block on H100: delayed < tensorwise < rowwise in bytes moved and in the sum of
    its ops' latencies, on a stack that casts in place (megatron-te) and one that does not (eager);
    on eager the row-wise surplus is exactly the backward GEMM outputs' rescale."""
    h100 = load_arch("h100-sxm")
    for stack in ("eager", "megatron-te"):
        graphs = {s: recipe_graph("llama3-8b", 1, Training(mbs=1, precision="fp8", fp8_scaling=s, stack=stack))
                  .op_graphs["block"] for s in ("delayed", "tensorwise", "rowwise")}
        moved = {s: sum(traffic(g) for g in passes.values()) for s, passes in graphs.items()}
        seconds = {s: sum(float(estimate(g, [h100]).single.sum()) for g in passes.values())
                   for s, passes in graphs.items()}
        assert moved["delayed"] < moved["tensorwise"] < moved["rowwise"], stack
        assert seconds["delayed"] < seconds["tensorwise"] < seconds["rowwise"], stack
        if stack == "eager":
            outputs = sum(2 * E * b * m * n for op in graphs["tensorwise"]["bwd"].ops if op.datatype
                          for b, m, _, n in [op.gemm])
            assert moved["rowwise"] - moved["tensorwise"] == pytest.approx(outputs)


@pytest.mark.parametrize("scaling, passes", [("delayed", (1, 1)), ("tensorwise", (2, 2))])
def test_weight_recast_casts_the_layer_weights_in_each_pass(scaling, passes):
    """fp8_weight_recast: each pass reads the layer's weights (once more for a dynamic amax) and
    writes their FP8 cast, ahead of its first low-precision GEMM; per microbatch that is
    params x (reads x 2 B + 1 B) in the forward and again in the backward."""
    model = load_model("llama3-8b")
    base = Training(mbs=1, precision="fp8", fp8_scaling=scaling, stack="eager")
    plain = recipe_graph(model, 2, base)
    recast = recipe_graph(model, 2, Training(mbs=1, precision="fp8", fp8_scaling=scaling, stack="eager",
                                             fp8_weight_recast=True))
    params = {layer.kind: layer.params for layer in plain.layers}
    fmt = FORMATS["fp8"].operand_bytes
    for kind in ("block",):
        for p, reads in zip(("fwd", "bwd"), passes):
            extra = traffic(recast.op_graphs[kind][p]) - traffic(plain.op_graphs[kind][p])
            amax_scale = 4.0 if scaling != "delayed" else 0.0
            assert extra == pytest.approx(params[kind] * (reads * E + fmt) + amax_scale), (kind, p)
            g = recast.op_graphs[kind][p]
            first = min(i for i, op in enumerate(g.ops) if op.datatype)
            cast = next(i for i, op in enumerate(g.ops) if op.name == "weights.cast_fp8")
            assert (cast, first) in g.edges
    for kind in ("embedding", "head"):  # BF16 layers: nothing cast
        assert recast.op_graphs[kind] == plain.op_graphs[kind]


@pytest.mark.parametrize("given, field", [
    (dict(fp8_scaling="tensorwise"), "fp8_scaling"),
    (dict(precision="mxfp8", fp8_scaling="rowwise"), "fp8_scaling"),
    (dict(fp8_weight_recast=True), "fp8_weight_recast"),
])
def test_scaling_fields_need_their_precision(given, field):
    with pytest.raises(RecipeError) as info:
        Training(**given)
    assert info.value.field == field and "needs" in info.value.detail


def test_the_recipe_keys_name_only_changed_scaling_fields():
    assert "fp8_scaling" not in Training(precision="fp8").recipe()
    key = Training(precision="fp8", fp8_scaling="rowwise").layer_key()
    assert ("fp8_scaling", "rowwise") in key and key != Training(precision="fp8").layer_key()


ROW = {"model": "llama3-8b", "tp": 1, "pp": 1, "gpus": 8, "batch": 16, "microbatch": 2, "recompute": "selective",
       "zero": 3, "iteration_time_s": 2.0, "source": {"paper": "p", "table": "t", "row": "r"}}


def _suite(tmp_path, *rows):
    data = {"suite": "t", "description": "d", "arch": "h100-sxm", "system": "dgx-h100", "metric": "iteration_time_s",
            "flops_formula": "megatron-core",
            "papers": {"p": "a source"}, "rows": [copy.deepcopy(r) for r in rows]}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_pending_recipe_row_is_checked_in_full_then_skipped(tmp_path):
    suite = load_suite(_suite(tmp_path, {**ROW, "pending_recipe": "op-level checkpointing"}, ROW))
    assert suite.rows[0].skip == "recipe not expressible yet: op-level checkpointing" and suite.rows[1].skip == ""
    calls = []
    result = run_suite(suite, evaluator=lambda *a: calls.append(a) or _Result(True, 2.0))
    assert len(calls) == 1 and len(result.skipped) == 1 and result.skipped[0].predicted is None
    with pytest.raises(PhazeError, match=r"rows\[0\]\.pending_recipe': must say what"):
        load_suite(_suite(tmp_path, {**ROW, "pending_recipe": " "}))
    with pytest.raises(PhazeError, match=r"rows\[0\]\.fp8_scaling': needs precision fp8"):
        load_suite(_suite(tmp_path, {**ROW, "pending_recipe": "x", "fp8_scaling": "rowwise"}))


@pytest.mark.parametrize("name", ["torchtitan-h100", "torchtitan-a100"])
def test_torchtitan_rows_are_the_published_throughput_and_cited(name):
    """iteration_time_s = batch x seq / (tokens/s/GPU x GPUs) to 4 digits; every row's source is in
    the suite's papers, no two rows cite the same table row, and every skipped row says why."""
    suite = load_suite(name)
    assert len({(r.source.paper, r.source.table, r.source.row) for r in suite.rows}) == len(suite.rows)
    for row in suite.rows:
        seq = row.seq or load_model(row.model).seq
        tokens = row.published["tokens_per_s_per_gpu"]
        assert row.value == pytest.approx(row.batch * seq / (tokens * row.gpus), rel=5e-4), row.source
        assert row.source.paper in suite.papers and "commit" in suite.papers[row.source.paper], row.source
        assert row.skip == "" or row.skip.startswith("recipe not expressible yet: "), row.source
        assert row.training.zero in (2, 3)  # FSDP2: resharding after forward, or not under PP
    assert sum(not r.skip for r in suite.rows) >= 2


def test_torchtitan_float8_rows_run_torchaos_recipe():
    suite = load_suite("torchtitan-h100")
    fp8 = [r for r in suite.rows if r.training.precision == "fp8"]
    assert fp8 and all(r.training.fp8_weight_recast for r in fp8)
    assert {r.training.fp8_scaling for r in fp8} == {"tensorwise", "rowwise"}
    assert any(r.training.precision == "bf16" and not r.skip for r in suite.rows)


@pytest.mark.parametrize("model", ["llama3-8b", "deepseek-v3"])
@pytest.mark.parametrize("stack", ["eager", "megatron-te"])
def test_every_recipe_builds_a_forward_dag_that_never_moves_fewer_bytes(model, stack):
    """Dense, MoE and MLA blocks (DeepSeek-V3 holds all three) under a stack that casts in place and
    one that does not, with sequence parallelism (views between a
    shared cast and its later GEMMs): each recipe's op graphs are DAGs in topological order
    (`OpGraph` refuses a backward edge) and each adds traffic over the one before it."""
    moved = []
    for scaling, recast in (("delayed", False), ("tensorwise", False), ("tensorwise", True), ("rowwise", True)):
        graph = recipe_graph(model, 2, Training(mbs=1, precision="fp8", fp8_scaling=scaling, stack=stack,
                                                fp8_weight_recast=recast), sequence_parallel=True)
        moved.append(sum(traffic(g) for passes in graph.op_graphs.values() for g in passes.values()))
    assert moved == sorted(moved) and len(set(moved)) == len(moved)


def test_a_training_step_orders_the_recipes_and_keeps_their_memory(tmp_path, monkeypatch):
    """A whole step of a tiny Llama on an H100 cut to one tensor and one vector core (schedules proven
    optimal, so no clock enters), TE fusion, 4 microbatches: delayed < tensorwise
    < rowwise in time, and casting the weights in every microbatch costs time on top; the scaling
    recipe moves no byte of memory (the same tensors are kept)."""
    import dataclasses

    from phaze_opt.design.evaluate import evaluate
    from phaze_opt.system import load_system
    from test_precision import tiny_llama

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    model = tiny_llama(layers=1, hidden=256, ffn=512)
    chip = dataclasses.replace(load_arch("h100-sxm"), num_tc=1, num_vc=1)
    system = dataclasses.replace(load_system("dgx-h100"), accelerators=2, global_batch=8)
    results = {}
    for scaling, recast in (("delayed", False), ("tensorwise", False), ("rowwise", False), ("rowwise", True)):
        recipe = Training(1, placement="tp=1,pp=1,dp=2", precision="fp8", fp8_scaling=scaling,
                          fp8_weight_recast=recast, stack="megatron-te")
        r = evaluate(model, chip, recipe, system, 60.0)
        assert r.feasible and r.proven and not r.unproven, (r.reason, r.unproven)  # optimal schedules: no clock
        results[scaling, recast] = (r.time_per_batch_s, r.placement["stages"][0]["memory_bytes"])
    times = [t for t, _ in results.values()]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert len({memory for _, memory in results.values()}) == 1


def test_fsdp_fp8_all_gather_halves_the_weight_gathers_and_keeps_the_memory(tmp_path, monkeypatch):
    """ZeRO-3 on a link slow enough that the weight gathers show: gathering each shard's FP8 cast
    (torchao's FSDP float8 all-gather) makes the step faster, and the parameters held (BF16) and
    every other byte of memory stay as they were; the rule refuses it without FSDP."""
    import dataclasses

    from phaze_opt.design.evaluate import evaluate
    from phaze_opt.system import load_system
    from test_precision import tiny_llama

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    chip = dataclasses.replace(load_arch("h100-sxm"), num_tc=1, num_vc=1)
    base = load_system("dgx-h100")
    slow = dataclasses.replace(base.intra_node, bandwidth=base.intra_node.bandwidth / 1000)
    system = dataclasses.replace(base, accelerators=2, global_batch=4, intra_node=slow)
    runs = {}
    for gather in (False, True):
        recipe = Training(1, placement="tp=1,pp=1,dp=2", precision="fp8", fp8_scaling="tensorwise", zero=3,
                          fp8_all_gather=gather, stack="megatron-te")
        r = evaluate(tiny_llama(layers=1, hidden=256, ffn=512), chip, recipe, system, 60.0)
        assert r.feasible and r.proven, (r.reason, r.unproven)
        runs[gather] = (r.time_per_batch_s, r.placement["stages"][0]["memory_bytes"])
    assert runs[True][0] < runs[False][0] and runs[True][1] == runs[False][1]
    with pytest.raises(RecipeError, match="needs precision fp8, zero 2 or 3"):
        Training(precision="fp8", zero=1, fp8_all_gather=True)
