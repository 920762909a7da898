"""The dense BF16 H100 suite from NVIDIA's DGX Cloud Benchmarking recipes (dgxc-h100-bf16): every row
consistent with its own published throughput, every model in both halves of the fit/held-out split,
and every row reaching the evaluator with the recipe its NeMo config sets (a recording fake)."""

from __future__ import annotations

import pytest

from phaze_opt.validation.runner import in_fit_subset, run_suite
from phaze_opt.validation.suites import load_suite
from phaze_opt.workload.models import load_model

from test_validate import _Result

SUITE = "dgxc-h100-bf16"


def test_step_time_times_throughput_is_the_batch_of_tokens():
    """The tables print step time and tokens/s over all GPUs, each rounded: their product is the global
    batch x sequence to 0.5% (a dropped or swapped digit in either column leaves that band)."""
    suite = load_suite(SUITE)
    assert (suite.arch, suite.system, suite.metric) == ("h100-sxm", "dgx-h100", "iteration_time_s")
    for row in suite.rows:
        seq = row.seq or load_model(row.model).seq
        assert row.value * row.published["tokens_per_s"] == pytest.approx(row.batch * seq, rel=5e-3), row.source
        assert 40 < row.published["mfu_percent"] < 70, row.source
        assert row.training.precision == "bf16" and row.source.paper in suite.papers and row.source.paper.startswith("dgxc-")


def test_every_model_is_both_fitted_and_held_out():
    rows = load_suite(SUITE).rows
    fitted = {r.model for i, r in enumerate(rows) if in_fit_subset(i)}
    held = {r.model for i, r in enumerate(rows) if not in_fit_subset(i)}
    assert fitted == held == {r.model for r in rows}
    assert {r.gpus for r in rows} >= {8, 2048, 2304}  # both ends of the weak-scaling tables


def test_rows_reach_the_evaluator_with_their_configs_recipe():
    """What each NeMo launcher config sets (suite header): the distributed optimizer with both overlaps,
    TE's userbuffers TP overlap wherever sequence parallelism is on (TP > 1), fused attention, TE's
    kernels, selective recompute and BF16 optimizer state only for Nemotron-4 340B; the published
    GPUs, batch and parallelism."""
    suite = load_suite(SUITE)
    seen = []

    def fake(model, arch, training, system):
        config = load_model(model) if isinstance(model, str) else model
        seen.append((config.name, system.accelerators, training))
        return _Result(True, 10.0)

    run_suite(suite, evaluator=fake)
    assert len(seen) == len(suite.rows)
    for row, (name, gpus, t) in zip(suite.rows, seen):
        assert (name, gpus) == (row.model, row.gpus)
        assert (t.zero, t.overlap_grad_reduce, t.overlap_param_gather) == (1, True, True), row.source
        assert t.sequence_parallel == t.tp_comm_overlap == (row.tp > 1), row.source
        assert t.stack == "megatron-te" and t.precision == "bf16"
        assert t.recompute == ("selective" if name == "nemotron-4-340b" else "none"), row.source
        # Nemotron-4 340B's config alone runs Apex's distributed Adam in BF16 (optim.dtype bf16)
        assert t.optimizer_state == ("bf16-adamw" if name == "nemotron-4-340b" else None), row.source
        assert (t.attention or load_model(name).attention) == "flash", row.source
        assert (t.mbs, t.virtual_stages) == (row.training.mbs, row.training.virtual_stages)
