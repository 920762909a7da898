"""Grouped GEMMs (a MoE's experts) by tokens per expert, held against DeepGEMM's published kernel
timings on an H800 (truth/deepgemm-h800-fp8-2025.json): nothing is fitted on that table, so every
row is held out; the template's limits, checked by enumeration over shapes; and the stacks that
issue a grouped GEMM one kernel per expert (TE's GroupedLinear), which pay the per-kernel cost per
expert."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.latency import estimate
from phaze_opt.workload.ops import Op, OpGraph

REPO = Path(__file__).resolve().parents[1]
TRUTH = REPO / "phaze_opt/presets/validation/truth/deepgemm-h800-fp8-2025.json"


def _kernel_chip():
    """h100-sxm as fitted, less its per-operator launch gap: DeepGEMM times the kernel alone
    (profiler kernel time), so the eager stack's dispatch gap between kernels is not in it."""
    chip = load_arch("h100-sxm")
    return dataclasses.replace(chip, efficiency=dataclasses.replace(chip.efficiency, op_overhead_s=0.0))


def _gemm(groups, m, k, n, datatype="", operand_bytes=2):
    """One (grouped) GEMM op: `groups` experts of m tokens each, K x N weights per expert."""
    return Op("mm", "grouped_gemm" if groups > 1 else "gemm", "tc", flops=2.0 * groups * m * k * n,
              bytes_read=groups * (m * k + k * n) * operand_bytes, bytes_written=groups * m * n * 2,
              gemm=(groups, m, k, n), datatype=datatype)


def _seconds(ops, chip):
    return estimate(OpGraph("block", "fwd", tuple(ops), ()), [chip]).split[0]


def _truth():
    return json.loads(TRUTH.read_text())


def test_the_truth_file_is_the_readme_table():
    data = _truth()
    assert data["commit"] == "989c9e3694638dd02aa36b4d8cb42339305caa85" and "H800" in data["device"]
    assert len(data["dense"]) == 18 and len(data["grouped"]) == 10
    assert {r["M"] for r in data["grouped"]} == {256, 512, 1024, 4096, 8192}


def _errors(rows, grouped):
    chip = _kernel_chip()
    ops = [_gemm(r["groups"] if grouped else 1, r["M"], r["K"], r["N"], "fp8", 1) for r in rows]
    published = [2.0 * (r["groups"] if grouped else 1) * r["M"] * r["N"] * r["K"] / (r["tflops"] * 1e12) for r in rows]
    return [float(t / p - 1.0) for t, p in zip(_seconds(ops, chip), published)]


def test_grouped_kernels_follow_the_published_tokens_per_expert():
    """256 to 8192 tokens per expert, FP8 on H800 (H100 SXM's SMs and HBM3): the template's fold
    fill and drain per group (the share of a fold's cycles not streaming rows falls as a group's
    rows grow) reproduces every published grouped row within 25%, 10% on the mean."""
    errors = _errors(_truth()["grouped"], grouped=True)
    assert max(abs(e) for e in errors) < 0.25
    assert sum(abs(e) for e in errors) / len(errors) < 0.10


def test_small_dense_kernels_within_the_stated_bound():
    """The dense rows (M 64, 128, 4096): the template is too slow at M 64-128, where a kernel's
    weight stream at a GEMM's HBM rate sets the time (the preset's hbm_fraction is the element-wise
    kernels'), by at most 35%; this bound is the known gap, so a change that widens it fails."""
    errors = _errors(_truth()["dense"], grouped=False)
    assert max(abs(e) for e in errors) < 0.36
    assert sum(abs(e) for e in errors) / len(errors) < 0.20


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 4, 16, 64, 128, 256]), st.sampled_from([512, 768, 2048, 4096, 7168]),
       st.sampled_from([192, 768, 1536, 2048, 4096, 7168]))
def test_more_tokens_per_expert_never_slower_per_token(groups, k, n):
    """For a fixed set of experts, the time per routed token never grows with the tokens each
    expert receives (32 to 32768): a group's fills and drains and its weights are paid once
    however many rows stream through, so efficiency follows tokens per expert."""
    chip = _kernel_chip()
    ms = [2**i for i in range(5, 16)]
    per_token = _seconds([_gemm(groups, m, k, n) for m in ms], chip) / ms
    assert all(b <= a * (1 + 1e-12) for a, b in zip(per_token, per_token[1:]))


@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048), (7168, 4096)])
def test_many_tokens_per_expert_reach_the_dense_gemm(k, n):
    """With many tokens per expert a grouped GEMM runs at the rate of one dense GEMM of the same
    rows (same weights per group, so compare per group): the per-group fills vanish against the
    stream, within 1% at 65536 rows a group."""
    chip = _kernel_chip()
    m = 65536
    grouped, dense = _seconds([_gemm(8, m, k, n), _gemm(1, m, k, n)], chip)
    assert grouped / 8 == pytest.approx(dense, rel=0.01)
    small, = _seconds([_gemm(8, 64, k, n)], chip)
    assert small / (8 * 64) > 1.2 * grouped / (8 * m)  # and at 64 tokens each, slower per token


@pytest.fixture
def _graph_cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "grouped-cache"))


@pytest.mark.parametrize("e", [2, 4])
def test_an_ep_ranks_grouped_gemms_are_those_of_fewer_experts(_graph_cache, e):
    """Oracle: an EP-e rank's grouped GEMMs (`expert_parallel_op` on the EP-1 trace) are exactly the
    ones the tracer records for the same tokens routed over E/e experts with the same top-k (each
    then receives e times the token slots): shapes, FLOPs and bytes, forward and backward."""
    from phaze_opt.design.parallel import expert_capacity_of, expert_parallel_op
    from phaze_opt.workload.graphs import build_layer_graph
    from phaze_opt.workload.models import load_model

    model = load_model("mixtral-8x7b")
    full = build_layer_graph(model, 8, 1, seq=256)
    fewer = build_layer_graph(dataclasses.replace(model, experts=model.experts // e), 8, 1, seq=256)
    capacity = expert_capacity_of(full.op_graphs["block"]["fwd"])
    assert capacity == 256 * model.top_k // model.experts
    for pass_name in ("fwd", "bwd"):
        ours = [expert_parallel_op(op, capacity, e) for op in full.op_graphs["block"][pass_name].ops
                if op.kind == "grouped_gemm"]
        traced = [op for op in fewer.op_graphs["block"][pass_name].ops if op.kind == "grouped_gemm"]
        assert len(ours) == len(traced) > 0
        for a, b in zip(ours, traced):
            assert a.gemm == b.gemm and a.flops == b.flops
            assert a.bytes_read == pytest.approx(b.bytes_read) and a.bytes_written == pytest.approx(b.bytes_written)


def test_an_ep_width_that_does_not_divide_the_experts_is_refused():
    from phaze_opt.design.parallel import expert_parallel_op

    with pytest.raises(ValueError, match="does not divide"):
        expert_parallel_op(_gemm(6, 64, 128, 256), 64, 4)
    with pytest.raises(ValueError, match="token slots"):
        expert_parallel_op(_gemm(8, 64, 128, 256), 32, 2)


@pytest.mark.parametrize("e,share", [(1, 1.0), (2, 1.0), (4, 0.25), (8, 0.5), (2, 0.125)])
def test_a_ranks_share_of_the_slots_sets_the_rows(e, share):
    """Under MoE parallel folding a rank holds `share` of the traced slots: E/e experts of
    e x share x the slots each, FLOPs and bytes those of that shape (2-byte operands, counted
    here from the dimensions), forward and weight-gradient GEMMs alike."""
    from phaze_opt.design.parallel import expert_parallel_op

    groups, slots, hidden, width = 8, 64, 128, 256
    data = expert_parallel_op(_gemm(groups, slots, hidden, width), slots, e, share)
    rows = round(slots * e * share)
    assert data.gemm == (groups // e, rows, hidden, width)
    assert data.flops == pytest.approx(2.0 * groups // e * rows * hidden * width)
    assert data.bytes_read == pytest.approx(2.0 * groups // e * (rows * hidden + hidden * width))
    assert data.bytes_written == pytest.approx(2.0 * groups // e * rows * width)
    grad = expert_parallel_op(_gemm(groups, hidden, slots, width), slots, e, share)  # dW = X^T dY
    assert grad.gemm == (groups // e, hidden, rows, width)
    assert grad.bytes_read == pytest.approx(2.0 * groups // e * (hidden * rows + rows * width))
    assert grad.bytes_written == pytest.approx(2.0 * groups // e * hidden * width)


@pytest.mark.parametrize("groups", [1, 2, 16, 128])
def test_a_grouped_gemm_issued_per_group_pays_the_kernel_cost_per_group(groups):
    """Issued one kernel per group (TE's GroupedLinear), a grouped GEMM costs the arch's fixed cost
    per kernel once per group on top of the same kernel time; as one kernel, once; with no fixed
    cost (the bare template) the two are the same; one group is one kernel either way."""
    from phaze_opt.hardware.latency import kernels_of

    chip = load_arch("h100-sxm")
    overhead = chip.efficiency.op_overhead_s
    assert overhead > 0
    one = _gemm(groups, 512, 2048, 1536)
    per_group = dataclasses.replace(one, per_group_kernels=True)
    assert kernels_of(one) == 1 and kernels_of(per_group) == groups
    t_one, t_per = _seconds([one, per_group], chip)
    assert t_per - t_one == pytest.approx((groups - 1) * overhead, rel=1e-9, abs=1e-15)
    bare = _kernel_chip()
    assert _seconds([one], bare)[0] == pytest.approx(_seconds([per_group], bare)[0])


def test_only_the_transformer_engine_stack_issues_grouped_gemms_per_group(_graph_cache):
    """`megatron-te` marks every grouped GEMM (forward and backward) as one kernel per expert and
    nothing else; the other stacks run the traced batched GEMM; a dense model is left as it is.
    The mark enters an op's hash and plain data only when set, and survives an EP rank's reshape,
    which leaves E/e kernels (one per local expert)."""
    from phaze_opt.design.parallel import expert_capacity_of, expert_parallel_op
    from phaze_opt.hardware.latency import kernels_of
    from phaze_opt.training import Training
    from phaze_opt.workload.ops import layer_graph_from_json, layer_graph_to_json, per_group_kernel_graph
    from phaze_opt.workload.stack import recipe_graph

    def marks(graph):
        ops = [op for passes in graph.op_graphs.values() for og in passes.values() for op in og.ops]
        return {(op.kind == "grouped_gemm", op.per_group_kernels) for op in ops}

    te = recipe_graph("mixtral-8x7b", 8, Training(stack="megatron-te"))
    assert te is recipe_graph("mixtral-8x7b", 8, Training(stack="megatron-te"))  # memoised in its form
    assert marks(te) == {(True, True), (False, False)}
    for stack in ("eager", "megatron-lm", "torch-compile"):
        assert (True, True) not in marks(recipe_graph("mixtral-8x7b", 8, Training(stack=stack)))
    dense = recipe_graph("llama3-8b", 8, Training(stack="megatron-te"))
    assert per_group_kernel_graph(dense) is dense
    op = next(op for op in te.op_graphs["block"]["fwd"].ops if op.kind == "grouped_gemm")
    assert op.cost_fields()["per_group_kernels"] is True
    assert "per_group_kernels" not in dataclasses.replace(op, per_group_kernels=False).cost_fields()
    assert layer_graph_from_json(json.loads(json.dumps(layer_graph_to_json(te)))) == te
    capacity = expert_capacity_of(te.op_graphs["block"]["fwd"])
    assert kernels_of(expert_parallel_op(op, capacity, 2)) == op.gemm[0] // 2
    assert kernels_of(expert_parallel_op(op, capacity, op.gemm[0])) == 1


def test_the_all_to_all_dispatcher_sorts_what_an_ep_rank_receives(_graph_cache):
    """Megatron-Core's all-to-all dispatcher sorts the received tokens by local expert and back
    (two copies of the rank's slots x hidden each pass); DeepEP's does not. So at EP e > 1 the
    experts' pass under `alltoall` is the `deepep` one plus exactly those two copies' time, and at
    EP 1, or with one expert per rank, the two are the same."""
    from phaze_opt.design.parallel import chunk_sorts, expert_capacity_of, expert_pass_s
    from phaze_opt.training import Training
    from phaze_opt.workload.models import load_model
    from phaze_opt.workload.stack import recipe_graph

    model = load_model("mixtral-8x7b")
    chip = load_arch("h100-sxm")
    graph = recipe_graph(model, 8, Training(stack="megatron-te"))
    for pass_name in ("fwd", "bwd"):
        og = graph.op_graphs["block"][pass_name]
        capacity = expert_capacity_of(graph.op_graphs["block"]["fwd"])
        for e in (1, 2, 4, 8):
            plain = expert_pass_s(og, capacity, e, [chip], None)[0]
            sorted_ = expert_pass_s(og, capacity, e, [chip], None, sort_width=model.hidden)[0]
            local = model.experts // e
            if e == 1 or local == 1:
                assert sorted_ == plain
                continue
            sorts = chunk_sorts(local * capacity * e, model.hidden, 2)
            assert [op.bytes_read for op in sorts] == [2.0 * local * capacity * e * model.hidden] * 2
            assert sorted_ - plain == pytest.approx(_seconds(sorts, chip).sum(), rel=1e-12)
            assert sorted_ > plain
