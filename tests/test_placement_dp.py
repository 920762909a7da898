"""The placement DP against independent oracles.

- brute force over every placement (every TP width, stage split, stage count and data-parallel
  degree), each scored by the independent evaluator, on small chains and small DAGs;
- the general downset DP against the chain DP on chains;
- the smallest memory reported for infeasible designs against brute force;
- the DP never worse than any random valid placement, and equal to the evaluator on its own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phaze_opt.solve.placement.dp import optimal_dense_placement
from phaze_opt.solve.placement.kernel import min_memory_needed
from phaze_opt.solve.placement.evaluate import evaluate_placement, fsdp_exposed_s, ring_allreduce_s, ring_half_s
from phaze_opt.solve.placement.types import Placement, PlacementProblem
from phaze_opt.training import RecipeError, Training
from test_placement_oracle import (
    brute_force,
    brute_min_memory,
    chain_splits,
    dag_splits,
    make_costs,
    make_system,
)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
FLAVOURS = st.sampled_from(["any", "tight", "allreduce"])


@st.composite
def problems(draw, max_layers=8, max_devices=16, dag=False, flavour="any"):
    """A random small placement problem; memory ranges from roomy to too small for anything.

    flavour "tight" makes memory scarce and the network slow, so pipelines and capped in-flight
    counts come up often; "allreduce" makes the gradient all-reduce dear and layer parameters
    similar, so that the least-bottleneck split is often not the best and the DP needs several
    epsilon-constraint sweeps.
    """
    tight = flavour == "tight"
    heavy = flavour == "allreduce"
    n = draw(st.integers(3 if heavy else 1, max_layers))
    widths = sorted(draw(st.sets(st.sampled_from([1, 2] if heavy else [1, 2, 4, 8]), min_size=1, max_size=3)))
    edges = None
    if dag:
        edges = set()
        for v in range(1, n):
            edges.add((draw(st.integers(0, v - 1)), v))
            for u in range(v):
                if draw(st.booleans()) and draw(st.booleans()):
                    edges.add((u, v))
        edges = tuple(sorted(edges))
    fwd = draw(st.lists(st.floats(0.05, 2.0), min_size=n, max_size=n))
    slow = draw(st.lists(st.floats(1.0, 3.0), min_size=n, max_size=n))
    params = draw(st.lists(st.integers(10, 40) if heavy else st.integers(0, 60), min_size=n, max_size=n))
    acts = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    boundary = draw(st.lists(st.integers(0, 30), min_size=n, max_size=n))
    inputs = draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    costs = []
    for t in widths:
        overhead = draw(st.floats(0.0, 0.3))
        costs.append(
            make_costs(
                t,
                [f / t + overhead for f in fwd],
                [f * s / t + overhead for f, s in zip(fwd, slow)],
                [math.ceil(p / t) for p in params],
                [math.ceil(a / t) for a in acts],
                boundary,
                inputs,
                edges,
            )
        )
    intra_bw = draw(st.floats(20.0, 200.0))
    inter_bw = draw(st.floats(0.5, 3.0 if tight else intra_bw))
    inter_lat = draw(st.floats(0.0, 0.05 if heavy else 1.0))
    system = make_system(
        accelerators=draw(st.integers(6, max_devices) if heavy else st.integers(1, max_devices)),
        devices_per_node=1 if heavy else draw(st.sampled_from([1, 2, 4, 8])),
        global_batch=draw(st.integers(16, 64) if heavy else st.integers(4, 64) if tight else st.integers(1, 40)),
        intra=(intra_bw, draw(st.floats(0.0, inter_lat))),
        inter=(inter_bw, inter_lat),
        optimizer=draw(st.sampled_from(["adam", "sgd"])),
        optimizer_memory=draw(st.sampled_from(["mixed_precision", "phaze"])),
    )
    state = sum(params) * system.state_bytes_per_param + 4 * sum(acts)
    share = st.floats(0.15, 0.7) if heavy else st.floats(0.03, 0.5) if tight else st.floats(0.05, 1.3)
    hbm = draw(share) * state + 1
    return PlacementProblem(training=Training(mbs=draw(st.integers(1, 4) if heavy else st.integers(1, 8)), recompute=draw(st.booleans())), costs=tuple(costs), system=system, hbm_bytes=hbm, peak_flops=1e3, seq_len=8, model_flops_per_sequence=100.0)


def assert_matches_oracle(problem, splits, force_dag=False):
    splits = list(splits)
    result = optimal_dense_placement(problem, force_dag=force_dag)
    best_time, best_placement = brute_force(problem, splits)
    if math.isinf(best_time):
        assert not result.feasible and result.reason
        assert math.isinf(result.time_per_batch_s) and result.throughput == 0.0
        need = brute_min_memory(problem, splits)
        assert result.min_memory_bytes == need
        if math.isfinite(need):
            assert need > problem.hbm_bytes
    else:
        assert result.feasible, (result.reason, best_placement)
        assert result.time_per_batch_s == pytest.approx(best_time, rel=1e-9), best_placement
        # the returned placement is what the evaluator scored
        again = evaluate_placement(problem, result.placement())
        assert again.time_per_batch_s == pytest.approx(result.time_per_batch_s, rel=1e-12)
        assert result.devices_used <= problem.system.accelerators
        assert result.peak_memory_bytes <= problem.hbm_bytes
    return result


@settings(max_examples=150, **SETTINGS)
@given(problems())
def test_chain_dp_equals_brute_force(problem):
    assert_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=150, **SETTINGS)
@given(problems(flavour="tight"))
def test_chain_dp_equals_brute_force_when_memory_is_scarce(problem):
    assert_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=120, **SETTINGS)
@given(problems(flavour="allreduce"))
def test_chain_dp_equals_brute_force_when_the_allreduce_is_dear(problem):
    assert_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=60, **SETTINGS)
@given(FLAVOURS.flatmap(lambda f: problems(max_layers=6, flavour=f)))
def test_downset_dp_on_chains_equals_brute_force(problem):
    result = assert_matches_oracle(problem, chain_splits(problem.n_layers), force_dag=True)
    assert result.method == "dp-dag"


@settings(max_examples=80, **SETTINGS)
@given(FLAVOURS.flatmap(lambda f: problems(max_layers=5, max_devices=12, dag=True, flavour=f)))
def test_dag_dp_equals_brute_force(problem):
    costs = problem.costs[0]
    assert_matches_oracle(problem, dag_splits(costs.n_layers, costs.edges))


@settings(max_examples=60, **SETTINGS)
@given(FLAVOURS.flatmap(lambda f: problems(flavour=f)), st.randoms(use_true_random=False))
def test_dp_never_worse_than_random_valid_placements(problem, rnd):
    result = optimal_dense_placement(problem)
    n = problem.n_layers
    N = problem.system.accelerators
    for _ in range(25):
        c = rnd.choice(problem.costs)
        S = rnd.randint(1, n)
        cuts = sorted(rnd.sample(range(1, n), S - 1))
        bounds = [0] + cuts + [n]
        stages = tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(S))
        d = rnd.randint(1, max(1, N))
        other = evaluate_placement(problem, Placement(c.tp, d, stages))
        if other.feasible:
            assert result.feasible
            assert result.time_per_batch_s <= other.time_per_batch_s * (1 + 1e-9)


def test_two_max_terms_the_least_bottleneck_is_not_optimal():
    """A witness that minimising the bottleneck alone would be wrong.

    With 6 replicas the gradient all-reduce over 5 GB/s (two ranks a node, each with a 2.5 GB/s
    NIC: `System.spanning_link`) is costly, and the split that
    minimises the slowest stage puts the two parameter-heavy layers together. The optimum accepts
    a slower bottleneck for a smaller largest stage.
    """
    costs = make_costs(
        1,
        fwd=[1.4, 0.3, 1.2],
        bwd=[3.8, 0.5, 3.0],
        params=[8, 17, 54],
        acts=[24, 14, 11],
        boundary=[11, 6, 7],
        inputs=[5, 6, 7],
    )
    system = make_system(accelerators=12, devices_per_node=2, global_batch=34, intra=(130, 0.2), inter=(2.5, 0.5),
                         optimizer="sgd", optimizer_memory="mixed_precision")
    problem = PlacementProblem((costs,), system, 877.0, 1e3, training=Training(mbs=1, recompute=False), seq_len=8, model_flops_per_sequence=100.0)
    result = optimal_dense_placement(problem)
    assert result.time_per_batch_s == pytest.approx(brute_force(problem, chain_splits(3))[0], rel=1e-12)
    assert (result.pp, result.dp) == (2, 6)
    same_shape = [evaluate_placement(problem, Placement(1, 6, s)) for s in chain_splits(3) if len(s) == 2]
    least_bottleneck = min((r for r in same_shape if r.feasible), key=lambda r: r.bottleneck_s)
    assert least_bottleneck.bottleneck_s < result.bottleneck_s
    assert least_bottleneck.time_per_batch_s > result.time_per_batch_s * 1.05


def test_memory_position_matters():
    """Stages nearer the front hold more microbatches in flight (1F1B); the DP must account for it.

    Two stages, m = 8 microbatches: the first stage holds 2, the last 1. With 20 bytes of HBM only
    (0)(1,2,3) fits (2 x 10 = 20 and 12), although (0,1)(2,3) would be faster and would fit if every
    stage held one microbatch.
    """
    costs = make_costs(1, fwd=[1, 1, 1, 1], bwd=[1, 1, 1, 1], params=[0, 0, 0, 0], acts=[10, 1, 1, 10],
                       boundary=[0, 0, 0, 0])
    system = make_system(accelerators=2, devices_per_node=2, global_batch=8)
    problem = PlacementProblem((costs,), system, 20.0, 1e3, training=Training(mbs=1, recompute=False))
    result = optimal_dense_placement(problem)
    assert result.feasible and (result.pp, result.dp, result.microbatches) == (2, 1, 8)
    assert [s.layers for s in result.stages] == [[0], [1, 2, 3]]
    assert [s.inflight_microbatches for s in result.stages] == [2, 1]
    assert [s.memory_bytes for s in result.stages] == [20.0, 12.0]
    balanced = evaluate_placement(problem, Placement(1, 1, ((0, 1), (2, 3))))
    assert not balanced.feasible and balanced.bottleneck_s < result.bottleneck_s


def test_infeasible_reports_the_least_memory_and_never_raises():
    costs = make_costs(1, fwd=[1, 1], bwd=[1, 1], params=[10, 10], acts=[5, 5], boundary=[1, 1])
    system = make_system(accelerators=4, global_batch=4)
    problem = PlacementProblem((costs,), system, 100.0, 1e3, training=Training(mbs=1, recompute=False))
    result = optimal_dense_placement(problem)
    assert not result.feasible
    # best: one layer per stage with d = 2, m = 2: the first stage holds 2 microbatches,
    # 10 params x 16 B + 2 x 5 = 170 bytes; one stage would need 2 x 160 + 10 = 330
    assert result.min_memory_bytes == 170.0
    assert "smallest memory any placement needs is 170 B" in result.reason and "100 B of HBM" in result.reason
    need, where = min_memory_needed(problem)
    assert need == 170.0 and (where["pp"], where["dp"]) == (2, 2)


def test_widths_wider_than_the_system_are_infeasible():
    costs = make_costs(8, fwd=[1], bwd=[1], params=[1], acts=[1], boundary=[0])
    problem = PlacementProblem((costs,), make_system(accelerators=4), 1e6, 1e3, training=Training(mbs=1, recompute=False))
    result = optimal_dense_placement(problem)
    assert not result.feasible and "exceeds the 4 accelerators" in result.reason


def test_result_fields_on_a_small_chain():
    costs = make_costs(2, fwd=[1, 2, 1, 2], bwd=[2, 4, 2, 4], params=[4, 4, 4, 4], acts=[2, 2, 2, 2],
                       boundary=[1, 1, 1, 0])
    system = make_system(accelerators=8, devices_per_node=8, global_batch=16)
    problem = PlacementProblem((costs,), system, 1e6, 10.0, training=Training(mbs=2, recompute=False), seq_len=32, model_flops_per_sequence=50.0)
    r = optimal_dense_placement(problem)
    assert r.feasible and r.tp == 2 and r.method == "dp-chain"
    assert r.microbatches == math.ceil(16 / (2 * r.dp))
    assert r.throughput == pytest.approx(16 / r.time_per_batch_s)
    assert r.tokens_per_s == pytest.approx(r.throughput * 32)
    assert r.mfu == pytest.approx(50.0 * 16 / (r.devices_used * 10.0 * r.time_per_batch_s))
    assert r.bubble_fraction == pytest.approx((r.pp - 1) / (r.microbatches + r.pp - 1))
    covered = [v for s in r.stages for v in s.layers]
    assert covered == list(range(4))
    d = r.placement_dict()
    assert set(d) >= {"tp", "pp", "dp", "microbatches", "stages"} and len(d["stages"]) == r.pp
    assert all(s["headroom_bytes"] == problem.hbm_bytes - s["memory_bytes"] for s in d["stages"])


def test_in_flight_microbatches_are_capped_by_the_microbatch_count():
    """With m = 2 microbatches no stage holds more than 2, however far from the end it sits.

    Every two-layer stage needs 2 x 16 + 2 x 10 = 52 bytes > 40, so only one layer per stage
    fits: 16 + 2 x 10 = 36 with the cap; without it the first stage would hold 4 (56 bytes).
    """
    costs = make_costs(1, fwd=[1, 1, 1, 1], bwd=[2, 2, 2, 2], params=[1, 1, 1, 1], acts=[10, 10, 10, 10],
                       boundary=[1, 1, 1, 0])
    system = make_system(accelerators=4, devices_per_node=4, global_batch=2)
    problem = PlacementProblem((costs,), system, 40.0, 1e3, training=Training(mbs=1, recompute=False))
    result = optimal_dense_placement(problem)
    assert result.feasible, result.reason
    assert (result.pp, result.dp, result.microbatches) == (4, 1, 2)
    assert [s.inflight_microbatches for s in result.stages] == [2, 2, 2, 1]
    assert [s.memory_bytes for s in result.stages] == [36.0, 36.0, 36.0, 26.0]
    assert result.time_per_batch_s == pytest.approx(brute_force(problem, chain_splits(4))[0], rel=1e-12)


def test_kmax_is_exact_where_float_division_rounds():
    """The number of in-flight microbatches that fit, against exact integer arithmetic."""
    from phaze_opt.solve.placement.kernel import most_in_flight

    big = float(2**51 + 1)
    cases = [
        (0.0, big, 3 * big - 1),  # one byte short of 3 stashes
        (0.0, big, 3 * big),
        (5.0, 0.0, 5.0),  # nothing to stash per microbatch: any number fits
        (6.0, 1.0, 5.0),  # not even one
        (7.0, 3.0, 16.0),
    ]
    base, stash, hbm = (np.array([c[i] for c in cases]) for i in range(3))
    got = [int(most_in_flight(np.array([b]), np.array([s]), h)[0]) for b, s, h in zip(base, stash, hbm)]
    expected = []
    for b, s, h in cases:
        b, s, h = int(b), int(s), int(h)
        if b > h:
            expected.append(0)
        elif s == 0:
            expected.append(1 << 30)
        else:
            expected.append(1 + (h - b) // s)
    assert got == expected
    assert expected[0] == 3 and expected[1] == 4


# --------------------------------------------------------------------------------------------
# Every recipe option (recompute mode, interleaving, ZeRO 0/1/3, overlapped reduction,
# the optimizer step) against the brute-force oracle
# --------------------------------------------------------------------------------------------


@st.composite
def recipe_problems(draw, dag=False, interleaved=False, uneven=False):
    import dataclasses

    flavour = "tight" if interleaved else draw(FLAVOURS)
    base = draw(problems(max_layers=6, max_devices=12, dag=dag, flavour=flavour))
    n = base.n_layers
    costs = []
    for c in base.costs:
        acts = c.activation_bytes
        selective = [draw(st.integers(0, int(a))) for a in acts]
        costs.append(dataclasses.replace(
            c,
            selective_bytes=selective,
            checkpoint_bytes=draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)),
            selective_work_bytes=[int(a) - s for a, s in zip(acts, selective)],
            full_work_bytes=[int(a) + draw(st.integers(0, 10)) for a in acts],
            selective_s=[f * draw(st.floats(0.0, 0.5)) for f in c.fwd_s],
            # module-level recompute (Training.recompute_modules): at most what selective keeps
            module_bytes=[draw(st.integers(0, s)) for s in selective],
            module_s=[f * draw(st.floats(0.0, 0.5)) for f in c.fwd_s],
            # decoder blocks (0: embedding, head) for every-n-th checkpointing and the op-level policy
            block_ordinal=np.cumsum(blocks := [draw(st.booleans()) for _ in range(n)]) * blocks,
            op_policy_bytes=[draw(st.integers(0, int(a) + 10)) for a in acts],
            op_policy_s=[f * draw(st.floats(0.0, 1.0)) for f in c.fwd_s],
        ))
    v = draw(st.sampled_from([2, 3] if interleaved else [1, 1, 2, 3]))
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    modules = draw(st.sampled_from([None, ("layernorm",), ("core_attn", "mlp")])) if recompute == "selective" else None
    training = dataclasses.replace(
        base.training,
        recompute=recompute,
        recompute_modules=modules,
        recompute_every=draw(st.sampled_from([1, 2, 3])) if recompute == "full" else 1,
        recompute_ops=recompute == "selective" and modules is None and draw(st.booleans()),
        virtual_stages=v,
        zero=(zero := draw(st.sampled_from([0, 1, 2, 3]))),
        # FSDP2 without resharding after forward: one gather a microbatch, the stage's weights held
        reshard_after_forward=zero != 3 or draw(st.booleans()),
        shard_group=draw(st.sampled_from([None, 1, 2])) if zero == 3 else None,  # HSDP, dividing d or not
        overlap_grad_reduce=draw(st.booleans()),
        overlap_param_gather=draw(st.booleans()),
        overlap_p2p_comm=draw(st.booleans()),  # a stage time that depends on S and m
        # Megatron-Core's uneven splits: layer counts p x v does not divide, embedding/loss counted
        account_for_embedding=uneven and draw(st.booleans()),
        account_for_loss=uneven and draw(st.booleans()),
        optimizer_state=draw(st.sampled_from([None, "fp32-adam", "bf16-moments", "bf16-adamw"])),
        precision=(precision := draw(st.sampled_from(["bf16", "fp8", "nvfp4"]))),  # low-precision weight copies in the state
        fp8_param_gather=(held := precision == "fp8" and draw(st.booleans())),  # 1-byte parameters, one copy fewer
        # FSDP's FP8 all-gather: 1-byte gathers of BF16 parameters
        fp8_all_gather=precision == "fp8" and zero >= 2 and not held and draw(st.booleans()),
        reduce_dtype=draw(st.sampled_from([None, "bf16", "fp32"])),  # FSDP's reduction format
    )
    layers = draw(st.integers(2, 13)) if uneven else 12 if interleaved else draw(st.sampled_from([n, 2 * n, 12]))
    return dataclasses.replace(
        base,
        costs=tuple(costs),
        training=training,
        hbm_bandwidth=draw(st.sampled_from([0.0, 50.0, 500.0])),
        interleave_layers=layers,
        fp8_transposed_copy=draw(st.booleans()),
    )


def assert_recipe_matches_oracle(problem, splits, force_dag=False):
    splits = list(splits)
    result = optimal_dense_placement(problem, force_dag=force_dag)
    best_time, best_placement = brute_force(problem, splits)
    if math.isinf(best_time):
        assert not result.feasible and result.reason
        # with ZeRO or interleaving the reported least memory is a lower bound
        assert result.min_memory_bytes <= brute_min_memory(problem, splits)
    else:
        assert result.feasible, (result.reason, best_placement)
        assert result.time_per_batch_s == pytest.approx(best_time, rel=1e-9), best_placement
        again = evaluate_placement(problem, result.placement())
        assert again.time_per_batch_s == pytest.approx(result.time_per_batch_s, rel=1e-12)
        assert result.peak_memory_bytes <= problem.hbm_bytes


@settings(max_examples=300, **SETTINGS)
@given(recipe_problems())
def test_chain_dp_equals_brute_force_for_every_recipe_option(problem):
    assert_recipe_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=300, **SETTINGS)
@given(recipe_problems(interleaved=True))
def test_chain_dp_equals_brute_force_interleaved(problem):
    """Scarce memory, so that interleaved pipelines (v = 2, 3; 12 layers to divide) are chosen."""
    assert_recipe_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=300, **SETTINGS)
@given(recipe_problems(interleaved=True, uneven=True))
def test_chain_dp_equals_brute_force_interleaved_uneven(problem):
    """Layer counts p x v does not divide, with and without the embedding and loss counted in the
    pipeline split: the DP's vectorised check admits exactly the pipelines the evaluator does."""
    assert_recipe_matches_oracle(problem, chain_splits(problem.n_layers))


def megatron_rank_splits(layers: int, pp: int, v: int, embedding: bool, loss: bool):
    """Every per-rank layer count Megatron-Core's pipeline split offers, enumerated from its rules
    (Megatron-Core MR 2795 lists them): each rank's count a positive multiple of v; with the embedding
    or the loss counted, the counted layers split evenly (the first/last flags are then refused);
    otherwise an even split or first/last ranks of their own counts with the middle ranks equal."""
    counted = layers + embedding + loss
    if embedding or loss:
        if counted % pp == 0 and (counted // pp) % v == 0:
            yield (counted // pp,) * pp
        return
    for first in range(v, layers + 1, v):
        for last in range(v, layers + 1, v):
            for middle in range(v, layers + 1, v):
                ranks = (first,) + (middle,) * (pp - 2) + (last,) if pp > 1 else (layers,)
                if sum(ranks) == layers and all(r % v == 0 for r in ranks):
                    yield ranks


def test_interleave_split_matches_megatron_cores_rules():
    """The closed form against an enumeration of the splits Megatron-Core accepts."""
    for layers in range(1, 40):
        for pp in range(2, 7):
            for v in range(2, 5):
                for embedding in (False, True):
                    for loss in (False, True):
                        recipe = Training(virtual_stages=v, account_for_embedding=embedding, account_for_loss=loss)
                        want = any(True for _ in megatron_rank_splits(layers, pp, v, embedding, loss))
                        assert recipe.interleave_split_ok(layers, pp) == want, (layers, pp, v, embedding, loss)
                        vec = recipe.interleave_split_ok(layers, np.array([pp, 1]))
                        assert list(vec) == [want, True]


def test_optimizer_state_layouts_set_the_state_bytes():
    """16, 12 and 8 B per parameter with a 16-bit weight and gradient; ZeRO-1 shards only the
    optimizer state; the layout that fits lets a placement the 16 B one refuses."""
    costs = make_costs(1, [1.0] * 2, [2.0] * 2, [10] * 2, [0] * 2, [0] * 2)
    system = make_system(accelerators=2, devices_per_node=2, global_batch=2)
    split = {}
    for layout, total in (("fp32-adam", 16), ("bf16-moments", 12), ("bf16-adamw", 8)):
        for zero in (0, 1):
            problem = PlacementProblem(training=Training(optimizer_state=layout, zero=zero), costs=(costs,),
                                       system=system, hbm_bytes=1e6, peak_flops=1.0)
            memory = evaluate_placement(problem, Placement(1, 2, ((0, 1),))).stages[0].memory_split
            split[layout, zero] = memory["optimizer_state"]
            if zero == 0:
                assert memory["parameters"] + memory["gradients"] + memory["optimizer_state"] == 20 * total
    assert split["fp32-adam", 0] == 20 * 12 and split["bf16-adamw", 0] == 20 * 4
    assert split["bf16-moments", 1] == 20 * 8 / 2
    tight = {layout: PlacementProblem(training=Training(optimizer_state=layout), costs=(costs,),
                                      system=make_system(accelerators=1, global_batch=1), hbm_bytes=20 * 8,
                                      peak_flops=1.0) for layout in ("fp32-adam", "bf16-adamw")}
    assert optimal_dense_placement(tight["bf16-adamw"]).feasible and not optimal_dense_placement(tight["fp32-adam"]).feasible


def test_llama3_405b_interleaves_with_the_embedding_and_loss_counted():
    """126 decoder layers (Llama 3 405B, Meta 2024 model card): PP 16 x VP 8 and PP 8 x VP 8 split
    126 + 2 = 128 counted layers evenly; without the accounting 126 is not a multiple of 8."""
    both = Training(virtual_stages=8, account_for_embedding=True, account_for_loss=True)
    plain = Training(virtual_stages=8)
    for pp in (8, 16):
        assert both.interleave_split_ok(126, pp) and not plain.interleave_split_ok(126, pp)
    assert Training(virtual_stages=2).interleave_split_ok(126, 16)  # 126 = 2 x 63: uneven first/last ranks
    assert not Training(virtual_stages=2).interleave_split_ok(126, 64)  # fewer than pp x v layers
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [1] * 4, [1] * 4, [1] * 4)
    problem = PlacementProblem(training=both, costs=(costs,), system=make_system(accelerators=16, global_batch=16),
                               hbm_bytes=1e6, peak_flops=1.0, interleave_layers=126)
    assert problem.interleaves(16, 1) == "" and problem.interleaves(8, 2) == ""
    refused = PlacementProblem(training=plain, costs=(costs,), system=make_system(accelerators=16, global_batch=16),
                               hbm_bytes=1e6, peak_flops=1.0, interleave_layers=126)
    assert "divisible by v = 8" in refused.interleaves(16, 1)


@settings(max_examples=60, **SETTINGS)
@given(recipe_problems(dag=True))
def test_dag_dp_equals_brute_force_for_every_recipe_option(problem):
    assert_recipe_matches_oracle(problem, dag_splits(problem.n_layers, problem.costs[0].edges), force_dag=True)


def test_recompute_is_charged_on_the_last_stage_too():
    costs = make_costs(1, [1.0, 1.0], [2.0, 2.0], [1, 1], [4, 4], [1, 1])
    problem = PlacementProblem(training=Training(mbs=1, recompute="full"), costs=(costs,), system=make_system(accelerators=1, global_batch=1), hbm_bytes=1e6, peak_flops=1.0)
    r = evaluate_placement(problem, Placement(1, 1, ((0, 1),)))
    assert r.stages[0].recompute_s == 2.0 and r.time_per_batch_s == 8.0
    assert optimal_dense_placement(problem).time_per_batch_s == 8.0


def test_zero_shards_state_and_interleaving_shrinks_the_bubble():
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [10] * 4, [4] * 4, [1] * 4)
    system = make_system(accelerators=8, devices_per_node=8, global_batch=8)
    plain = PlacementProblem(training=Training(mbs=1), costs=(costs,), system=system, hbm_bytes=1e6, peak_flops=1.0)
    zero1 = PlacementProblem(training=Training(mbs=1, zero=1), costs=(costs,), system=system, hbm_bytes=1e6, peak_flops=1.0)
    zero3 = PlacementProblem(training=Training(mbs=1, zero=3), costs=(costs,), system=system, hbm_bytes=1e6, peak_flops=1.0)
    pl = Placement(1, 4, ((0, 1), (2, 3)))
    split = {p.training.zero: evaluate_placement(p, pl).stages[0].memory_split for p in (plain, zero1, zero3)}
    assert split[0]["optimizer_state"] == 20 * 12 and split[1]["optimizer_state"] == 60
    assert split[3]["parameters"] == 10 and split[1]["parameters"] == 40
    inter = PlacementProblem(training=Training(mbs=1, virtual_stages=2), costs=(costs,), system=system, hbm_bytes=1e6, peak_flops=1.0)
    a, b = evaluate_placement(plain, Placement(1, 1, ((0, 1), (2, 3)))), evaluate_placement(inter, Placement(1, 1, ((0, 1), (2, 3))))
    assert b.bubble_fraction < a.bubble_fraction and b.feasible


def test_zero2_memory_lies_between_zero1_and_zero3_and_it_reduces_every_microbatch():
    """ZeRO-2 shards the gradients as well as the optimizer state and keeps the weights whole
    (Rajbhandari et al., SC'20, Sec. 5.2). Four equal layers, 20 parameters a stage, d = 4 with 16 B
    of mixed-precision state (2 + 2 + 12): ZeRO-1 holds 20 x 4 + 240 / 4 = 140 B, ZeRO-2
    20 x 2 + 40 / 4 + 60 = 110 B, ZeRO-3 320 / 4 = 80 B plus the 20 B of its gathered layer. With
    m = 2 microbatches and no overlap ZeRO-2 reduce-scatters the stage's gradients after every
    microbatch (m + S - 1 = 3 times per batch) where ZeRO-1 does once, and both all-gather the
    weights once: the iteration is longer by exactly (m + S - 2) reduce-scatters. Fails if the
    gradients are not divided by d, or if the reduce-scatter runs once per batch."""
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [10] * 4, [0] * 4, [1] * 4)
    system = make_system(accelerators=8, devices_per_node=8, global_batch=8)
    pl = Placement(1, 4, ((0, 1), (2, 3)))

    def run(zero, **recipe):
        problem = PlacementProblem(training=Training(mbs=1, zero=zero, **recipe), costs=(costs,), system=system,
                                   hbm_bytes=1e6, peak_flops=1.0)
        return evaluate_placement(problem, pl)

    r1, r2, r3 = run(1), run(2), run(3)
    assert r2.microbatches == 2 and r2.feasible
    assert [r.peak_memory_bytes for r in (r1, r2, r3)] == [140, 110, 100]
    split = r2.stages[0].memory_split
    assert (split["parameters"], split["gradients"], split["optimizer_state"]) == (40, 10, 60)
    ring = system.dp_ring_link(1, 2, 4)
    scatter = ring_half_s(20 * 2, 4, ring.bandwidth, ring.latency)
    assert r2.time_per_batch_s > r1.time_per_batch_s
    assert r2.time_per_batch_s == pytest.approx(r1.time_per_batch_s + (2 + 2 - 2) * scatter, rel=1e-12)
    assert r2.stages[0].allreduce_s == pytest.approx(scatter)  # the tail keeps only the weights' gather
    # overlapped: each reduce-scatter (1.8 s) hides under its microbatch's 4 s backward; the gather
    # after the optimizer step has nothing beside it, unless it runs under the next forward
    assert run(2, overlap_grad_reduce=True).stages[0].time_s == r1.stages[0].time_s
    assert run(2, overlap_grad_reduce=True).allreduce_s == pytest.approx(scatter)
    assert run(2, overlap_grad_reduce=True, overlap_param_gather=True).allreduce_s == 0.0
    problem2 = PlacementProblem(training=Training(mbs=1, zero=2), costs=(costs,), system=system, hbm_bytes=110,
                                peak_flops=1.0)
    problem1 = PlacementProblem(training=Training(mbs=1, zero=1), costs=(costs,), system=system, hbm_bytes=110,
                                peak_flops=1.0)
    assert optimal_dense_placement(problem2).feasible and not evaluate_placement(problem1, pl).feasible


def test_zero3_gathers_every_microbatch_and_reshard_after_forward_trades_a_gather_for_memory():
    """ZeRO-3 under gradient accumulation: each microbatch all-gathers every layer's weights before
    its forward and (resharded after forward) again before its backward, so a batch of more
    microbatches pays proportionally more gather time; only the first layer's gather of a pass and
    the part of each later one longer than the layer before it are exposed (FSDP's prefetch).
    Four layers of 10 parameters, d = 4 on a slow ring so each gather (about 19 s) outlasts a
    layer's compute (1 s forward, 2 s backward). Holding the gathered weights (reshard_after_forward
    off) drops the backward gathers and adds the stage's 20 gathered parameters x 2 B to its memory.
    Fails if the gathers are priced once per batch, if the backward gathers stay, or if the held
    weights are not counted."""
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [10] * 4, [0] * 4, [1] * 4)
    pl = Placement(1, 4, ((0, 1), (2, 3)))

    def run(batch, zero=3, **recipe):
        system = make_system(accelerators=8, devices_per_node=8, global_batch=batch, intra=(1.0, 0.5))
        problem = PlacementProblem(training=Training(mbs=1, zero=zero, **recipe), costs=(costs,), system=system,
                                   hbm_bytes=1e6, peak_flops=1.0)
        return evaluate_placement(problem, pl), system.dp_ring_link(1, 2, 4)

    (few, ring), (many, _) = run(8), run(32)
    p2p = run(8, zero=1)[0].stages[0].comm_s  # the pipeline messages alone
    assert (few.microbatches, many.microbatches) == (2, 8)
    gather = ring_half_s(10 * 2, 4, ring.bandwidth, ring.latency)
    scatter = ring_half_s(20 * 2, 4, ring.bandwidth, ring.latency)
    assert gather > 2.0  # longer than a layer's backward: the prefetch cannot hide it
    # per microbatch: forward g + (g - 1); backward g + (g - 2); the reduce-scatter after the backward
    per_mb = (2 * gather - 1.0) + (2 * gather - 2.0) + scatter
    assert few.stages[0].comm_s - p2p == pytest.approx(per_mb, rel=1e-12)
    assert few.bottleneck_s == pytest.approx(6.0 + p2p + per_mb, rel=1e-12)
    # six more microbatches, six more stage times, each with its gathers and reduce-scatter
    assert many.time_per_batch_s - few.time_per_batch_s == pytest.approx(6 * few.bottleneck_s, rel=1e-9)
    # overlapped, the reduce-scatter shares the link with the backward's two gathers: the backward
    # pass takes max(compute 4 + exposed gathers 2g - 2, gathers 2g + scatter), not max(..., scatter)
    overlapped, _ = run(8, overlap_grad_reduce=True)
    assert scatter > 2.0
    assert overlapped.stages[0].comm_s - p2p == pytest.approx((2 * gather - 1.0) + (2 * gather - 2.0) + (scatter - 2.0),
                                                              rel=1e-12)
    held, _ = run(8, reshard_after_forward=False)
    assert held.stages[0].comm_s - p2p == pytest.approx((2 * gather - 1.0) + scatter, rel=1e-12)
    assert held.peak_memory_bytes - few.peak_memory_bytes == 20 * 2 - 10 * 2  # held stage less one layer's working set
    assert held.stages[0].memory_split["gathered_weights"] == 40


def test_fp32_reduction_doubles_the_bytes_of_every_gradient_collective():
    """FSDP mixed precision (`reduce_dtype` fp32) on BF16 gradients: ZeRO-0's all-reduce and ZeRO-3's
    per-microbatch reduce-scatter move 4 B per parameter instead of 2, on a ring whose latency is 0
    so the time is the bytes over the bandwidth; the gradients' memory is unchanged. Fails if a
    collective keeps the gradient's width or if the memory grows."""
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [10] * 4, [0] * 4, [1] * 4)
    system = make_system(accelerators=8, devices_per_node=8, global_batch=8, intra=(1.0, 0.0))
    pl = Placement(1, 4, ((0, 1), (2, 3)))

    def run(zero, reduce_dtype=None):
        problem = PlacementProblem(training=Training(mbs=1, zero=zero, reduce_dtype=reduce_dtype), costs=(costs,),
                                   system=system, hbm_bytes=1e6, peak_flops=1.0)
        return evaluate_placement(problem, pl)

    assert run(0, "fp32").allreduce_s == pytest.approx(2 * run(0).allreduce_s, rel=1e-12)
    assert run(0, "bf16").allreduce_s == pytest.approx(run(0).allreduce_s, rel=1e-12)
    gathers = run(3).stages[0].comm_s - ring_half_s(20 * 2, 4, 1.0, 0.0)  # all but the reduce-scatter
    assert run(3, "fp32").stages[0].comm_s == pytest.approx(gathers + ring_half_s(20 * 4, 4, 1.0, 0.0), rel=1e-12)
    assert run(3, "fp32").peak_memory_bytes == run(3).peak_memory_bytes


def test_hsdp_shards_within_its_group_on_the_node_link_and_all_reduces_across_groups():
    """Hybrid sharding (HSDP) at d = 8 on nodes of 4: ZeRO-3 over all 8 shards the 40 parameters'
    16 B of state 8 ways and gathers over the inter-node ring; a shard group of 4 shards them 4 ways
    (memory between ZeRO-0 and ZeRO-3), gathers and reduce-scatters on the intra-node ring, and
    all-reduces its gradient shard across the 2 replicas once per batch. Fails if HSDP divides by
    the wrong count, keeps the inter-node link for the group or drops the cross-replica all-reduce."""
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [10] * 4, [0] * 4, [1] * 4)
    system = make_system(accelerators=8, devices_per_node=4, global_batch=8, intra=(100.0, 0.5), inter=(1.0, 0.5))
    pl = Placement(1, 8, ((0, 1, 2, 3),))

    def run(zero, **recipe):
        problem = PlacementProblem(training=Training(mbs=1, zero=zero, **recipe), costs=(costs,), system=system,
                                   hbm_bytes=1e6, peak_flops=1.0)
        return evaluate_placement(problem, pl)

    plain, full, hsdp = run(0), run(3), run(3, shard_group=4)
    assert full.peak_memory_bytes < hsdp.peak_memory_bytes < plain.peak_memory_bytes
    assert sum(hsdp.stages[0].memory_split[k] for k in ("parameters", "gradients", "optimizer_state")) == 40 * 16 / 4
    intra, inter = system.intra_node, system.inter_node
    gathers = [ring_half_s(10 * 2, 4, intra.bandwidth, intra.latency)] * 4
    exposed = (fsdp_exposed_s([1.0] * 4, gathers, reverse=False) + fsdp_exposed_s([2.0] * 4, gathers, reverse=True)
               + ring_half_s(40 * 2, 4, intra.bandwidth, intra.latency))
    assert hsdp.stages[0].comm_s == pytest.approx(exposed, rel=1e-12)
    assert hsdp.allreduce_s == pytest.approx(ring_allreduce_s(40 * 2 / 4, 2, inter.bandwidth, inter.latency), rel=1e-12)
    assert full.allreduce_s == 0.0 and hsdp.stages[0].comm_s < full.stages[0].comm_s
    odd = run(3, shard_group=3)  # 3 does not divide the 8 ranks
    assert not odd.feasible and "shard group 3 must divide the 8" in odd.reason


def test_reshard_after_forward_off_needs_zero_3():
    with pytest.raises(RecipeError, match="reshard_after_forward off needs zero 3"):
        Training(zero=2, reshard_after_forward=False)
    assert Training(zero=3, reshard_after_forward="off").reshard_after_forward is False


@settings(max_examples=200, **SETTINGS)
@given(recipe_problems(), st.sampled_from([None, ("layernorm",), ("core_attn", "mlp")]))
def test_module_recompute_least_memory_is_the_brute_forces(problem, modules):
    """Module-level selective recompute without ZeRO or interleaving: the DP's least memory of an
    infeasible problem is exactly the oracle's, so its kept bytes and its working set (the
    rebuilt `module_bytes`) are the evaluator's."""
    import dataclasses

    training = dataclasses.replace(problem.training, recompute="selective", recompute_modules=modules, zero=0,
                                   recompute_every=1, recompute_ops=False, reshard_after_forward=True, shard_group=None,
                                   fp8_all_gather=False,
                                   virtual_stages=1, overlap_grad_reduce=False, overlap_param_gather=False)
    assert_matches_oracle(dataclasses.replace(problem, training=training), chain_splits(problem.n_layers))


@settings(max_examples=200, **SETTINGS)
@given(recipe_problems(), st.sampled_from([("full", 2, False), ("full", 3, False), ("selective", 1, True)]))
def test_checkpoint_policy_least_memory_is_the_brute_forces(problem, policy):
    """Every n-th block checkpointed and torchtitan's op-level policy, without ZeRO or interleaving:
    the DP's least memory of an infeasible problem is exactly the oracle's (kept bytes and working
    set block by block, as the evaluator prices them)."""
    import dataclasses

    recompute, every, ops = policy
    training = dataclasses.replace(problem.training, recompute=recompute, recompute_modules=None, zero=0,
                                   recompute_every=every, recompute_ops=ops, reshard_after_forward=True, shard_group=None,
                                   fp8_all_gather=False,
                                   virtual_stages=1, overlap_grad_reduce=False, overlap_param_gather=False)
    assert_matches_oracle(dataclasses.replace(problem, training=training), chain_splits(problem.n_layers))


@settings(max_examples=200, **SETTINGS)
@given(recipe_problems(interleaved=True), st.sampled_from([0.05, 1.0, 20.0]))
def test_chain_dp_equals_brute_force_with_overlapped_p2p(problem, network):
    """Overlapped pipeline sends (`overlap_p2p_comm`): a stage time that depends on S and m, from
    messages far shorter than compute to far longer; the DP prices each S's own share."""
    import dataclasses

    system = dataclasses.replace(problem.system, inter_node=dataclasses.replace(
        problem.system.inter_node, bandwidth=problem.system.inter_node.bandwidth * network))
    problem = dataclasses.replace(problem, system=system,
                                  training=dataclasses.replace(problem.training, overlap_p2p_comm=True))
    assert_recipe_matches_oracle(problem, chain_splits(problem.n_layers))
