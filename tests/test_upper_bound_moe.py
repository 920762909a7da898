"""The sweep's bounds stay valid with expert and context parallelism: level 0 >= level 1
>= the evaluated throughput for a MoE model at a sequence CP may split, on random designs and
recipes; and level 0 takes the CP widths' work."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from phaze_opt.design.evaluate import evaluate, tp_widths
from phaze_opt.design.space import load_space
from phaze_opt.design.upper_bound import (WidthBounds, ideal_throughput, layer_lower_bounds, pipeline_throughput,
                                         placement_throughput)
from phaze_opt.hardware.latency import DesignArrays
from phaze_opt.system import load_system
from phaze_opt.training import Training
from phaze_opt.workload.models import parse_model

from test_moe_design import TINY


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "moe-bound-cache"))


HBM = 20 * 2**20
RECIPES = [dict(recompute="none"), dict(recompute="selective", zero=1), dict(recompute="full", overlap_grad_reduce=True),
           dict(recompute="none", zero=1, overlap_grad_reduce=True),
           dict(recompute="none", zero=2, overlap_grad_reduce=True, overlap_param_gather=True),
           dict(recompute="none", cp_comm="all_gather")]  # all-gather CP: level 1 prices its exposed gathers


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()))
def test_bounds_hold_with_ep_and_cp(recipe):
    model = parse_model(TINY, "tiny.yaml")
    system = dataclasses.replace(load_system("default"), accelerators=16, global_batch=32)
    space = load_space("phaze")
    archs = space.architectures(order="grid")
    rng = random.Random(7)
    points = []
    for k in rng.sample(range(len(archs)), 2):
        p = {n: v for n, v in archs[k].items() if n != "area_mm2"}
        p.update(hbm_gib=rng.choice(space.params["hbm_gib"]), mbs=1, recompute=recipe["recompute"])
        points.append(p)
    # HBM so small that only splitting the experts (EP) or the sequence (CP) makes the model fit:
    # a bound that ignored them would call these designs infeasible (0) below their throughput
    accels = [dataclasses.replace(space.accelerator(p), hbm_bytes=HBM) for p in points]
    designs = DesignArrays.from_accelerators(accels)
    widths = [layer_lower_bounds(model, designs, 1, system, tp) for tp in tp_widths(model, system)]
    assert {w.cp for w in widths[0].cp_bounds} == {2, 4, 8, 16}
    ideal = ideal_throughput(widths, 1, system.accelerators)
    extra = {k: v for k, v in recipe.items() if k != "recompute"}
    feasible = used_parallel = 0
    for i, a in enumerate(accels):
        ub1 = placement_throughput(model, widths, i, system=system, training=Training(1, **recipe),
                                   hbm_bytes=a.hbm_bytes, peak_flops=a.peak_flops)
        # a 1 s pass limit: an open pass's proven lower bound only gets weaker with less time, so
        # throughput_bound (the placement on those bounds) only rises and the check below only tightens
        result = evaluate(model, a, Training(1, **recipe), system, 1.0)
        feasible += result.feasible
        used_parallel += result.feasible and (result.placement["ep"] > 1 or result.placement["cp"] > 1)
        assert ideal[i] * (1 + 1e-12) >= ub1 >= result.throughput_bound, (ideal[i], ub1, result.throughput_bound)
        pipe = pipeline_throughput(widths, 1, system.accelerators, system.global_batch, extra.get("virtual_stages", 1))
        assert pipe[i] * (1 + 1e-12) >= result.throughput_bound, (pipe[i], result.throughput_bound)
        # without the CP widths level 0 would be a different (here: lower) number
        plain = ideal_throughput([dataclasses.replace(w, cp_bounds=()) for w in widths], 1, system.accelerators)
        assert plain[i] <= ideal[i]
    assert feasible
    assert used_parallel  # the comparison exercised EP or CP


def test_pipeline_bound_counts_context_parallel_stages():
    """One layer of 1 s per microbatch at CP 1 and 0.4 s at CP 2 (traced at seq / 2), 2 devices, one
    sequence: CP 2 runs it in 0.4 s (2.5 seq/s), so a level-0 bound below 2.5 would cut the optimum;
    without the CP widths the pipeline bound says 1 seq/s."""
    kinds = np.array([0])
    cp2 = WidthBounds(tp=1, kind_fwd=np.array([[0.1]]), kind_bwd=np.array([[0.3]]), layer_kind=kinds, cp=2)
    w = WidthBounds(tp=1, kind_fwd=np.array([[0.25]]), kind_bwd=np.array([[0.75]]), layer_kind=kinds, cp_bounds=(cp2,))
    assert pipeline_throughput([w], 1, 2, 1)[0] == pytest.approx(2.5)
    assert pipeline_throughput([dataclasses.replace(w, cp_bounds=())], 1, 2, 1)[0] == pytest.approx(1.0)


def test_layer_bounds_hold_at_every_ep_width():
    """Many small experts (64 of 16 token slots each): an EP rank runs them as fewer experts of more
    tokens, faster than the traced EP-1 shape, so a MoE layer's lower bound gives up that saving
    and stays below the layer's time at every EP width (`LayerCosts.at_expert_width`)."""
    from phaze_opt.design.evaluate import training_problem
    from phaze_opt.hardware.arch import load_arch

    model = parse_model(dict(TINY, seq=512, hidden=1024, heads=8, experts=64, top_k=2, expert_ffn=512,
                             expert_placement={"tp": 1, "pp": 1, "dp": 64}),
                        "tiny.yaml")
    system = dataclasses.replace(load_system("default"), accelerators=64, global_batch=64)
    arch = load_arch("h100-sxm")
    _, _, problem, _ = training_problem(model, arch, Training(1), system, widths=(1,))
    costs = problem.costs_at(1)
    bounds = layer_lower_bounds(model, DesignArrays.from_accelerators([arch]), 1, system, 1)
    fwd_bound, bwd_bound = bounds.layer_rows(0)
    moe = np.flatnonzero(costs.expert_fwd_s > 0)
    assert len(moe) and problem.ep_widths[-1] == 64
    saved = 0.0
    for e in problem.ep_widths:
        fwd, bwd, _, _ = costs.at_expert_width(e)
        assert np.all(fwd_bound <= fwd * (1 + 1e-9)) and np.all(bwd_bound <= bwd * (1 + 1e-9)), e
        saved = max(saved, float(np.max(costs.fwd_s[moe] - fwd[moe])))
    assert saved > 0.1 * float(np.max(costs.fwd_s[moe]))  # the widths do save: the check has teeth
