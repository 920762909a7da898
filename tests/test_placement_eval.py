"""The independent evaluator by hand, malformed placements, even splits and placement specs."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.dp import even_placement, optimal_dense_placement
from phaze_opt.solve.placement.evaluate import evaluate_placement, format_bytes, ring_allreduce_s
from phaze_opt.solve.placement.types import LayerCosts, Placement, PlacementProblem
from phaze_opt.training import Layout
from phaze_opt.training import Training
from test_placement_oracle import make_costs, make_system


def three_layer_problem(recompute=False, hbm=1e6, accelerators=16, devices_per_node=1):
    costs = make_costs(
        2,
        fwd=[1.0, 2.0, 3.0],
        bwd=[2.0, 4.0, 6.0],
        params=[10, 20, 30],
        acts=[100, 200, 300],
        boundary=[8, 16, 0],
        inputs=[4, 8, 16],
    )
    system = make_system(accelerators=accelerators, devices_per_node=devices_per_node, global_batch=24,
                         intra=(100.0, 0.5), inter=(8.0, 1.0))
    return PlacementProblem((costs,), system, hbm, training=Training(mbs=2, recompute=recompute), peak_flops=1.0, seq_len=10, model_flops_per_sequence=3.0)


def test_evaluator_by_hand_without_recompute():
    problem = three_layer_problem()
    r = evaluate_placement(problem, Placement(tp=2, dp=3, stages=((0, 1), (2,))))
    assert r.feasible and (r.tp, r.pp, r.dp, r.devices_used) == (2, 2, 3, 12)
    assert r.microbatches == 4  # ceil(24 / (2 * 3))
    first, last = r.stages
    # one device per node: every hop takes the inter-node link (8 B/s, 1 s)
    assert first.compute_s == 9.0 and first.recompute_s == 0.0
    assert first.comm_s == 1.0 + 16 / 8.0  # gradient of layer 1's output, back from stage 1
    assert last.comm_s == 1.0 + 16 / 8.0  # layer 1's output, received
    assert first.time_s == 12.0 and last.time_s == 9.0 + 3.0
    # memory: 16 bytes/param (mixed-precision Adam); first stage holds min(2, 4) microbatches
    assert first.inflight_microbatches == 2 and last.inflight_microbatches == 1
    assert first.memory_bytes == 30 * 16 + 2 * 300 and last.memory_bytes == 30 * 16 + 300
    assert first.headroom_bytes == 1e6 - first.memory_bytes
    # all-reduce over 3 replicas (12 devices > 1 per node: inter-node): 4 steps
    grad = 30 * 2
    assert first.allreduce_s == pytest.approx(4 * 1.0 + 4 / 3 * grad / 8.0)
    assert r.allreduce_s == pytest.approx(first.allreduce_s)
    assert r.bottleneck_s == 12.0 and r.pipeline_s == 12.0 * (4 + 2 - 1)
    assert r.time_per_batch_s == pytest.approx(60.0 + 4 + 4 / 3 * 60 / 8)
    assert r.throughput == pytest.approx(24 / r.time_per_batch_s)
    assert r.tokens_per_s == pytest.approx(240 / r.time_per_batch_s)
    assert r.bubble_fraction == pytest.approx(1 / 5)
    assert r.mfu == pytest.approx(3.0 * 24 / (12 * 1.0 * r.time_per_batch_s))
    assert first.ranks == [0, 1] and last.ranks == [2, 3]
    assert (first.first_layer, first.last_layer) == ("layer0", "layer1")


def test_evaluator_by_hand_with_recompute():
    problem = three_layer_problem(recompute=True)
    r = evaluate_placement(problem, Placement(tp=2, dp=3, stages=((0,), (1, 2))))
    first, last = r.stages
    # full recompute (True) on every stage, the last included (as Megatron does)
    assert first.recompute_s == 1.0 and last.recompute_s == 5.0
    assert first.time_s == 3.0 + 1.0 + (1.0 + 8 / 8.0)
    # full: each layer's input checkpointed per in-flight microbatch (layer 0's input is the
    # model's, 4 B; layer 1's is layer 0's output, 8 B; layer 2's 16 B), plus one layer's full
    # activations during its backward
    assert first.memory_bytes == 10 * 16 + 2 * 4 + 100
    assert last.memory_bytes == 50 * 16 + 1 * (8 + 16) + 300
    split = last.memory_split
    assert (split["parameters"], split["gradients"], split["optimizer_state"]) == (100, 100, 600)
    assert (split["activations"], split["recompute_working_set"]) == (24, 300)


def test_pipeline_inside_a_node_uses_the_fast_link():
    problem = three_layer_problem(devices_per_node=4)
    r = evaluate_placement(problem, Placement(tp=2, dp=1, stages=((0, 1), (2,))))  # 4 devices: one node
    assert r.stages[0].comm_s == 0.5 + 16 / 100.0
    assert r.allreduce_s == 0.0


def test_ring_allreduce_formula():
    assert ring_allreduce_s(100.0, 1, 10.0, 1.0) == 0.0
    assert ring_allreduce_s(100.0, 4, 10.0, 1.0) == pytest.approx(6 * 1.0 + 6 / 4 * 100 / 10.0)


def test_memory_over_hbm_is_infeasible_with_a_reason():
    problem = three_layer_problem(hbm=1000.0)
    r = evaluate_placement(problem, Placement(tp=2, dp=1, stages=((0, 1, 2),)))
    assert not r.feasible and math.isinf(r.time_per_batch_s) and r.throughput == 0.0
    # 60 params x 16 B + 600 B of activations = 1560 B
    assert "stage 0 needs 1.523 KiB per device, more than the 1000 B of HBM" in r.reason
    assert r.stages[0].headroom_bytes < 0  # the per-stage table is still there


def test_too_many_devices_is_infeasible_with_a_reason():
    r = evaluate_placement(three_layer_problem(accelerators=8), Placement(tp=2, dp=3, stages=((0, 1), (2,))))
    assert not r.feasible and "needs 12 accelerators (tp 2 x pp 2 x dp 3) but the system has 8" in r.reason


@pytest.mark.parametrize(
    "placement, words",
    [
        (Placement(2, 1, ((0, 1), (1, 2))), "in stages 0 and 1"),
        (Placement(2, 1, ((0,), (2,))), "in no stage"),
        (Placement(2, 1, ((2,), (0, 1))), "feeds layer 2"),
        (Placement(2, 1, ((0, 1, 5),)), "layers are 0..2"),
        (Placement(2, 1, ((0,), ())), "no layers"),
        (Placement(2, 0, ((0, 1, 2),)), "dp must be a positive integer"),
        (Placement(4, 1, ((0, 1, 2),)), "no layer costs for TP width 4"),
        (Placement(2, 1, ()), "at least one stage"),
    ],
)
def test_malformed_placements_are_one_line_errors(placement, words):
    with pytest.raises(PhazeError) as info:
        evaluate_placement(three_layer_problem(), placement)
    assert words in str(info.value) and "\n" not in str(info.value)


def gpt_like(pp_layers=12):
    """Embedding, identical decoders, a head a third of a decoder."""
    n = pp_layers + 2
    fwd = [0.01] + [1.0] * pp_layers + [0.33]
    costs = make_costs(1, fwd=fwd, bwd=[2 * f for f in fwd], params=[5] * n, acts=[1] * n, boundary=[1] * n)
    return PlacementProblem((costs,), make_system(accelerators=64), 1e9, 1.0, training=Training(mbs=1, recompute=False))


def test_even_split_by_time_matches_megatron_on_a_transformer():
    problem = gpt_like(12)
    placement = even_placement(problem, tp=1, pp=4, dp=2)
    assert (placement.tp, placement.pp, placement.dp) == (1, 4, 2)
    assert placement.stages == ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12, 13))
    # embedding with the first three decoders, the head with the last three


def test_even_split_by_layers():
    placement = even_placement(gpt_like(12), tp=1, pp=4, dp=1, balance="layers")
    assert [len(s) for s in placement.stages] == [4, 4, 3, 3]
    assert [v for s in placement.stages for v in s] == list(range(14))


def test_even_split_is_no_better_than_the_optimum():
    problem = gpt_like(12)
    best = optimal_dense_placement(problem)
    for pp in (1, 2, 3, 4, 7):
        r = evaluate_placement(problem, even_placement(problem, 1, pp, 64 // pp))
        assert r.feasible and best.time_per_batch_s <= r.time_per_batch_s * (1 + 1e-12)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp=1, pp=15, dp=1), "more than the 14 layers"),
        (dict(tp=1, pp=0, dp=1), "pp must be a positive integer"),
        (dict(tp=3, pp=2, dp=1), "no layer costs for TP width 3"),
        (dict(tp=1, pp=2, dp=1, balance="vibes"), "balance must be"),
    ],
)
def test_even_split_errors(kwargs, words):
    with pytest.raises(PhazeError, match=words):
        even_placement(gpt_like(12), **kwargs)


def test_parse_placement_spec():
    assert Layout.from_spec("tp=8,pp=16,dp=8") == Layout(8, 16, 8)
    assert Layout.from_spec(" PP=2 , tp=1,dp=4 ") == Layout(tp=1, pp=2, dp=4)
    assert Layout.from_spec("tp=2,pp=1,dp=16,ep=4,cp=2").spec() == "tp=2,pp=1,dp=16,ep=4,cp=2"
    assert Layout.from_spec(Layout(4, 8, 32, ep=8).spec()) == Layout(4, 8, 32, ep=8)
    assert Placement(2, 3, ((0,), (1, 2)), ep=3).layout == Layout(2, 2, 3, ep=3)


@pytest.mark.parametrize(
    "text, words",
    [("tp=8,pp=16", "missing dp"), ("tp=8,pp=0,dp=1", "positive integer"), ("tp=x,pp=1,dp=1", "positive integer"),
     ("tp=1,pp=1,dp=1,xp=2", "expected tp=T,pp=P,dp=D"), ("tp=1,pp=1,dp=1,ep=0", "ep must be a positive"), ("tp=1,tp=2,pp=1,dp=1", "given twice"),
     ("optimal", "expected")],
)
def test_bad_placement_specs(text, words):
    with pytest.raises(PhazeError, match=words):
        Layout.from_spec(text)


def test_layer_costs_validation():
    ok = dict(tp=1, fwd_s=[1, 1], bwd_s=[1, 1], params=[1, 1], activation_bytes=[1, 1], boundary_bytes=[1, 1],
              input_bytes=[1, 1])
    LayerCosts(**ok)
    with pytest.raises(ValueError, match="expected 2 entries"):
        LayerCosts(**{**ok, "bwd_s": [1]})
    with pytest.raises(ValueError, match="non-negative"):
        LayerCosts(**{**ok, "params": [1, -1]})
    with pytest.raises(ValueError, match="producer < consumer"):
        LayerCosts(**ok, edges=((1, 0),))
    with pytest.raises(ValueError, match="positive integer"):
        LayerCosts(**{**ok, "tp": 0})
    rounded = LayerCosts(**{**ok, "activation_bytes": [1.2, 3.0]})
    assert list(rounded.activation_bytes) == [2.0, 3.0]  # whole bytes, rounded up
    assert LayerCosts(**ok).is_chain() and not LayerCosts(**ok, edges=()).is_chain()


def test_problem_validation():
    a = make_costs(1, [1, 1], [1, 1], [1, 1], [1, 1], [1, 1])
    b = make_costs(2, [1], [1], [1], [1], [1])
    with pytest.raises(ValueError, match="different layer graph"):
        PlacementProblem((a, b), make_system(), 10.0, 1.0, training=Training(mbs=1, recompute=False))
    with pytest.raises(ValueError, match="duplicate TP widths"):
        PlacementProblem((a, a), make_system(), 10.0, 1.0, training=Training(mbs=1, recompute=False))
    problem = PlacementProblem({2: make_costs(2, [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]), 1: a}, make_system(), 10.7, 1.0, training=Training(mbs=1, recompute=False))
    assert problem.tp_widths == (1, 2) and problem.hbm_bytes == 10.0


def test_format_bytes():
    assert format_bytes(170) == "170 B"
    assert format_bytes(1536) == "1.500 KiB"
    assert format_bytes(32 * 2**30) == "32.000 GiB"


def test_result_dict_is_json_ready():
    import json

    r = optimal_dense_placement(three_layer_problem())
    text = json.dumps(r.to_dict())
    assert '"stages"' in text and json.loads(text)["tp"] == 2
    assert isinstance(r.placement_dict()["stages"][0]["layers"], list)
    assert np.isfinite(r.time_per_batch_s)


def test_layer_costs_from_a_layer_graph():
    from phaze_opt.workload.ops import Layer, LayerGraph

    layers = tuple(
        Layer(name=f"l{i}", kind="k", params=10 + i, param_bytes=2.0 * (10 + i), activation_bytes=100.0 + i,
              boundary_bytes=8.0, input_bytes=4.0 + i, fwd_flops=1e3, bwd_flops=2e3)
        for i in range(3)
    )
    graph = LayerGraph(model="m", tp=2, mbs=1, seq=16, bytes_per_element=2, layers=layers,
                       edges=((0, 1), (1, 2)), op_graphs={}, total_params=99, train_flops_per_sequence=9e3)
    costs = LayerCosts.from_layer_graph(graph, [1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert costs.tp == 2 and costs.names == ("l0", "l1", "l2") and costs.is_chain()
    assert list(costs.params) == [10, 11, 12] and list(costs.activation_bytes) == [100, 101, 102]
    assert list(costs.input_bytes) == [4, 5, 6] and list(costs.flops) == [3e3] * 3


def test_an_overlapped_reduction_makes_time_fall_as_a_backward_grows():
    """Why the sweep's level-1 bound counts an overlapped reduction as hidden
    (design/upper_bound.placement_throughput, PlacementProblem.reduction_hidden): the exposed reduction, max(0, reduction - backward),
    shrinks as a non-bottleneck stage's backward grows, so lower-bound layer times alone would not
    give a lower-bound time."""
    system = make_system(accelerators=4, devices_per_node=1, global_batch=2, intra=(100.0, 0.0), inter=(100.0, 0.0))

    def time_with(bwd0):
        costs = make_costs(1, [1.0, 5.0], [bwd0, 10.0], [1000, 1], [0, 0], [0, 0])
        problem = PlacementProblem((costs,), system, 1e9, training=Training(mbs=1, overlap_grad_reduce=True), peak_flops=1.0)
        return evaluate_placement(problem, Placement(1, 2, ((0,), (1,)))).time_per_batch_s

    assert time_with(8.0) < time_with(1.0)


def test_zero3_gathers_are_prefetched_under_the_previous_layers_compute():
    """FSDP's prefetch by hand: 3 layers in one stage, 2 replicas on a 100 B/s link without latency;
    each layer's gather is (d-1)/d x params x 2 bytes / 100 = params / 100 s. Forward: layer 0's gather
    (1 s) shows, layer 1's (3 s) under layer 0's 1 s forward shows 2 s, layer 2's (0.5 s) under layer
    1's 2 s shows nothing: 3 s. Backward, descending: layer 2's gather 0.5 s, layer 1's 3 s under
    layer 2's 3 s backward: 0, layer 0's 1 s under layer 1's 1 s: 0: 0.5 s."""
    costs = make_costs(1, [1.0, 2.0, 0.5], [2.0, 1.0, 3.0], [100, 300, 50], [0, 0, 0], [0, 0, 0])
    system = make_system(accelerators=2, devices_per_node=2, global_batch=2, intra=(100.0, 0.0), inter=(100.0, 0.0))
    problem = PlacementProblem((costs,), system, 1e9, training=Training(mbs=1, zero=3), peak_flops=1.0)
    r = evaluate_placement(problem, Placement(1, 2, ((0, 1, 2),)))
    scatter = 0.5 * 450 * 2 / 100.0  # the reduce-scatter of all gradients, exposed in full
    st = r.stages[0]
    assert st.comm_s == pytest.approx(3.0 + 0.5 + scatter)
    assert st.time_s == pytest.approx(9.5 + 3.5 + scatter)
    assert optimal_dense_placement(problem).time_per_batch_s <= r.time_per_batch_s


def test_zero3_stage_time_never_falls_as_a_backward_grows():
    """The overlapped ZeRO-3 reduce-scatter runs beside the whole backward pass: a layer whose
    backward hides under the next gather lengthens the compute but not the pass, so measuring the
    overlap window by compute alone would make the stage time fall as that backward grows (and the
    sweep's level-1 bound, on lower-bound layer times, too high); by the pass it cannot."""
    system = make_system(accelerators=2, devices_per_node=2, global_batch=2, intra=(100.0, 0.0), inter=(100.0, 0.0))

    def time_with(bwd1):
        costs = make_costs(1, [0.1, 0.1], [0.1, bwd1], [100, 100], [0, 0], [0, 0])
        problem = PlacementProblem((costs,), system, 1e9, training=Training(mbs=1, zero=3, overlap_grad_reduce=True), peak_flops=1.0)
        return evaluate_placement(problem, Placement(1, 2, ((0, 1),))).stages[0].time_s

    times = [time_with(b) for b in (0.1, 0.5, 0.9, 1.5)]
    # up to rounding of equal sums (the bounds keep a 1e-12 slack): a pass held by the link's gathers
    # and reduce-scatter is the same time whatever the compute under it
    assert all(a <= b * (1 + 1e-12) for a, b in zip(times, times[1:])), times


def test_a_model_whose_ops_cost_nothing_is_one_clear_line():
    """All costs zero (a degenerate model): infeasible with a reason, not a ZeroDivisionError."""
    costs = make_costs(1, fwd=[0.0, 0.0], bwd=[0.0, 0.0], params=[0, 0], acts=[0, 0], boundary=[0, 0], inputs=[0, 0])
    system = make_system(accelerators=1, devices_per_node=1, global_batch=4, intra=(100.0, 0.0), inter=(8.0, 0.0))
    problem = PlacementProblem((costs,), system, 1e6, peak_flops=1.0, training=Training(1, False), seq_len=10,
                               model_flops_per_sequence=0.0)
    r = evaluate_placement(problem, Placement(tp=1, dp=1, stages=((0, 1),)))
    assert not r.feasible and "take no time" in r.reason
    best = optimal_dense_placement(problem)
    assert not best.feasible and "\n" not in best.reason


def test_overlapped_param_gather_hides_under_the_stages_forward_by_hand():
    """ZeRO-1, one stage of two layers, 2 replicas on a 100 B/s link without latency, 2-byte weights
    and gradients: the reduce-scatter and the all-gather move 0.5 x 300 x 2 / 100 = 3 s each. With
    `overlap_param_gather` the gather runs under the stage's forward (1 + 0.5 s per microbatch):
    1.5 s of it exposed; the reduce-scatter stays whole. No effect without ZeRO-1."""
    costs = make_costs(1, [1.0, 0.5], [2.0, 1.0], [100, 200], [0, 0], [0, 0])
    system = make_system(accelerators=2, devices_per_node=2, global_batch=2, intra=(100.0, 0.0), inter=(100.0, 0.0))
    placement = Placement(1, 2, ((0, 1),))

    def reduce_s(**recipe):
        problem = PlacementProblem((costs,), system, 1e9, training=Training(mbs=1, **recipe), peak_flops=1.0)
        return evaluate_placement(problem, placement).stages[0].allreduce_s

    assert reduce_s(zero=1) == pytest.approx(3.0 + 3.0)
    assert reduce_s(zero=1, overlap_param_gather=True) == pytest.approx(3.0 + 1.5)
    # with the gradient reduction overlapped too: the reduce-scatter beside the 3 s backward
    assert reduce_s(zero=1, overlap_grad_reduce=True, overlap_param_gather=True) == pytest.approx(0.0 + 1.5)
    assert reduce_s(zero=0, overlap_param_gather=True) == reduce_s(zero=0)
    hidden = PlacementProblem((costs,), system, 1e9, training=Training(mbs=1, zero=1, overlap_param_gather=True),
                              peak_flops=1.0, reduction_hidden=True)
    assert evaluate_placement(hidden, placement).stages[0].allreduce_s == pytest.approx(3.0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_optimizer_pass_by_hand_under_every_zero_stage(zero):
    """The per-batch work after the last backward, written out from its causes (mixed-precision Adam:
    2 B weight, 2 B gradient, 12 B state): Adam's update reads g and the state and writes the state
    and w, the gradient norm reads g again (both over the optimizer's shard from ZeRO-1 on), and
    zeroing the gradient buffer writes g (over the gradients' shard from ZeRO-2 on)."""
    problem = dataclasses.replace(three_layer_problem(hbm=1e9), hbm_bandwidth=4.0,
                                  training=Training(mbs=2, recompute=False, zero=zero))
    r = evaluate_placement(problem, Placement(tp=2, dp=3, stages=((0, 1), (2,))))
    first = r.stages[0]
    params, d, w, g, o = 30, 3, 2, 2, 12
    update_and_norm = params * (w + g + 2 * o + g) / (d if zero else 1)
    zeroing = params * g / (d if zero >= 2 else 1)
    assert first.optimizer_step_s == pytest.approx((update_and_norm + zeroing) / 4.0, rel=1e-12)
    # the step grows with the stage's parameters, as its cause does: the 30-parameter stage pays it
    assert r.stages[1].optimizer_step_s == pytest.approx(first.optimizer_step_s, rel=1e-12)
