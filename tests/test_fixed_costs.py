"""A training step's fixed costs come from their causes: a one-GPU step on dgx-h100 is its layers,
the schedule's per-step host cost and the optimizer's once-per-batch HBM traffic, and nothing else
(no flat per-iteration constant that a short step would pay in full)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from phaze_opt.design.evaluate import evaluate
from phaze_opt.hardware.arch import load_arch
from phaze_opt.system import load_system
from phaze_opt.training import Training


def test_a_one_gpu_step_pays_only_what_its_causes_cost():
    arch = load_arch("h100-sxm")
    system = replace(load_system("dgx-h100"), accelerators=1, global_batch=4)
    result = evaluate("megatron-gpt-1.7b", arch, Training(1, "none", "tp=1,pp=1,dp=1"), system)
    assert result.feasible
    (stage,) = result.placement["stages"]
    m = result.placement["microbatches"]
    assert m == 4
    per_step = system.efficiency.microbatch_overhead_s
    assert per_step > 0  # the preset's fitted cost per schedule step is charged, once a step
    layers = stage["compute_s"] + stage["recompute_s"] + stage["comm_s"]
    # mixed-precision Adam: 2 B weight, 2 B gradient, 12 B state; Adam's pass (w + g + 2 x 12), the
    # gradient norm (g) and zeroing the gradients (g), all whole at ZeRO 0, over the achieved HBM rate
    step = stage["params"] * (2 + 2 + 24 + 2 + 2) / (arch.hbm_bw * arch.efficiency.hbm_fraction)
    assert result.placement["optimizer_step_s"] == pytest.approx(step, rel=1e-12)
    assert result.time_per_batch_s == pytest.approx(m * (layers + per_step) + step, rel=1e-12)
    # a 0.46 s step: what is not the layers is 7% of it (27 ms of optimizer traffic, 4 x 0.9 ms of
    # schedule steps), where the flat 0.18 s once fitted on 3-15 s steps would have been a third
    assert (result.time_per_batch_s - m * layers) / result.time_per_batch_s < 0.10
