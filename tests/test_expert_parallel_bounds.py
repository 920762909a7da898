"""The EP/CP DP's pruning bounds (`expert_parallel._items`, `_fit_mask`) against brute force: for every
(block, d, S) item of many random problems, every feasible S-stage placement of it (scored by the
independent evaluator) takes at least the item's lower bound, has a tail (exposed reduction +
optimizer step) at least the item's tail floor, and the item is not dropped as not fitting HBM.
A bound made too large (say multiplied by 1.5) fails here deterministically, before the search's
oracle test (test_expert_parallel.py) has to stumble on a case where it changes the optimum."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from phaze_opt.solve.placement import expert as ep
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.types import Placement
from phaze_opt.training import Training

from test_expert_parallel import moe_problem
from test_placement_oracle import chain_splits

RECIPES = list(itertools.product(["none", "selective", "full"], [0, 1, 2], [False, True], [0.0, 50.0]))


def recipe(seed):
    rng = np.random.default_rng(seed + 12345)
    rc, zero, overlap, hbm_bw = RECIPES[int(rng.integers(len(RECIPES)))]
    kw = dict(recompute=rc, zero=zero, overlap_grad_reduce=overlap, hbm_bandwidth=hbm_bw,
              load_imbalance=float(rng.choice([1.0, 1.5])), overlap_param_gather=bool(rng.random() < 0.5))
    if rng.random() < 0.25:
        kw.update(n=4, virtual_stages=2, global_batch=8)
    return kw


def check_items(problem, force_dag=False):
    classes, items = ep._prepare(problem, force_dag)
    splits: dict = {}
    for stages in chain_splits(problem.n_layers):
        splits.setdefault(len(stages), []).append(stages)
    checked = 0
    for i in range(items["lb"].size):
        b = classes[int(items["cls"][i])]
        blk, d, S = int(items["blk"][i]), int(items["d"][i]), int(items["S"][i])
        t, e, c = int(b.t[blk]), int(b.e[blk]), int(b.c[blk])
        for stages in splits[S]:
            r = evaluate_placement(problem, Placement(t, d, stages, e, c))
            if not r.feasible:
                continue
            checked += 1
            where = (t, e, c, d, stages)
            assert items["fits"][i], ("dropped as not fitting HBM", where)
            assert items["lb"][i] <= r.time_per_batch_s * (1 + 1e-9), ("lower bound", items["lb"][i], r.time_per_batch_s, where)
            tail = max(s.allreduce_s + s.optimizer_step_s for s in r.stages)
            assert items["tail_lb"][i] <= tail * (1 + 1e-9) + 1e-12, ("tail floor", items["tail_lb"][i], tail, where)
    return checked


@pytest.mark.parametrize("seed", range(120))
def test_item_bounds_hold(seed):
    kw = recipe(seed)
    n = kw.pop("n", 3)
    problem = moe_problem(seed, n=n, **kw)
    check_items(problem, force_dag=seed % 5 == 0)


def test_item_bounds_are_checked_on_many_placements():
    """The parametrised test above is not vacuous: its problems have feasible placements to check."""
    total = 0
    for seed in range(10):
        kw = recipe(seed)
        n = kw.pop("n", 3)
        total += check_items(moe_problem(seed, n=n, **kw))
    assert total > 200


@pytest.mark.parametrize("seed", range(80))
def test_item_bounds_hold_interleaved_tight_memory(seed):
    """Interleaved 1F1B (v = 2) where HBM binds: the in-flight chunks of the memory bound."""
    rng = np.random.default_rng(seed + 999)
    problem = moe_problem(seed, n=4, virtual_stages=2, global_batch=int(rng.choice([4, 8, 16])),
                          recompute=str(rng.choice(["none", "selective", "full"])), zero=int(rng.choice([0, 1, 2])),
                          hbm=float(rng.uniform(60, 400)), accelerators=int(rng.integers(8, 33)))
    check_items(problem, force_dag=seed % 4 == 0)


def test_interleaved_memory_bound_at_its_edge():
    """v = 2, S = 2, m = 4: the first device holds 5 chunks of 1/2 of its stage's activations, the
    last 3 (Megatron); with 60 and 100 bytes both need 150, so at HBM 150 + state the split
    ((0, 1), (2, 3)) fits exactly, and the memory bound (least-loaded position: 3 chunks, over the
    mean stage) must keep its item. Counting 5 chunks there (the first device's) would drop it."""
    from phaze_opt.solve.placement.types import LayerCosts, PlacementProblem

    from test_placement_oracle import make_system

    def costs(tp, cp=1):
        return LayerCosts(tp=tp, cp=cp, fwd_s=[1.0] * 4, bwd_s=[2.0] * 4, params=[1.0] * 4,
                          activation_bytes=[30.0, 30.0, 50.0, 50.0], boundary_bytes=[1.0] * 4, input_bytes=[1.0] * 4)

    system = make_system(accelerators=4, devices_per_node=4, global_batch=4)
    state = 2 * system.state_bytes_per_param
    problem = PlacementProblem(training=Training(virtual_stages=2), costs=(costs(1),), system=system, hbm_bytes=150 + state, peak_flops=1.0, cp_widths=(1, 2), cp_costs=(costs(1, 2),))
    assert evaluate_placement(problem, Placement(1, 1, ((0, 1), (2, 3)))).feasible
    assert not evaluate_placement(replace(problem, hbm_bytes=149 + state), Placement(1, 1, ((0, 1), (2, 3)))).feasible
    assert check_items(problem) > 0
