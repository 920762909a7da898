"""The fixed cost per microbatch and pipeline stage (`SystemEfficiency.microbatch_overhead_s`):
the placement DPs stay exact with it (brute-force oracle), a batch pays it m v + S - 1 times (the
closed form the fit relies on), the fit reads only the declared subset, and the preset block is
checked with one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from phaze_opt import configs
from phaze_opt.errors import PhazeError
from phaze_opt.solve.placement.dp import optimal_dense_placement
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.system import SystemEfficiency, load_system
from phaze_opt.validation.calibration import fit_system, schedule_steps
from phaze_opt.validation.suites import load_suite
from test_placement_dp import SETTINGS, assert_recipe_matches_oracle, recipe_problems
from test_placement_oracle import chain_splits, dag_splits


@st.composite
def with_fixed_cost(draw, **kind):
    problem = draw(recipe_problems(**kind))
    cost = draw(st.sampled_from([0.05, 0.3, 2.0]))  # from a fraction of a layer's time to several
    return dataclasses.replace(problem, system=dataclasses.replace(
        problem.system, efficiency=SystemEfficiency(microbatch_overhead_s=cost)))


@settings(max_examples=80, **SETTINGS)
@given(with_fixed_cost())
def test_chain_dp_equals_brute_force_with_a_fixed_cost_per_microbatch(problem):
    assert_recipe_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=60, **SETTINGS)
@given(with_fixed_cost(interleaved=True))
def test_interleaved_dp_equals_brute_force_with_a_fixed_cost_per_microbatch(problem):
    assert_recipe_matches_oracle(problem, chain_splits(problem.n_layers))


@settings(max_examples=40, **SETTINGS)
@given(with_fixed_cost(dag=True))
def test_dag_dp_equals_brute_force_with_a_fixed_cost_per_microbatch(problem):
    assert_recipe_matches_oracle(problem, dag_splits(problem.n_layers, problem.costs[0].edges or ()),
                                 force_dag=True)


@settings(max_examples=60, **SETTINGS)
@given(recipe_problems(), st.sampled_from([1e-4, 0.01, 1.0]))
def test_a_batch_pays_the_cost_once_per_schedule_step(problem, cost):
    """A placement's time per batch grows by exactly c (m v + S - 1): the closed form the fit uses."""
    result = optimal_dense_placement(problem)
    assume(result.feasible)
    costly = dataclasses.replace(problem, system=dataclasses.replace(
        problem.system, efficiency=SystemEfficiency(microbatch_overhead_s=cost)))
    again = evaluate_placement(costly, result.placement())
    steps = result.microbatches * problem.training.virtual_stages + result.pp - 1
    assert again.time_per_batch_s == pytest.approx(result.time_per_batch_s + cost * steps, rel=1e-12)


def _suite(tmp_path, values, name):
    """Four rows of one run shape at 1..4 microbatches per pipeline (4 GPUs, microbatch 4)."""
    rows = [{"model": "megatron-gpt-1.7b", "tp": 1, "pp": 1, "gpus": 4, "batch": 16 * (i + 1), "microbatch": 4,
             "recompute": "full", "iteration_time_s": value, "source": {"paper": "p", "table": "1", "row": f"r{i}"}}
            for i, value in enumerate(values)]
    data = {"suite": "tiny", "description": "a hand-made suite", "arch": "a100-like", "system": "dgx-a100",
            "metric": "iteration_time_s", "flops_formula": "megatron-model", "papers": {"p": "a paper"}, "rows": rows}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_suite(path)


@dataclasses.dataclass
class _Result:
    feasible: bool
    time_per_batch_s: float
    reason: str = ""


def _evaluator(model, arch, training, system):
    """1 s per microbatch of compute plus the system's cost per schedule step, as the real model charges it."""
    m = system.global_batch // (training.mbs * 4)
    return _Result(True, 1.0 * m + system.efficiency.microbatch_overhead_s * m)


def test_fit_of_the_microbatch_cost_uses_only_the_declared_subset(tmp_path):
    # rows 1 and 3 (2 and 4 microbatches) as a stack with 3 ms per step runs them
    exact = [m + 0.003 * m for m in (1, 2, 3, 4)]
    suite = _suite(tmp_path, (9.0, exact[1], 0.5, exact[3]), "a.yaml")
    assert [schedule_steps(r) for r in suite.rows] == [1, 2, 3, 4]

    def fit(s):
        return fit_system([s], "dgx-a100", evaluator=_evaluator, intra_fractions=(1.0,), inter_fractions=(1.0,))

    base = fit(suite)
    assert base.efficiency.microbatch_overhead_s == pytest.approx(0.003)
    assert base.objective < 1e-9
    assert "microbatch_overhead_s" in base.fitted
    moved_held_out = fit(_suite(tmp_path, (1.0, exact[1], 30.0, exact[3]), "b.yaml"))
    assert moved_held_out.efficiency == base.efficiency
    moved_fitted = fit(_suite(tmp_path, (9.0, exact[1] + 0.01, 0.5, exact[3] + 0.02), "c.yaml"))  # it can fail
    assert moved_fitted.efficiency.microbatch_overhead_s == pytest.approx(0.008)


def test_preset_block_reads_the_microbatch_overhead(tmp_path):
    data = yaml.safe_load(configs.resolve("systems", "dgx-a100").read_text())
    data["efficiency"]["microbatch_overhead"] = "0.4 ms"
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert load_system(str(path)).efficiency.microbatch_overhead_s == pytest.approx(4e-4)
    assert load_system("dgx-a100").efficiency.microbatch_overhead_s == 0.0  # the shipped presets: none
    data["efficiency"]["microbatch_overhead"] = "2 s"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PhazeError, match="efficiency.microbatch_overhead.*at most 1 s"):
        load_system(str(path))
