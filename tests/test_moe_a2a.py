"""The EP all-to-all recipe fields: the overlap of dispatch/combine with the paired microbatch's
compute (`Training.moe_a2a_overlap`) and DeepEP's once-per-node dispatch (`moe_dispatcher`), by
hand, by their bounds, and in the EP/CP placement DP against brute force."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.expert import optimal_placement
from phaze_opt.solve.placement.types import Placement, PlacementProblem
from phaze_opt.training import Training

from test_expert_parallel import assert_dp_is_brute, hand_system, moe_problem, one_layer


def overlap_problem(seed, **kw):
    recipe = {k: kw.pop(k) for k in ("moe_a2a_overlap", "moe_dispatcher") if k in kw}
    problem = moe_problem(seed, **kw)
    return replace(problem, training=replace(problem.training, **recipe))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), v=st.sampled_from([1, 2]), recompute=st.sampled_from(["none", "selective"]),
       zero=st.sampled_from([0, 1]), dispatcher=st.sampled_from(["alltoall", "deepep"]),
       top_k=st.sampled_from([1, 2, 8]), overlap_grad=st.booleans())
def test_dp_matches_brute_force_with_a2a_overlap_and_deepep(seed, v, recompute, zero, dispatcher, top_k, overlap_grad):
    problem = overlap_problem(seed, n=4, virtual_stages=v, global_batch=8, recompute=recompute, zero=zero,
                              overlap_grad_reduce=overlap_grad, top_k=top_k, moe_a2a_overlap=True,
                              moe_dispatcher=dispatcher, devices_per_node=int(np.random.default_rng(seed).choice([1, 2])))
    assert_dp_is_brute(problem)


def _layer_terms(problem, placement):
    """Per layer of a one-stage placement: (compute without the all-to-alls, the four all-to-alls)."""
    plain = replace(problem, training=replace(problem.training, moe_a2a_overlap=False))
    one = evaluate_placement(plain, Placement(placement.tp, placement.dp, tuple((u,) for u in range(problem.n_layers)),
                                              placement.ep, placement.cp))
    lc = problem.costs_at(placement.tp, placement.cp)
    out = []
    for v in range(problem.n_layers):
        moe = lc.expert_params[v] > 0 or lc.expert_fwd_s[v] > 0
        a2a = 0.0 if not moe else problem.system.alltoall_s(
            problem.training.load_imbalance * float(lc.dispatch_bytes[v]), placement.ep,
            problem.training.expert_stride(placement.tp, placement.cp), problem.training, problem.top_k)
        out.append((one.stages[v].compute_s - 4 * a2a, 4 * a2a))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_overlap_is_never_slower_and_never_beats_max_compute_comm(seed):
    """Overlap only hides: never slower than without it, each paired layer never below
    max(compute, comm) (what a perfect overlap reaches) nor above compute + comm; at PP = 1 exactly
    one microbatch (the first forward, the last backward) runs unpaired and pays back what the
    pairs hide."""
    problem = overlap_problem(seed, n=3, ep=(1, 2, 4), cp=(1,), hbm=1e12, accelerators=16, devices_per_node=2,
                              global_batch=12, moe_a2a_overlap=True)
    plain = replace(problem, training=replace(problem.training, moe_a2a_overlap=False))
    hid_any = False
    for e in (2, 4):
        p = Placement(1, 4, ((0, 1, 2),), ep=e)
        on, off = evaluate_placement(problem, p), evaluate_placement(plain, p)
        assert on.feasible and off.feasible
        assert on.time_per_batch_s <= off.time_per_batch_s * (1 + 1e-12)
        terms = _layer_terms(problem, p)
        assert on.stages[0].compute_s >= sum(max(x, c) for x, c in terms) * (1 - 1e-12)
        assert on.stages[0].compute_s <= sum(x + c for x, c in terms) * (1 + 1e-12)
        m = on.microbatches
        hidden = off.stages[0].compute_s - on.stages[0].compute_s
        assert on.time_per_batch_s == pytest.approx(off.time_per_batch_s - (m - 1) * hidden)
        hid_any = hid_any or hidden > 0
    # the checks above are not vacuous where the model has MoE layers
    assert hid_any or not np.any(problem.costs[0].expert_params > 0)


def test_overlap_phases_by_hand():
    """One layer, fwd 1 / bwd 2 s, experts 0.5 / 1 s of it, all-to-all a = 0.01 + 50 / 100 = 0.51 s:
    the four phases are max(0.5 + 1/2, a) + max(1/2, a) + max(0.5 + 1/2, a) + max(1/2, a)."""
    s = hand_system(dpn=4, batch=4)
    lc = one_layer(dispatch_bytes=[100.0])
    prob = PlacementProblem(training=Training(moe_a2a_overlap=True), costs=(lc,), system=s, hbm_bytes=1e12,
                            peak_flops=1.0, seq_len=8, ep_widths=(1, 2))
    r = evaluate_placement(prob, Placement(1, 4, ((0,),), ep=2))
    a = 0.01 + 50 / 100
    assert s.alltoall_s(100.0, 2, 1) == pytest.approx(a)
    paired = 1.0 + a + 1.0 + a
    assert r.stages[0].compute_s == pytest.approx(paired)
    assert r.microbatches == 1  # one microbatch: nothing pairs, all of it is paid back
    assert r.stages[0].unpaired_a2a_s == pytest.approx(3.0 + 4 * a - paired)
    plain = evaluate_placement(replace(prob, training=Training()), Placement(1, 4, ((0,),), ep=2))
    assert r.time_per_batch_s == pytest.approx(plain.time_per_batch_s)


def test_overlap_changes_nothing_at_ep_one_and_deepep_nothing_inside_a_node():
    problem = moe_problem(4, n=3, ep=(1, 2, 4), cp=(1,), hbm=1e12, accelerators=16, devices_per_node=4, global_batch=8)
    base = problem.training
    for e, dispatcher in ((1, "deepep"), (1, "alltoall"), (4, "deepep")):  # e = 4 at stride 1 sits in one node
        p = Placement(1, 4, ((0,), (1, 2)), ep=e)
        plain = evaluate_placement(problem, p)
        other = evaluate_placement(replace(problem, top_k=8, training=replace(base, moe_dispatcher=dispatcher,
                                                                           moe_a2a_overlap=e == 1)), p)
        assert other.time_per_batch_s == plain.time_per_batch_s
        assert [s.compute_s for s in other.stages] == [s.compute_s for s in plain.stages]


def test_deepep_sends_each_token_once_per_node_by_hand():
    s = hand_system(dpn=4)  # intra 100 B/s, 0.01 s; inter 10 B/s, 0.1 s
    deep = Training(moe_dispatcher="deepep")
    # 8 ranks at stride 1: 2 nodes of 4. k = 2: the other node holds one of a token's 2 experts with p = 3/4
    far = 1 * (0.1 + 800.0 / 2 * 0.75 / 10)
    near = 3 * 0.01 + 800.0 * 3 / 4 / 100
    assert s.alltoall_s(800.0, 8, 1, deep, 2) == pytest.approx(max(near, far))
    # inside one node, the all-to-all's number exactly, whatever k
    assert s.alltoall_s(800.0, 4, 1, deep, 8) == s.alltoall_s(800.0, 4, 1)
    # one rank per node: e nodes; k = 1 sends what the all-to-all sends (each token to one place)
    assert s.alltoall_s(800.0, 4, 4, deep, 1) == pytest.approx(s.alltoall_s(800.0, 4, 4))
    # with a fast NVLink, DeepEP never crosses more than the all-to-all (1 - (1 - 1/N)^k <= k/N)
    fast = hand_system(dpn=4)
    fast = replace(fast, intra_node=replace(fast.intra_node, bandwidth=1e12, latency=0.0))
    for e, k in ((8, 1), (8, 8), (16, 4), (32, 8)):
        assert fast.alltoall_s(800.0, e, 1, deep, k) <= fast.alltoall_s(800.0, e, 1) * (1 + 1e-12)
    assert fast.alltoall_s(800.0, 32, 1, deep, 8) < 0.7 * fast.alltoall_s(800.0, 32, 1)


def test_unpaired_microbatches_follow_megatron_warmup():
    lc = one_layer()
    prob = PlacementProblem(training=Training(moe_a2a_overlap=True, virtual_stages=2), costs=(lc,),
                            system=hand_system(batch=8), hbm_bytes=1e12, peak_flops=1.0, seq_len=8)
    assert prob.unpaired_microbatches(1, 1) == 1.0
    # p = 2, v = 2, m = 8: W = 2 (p - 1) + (v - 1) p + 1 = 5 chunks, u = (5 + p - 1) / v = 3
    assert prob.unpaired_microbatches(2, 1) == 3.0
    # m = 2 (dp 4): every chunk warms up (W capped at m v = 4), u = (4 + 1) / 2
    assert prob.unpaired_microbatches(2, 4) == 2.5


def test_overlap_needs_interleaving_when_pipelined():
    problem = overlap_problem(2, n=3, ep=(1, 2), cp=(1,), hbm=1e12, accelerators=16, devices_per_node=4,
                              global_batch=8, moe_a2a_overlap=True)
    r = evaluate_placement(problem, Placement(1, 2, ((0,), (1, 2)), ep=2))
    assert not r.feasible and "interleaving" in r.reason
    assert evaluate_placement(problem, Placement(1, 2, ((0,), (1, 2)), ep=1)).feasible  # no EP: no overlap
    assert evaluate_placement(problem, Placement(1, 2, ((0, 1, 2),), ep=2)).feasible


def test_recipe_fields_check_and_report():
    assert Training().recipe() == Training(moe_dispatcher="alltoall", moe_a2a_overlap=False).recipe()
    r = Training(moe_dispatcher="DeepEP", moe_a2a_overlap="on").recipe()
    assert r["moe_dispatcher"] == "deepep" and r["moe_a2a_overlap"] is True
    with pytest.raises(PhazeError, match="moe_dispatcher must be one of alltoall, deepep"):
        Training(moe_dispatcher="nccl")
    with pytest.raises(PhazeError, match="moe_a2a_overlap must be on/off"):
        Training(moe_a2a_overlap="maybe")
    with pytest.raises(PhazeError, match="full recompute"):
        Training(moe_a2a_overlap=True, recompute="full")
    assert not math.isnan(hash(Training(moe_a2a_overlap=True)))


@pytest.mark.parametrize("seed", [18, 72, 73, 89])
def test_dp_never_picks_a_pipelined_ep_overlap_without_interleaving(seed):
    """Problems (small HBM) where the best placement without Megatron-Core's rule would pipeline an
    overlapped EP group at v = 1: the DP must skip them as the evaluator refuses them."""
    problem = overlap_problem(seed, n=4, global_batch=8, hbm=300.0, moe_a2a_overlap=True)
    got = optimal_placement(problem)
    assert not (got.feasible and got.ep > 1 and got.pp > 1)
    assert_dp_is_brute(problem)


@pytest.mark.parametrize("seed", range(6))
def test_effective_costs_are_the_evaluators_overlapped_layer_terms(seed):
    """The EP DP's vectorised layer terms under the overlap (times and hidden all-to-all) equal the
    evaluator's layer by layer, with all-to-alls from far shorter to far longer than the compute
    phases (so every phase's max is taken both ways)."""
    from phaze_opt.solve.placement.expert import effective_costs

    base = overlap_problem(seed, n=4, ep=(1, 2, 4), cp=(1, 2), hbm=1e12, accelerators=16, moe_a2a_overlap=True,
                           load_imbalance=1.25)
    for scale in (0.001, 0.02, 0.3, 5.0):
        prob = replace(base, costs=tuple(replace(lc, dispatch_bytes=np.ceil(lc.dispatch_bytes * scale))
                                         for lc in base.costs),
                       cp_costs=tuple(replace(lc, dispatch_bytes=np.ceil(lc.dispatch_bytes * scale))
                                      for lc in base.cp_costs))
        for lc in prob.costs:
            for c in prob.cp_widths:
                at = prob.costs_at(lc.tp, c)
                for e in (2, 4):
                    eff = effective_costs(prob, at, e, c)
                    r = evaluate_placement(prob, Placement(lc.tp, 4, tuple((u,) for u in range(prob.n_layers)), e, c))
                    u = prob.unpaired_microbatches(prob.n_layers, 4)
                    for v, st_ in enumerate(r.stages):
                        assert st_.compute_s == pytest.approx(eff.fwd_s[v] + eff.bwd_s[v], rel=1e-12, abs=1e-15)
                        assert st_.unpaired_a2a_s == pytest.approx(u * eff.a2a_hidden_s[v], rel=1e-12, abs=1e-15)


# --- suite rows ---------------------------------------------------------------------------------------

def _mixtral_suite(tmp_path, **change):
    from test_validation_modern import MIXTRAL, _suite
    return _suite(tmp_path, {**MIXTRAL, **change})


def test_suite_rows_carry_the_dispatcher_and_overlap_to_the_recipe(tmp_path):
    from phaze_opt.validation.runner import row_config
    from phaze_opt.validation.suites import load_suite

    suite = load_suite(_mixtral_suite(tmp_path, moe_dispatcher="deepep", moe_a2a_overlap=True))
    (row,) = suite.rows
    t = row.training
    assert (t.moe_dispatcher, t.moe_a2a_overlap) == ("deepep", True)
    assert row_config(row, suite)["moe_dispatcher"] == "deepep" and row_config(row, suite)["moe_a2a_overlap"]
    (plain,) = load_suite(_mixtral_suite(tmp_path)).rows  # absent: today's defaults, and no report change
    assert (plain.training.moe_dispatcher, plain.training.moe_a2a_overlap) == ("alltoall", False)
    assert "moe_dispatcher" not in row_config(plain, suite) and "moe_a2a_overlap" not in row_config(plain, suite)


@pytest.mark.parametrize("change, field, words", [
    ({"moe_dispatcher": "nccl"}, "rows[0].moe_dispatcher", "must be one of alltoall, deepep"),
    ({"moe_a2a_overlap": "yes"}, "rows[0].moe_a2a_overlap", "must be true or false"),
    ({"moe_a2a_overlap": True, "ep": 1}, "rows[0].moe_a2a_overlap", "needs ep > 1"),
    ({"moe_a2a_overlap": True, "recompute": "full"}, "rows[0].moe_a2a_overlap", "cannot run with full recompute"),
])
def test_suite_rows_refuse_bad_moe_fields_in_one_line(tmp_path, change, field, words):
    from phaze_opt.validation.suites import load_suite

    path = _mixtral_suite(tmp_path, **change)
    with pytest.raises(PhazeError) as info:
        load_suite(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"field '{field}'" in message and words in message


def test_shipped_suites_set_the_published_dispatcher_and_overlap():
    from phaze_opt.validation.suites import load_suite

    zoo = [r for r in load_suite("megatron-core-h100").rows if r.model == "qwen3-235b-a22b"]
    assert len(zoo) == 8
    overlapped = [r for r in zoo if r.training.moe_a2a_overlap]
    assert [r.value for r in overlapped] == [276]  # the "+1f1b overlap" row only
    assert [r.training.moe_dispatcher for r in zoo].count("alltoall") == 1  # the intra-node "A2A" row
    nemo = {r.source.row: r for r in load_suite("nemo-fp8-h100").rows}
    q235 = [r for name, r in nemo.items() if r.model == "qwen3-235b-a22b"]
    assert q235 and all(r.training.moe_a2a_overlap and r.training.moe_dispatcher == "alltoall" for r in q235)
    assert nemo["DGX-H100, 16 GPUs, FP8, EP 16"].training.moe_dispatcher == "deepep"


def _node_share_by_enumeration(nodes, k, groups, group_topk, experts):
    """The share by brute force: every equally likely choice of the token's M groups, each of its k
    experts uniform over the chosen groups' experts; experts and groups laid out contiguously."""
    import itertools

    per_node, per_group = experts // nodes, experts // groups
    total = 0.0
    for node in range(nodes):
        mine = set(range(node * per_node, (node + 1) * per_node))
        subsets = list(itertools.combinations(range(groups), group_topk))
        for chosen in subsets:
            pool = [x for g in chosen for x in range(g * per_group, (g + 1) * per_group)]
            inside = sum(1 for x in pool if x in mine) / len(pool)
            total += (1.0 - (1.0 - inside) ** k) / len(subsets)
    return total / nodes


@pytest.mark.parametrize("nodes, groups, group_topk, k", [
    (8, 8, 4, 8), (4, 8, 4, 8), (2, 8, 3, 6), (8, 4, 2, 8), (16, 4, 1, 4), (4, 4, 4, 8), (8, 8, 1, 2)])
def test_group_limited_routing_reaches_the_nodes_enumeration_says(nodes, groups, group_topk, k):
    """DeepSeek-V3's node-limited routing (a token's experts from its best M of G groups): the
    closed form equals brute-force enumeration when a node holds whole groups or a group spans whole
    nodes; M = G is the ungrouped share; fewer groups per token never reach more nodes."""
    from phaze_opt.system import routed_node_share

    experts = 8 * nodes * groups
    got = routed_node_share(nodes, k, groups, group_topk)
    assert got == pytest.approx(_node_share_by_enumeration(nodes, k, groups, group_topk, experts), rel=1e-12)
    assert routed_node_share(nodes, k, groups, groups) == pytest.approx(1 - (1 - 1 / nodes) ** k, rel=1e-12)
    assert got <= routed_node_share(nodes, k) + 1e-12


def test_deepseek_v3_sends_fewer_copies_between_nodes_with_its_node_limited_routing():
    """The model card's n_group 8 / topk_group 4 reach the all-to-all: over 8 nodes DeepEP sends
    (1 - 0.75^8)/2 = 0.45 of the token copies to a given node instead of 1 - (7/8)^8 = 0.66; the
    plain all-to-all sends every copy to its expert's rank either way."""
    import dataclasses

    from phaze_opt.system import load_system
    from phaze_opt.workload.models import load_model, parse_model

    model = load_model("deepseek-v3")
    assert (model.router_groups, model.router_group_topk) == (8, 4)
    system = dataclasses.replace(load_system("dgx-h100"), accelerators=64)
    deepep, plain = Training(moe_dispatcher="deepep"), Training()
    grouped = system.alltoall_s(1e9, 64, 1, deepep, 8, (8, 4))
    ungrouped = system.alltoall_s(1e9, 64, 1, deepep, 8)
    assert grouped < ungrouped
    assert system.alltoall_s(1e9, 64, 1, plain, 8, (8, 4)) == system.alltoall_s(1e9, 64, 1, plain, 8)
    import yaml

    base = yaml.safe_load(open(model.source))  # the shipped file, as a user's copy would read
    base.pop("router_groups"), base.pop("router_group_topk")
    parse_model(base, "ds.yaml")  # without the fields: ungrouped routing
    for bad, words in (({"router_groups": 7, "router_group_topk": 4}, "must divide experts"),
                       ({"router_groups": 8}, "come together"),
                       ({"router_groups": 8, "router_group_topk": 9}, "must be at most router_groups")):
        with pytest.raises(PhazeError, match=words):
            parse_model({**base, **bad}, "ds.yaml")


def test_the_evaluator_routes_by_the_model_s_groups(monkeypatch, tmp_path):
    """A tiny MoE whose EP group spans two nodes, DeepEP: declaring group-limited routing (one of two
    groups per token, a group per node) leaves every token's experts on one node, so the iteration is
    shorter than with the same model routed freely; the graphs and memory are the same."""
    import dataclasses

    from phaze_opt.design.evaluate import evaluate
    from phaze_opt.hardware.arch import load_arch
    from phaze_opt.system import load_system
    from phaze_opt.workload.models import parse_model

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    tiny = dict(name="tiny-moe", family="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, seq=512,
                vocab=512, activation="swiglu", norm="rmsnorm", position="rotary", tied_embeddings=False, bias=False,
                dropout=0.0, attention="flash", experts=4, top_k=2, expert_ffn=128)
    free = parse_model(tiny, "tiny.yaml")
    limited = parse_model(dict(tiny, router_groups=2, router_group_topk=1), "tiny.yaml")
    system = dataclasses.replace(load_system("dgx-h100"), accelerators=4, devices_per_node=2, nics_per_node=2,
                                 global_batch=8)
    recipe = Training(1, placement="tp=1,pp=1,dp=4,ep=4", expert_tensor_parallel=1, moe_dispatcher="deepep")
    arch = load_arch("h100-sxm")
    a, b = (evaluate(m, arch, recipe, system, 10.0) for m in (free, limited))
    assert a.feasible and b.feasible
    assert b.time_per_batch_s < a.time_per_batch_s
    assert b.placement["peak_memory_bytes"] == a.placement["peak_memory_bytes"]
