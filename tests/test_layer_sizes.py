"""The level-1 bound prices one graph's layer sizes with many designs' layer times: the sizes held once a
process (`upper_bound.layer_sizes`) with a design's times (`LayerCosts.with_times`) must be exactly the
costs built from scratch for that design, and the new times are checked as a constructor checks them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from phaze_opt.design import upper_bound
from phaze_opt.design.parallel import parallel_sizes
from phaze_opt.solve.placement.types import LayerCosts
from phaze_opt.training import Training
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.models import load_model

MODEL = load_model("opt-1.3b")  # 32 heads: TP 1, 2 and 4


def _fields(costs: LayerCosts) -> dict:
    return {f.name: getattr(costs, f.name) for f in dataclasses.fields(costs)}


def _same(a: LayerCosts, b: LayerCosts) -> None:
    left, right = _fields(a), _fields(b)
    assert left.keys() == right.keys()
    for name in left:
        x, y = left[name], right[name]
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), mbs=st.sampled_from([1, 2]),
       sp=st.booleans(), attention=st.sampled_from([None, "flash"]), seed=st.integers(0, 2**31 - 1))
def test_held_sizes_with_a_designs_times_equal_the_costs_built_for_it(tp, cp, mbs, sp, attention, seed):
    training = Training(mbs=mbs, sequence_parallel=sp, attention=attention)
    model = dataclasses.replace(MODEL, seq=MODEL.seq // cp) if cp > 1 else MODEL
    graph = build_layer_graph(model, tp, mbs, attention=attention)
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.random(len(graph.layers)), rng.random(len(graph.layers))
    built = parallel_sizes(LayerCosts.from_layer_graph(graph, fwd, bwd, sequence_parallel=sp), model, training, cp)
    held = upper_bound.layer_sizes(MODEL, tp, cp, training)
    _same(held.with_times(fwd, bwd), built)
    assert upper_bound.layer_sizes(MODEL, tp, cp, training) is held  # built once a process
    assert not held.fwd_s.any() and not held.bwd_s.any()  # the held sizes keep no design's times


def test_another_model_object_is_never_served_a_held_size(monkeypatch):
    """The memo is keyed by the model object's id; an equal id on another object (a freed id
    reused) must miss."""
    monkeypatch.setattr(upper_bound, "_SIZES", {})
    training = Training(mbs=1)
    first = upper_bound.layer_sizes(MODEL, 1, 1, training)
    other = dataclasses.replace(MODEL, layers=MODEL.layers // 2)
    key = next(iter(upper_bound._SIZES))
    upper_bound._SIZES[(id(other), *key[1:])] = upper_bound._SIZES[key]  # as if `other` had MODEL's id
    sizes = upper_bound.layer_sizes(other, 1, 1, training)
    assert sizes is not first and sizes.n_layers < first.n_layers


def test_new_times_are_checked_and_the_old_costs_kept():
    costs = upper_bound.layer_sizes(MODEL, 1, 1, Training(mbs=1))
    n = costs.n_layers
    with pytest.raises(ValueError, match="fwd_s: expected"):
        costs.with_times(np.ones(n + 1), np.ones(n))
    with pytest.raises(ValueError, match="bwd_s: entries must be finite and non-negative"):
        costs.with_times(np.ones(n), -np.ones(n))
    timed = costs.with_times(np.full(n, 2.0), np.full(n, 3.0))
    assert (timed.fwd_s == 2.0).all() and (timed.bwd_s == 3.0).all() and not costs.fwd_s.any()
    assert not timed.fwd_s.flags.writeable
