"""Running a study: `run_study(config, backend)`, what `python -m phaze_opt.study` calls.

It picks the strategy and hands it the config; each opens a `session.Session` (validation, the
Optuna study in its storage, the TPUv4 baselines, the MLflow parent run) and ends with
`report.finish` (the summary):

- `sampled.run_sampled`: an Optuna sampler proposes `--trials` designs (`--workers` processes);
- `exhaustive.run_exhaustive`: every grid point of the space, by area groups (with hysteresis);
  with `--prune bound` it hands over to `branch_bound.run_pruned`, which settles every point by
  evaluation or by a proven throughput bound.

The arrows point one way: runner -> sampled, exhaustive -> branch_bound -> report, trials ->
session -> setup, objective, encoding, tracking (docs/architecture.md).
"""

from __future__ import annotations

from .exhaustive import run_exhaustive
from .sampled import run_sampled
from .setup import Backend, StudyConfig


def run_study(config: StudyConfig, backend: Backend | None = None) -> dict:
    """Run (or resume) the study by its strategy's mode: sampled, or a sweep of the whole grid
    (`run_exhaustive` hands a branch-and-bound sweep to `branch_bound.run_pruned` once the
    settings are validated, since `--prune auto` is resolved there)."""
    return RUNS[config.strategy.mode](config, backend)


RUNS = {"sampled": run_sampled, "exhaustive": run_exhaustive}
