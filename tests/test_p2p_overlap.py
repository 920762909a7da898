"""Overlapped pipeline sends and receives (`Training.overlap_p2p_comm`, Megatron-LM's default with
interleaving): by hand on a two-stage pipeline, and what the recipe field does end to end."""

from __future__ import annotations

import dataclasses

import pytest

from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.types import Placement, PlacementProblem
from phaze_opt.training import Training
from test_placement_oracle import make_costs, make_system


def _problem(seconds_per_message: float, **recipe) -> PlacementProblem:
    """Four layers of 1 s forward and 2 s backward, each sending 1 byte on a link of
    1 / seconds_per_message bytes/s with no latency; 2 devices, one per node, 4 microbatches."""
    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [0] * 4, [0] * 4, [1] * 4)
    system = make_system(accelerators=2, devices_per_node=1, global_batch=4,
                         intra=(1.0 / seconds_per_message, 0.0), inter=(1.0 / seconds_per_message, 0.0))
    return PlacementProblem(training=Training(mbs=1, **recipe), costs=(costs,), system=system, hbm_bytes=1e9,
                            peak_flops=1.0, interleave_layers=4)


TWO_STAGES = Placement(1, 1, ((0, 1), (2, 3)))


@pytest.mark.parametrize("message, exposed, overlapped", [
    # W = 6 s of compute per stage and microbatch; v = 2 chunks send P = 2 x message per stage;
    # m = 4, bubble (S - 1) / v = 1/2, so the warm-up and flush share f = 1/2 / 4.5 = 1/9.
    (0.5, 7.0 * 4.5, 6.0 * 4 + 7.0 * 0.5),  # P = 1 < W: hidden in the steady state
    (5.0, 16.0 * 4.5, (6.0 / 9 + 10.0) * 4.5),  # P = 10 > W: the link is the bottleneck, W hides under it
])
def test_two_stage_pipeline_by_hand(message, exposed, overlapped):
    plain = evaluate_placement(_problem(message, virtual_stages=2), TWO_STAGES)
    over = evaluate_placement(_problem(message, virtual_stages=2, overlap_p2p_comm=True), TWO_STAGES)
    assert plain.time_per_batch_s == pytest.approx(exposed, rel=1e-12)
    assert over.time_per_batch_s == pytest.approx(overlapped, rel=1e-12)


def test_no_effect_without_interleaving_or_a_pipeline():
    """Megatron-LM overlaps p2p only in the interleaved schedule, and one stage sends nothing."""
    one = Placement(1, 1, ((0, 1, 2, 3),))
    for placement, recipe in ((TWO_STAGES, {}), (one, {"virtual_stages": 2})):
        plain = evaluate_placement(_problem(0.5, **recipe), placement)
        over = evaluate_placement(_problem(0.5, overlap_p2p_comm=True, **recipe), placement)
        assert over.time_per_batch_s == plain.time_per_batch_s


def test_more_microbatches_hide_more():
    """The exposed share falls as the steady state grows: the time per microbatch approaches the
    compute alone (6 s) from above."""
    per_microbatch = []
    for batch in (4, 16, 64):
        problem = _problem(0.5, virtual_stages=2, overlap_p2p_comm=True)
        problem = dataclasses.replace(problem, system=dataclasses.replace(problem.system, global_batch=batch))
        per_microbatch.append(evaluate_placement(problem, TWO_STAGES).time_per_batch_s / batch)
    assert per_microbatch[0] > per_microbatch[1] > per_microbatch[2] > 6.0


def test_recipe_field_checked_and_listed():
    assert Training(overlap_p2p_comm=True).recipe()["overlap_p2p_comm"] is True
    assert Training(overlap_p2p_comm=False).recipe()["overlap_p2p_comm"] is False
    assert "overlap_p2p_comm" not in Training().recipe()  # earlier recipes (and resumed keys) unchanged
    with pytest.raises(PhazeError, match="overlap_p2p_comm"):
        Training(overlap_p2p_comm="often")


def test_unset_it_is_the_stacks_default():
    """Megatron-Core, NeMo and Megatron-Bridge (the megatron-te stack) overlap the interleaved
    schedule's sends unless told not to; 2021-22 Megatron-LM and eager PyTorch do not."""
    assert Training(stack="megatron-te").overlaps_p2p
    assert not Training(stack="megatron-te", overlap_p2p_comm=False).overlaps_p2p
    assert not Training().overlaps_p2p and not Training(stack="eager").overlaps_p2p
    assert Training(stack="eager", overlap_p2p_comm=True).overlaps_p2p
    te = evaluate_placement(_problem(5.0, virtual_stages=2, stack="megatron-te"), TWO_STAGES)
    on = evaluate_placement(_problem(5.0, virtual_stages=2, overlap_p2p_comm=True), TWO_STAGES)
    assert te.time_per_batch_s == on.time_per_batch_s


def test_a_row_that_turns_it_off_under_megatron_te_says_so():
    """NeMo 24.07's Nemotron-4 340B launcher config sets `overlap_p2p_comm: False`."""
    from phaze_opt.validation.runner import row_config
    from phaze_opt.validation.suites import load_suite

    suite = load_suite("nemo-fp8-h100")
    (row,) = [r for r in suite.rows if r.model == "nemotron-4-340b"]
    assert row.training.stack == "megatron-te" and not row.training.overlaps_p2p
    assert row_config(row, suite)["overlap_p2p_comm"] is False


def test_cli_flag_reaches_the_recipe():
    import argparse

    from phaze_opt.commands import evaluate as command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    assert p.parse_args(["--overlap-p2p-comm"]).overlap_p2p_comm is True
    assert p.parse_args(["--no-overlap-p2p-comm"]).overlap_p2p_comm is False
    assert p.parse_args([]).overlap_p2p_comm is None


ROW = {"model": "llama3-70b", "tp": 8, "pp": 4, "virtual_stages": 5, "gpus": 64, "batch": 64, "microbatch": 1,
       "recompute": "none", "sequence_parallel": True, "per_gpu_tflops": 400,
       "source": {"paper": "p", "table": "t", "row": "r"}}


def test_suite_rows_carry_it_to_the_recipe(tmp_path):
    from test_validation_modern import assert_row_field_reaches_the_recipe

    assert_row_field_reaches_the_recipe(tmp_path, ROW, "overlap_p2p_comm", True, None)


@pytest.mark.parametrize("change, words", [
    ({"overlap_p2p_comm": "yes"}, "must be true or false"),
    ({"overlap_p2p_comm": True, "virtual_stages": 1}, "needs virtual_stages > 1"),
])
def test_suite_rows_refuse_a_bad_value_in_one_line(tmp_path, change, words):
    from test_validation_modern import assert_row_refused_in_one_line

    assert_row_refused_in_one_line(tmp_path, {**ROW, **change}, "overlap_p2p_comm", words)


def test_stage_time_never_falls_as_the_backward_grows_beside_a_hidden_reduce_scatter():
    """ZeRO-2's per-microbatch reduce-scatter hides under the backward too: the sends must hide
    under the stage's whole work (compute and that exposed scatter), or a longer backward would
    shorten the stage (and the placement bound, which runs on lower-bound layer times, would fail)."""
    times = []
    for bwd in (0.1, 1.0, 4.0, 8.0, 12.0, 16.0):  # a stage's backward from 0.2 s to 32 s
        # sends of 4 B on a 0.1 B/s link (80 s per microbatch, past the work), a scatter of 20 s
        costs = make_costs(1, [1.0] * 4, [bwd] * 4, [1] * 4, [0] * 4, [4] * 4)
        system = make_system(accelerators=4, devices_per_node=1, global_batch=8, intra=(0.1, 0.0), inter=(0.1, 0.0))
        problem = PlacementProblem(training=Training(mbs=1, virtual_stages=2, zero=2, overlap_grad_reduce=True,
                                                     overlap_p2p_comm=True),
                                   costs=(costs,), system=system, hbm_bytes=1e9, peak_flops=1.0, interleave_layers=4)
        times.append(evaluate_placement(problem, Placement(1, 2, ((0, 1), (2, 3)))).stages[0].time_s)
    assert times == sorted(times) and times[0] < times[-1]
