"""The layers-h100 comparison (validation/layers.py) and the operator-efficiency fit
(validation/fit_operators.py): every row predicted, the committed h100-sxm efficiency meets the target
on the held-out rows, and the fit recovers a known efficiency from data it generated itself."""

import math
from dataclasses import replace

import numpy as np
import pytest

from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.efficiency import IDENTITY, Efficiency
from phaze_opt.solve.schedule.solver import schedule_graph
from phaze_opt.validation.fit_operators import (
    DERIVED, FIT_TP, GRID, fit_operator_efficiency, serial_seconds, split_rows,
)
from phaze_opt.validation.layers import (
    BLOCK, block_graph, block_pass_latencies, compare_gemms, compare_layers, gemm_seconds, mape,
)
from phaze_opt.validation.suites import LayerRow, Source, load_suite

TARGET = 0.10  # the validation target: mean absolute error at most 10% on the held-out rows


@pytest.fixture(scope="module")
def suite():
    return load_suite("layers-h100")


# Schedules that the time limit stops are verified incumbents within `gap` of their proven bound
# (Llama-2's unfused backward passes: at most 0.3% at 60 s); a short limit keeps the test quick.
TIME_LIMIT_S = 2.0
# How close a stopped schedule gets depends on how much the solvers did before the limit, that is on
# the machine: with a cold cache this suite's worst gap was 0.24% at 2 s on the 2-core box, 21.7% at
# 0.2 s (a machine ten times slower) and 14.5% with no solver time at all. A gap this large means a
# broken solver on any machine; the 0.3% above is a measurement, not a test.
GAP_LIMIT = 0.5


@pytest.fixture(scope="module")
def results(suite):
    return compare_layers(suite, time_limit_s=TIME_LIMIT_S)


def test_every_row_is_predicted(suite, results):
    assert [r.row for r in results] == list(suite.rows) and len(results) == 48
    for r in results:
        assert math.isfinite(r.fwd_s) and math.isfinite(r.bwd_s) and 0 < r.fwd_s and 0 < r.bwd_s
        assert r.proven == (r.gap == 0.0) and 0 <= r.gap < GAP_LIMIT
        assert r.error == pytest.approx((r.fwd_s + r.bwd_s) / r.row.fwd_bwd_s - 1)


def test_committed_efficiency_meets_the_target_on_held_out_rows(suite, results):
    # The figure in configs/archs/h100-sxm.yaml (held out 4.90%) is what this measures; the test holds
    # it to the target, so a change that breaks the calibration fails here.
    fit, held = split_rows(suite)
    assert set(suite.rows[i].tp for i in fit) == set(FIT_TP) and len(fit) == len(held) == 24
    assert mape(results[i] for i in held) <= TARGET
    assert mape(results[i] for i in fit) <= TARGET
    # ... and the calibration is what gets it there: the bare template misses by more on the same rows
    # (checked on a cheap subset: the unfused rows of the held-out TP widths at microbatch 1)
    rows = [i for i in held if suite.rows[i].microbatch == 1 and not suite.rows[i].flash]
    bare = replace(load_arch("h100-sxm"), efficiency=IDENTITY)
    sub = replace(suite, rows=tuple(suite.rows[i] for i in rows))
    assert mape(compare_layers(sub, bare, time_limit_s=TIME_LIMIT_S)) > mape(results[i] for i in rows)


def test_exact_schedule_never_above_the_serial_one(suite, results):
    # the fit's search runs ops one after another (serial_seconds); the exact schedule can only do better
    acc = load_arch(suite.arch)
    graphs = [block_graph(r.row.model, r.row.tp, r.row.microbatch, r.row.flash) for r in results]
    serial = serial_seconds(graphs, acc)
    exact = np.array([[r.fwd_s, r.bwd_s] for r in results])
    assert (exact <= serial * (1 + 1e-9)).all()
    assert np.allclose(exact, serial, rtol=0.05)  # and on these blocks nearly all of it is serial anyway


def test_collectives_are_left_out(suite):
    acc = load_arch(suite.arch)
    g = block_graph("gpt3-175b", 8, 1, False)
    og = g.op_graphs[BLOCK]["fwd"]
    nets = [i for i, op in enumerate(og.ops) if op.unit == "net"]
    assert nets  # the TP shard's all-reduce is in the graph ...
    single, split = block_pass_latencies(og, acc)
    assert (single[nets] == 0).all() and (split[nets] == 0).all()  # ... but costs nothing here
    sched = schedule_graph(og, single, split, acc, time_limit_s=TIME_LIMIT_S)
    assert sched.makespan == pytest.approx(sum(split[i] for i, op in enumerate(og.ops) if op.unit not in ("net", "none")),
                                           rel=0.05)


def test_gemm_rows_and_the_qkv_shape(suite):
    calibrated = compare_gemms(suite)
    bare = compare_gemms(suite, replace(load_arch("h100-sxm"), efficiency=IDENTITY))
    assert len(calibrated) == len(suite.gemms) == 8
    for c, b in zip(calibrated, bare):
        assert c.seconds > 0 and b.seconds > 0
        assert c.error == pytest.approx(c.seconds / c.gemm.seconds - 1)
    qkv = next(i for i, g in enumerate(suite.gemms) if (g.m, g.n, g.k) == (2048, 36864, 12288))
    # the bare template is bound by re-streaming the activation (about 578 TFLOP/s); with the
    # tile reuse the projection is compute-bound and within 10% of cuBLAS's measured 769 TFLOP/s (704)
    assert bare[qkv].tflops == pytest.approx(579, abs=2)
    assert abs(calibrated[qkv].error) < 0.10 and calibrated[qkv].tflops > 1.2 * bare[qkv].tflops
    # over the eight shapes the calibration more than halves the GEMM error (31% -> 12%)
    assert mape(calibrated) < 0.5 * mape(bare)


def test_gemm_seconds_is_the_latency_model(suite):
    acc = replace(load_arch("h100-sxm"), efficiency=IDENTITY)
    # (2048 x 12288) @ (12288 x 36864) on the bare template: GLB-bound, A streamed once per 64-wide
    # column tile (576 of them), B and C once, at 9369.6 GB/s
    a, b, c = 2048 * 12288 * 2, 12288 * 36864 * 2, 2048 * 36864 * 2
    assert gemm_seconds(2048, 36864, 12288, acc) == pytest.approx((576 * a + b + c) / 9369.6e9)


def test_fit_recovers_a_known_efficiency():
    # oracle: "measurements" made by the model itself under a known efficiency; the fit must find a
    # point that reproduces them exactly (zero error), on fit and held-out rows alike
    truth = Efficiency(gemm_tile_reuse=4.0, tc_fraction=0.9, hbm_fraction=0.6, op_overhead_s=5e-6)
    acc = replace(load_arch("h100-sxm"), efficiency=truth)
    keys = [("gpt3-175b", 8, 1, False), ("gpt3-175b", 8, 1, True), ("llama2-70b", 8, 1, False),
            ("gpt3-175b", 4, 1, False), ("llama2-70b", 4, 1, True), ("gpt3-175b", 2, 1, False)]
    rows = []
    for model, tp, mbs, flash in keys:
        fwd, bwd = serial_seconds([block_graph(model, tp, mbs, flash)], acc)[0]
        rows.append(LayerRow(model=model, tp=tp, microbatch=mbs, flash=flash, fwd_s=fwd, bwd_s=bwd,
                             source=Source("oracle", "t", "r")))
    base = load_suite("layers-h100")
    synthetic = replace(base, rows=tuple(rows))
    grid = {"gemm_tile_reuse": (1.0, 4.0, 8.0), "tc_fraction": (0.8, 0.9, 1.0), "hbm_fraction": (0.5, 0.6, 0.7),
            "op_overhead_s": (0.0, 5e-6, 1e-5)}
    # the coarse stage covers this small grid whole, so the truth is among the points it tries
    res = fit_operator_efficiency(synthetic, replace(acc, efficiency=IDENTITY), fit_tp=(4, 8), grid=grid,
                                  coarse=grid, fixed={}, time_limit_s=TIME_LIMIT_S)
    assert res.search_mape < 1e-9
    assert res.efficiency.tc_fraction == 0.9 and res.efficiency.hbm_fraction == 0.6
    assert res.efficiency.op_overhead_s == 5e-6
    assert res.fit_rows == (0, 1, 2, 3, 4) and res.held_rows == (5,)
    # the exact schedules may overlap a few small ops where the serial "measurement" did not
    assert res.held_mape < 1e-3 and res.fit_mape < 1e-3


def test_fit_needs_rows_at_the_fit_widths(suite):
    with pytest.raises(ValueError, match="no rows at TP"):
        fit_operator_efficiency(replace(suite, rows=suite.rows[:1]), fit_tp=(16,))


def test_committed_h100_values_are_the_fit_s_kind_of_answer():
    # h100-sxm.yaml's efficiency: the derived values as fit_operators.DERIVED says, the fitted ones points
    # of its grid (the command in the YAML comment reproduces them: about 2-5 minutes, not run here)
    eff = load_arch("h100-sxm").efficiency
    for name, value in DERIVED.items():
        assert getattr(eff, name) == value
    for name in ("tc_fraction", "hbm_fraction", "op_overhead_s"):
        assert any(math.isclose(getattr(eff, name), g, rel_tol=1e-9, abs_tol=1e-12) for g in GRID[name]), name
    # a100-80gb: the GEMM tiling, plus the tensor-core fraction that `validate --fit-tc` fitted on the
    # training suites (tests/test_validate.py checks it is a point of that fit's grid)
    assert load_arch("a100-80gb").efficiency == Efficiency(gemm_tile_reuse=8.0, tc_fraction=0.81)
