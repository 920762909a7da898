"""Running a study: `run_study(config, backend)`, what `python -m phaze_opt.study` calls.

It hands the config to the strategy it names (`StudyConfig.strategy`, see `strategy.Strategy`),
whose `run` opens a `session.Session`, visits its points and ends with `report.finish`:

- `sampled.SAMPLED`: an Optuna sampler proposes `--trials` designs (`--workers` processes);
- `exhaustive.GRID`: every grid point of the space, by area groups (with hysteresis);
- `branch_bound.BRANCH_AND_BOUND`: every grid point, settled by evaluation or by a proven
  throughput bound;
- `exhaustive.AUTO_SWEEP`: branch and bound where the proven bounds apply, else the grid.

Each of those modules registers its strategy when imported (`strategy.register`), so this module
imports them all. The arrows point one way: runner -> sampled, exhaustive, branch_bound -> report,
trials -> session -> setup, objective, encoding, strategy, tracking (docs/architecture.md).
"""

from __future__ import annotations

from . import branch_bound, exhaustive, sampled  # noqa: F401  (each registers its strategy)
from .setup import Backend, StudyConfig


def run_study(config: StudyConfig, backend: Backend | None = None) -> dict:
    """Run (or resume) the study by the strategy its config names."""
    return config.searcher.run(config, backend)
