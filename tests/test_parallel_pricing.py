"""Context and expert parallelism priced at the chip's speed: the per-layer CP and EP terms
(design/parallel.py) come from the same split latencies as the rest of the layer, never from one
core's latency (the mistake made a Llama-2 7B block at 8192 tokens per CP rank 8-31x too slow on
an H100)."""

from __future__ import annotations

import dataclasses

import pytest

from phaze_opt.design.evaluate import layer_costs
from phaze_opt.design.parallel import attention_core_s, expert_s, with_parallel_terms
from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.latency import estimate
from phaze_opt.solve.placement.expert import effective_costs
from phaze_opt.solve.placement.types import PlacementProblem
from phaze_opt.system import load_system
from phaze_opt.training import Training
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.models import load_model

ILP_S = 5.0


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "parallel-pricing-cache"))


def _terms(model, arch, system, tp, mbs=1, attention=None):
    costs = layer_costs(model, arch, Training(mbs=mbs, attention=attention), system, tp, ILP_S).costs
    return costs, with_parallel_terms(costs, model, arch, Training(mbs, attention=attention), system)


def test_the_ring_core_is_the_core_selective_recompute_prices():
    """Two paths price one layer's attention core: layer_costs' selective recompute and the CP
    ring's per-step core. With unfused attention the core is a small part of the forward, so
    selective_s is not capped at it and the two must agree exactly."""
    model, arch, system = load_model("megatron-gpt-22b"), load_arch("a100-80gb"), load_system("dgx-a100")
    costs, lc = _terms(model, arch, system, 8, mbs=4)
    block = costs.names.index("block.0")
    assert 0 < costs.selective_s[block] < 0.25 * costs.fwd_s[block]
    assert lc.core_fwd_s[block] == pytest.approx(costs.selective_s[block], rel=1e-12)
    # the backward core: more work than the forward's, still a part of the backward
    assert lc.core_fwd_s[block] < lc.core_bwd_s[block] < lc.bwd_s[block]


def test_cp_block_runs_at_least_at_a_physical_floor():
    """Llama-2 7B at 32k tokens, flash attention, on h100-sxm: whatever the CP width, a rank's block
    (its traced s/c tokens plus c - 1 further K/V blocks of attention) computes its 1/c share of the
    full-sequence block's FLOPs at no less than 30% of the preset's dense GEMM rate (tc_fraction x
    peak), and the c ranks together never take less time than one rank's share of the dense block
    (attention work is not created or lost by the split)."""
    arch, system = load_arch("h100-sxm"), load_system("dgx-h100")
    model = dataclasses.replace(load_model("llama2-7b-32k"), seq=32768)
    floor = 0.3 * arch.efficiency.tc_fraction * arch.peak_flops
    graph = build_layer_graph(model, 1, 1, attention="flash")
    block_flops = sum(op.flops for p in ("fwd", "bwd") for op in graph.op_graphs["block"][p].ops if op.unit != "net")
    for c in (2, 4, 8):
        short = dataclasses.replace(model, seq=model.seq // c)
        costs, lc = _terms(short, arch, system, 1, attention="flash")
        lc = dataclasses.replace(lc, cp=c)
        problem = PlacementProblem(costs=(costs,), system=system, hbm_bytes=arch.hbm_bytes, peak_flops=arch.peak_flops)
        eff = effective_costs(problem, lc, 1, c)
        b = lc.names.index("block.0")
        rank_s = eff.fwd_s[b] + eff.bwd_s[b]
        assert block_flops / c / rank_s >= floor, (c, block_flops / c / rank_s / 1e12)
        assert rank_s <= (costs.fwd_s[b] + costs.bwd_s[b]) * c * c  # a loose ceiling: c blocks of s/c each


def test_ring_core_and_expert_terms_use_split_latencies():
    """With_parallel_terms' numbers are the split-latency sums of their ops (and far below the
    single-core sums on a many-core chip)."""
    model, arch, system = load_model("mixtral-8x7b"), load_arch("h100-sxm"), load_system("dgx-h100")
    costs, lc = _terms(model, arch, system, 4)
    graph = build_layer_graph(model, 4, 1)
    b = lc.names.index("block.0")
    for p, core, expert in (("fwd", lc.core_fwd_s, lc.expert_fwd_s), ("bwd", lc.core_bwd_s, lc.expert_bwd_s)):
        op_graph = graph.op_graphs["block"][p]
        lat = estimate(op_graph, [arch], interconnect=system.tp_link(4))
        assert core[b] == pytest.approx(attention_core_s(op_graph, lat.split[0], p == "fwd"), rel=1e-12)
        assert expert[b] == pytest.approx(expert_s(op_graph, lat.split[0]), rel=1e-12)
        assert 0 < expert[b] < 0.9 * (costs.fwd_s[b] if p == "fwd" else costs.bwd_s[b])
        assert expert_s(op_graph, lat.single[0]) > 10 * expert[b]  # what one core's latency made of it


def test_tp_comm_overlap_hides_the_sp_collectives_under_the_rest_of_the_pass():
    """`--tp-comm-overlap` (Training.tp_comm_overlap): each pass of T seconds with SP collectives of
    C seconds takes max(T - C + x C, C), x the share the userbuffers plan leaves exposed per pass;
    without SP (all-reduces) or at TP 1 nothing changes."""
    from phaze_opt.design.evaluate import UB_EXPOSED, overlapped_pass_s, sp_collective_s
    from phaze_opt.workload.graphs import sequence_parallel_graph

    assert overlapped_pass_s(10.0, 3.0) == 7.0 and overlapped_pass_s(10.0, 6.0) == 6.0
    assert overlapped_pass_s(2.0, 3.0) == 2.0  # a lower bound below C stays a lower bound
    assert overlapped_pass_s(10.0, 3.0, 0.25) == 7.75 and overlapped_pass_s(10.0, 6.0, 0.5) == 7.0
    assert overlapped_pass_s(10.0, 3.0, 1.0) == 10.0  # nothing hidden: the pass as it was, never slower
    model, arch, system = load_model("llama3-8b"), load_arch("h100-sxm"), load_system("dgx-h100")
    plain = layer_costs(model, arch, Training(mbs=1, sequence_parallel=True), system, 4, ILP_S).costs
    hidden = layer_costs(model, arch, Training(mbs=1, sequence_parallel=True, tp_comm_overlap=True), system, 4, ILP_S).costs
    graph = sequence_parallel_graph(build_layer_graph(model, 4, 1))
    block = [i for i, n in enumerate(plain.names) if n.startswith("block")][0]
    for name, pass_name in (("fwd_s", "fwd"), ("bwd_s", "bwd")):
        og = graph.op_graphs["block"][pass_name]
        comm = sp_collective_s(og, estimate(og, [arch], interconnect=system.tp_link(4)).single[0])
        assert comm > 0
        got, full = getattr(hidden, name)[block], getattr(plain, name)[block]
        assert got == pytest.approx(max(full - comm + UB_EXPOSED[pass_name] * comm, comm)) and got < full
    no_sp = layer_costs(model, arch, Training(mbs=1, tp_comm_overlap=True), system, 4, ILP_S).costs
    base = layer_costs(model, arch, Training(mbs=1), system, 4, ILP_S).costs
    assert list(no_sp.fwd_s) == list(base.fwd_s) and list(no_sp.bwd_s) == list(base.bwd_s)


def test_userbuffers_exposure_is_what_the_shipped_plan_leaves():
    """The exposed shares come from the H100 userbuffers plan NeMo ships (design/evaluate.py's
    comment): forward, half the SP time is a reduce-scatter pipelined in 4 chunks on 20 of 132 SMs
    (a quarter of it after the GEMM, 20/132 of its time lost to the GEMM) and half an all-gather on
    1 SM; backward, reduce-scatters on 14 SMs and all-gathers on 2, nothing after the GEMM. The
    forward costs more than the backward, and neither hides less than half."""
    from phaze_opt.design.evaluate import UB_EXPOSED

    assert UB_EXPOSED["fwd"] == pytest.approx((20 / 132 + 1 / 4 + 1 / 132) / 2)
    assert UB_EXPOSED["bwd"] == pytest.approx((14 / 132 + 2 / 132) / 2)
    assert 0 < UB_EXPOSED["bwd"] < UB_EXPOSED["fwd"] < 0.5
