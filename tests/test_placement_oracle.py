"""Shared builders and the brute-force oracle for the placement tests, and tests of the oracle.

The oracle enumerates every placement (every TP width, stage split, stage count and data-parallel
degree) and scores each with the independent evaluator; it shares no code with the DP.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.solve.placement.types import LayerCosts, Placement, PlacementProblem
from phaze_opt.system import Link, System
from phaze_opt.training import Training


def make_system(accelerators=16, devices_per_node=4, global_batch=16, intra=(100.0, 0.5), inter=(10.0, 2.0),
                optimizer="adam", optimizer_memory="mixed_precision", precision="bf16") -> System:
    return System(
        name="test",
        accelerators=accelerators,
        devices_per_node=devices_per_node,
        intra_node=Link(*intra),
        inter_node=Link(*inter),
        global_batch=global_batch,
        precision=precision,
        optimizer=optimizer,
        optimizer_memory=optimizer_memory,
    )


def make_costs(tp, fwd, bwd, params, acts, boundary, inputs=None, edges=None) -> LayerCosts:
    n = len(fwd)
    return LayerCosts(
        tp=tp,
        fwd_s=fwd,
        bwd_s=bwd,
        params=params,
        activation_bytes=acts,
        boundary_bytes=boundary,
        input_bytes=inputs if inputs is not None else [1.0] * n,
        edges=edges,
    )


def chain_splits(n: int):
    """Every split of layers 0..n-1 into contiguous non-empty stages."""
    for S in range(1, n + 1):
        for cuts in itertools.combinations(range(1, n), S - 1):
            bounds = (0,) + cuts + (n,)
            yield tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(S))


def downsets(n: int, edges):
    preds = [set() for _ in range(n)]
    for u, v in edges:
        preds[v].add(u)
    out = []
    for bits in range(1 << n):
        members = {v for v in range(n) if bits >> v & 1}
        if all(preds[v] <= members for v in members):
            out.append(frozenset(members))
    return out


def dag_splits(n: int, edges):
    """Every chain of downsets {} < D1 < ... < all, as stage tuples (differences)."""
    downs = downsets(n, edges)
    full = frozenset(range(n))

    def grow(current):
        if current == full:
            yield ()
            return
        for nxt in downs:
            if current < nxt:
                stage = tuple(sorted(nxt - current))
                for rest in grow(nxt):
                    yield (stage,) + rest

    yield from grow(frozenset())


def brute_force(problem: PlacementProblem, splits):
    """(best time, best placement) over every placement; (inf, None) when none is feasible."""
    splits = list(splits)
    best = (math.inf, None)
    N = problem.system.accelerators
    for c in problem.costs:
        for stages in splits:
            S = len(stages)
            for d in range(1, N // (c.tp * S) + 1):
                placement = Placement(c.tp, d, stages)
                r = evaluate_placement(problem, placement)
                if r.feasible and r.time_per_batch_s < best[0]:
                    best = (r.time_per_batch_s, placement)
    return best


def brute_min_memory(problem: PlacementProblem, splits) -> float:
    splits = list(splits)
    N = problem.system.accelerators
    best = math.inf
    for c in problem.costs:
        for stages in splits:
            S = len(stages)
            for d in range(1, N // (c.tp * S) + 1):
                r = evaluate_placement(problem, Placement(c.tp, d, stages))
                best = min(best, r.peak_memory_bytes)
    return best


def random_problem(rng: np.random.Generator, n_layers: int, widths, edges=None, **overrides) -> PlacementProblem:
    """Random layer costs per TP width (a wider TP splits params and activations, adds a collective)."""
    fwd = rng.uniform(0.1, 2.0, n_layers)
    bwd = fwd * rng.uniform(1.0, 3.0, n_layers)
    params = rng.integers(0, 60, n_layers).astype(float)
    acts = rng.integers(0, 40, n_layers).astype(float)
    boundary = rng.integers(0, 30, n_layers).astype(float)
    inputs = rng.integers(0, 10, n_layers).astype(float)
    costs = []
    for t in widths:
        slow = rng.uniform(0.0, 0.3)
        costs.append(
            make_costs(
                t, fwd / t + slow, bwd / t + slow, np.ceil(params / t), np.ceil(acts / t), boundary, inputs, edges
            )
        )
    system = make_system(
        accelerators=int(overrides.get("accelerators", rng.integers(1, 17))),
        devices_per_node=int(overrides.get("devices_per_node", rng.choice([1, 2, 4, 8]))),
        global_batch=int(overrides.get("global_batch", rng.integers(1, 40))),
        intra=(float(rng.uniform(20, 200)), float(rng.uniform(0, 0.2))),
        inter=(float(rng.uniform(0.5, 20)), float(rng.uniform(0.2, 1.0))),
        optimizer=str(rng.choice(["adam", "sgd"])),
        optimizer_memory=str(rng.choice(["mixed_precision", "phaze"])),
    )
    total = float(np.sum(params)) * system.state_bytes_per_param + float(np.sum(acts)) * 4
    hbm = float(overrides.get("hbm", rng.uniform(0.05, 1.2) * total + 1))
    return PlacementProblem(training=Training(mbs=int(overrides.get("mbs", rng.integers(1, 5))), recompute=bool(overrides.get("recompute", rng.integers(0, 2)))), costs=tuple(costs), system=system, hbm_bytes=hbm, peak_flops=1e3, seq_len=8, model_flops_per_sequence=100.0)


def random_dag(rng: np.random.Generator, n: int, density: float):
    edges = set()
    for v in range(1, n):
        # keep it connected-ish: every layer but the first has a predecessor
        edges.add((int(rng.integers(0, v)), v))
        for u in range(v):
            if rng.random() < density:
                edges.add((u, v))
    return tuple(sorted(edges))


# ---- the oracle's own enumerations -------------------------------------------------------------


def test_chain_splits_are_every_composition():
    for n in range(1, 8):
        splits = list(chain_splits(n))
        assert len(splits) == 2 ** (n - 1) and len(set(splits)) == len(splits)
        assert all([v for s in split for v in s] == list(range(n)) for split in splits)


def test_dag_splits_of_a_chain_are_its_compositions():
    for n in range(1, 7):
        chain = tuple((i, i + 1) for i in range(n - 1))
        assert sorted(dag_splits(n, chain)) == sorted(chain_splits(n))


def test_dag_splits_of_independent_layers_are_ordered_set_partitions():
    # Fubini numbers: ordered partitions of n labelled items
    assert [len(list(dag_splits(n, ()))) for n in range(1, 6)] == [1, 3, 13, 75, 541]
    assert len(downsets(4, ())) == 16


def test_dag_splits_respect_edges():
    edges = ((0, 2), (1, 2), (2, 3))
    for split in dag_splits(4, edges):
        stage_of = {v: s for s, stage in enumerate(split) for v in stage}
        assert all(stage_of[u] <= stage_of[v] for u, v in edges)
