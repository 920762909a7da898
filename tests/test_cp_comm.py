"""All-gather context parallelism (`Training.cp_comm`): K and V gathered over the CP group before the
attention and dK, dV reduce-scattered after it, exposed (Megatron-Core `--cp-comm-type all_gather`,
Llama 3's CP), against the default ring: by hand, in the scalar evaluator against the placement DP's
vectorised costs, in the DP against brute force, and as a recipe, CLI and suite field."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.expert import effective_costs_at, optimal_placement
from phaze_opt.solve.placement.kernel import layer_terms
from phaze_opt.solve.placement.types import Placement, PlacementProblem
from phaze_opt.training import CP_COMMS, Training

from test_expert_parallel import assert_dp_is_brute, hand_system, moe_problem, one_layer


def with_cp_comm(problem: PlacementProblem, cp_comm: str) -> PlacementProblem:
    return replace(problem, training=replace(problem.training, cp_comm=cp_comm))


def layer_by_layer(problem, tp, d, e, c):
    """Every layer its own stage: the evaluator's per-layer terms, one StageResult each."""
    return evaluate_placement(problem, Placement(tp, d, tuple((u,) for u in range(problem.n_layers)), e, c))


# --- (1) CP width 1 -----------------------------------------------------------------------------------

def test_at_cp_width_one_all_gather_changes_nothing_in_a_whole_evaluation():
    from phaze_opt.design.evaluate import evaluate
    from phaze_opt.hardware.arch import load_arch

    def result(recipe):
        out = evaluate("gpt2-xl", load_arch("tpuv4"), recipe, "default").to_json()
        out.pop("timings")  # wall-clock seconds; the second call reuses the first one's layer costs
        return out

    for placement in ("optimal", "tp=1,pp=4,dp=4"):
        ring = result(Training(1, "selective", placement))
        assert ring["feasible"] and ring == result(Training(1, "selective", placement, cp_comm="all_gather"))


@pytest.mark.parametrize("seed", range(4))
def test_at_cp_width_one_all_gather_changes_no_placement(seed):
    """With CP 2 on offer, every placement at c = 1 evaluates to the digit the same, and the DP's
    effective costs at c = 1 are the same arrays."""
    ring = moe_problem(seed, n=3, ep=(1, 2), cp=(1, 2), hbm=1e9, accelerators=16)
    gathered = with_cp_comm(ring, "all_gather")
    for lc in ring.costs:
        for e in (1, 2):
            a, b = layer_by_layer(ring, lc.tp, 4, e, 1), layer_by_layer(gathered, lc.tp, 4, e, 1)
            assert a == b
            (x,), (y,) = effective_costs_at(ring, lc, 1, (e,)), effective_costs_at(gathered, lc, 1, (e,))
            for name in ("fwd_s", "bwd_s", "activation_bytes", "full_work_bytes", "selective_work_bytes",
                         "gathered_kv_bytes"):
                assert np.array_equal(getattr(x, name), getattr(y, name)), name


# --- (2) by hand --------------------------------------------------------------------------------------

def test_all_gather_exposes_every_kv_hop_by_hand():
    """One attention layer at CP 4 on one node (intra link 100 B/s, 0.01 s): forward hop 0.01 + 20 /
    100 = 0.21 s, under the ring wholly hidden by a 0.3 s block core; backward hop 0.41 s, 0.16 s of
    it exposed past a 0.25 s core. All-gather pays every hop: 3 x 0.21 more forward, 3 x 0.25 more
    backward (the hidden parts), and holds the 3 gathered K/V blocks (3 x 20 bytes) on the working set."""
    s = hand_system(dpn=4, batch=4)
    dense = dict(expert_params=[0.0], dispatch_bytes=[0.0], expert_fwd_s=[0.0], expert_bwd_s=[0.0])
    base = one_layer(**dense)
    quarter = one_layer(**dense, fwd_s=[0.6], bwd_s=[1.1], activation_bytes=[50.0], selective_bytes=[40.0],
                        selective_work_bytes=[10.0], kv_bytes=[20.0], core_fwd_s=[0.3], core_bwd_s=[0.25], cp=4)
    c, kv = 4, 20.0
    link = s.cp_link(1, c)
    assert link is s.intra_node
    hop_f, hop_b = link.latency + kv / link.bandwidth, link.latency + 2 * kv / link.bandwidth
    assert hop_f < 0.3 and hop_b > 0.25  # hidden forward, partly exposed backward under the ring
    for mode in ("none", "selective", "full"):
        prob = PlacementProblem(training=Training(recompute=mode), costs=(base,), system=s, hbm_bytes=1e12,
                                peak_flops=1.0, seq_len=8, cp_widths=(1, c), cp_costs=(quarter,))
        place = Placement(1, 1, ((0,),), cp=c)
        ring = evaluate_placement(prob, place)
        gathered = evaluate_placement(with_cp_comm(prob, "all_gather"), place)
        assert ring.feasible and gathered.feasible
        ring_f = 0.6 + (c - 1) * 0.3 + (c - 1) * max(0.0, hop_f - 0.3)
        ring_b = 1.1 + (c - 1) * 0.25 + (c - 1) * max(0.0, hop_b - 0.25)
        assert ring.stages[0].compute_s == pytest.approx(ring_f + ring_b, rel=1e-12)
        assert gathered.stages[0].compute_s == pytest.approx(0.6 + (c - 1) * (0.3 + hop_f) + 1.1
                                                             + (c - 1) * (0.25 + hop_b), rel=1e-12)
        # the closed form of the difference: (c - 1) x (hop - the part the ring hid), each way
        hidden = min(hop_f, 0.3) + min(hop_b, 0.25)
        diff = gathered.stages[0].compute_s - ring.stages[0].compute_s
        assert diff == pytest.approx((c - 1) * hidden, rel=1e-12)
        # full recompute reruns the layer's forward, its gathers included (the evaluator's fwd term)
        rerun = (c - 1) * min(hop_f, 0.3) if mode == "full" else 0.0
        assert gathered.stages[0].recompute_s - ring.stages[0].recompute_s == pytest.approx(rerun, rel=1e-12, abs=1e-15)
        m = ring.microbatches
        assert gathered.time_per_batch_s - ring.time_per_batch_s == pytest.approx(m * (diff + rerun), rel=1e-12)
        split_r, split_g = ring.stages[0].memory_split, gathered.stages[0].memory_split
        assert split_g["recompute_working_set"] - split_r["recompute_working_set"] == (c - 1) * kv
        assert split_g["activations"] == split_r["activations"]  # nothing kept across layers
        assert gathered.peak_memory_bytes - ring.peak_memory_bytes == (c - 1) * kv


def test_a_layer_without_kv_pays_nothing():
    s = hand_system(dpn=4, batch=4)
    dense = dict(expert_params=[0.0], dispatch_bytes=[0.0], expert_fwd_s=[0.0], expert_bwd_s=[0.0], kv_bytes=[0.0])
    half = one_layer(**dense, cp=2)
    prob = PlacementProblem(costs=(one_layer(**dense),), system=s, hbm_bytes=1e12, peak_flops=1.0, seq_len=8,
                            cp_widths=(1, 2), cp_costs=(half,))
    place = Placement(1, 2, ((0,),), cp=2)
    assert evaluate_placement(prob, place) == \
        evaluate_placement(with_cp_comm(prob, "all_gather"), place)


# --- (3) the evaluator, the vectorised costs and the DP -----------------------------------------------

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), recompute=st.sampled_from(["none", "selective", "full"]),
       modules=st.sampled_from([None, ("layernorm",)]), imbalance=st.sampled_from([1.0, 1.5]))
def test_evaluator_and_effective_costs_agree_and_all_gather_is_never_faster(seed, recompute, modules, imbalance):
    """Per layer, for both exchanges: the scalar evaluator's time and working set are the vectorised
    effective costs'; and all-gather is never faster and never lighter than the ring, placement by
    placement."""
    ring = moe_problem(seed, n=3, ep=(1, 2), cp=(1, 2, 4), hbm=1e12, accelerators=16, recompute=recompute,
                       load_imbalance=imbalance, recompute_modules=modules if recompute == "selective" else None)
    for cp_comm in CP_COMMS:
        prob = with_cp_comm(ring, cp_comm)
        for lc in prob.costs:
            for c in prob.cp_widths:
                at = prob.costs_at(lc.tp, c)
                for e, eff in zip((1, 2), effective_costs_at(prob, at, c, (1, 2))):
                    r = layer_by_layer(prob, lc.tp, 4, e, c)
                    work = layer_terms(prob, eff)[1]
                    for v, stage in enumerate(r.stages):
                        assert stage.compute_s == pytest.approx(eff.fwd_s[v] + eff.bwd_s[v], rel=1e-12, abs=1e-15)
                        assert stage.memory_split["recompute_working_set"] == work[v]
                    if cp_comm == "all_gather":
                        p2p = layer_by_layer(ring, lc.tp, 4, e, c)
                        assert r.time_per_batch_s >= p2p.time_per_batch_s * (1 - 1e-12)
                        assert r.peak_memory_bytes >= p2p.peak_memory_bytes
                        if c == 1:
                            assert r == p2p


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), recompute=st.sampled_from(["none", "selective", "full"]),
       zero=st.sampled_from([0, 1, 2]), v=st.sampled_from([1, 2]), batch=st.sampled_from([1, 2, 8]))
def test_dp_matches_brute_force_with_all_gather_cp(seed, recompute, zero, v, batch):
    """Few sequences on 16 devices, so that CP is often the best use of them (a third of the cases)."""
    problem = moe_problem(seed, n=3, ep=(1, 2), cp=(1, 2, 4), recompute=recompute, zero=zero, virtual_stages=v,
                          global_batch=batch, accelerators=16)
    assert_dp_is_brute(with_cp_comm(problem, "all_gather"))


@pytest.mark.parametrize("seed", [7, 10, 28, 31])
def test_dp_matches_brute_force_where_the_gathered_kv_decides_memory(seed):
    """HBM 1% above what the ring's best placement (at CP 2 or 4) needs: the gathered K/V blocks push
    CP placements out of memory, which the DP must see as the evaluator does."""
    ring = moe_problem(seed, n=3, ep=(1, 2), cp=(1, 2, 4), recompute="none", global_batch=1, accelerators=16, hbm=1e12)
    best = optimal_placement(ring)
    assert best.feasible and best.cp > 1
    tight = with_cp_comm(replace(ring, hbm_bytes=best.peak_memory_bytes * 1.01), "all_gather")
    assert_dp_is_brute(tight)
    roomy = optimal_placement(with_cp_comm(ring, "all_gather"))
    assert optimal_placement(tight).time_per_batch_s > roomy.time_per_batch_s  # memory did decide


# --- (4) bad values -----------------------------------------------------------------------------------

# A bad cp_comm: tests/test_expert_weights.py, with the other choice fields.


def test_recipe_lists_cp_comm_only_when_not_the_ring():
    assert "cp_comm" not in Training().recipe()
    assert Training(cp_comm=" ALL_GATHER ").recipe()["cp_comm"] == "all_gather"
    assert Training(cp_comm="all_gather").layer_key() == Training().layer_key()  # the layer traces are the same


def test_evaluate_cli_flag():
    from phaze_opt.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["evaluate", "--cp-comm", "all_gather"]).cp_comm == "all_gather"
    assert parser.parse_args(["evaluate"]).cp_comm == "p2p"
    with pytest.raises(SystemExit):
        parser.parse_args(["evaluate", "--cp-comm", "a2a"])


LLAMA_CP = {"model": "llama3-405b", "tp": 8, "pp": 16, "cp": 16, "seq": 131072, "gpus": 16384, "batch": 128,
            "microbatch": 1, "recompute": "none", "per_gpu_tflops": 380,
            "source": {"paper": "p", "table": "t", "row": "cp16"}}


def test_suite_rows_carry_cp_comm_to_the_recipe(tmp_path):
    from test_validation_modern import assert_row_field_reaches_the_recipe

    assert_row_field_reaches_the_recipe(tmp_path, LLAMA_CP, "cp_comm", "all_gather", "p2p")


@pytest.mark.parametrize("change, words", [
    ({"cp_comm": "a2a"}, "must be one of p2p, all_gather"),
    ({"cp_comm": "all_gather", "cp": 1, "gpus": 1024}, "needs cp > 1"),
])
def test_suite_rows_refuse_a_bad_cp_comm_in_one_line(tmp_path, change, words):
    from test_validation_modern import assert_row_refused_in_one_line

    assert_row_refused_in_one_line(tmp_path, {**LLAMA_CP, **change}, "cp_comm", words)


def test_shipped_suite_runs_llama3_long_context_with_all_gather_cp():
    from phaze_opt.validation.suites import load_suite

    rows = load_suite("megatron-core-h100").rows
    assert [(r.model, r.cp) for r in rows if r.training.cp_comm == "all_gather"] == [("llama3-405b", 16)]
