"""MoE parallel folding (`Training.expert_tensor_parallel`): the MoE layers on their own ETP x EP x
EDP grid over the attention layers' TP x CP x DP ranks (Liu et al. 2025, arXiv 2504.14960;
Megatron-Core `--expert-tensor-parallel-size`). The placement DP stays exact against brute force
with folded layouts; the evaluator's folded terms against hand computations; the pricing of the
experts at ETP against the layer traced at that width; and a published layout (Qwen3-235B-A22B,
TP 2 EP 32 over DP 16) that only folding makes feasible."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.evaluate import evaluate_placement, ring_allreduce_s, ring_half_s
from phaze_opt.solve.placement.expert import optimal_placement
from phaze_opt.solve.placement.types import Placement, PlacementProblem
from phaze_opt.training import Training

from test_expert_parallel import assert_dp_is_brute, hand_system, moe_problem, one_layer


def folded(problem: PlacementProblem, etp) -> PlacementProblem:
    return replace(problem, training=replace(problem.training, expert_tensor_parallel=etp))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), etp=st.sampled_from([1, 2, 4]), zero=st.sampled_from([0, 1, 2, 3]),
       recompute=st.sampled_from(["none", "full"]), overlap=st.booleans(), imbalance=st.sampled_from([1.0, 1.5]),
       hbm_bw=st.sampled_from([0.0, 50.0]), gather=st.booleans())
def test_folded_dp_matches_brute_force(seed, etp, zero, recompute, overlap, imbalance, hbm_bw, gather):
    """Every (t, c, e, d, split) scored by the evaluator: the DP's optimum is the brute-force one,
    with EP widths wider than the data-parallel degree (only folding admits those)."""
    problem = folded(moe_problem(seed, ep=(1, 2, 4, 8), zero=zero, recompute=recompute, overlap_grad_reduce=overlap,
                                 load_imbalance=imbalance, hbm_bandwidth=hbm_bw, overlap_param_gather=gather), etp)
    assert_dp_is_brute(problem)


def test_folded_experts_shard_their_state_over_more_ranks_than_the_dense_layers():
    """ETP 1 under TP 2, ZeRO-1: the experts' optimizer state shards over t c d / (e ETP) = 6 ranks
    while the dense layers' shards over d = 3, so the one-stage placement on 6 GPUs fits (one GPU
    per stage and replica, d = 1, does not). The DP once pruned it: its longest fitting stage
    assumed the dense layers' most replicas (N / t) for the experts too (found by the oracle above,
    seed 195, when that placement was the optimum; the brute force below scores it among the rest)."""
    problem = folded(moe_problem(195, ep=(1, 2, 4, 8), zero=1, recompute="none", hbm_bandwidth=50.0), 1)
    whole = (tuple(range(problem.costs[0].n_layers)),)
    assert evaluate_placement(problem, Placement(tp=2, dp=3, stages=whole)).feasible
    assert not evaluate_placement(problem, Placement(tp=2, dp=1, stages=whole)).feasible
    assert_dp_is_brute(problem)
    # with no EP or CP width to search the folded experts still need the expert DP (the dense DP
    # would reduce them over the dense replicas and disagree with the evaluator)
    only_tp2 = replace(problem, costs=tuple(c for c in problem.costs if c.tp == 2), ep_widths=(1,), cp_widths=(1,))
    assert only_tp2.parallel_dims
    assert_dp_is_brute(only_tp2)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), etp=st.sampled_from([1, 2]))
def test_folded_dp_matches_brute_force_interleaved(seed, etp):
    problem = folded(moe_problem(seed, n=4, ep=(1, 2, 4, 8), virtual_stages=2, global_batch=8), etp)
    assert_dp_is_brute(problem)


def test_folding_at_etp_equal_tp_without_cp_is_the_unfolded_layout():
    """ETP = t, c = 1: the EP group is the same d/e-strided set of replicas, so every number is the
    unfolded one, placement by placement and at the optimum."""
    for seed in range(6):
        problem = moe_problem(seed, widths=(2,), cp=(1,), ep=(1, 2, 4), zero=seed % 2, accelerators=16)
        same = folded(problem, 2)
        for d in (2, 4, 8):
            for e in (1, 2):
                p = Placement(2, d, ((0,), (1, 2)) if d <= 4 else ((0, 1, 2),), e, 1)
                a, b = evaluate_placement(problem, p), evaluate_placement(same, p)
                assert (a.feasible, a.time_per_batch_s, a.peak_memory_bytes, a.allreduce_s) == \
                       (b.feasible, b.time_per_batch_s, b.peak_memory_bytes, b.allreduce_s)
        a, b = optimal_placement(problem), optimal_placement(same)
        assert a.feasible == b.feasible and (not a.feasible or a.time_per_batch_s == b.time_per_batch_s)


def test_only_folding_makes_the_published_layout_feasible():
    """Qwen3-235B-A22B as the Megatron MoE model zoo runs it (TP 2, EP 32, DP 16, ETP 1), on a
    one-layer stand-in: EP 32 does not divide DP 16, so the unfolded layout is refused with that
    reason; folded, EP x ETP = 32 divides TP x DP = 32 and it runs."""
    system = hand_system(dpn=8, accelerators=32, batch=32)
    problem = PlacementProblem(costs=(one_layer(tp=2),), system=system, hbm_bytes=1e12, peak_flops=1.0, seq_len=8,
                               ep_widths=(1, 32))
    layout = Placement(2, 16, ((0,),), ep=32, cp=1)
    plain = evaluate_placement(problem, layout)
    assert not plain.feasible and "expert parallelism 32 must divide the data-parallel degree 16" in plain.reason
    fold = evaluate_placement(folded(problem, 1), layout)
    assert fold.feasible, fold.reason
    wide = evaluate_placement(folded(problem, 2), layout)  # 32 x 2 does not divide 2 x 16
    assert not wide.feasible and "(64) must divide tp x cp x dp (2 x 1 x 16 = 32)" in wide.reason


def test_folded_terms_by_hand():
    """t = 2, c = 1, d = 4, e = 4, ETP = 1 on nodes of 4: the EP group is 4 consecutive ranks (one
    node), EDP = 2 x 4 / 4 = 2 replicas of each expert shard; ZeRO-1 shards each kind over its own
    group."""
    s = hand_system(dpn=4, batch=4)
    lc = one_layer(tp=2)  # 800 parameters per device, 640 of them routed experts (already / ETP)
    prob = PlacementProblem(training=Training(zero=1, expert_tensor_parallel=1), costs=(lc,), system=s,
                            hbm_bytes=1e12, peak_flops=1.0, seq_len=8, ep_widths=(1, 4))
    r = evaluate_placement(prob, Placement(2, 4, ((0,),), ep=4, cp=1))
    assert r.feasible, r.reason
    a2a = s.alltoall_s(1000.0, 4, 1)  # stride ETP = 1: the 4 ranks share a node
    assert a2a == pytest.approx(3 * (0.01 + 250 / 100))
    assert r.stages[0].compute_s == pytest.approx(1.0 + 2.0 + 4 * a2a)
    assert r.stages[0].params == 160 + 640 / 4
    ring = s.dp_ring_link(2, 1, 4, spread=False)  # it also carries the expert groups: one NIC a member
    half = lambda n, k: ring_half_s(n, k, ring.bandwidth, ring.latency)
    # dense over d c = 4 ranks, the experts over EDP = 2: reduce-scatter of gradients + all-gather of weights
    want = half(160 * 2, 4) + half(160 * 2, 4) + half(160 * 2, 2) + half(160 * 2, 2)
    assert r.allreduce_s == pytest.approx(want)
    state = 320 * (2 + 2) + math.ceil(160 * 12 / 4) + math.ceil(160 * 12 / 2)
    assert r.stages[0].memory_bytes == state + 100
    # unfolded the same EP would need e | d and reduce the experts over d / e = 1 replica
    unfolded = evaluate_placement(replace(prob, training=Training(zero=1)), Placement(2, 4, ((0,),), ep=4, cp=1))
    assert unfolded.feasible and unfolded.allreduce_s == pytest.approx(half(320, 4) * 2)


def test_expert_replicas_differing_from_the_dense_ones_split_even_at_ep_one():
    """ETP 1 under TP 2 at e = 1: every rank holds all experts whole, replicated over t d = 8 ranks
    while the dense weights are over d = 4: two reductions (and two ZeRO-3 shards, as with EP)."""
    s = hand_system(dpn=8, batch=4)
    prob = PlacementProblem(training=Training(expert_tensor_parallel=1), costs=(one_layer(tp=2),), system=s,
                            hbm_bytes=1e12, peak_flops=1.0, seq_len=8, ep_widths=(1,))
    r = evaluate_placement(prob, Placement(2, 4, ((0,),), ep=1, cp=1))
    ring = s.dp_ring_link(2, 1, 4, spread=False)  # it also carries the expert groups: one NIC a member
    assert r.allreduce_s == pytest.approx(ring_allreduce_s(160 * 2, 4, ring.bandwidth, ring.latency)
                                          + ring_allreduce_s(640 * 2, 8, ring.bandwidth, ring.latency))
    # ZeRO-3 shards each kind over its own group: the dense weights over d = 4, the experts over 8
    z3 = evaluate_placement(folded(replace(prob, training=Training(zero=3)), 1), Placement(2, 4, ((0,),)))
    assert z3.feasible and z3.stages[0].memory_split["parameters"] == 160 * 2 / 4 + 640 * 2 / 8


def test_training_field():
    assert Training().expert_tensor_parallel is None and "expert_tensor_parallel" not in Training().recipe()
    assert Training(expert_tensor_parallel=1).recipe()["expert_tensor_parallel"] == 1
    for bad in (0, -1, 1.5, "x", True):
        with pytest.raises(PhazeError, match="expert_tensor_parallel"):
            Training(expert_tensor_parallel=bad)
    t = Training(expert_tensor_parallel=2)
    assert t.expert_fits(4, 2, 4, 16) and not t.expert_fits(4, 1, 2, 8)
    assert t.data_step(4, 1, 8) == 4 and Training().data_step(4, 1, 8) == 8
    assert int(t.expert_replicas(4, 2, 4, 16)) == 1 and int(Training().expert_replicas(4, 2, 4, 2)) == 4
    assert t.expert_stride(4, 2) == 2 and Training().expert_stride(4, 2) == 8


def test_experts_priced_at_their_own_width(monkeypatch, tmp_path):
    """Mixtral 8x7B at TP 2 on h100-sxm: ETP 2 changes nothing; ETP 1 holds every expert whole (the
    routed parameters per device double, the dense ones stay), its experts' time is the grouped
    GEMMs of the layer traced at TP 1 x 1/2 (the same FLOPs per device, wider GEMMs), and the layer's
    passes move by exactly the experts' change."""
    from phaze_opt.design.evaluate import layer_costs
    from phaze_opt.design.parallel import check_expert_tp, expert_s, with_parallel_terms
    from phaze_opt.hardware.arch import load_arch
    from phaze_opt.hardware.latency import estimate
    from phaze_opt.system import load_system
    from phaze_opt.workload.graphs import build_layer_graph, routed_expert_params
    from phaze_opt.workload.models import load_model

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    model, arch, system = load_model("mixtral-8x7b"), load_arch("h100-sxm"), load_system("dgx-h100")
    costs = layer_costs(model, arch, Training(), system, 2, 5.0).costs
    plain = with_parallel_terms(costs, model, arch, Training(), system)
    same = with_parallel_terms(costs, model, arch, Training(expert_tensor_parallel=2), system)
    for name in ("fwd_s", "bwd_s", "params", "expert_params", "expert_fwd_s", "expert_bwd_s", "dispatch_bytes"):
        assert np.array_equal(getattr(plain, name), getattr(same, name)), name
    wide = with_parallel_terms(costs, model, arch, Training(expert_tensor_parallel=1), system)
    b = costs.names.index("block.0")
    routed = routed_expert_params(model) * model.experts
    assert plain.expert_params[b] == routed // 2 and wide.expert_params[b] == routed
    assert wide.params[b] - wide.expert_params[b] == plain.params[b] - plain.expert_params[b]
    graph = build_layer_graph(model, 1, 1)
    for p, got, base, traced in (("fwd", wide.expert_fwd_s, plain.expert_fwd_s, wide.fwd_s),
                                 ("bwd", wide.expert_bwd_s, plain.expert_bwd_s, wide.bwd_s)):
        og = graph.op_graphs["block"][p]
        at1 = expert_s(og, estimate(og, [arch], interconnect=system.tp_link(1)).split[0])
        assert got[b] == pytest.approx(at1 / 2, rel=1e-12) and got[b] > 0
        assert traced[b] - getattr(costs, p + "_s")[b] == pytest.approx(got[b] - base[b], rel=1e-9, abs=1e-15)
    flops = lambda og: sum(op.flops for op in og.ops if op.kind == "grouped_gemm")
    g2 = build_layer_graph(model, 2, 1)
    assert flops(graph.op_graphs["block"]["fwd"]) == pytest.approx(2 * flops(g2.op_graphs["block"]["fwd"]), rel=1e-9)
    with pytest.raises(PhazeError, match="expert_tensor_parallel 3: not a width mixtral-8x7b's layers shard at"):
        check_expert_tp(model, Training(expert_tensor_parallel=3))


def test_evaluate_end_to_end_with_folding(monkeypatch, tmp_path, capsys):
    """A tiny 4-expert model on 4 devices at TP 2 x DP 2: EP 4 only folded (ETP 1); the optimal
    search with the recipe's ETP finds a placement the evaluator accepts, no slower than the fixed
    one; the CLI flag reaches the recipe and a bad value is one line."""
    from phaze_opt import cli
    from phaze_opt.design.evaluate import evaluate
    from phaze_opt.hardware.arch import load_arch
    from phaze_opt.workload.models import parse_model

    from test_moe_design import TINY, small_system

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    model, arch, system = parse_model(dict(TINY, seq=1024), "tiny.yaml"), load_arch("tpuv4"), small_system(4, 8)
    layout = "tp=2,pp=1,dp=2,ep=4"
    # a 2 s pass limit: the block's backward pass stays open at 10 s too (gap ~1%); what is compared
    # below (the fixed layout against the search, the CLI against the call) shares the same layer times
    plain = evaluate(model, arch, Training(1, placement=layout), system, 2.0)
    assert not plain.feasible and "expert parallelism 4 must divide the data-parallel degree 2" in plain.reason
    fold = evaluate(model, arch, Training(1, placement=layout, expert_tensor_parallel=1), system, 2.0)
    assert fold.feasible, fold.reason
    assert (fold.placement["tp"], fold.placement["dp"], fold.placement["ep"]) == (2, 2, 4)
    best = evaluate(model, arch, Training(1, expert_tensor_parallel=1), system, 2.0)
    assert best.feasible and best.time_per_batch_s <= fold.time_per_batch_s * (1 + 1e-9)
    path = tmp_path / "tiny-moe.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, seq=1024)))
    monkeypatch.setattr(cli, "COMMANDS", ("evaluate",))
    code = cli.main(["evaluate", "--model", str(path), "--arch", "tpuv4", "--devices", "4", "--global-batch", "8",
                     "--placement", layout, "--expert-tensor-parallel", "1", "--ilp-time-limit", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    got = json.loads(out)
    assert got["time_per_batch_s"] == pytest.approx(fold.time_per_batch_s) and got["expert_tensor_parallel"] == 1
    code = cli.main(["evaluate", "--model", str(path), "--expert-tensor-parallel", "0"])
    _, err = capsys.readouterr()
    assert code == 2 and "--expert-tensor-parallel: must be a positive integer" in err and err.count("\n") == 1


def test_the_sweep_bound_does_not_claim_folded_experts():
    """The level-1 bound runs on layer lower bounds traced at the attention's TP width, which the
    experts at another width may beat: for a folded MoE recipe it gives no bound (inf)."""
    from phaze_opt.design.upper_bound import placement_throughput
    from phaze_opt.workload.models import load_model

    got = placement_throughput(load_model("mixtral-8x7b"), [], 0, system=None, training=Training(expert_tensor_parallel=1),
                               hbm_bytes=1.0, peak_flops=1.0)
    assert got == math.inf


def test_only_the_all_to_all_dispatcher_pays_the_token_sorts(monkeypatch, tmp_path):
    """Mixtral 8x7B at TP 2: the `alltoall` dispatcher's experts at EP 2 and 4 (4 and 2 experts a
    rank) take `deepep`'s time plus the two token sorts of each pass (`chunk_sorts`, the rank's
    slots x hidden); at EP 8 (one expert a rank) and at EP 1 the two are the same; folded (ETP 1)
    the sorts cover the rank's share of the slots."""
    from phaze_opt.design.evaluate import layer_costs
    from phaze_opt.design.parallel import chunk_sorts, expert_capacity_of, with_parallel_terms
    from phaze_opt.hardware.arch import load_arch
    from phaze_opt.hardware.latency import estimate
    from phaze_opt.system import load_system
    from phaze_opt.workload.models import load_model
    from phaze_opt.workload.ops import OpGraph
    from phaze_opt.workload.stack import recipe_graph

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    model, arch, system = load_model("mixtral-8x7b"), load_arch("h100-sxm"), load_system("dgx-h100")
    costs = layer_costs(model, arch, Training(), system, 2, 5.0).costs
    b = costs.names.index("block.0")
    for etp, width in ((None, 2), (1, 1)):
        deepep = Training(moe_dispatcher="deepep", expert_tensor_parallel=etp)
        plain = with_parallel_terms(costs, model, arch, deepep, system)
        a2a = with_parallel_terms(costs, model, arch, Training(expert_tensor_parallel=etp), system)
        assert a2a.expert_fwd_s[b] == plain.expert_fwd_s[b] and a2a.expert_bwd_s[b] == plain.expert_bwd_s[b]
        capacity = expert_capacity_of(recipe_graph(model, width, Training()).op_graphs["block"]["fwd"])
        for (e, f_a, b_a), (_, f_p, b_p) in zip(a2a.expert_ep, plain.expert_ep):
            local = model.experts // e
            if local == 1:
                assert (f_a[b], b_a[b]) == (f_p[b], b_p[b])
                continue
            slots = local * round(capacity * e * width / 2)
            sorts = estimate(OpGraph("block", "fwd", chunk_sorts(slots, model.hidden, 2), ()), [arch]).split[0].sum()
            assert f_a[b] - f_p[b] == pytest.approx(sorts, rel=1e-9)
            assert b_a[b] - b_p[b] == pytest.approx(sorts, rel=1e-9)
