"""The outer search: the study's settings, its strategies (sampled, exhaustive, branch and bound),
the objective and the session that runs them; run infrastructure lives below, in `runs/`.

Packages above `search/` (experiments, commands) import the names below, not the modules.
"""

from .config import PHAZE_AREA_GROUP_MM2, SAMPLERS, StudyConfig, reference_system_for
from .objective import Baseline, baseline_points, compute_baselines
from .report import render
from .runner import run_study
from .session import REPEAT_ATTR, Session, best_trial, finished_trials, is_feasible, quiet_optuna, study_wall_s
from .setup import Backend, clean_name, default_storage
from .strategy import Strategy, strategy_for, strategy_from_flags

__all__ = [
    "Backend",
    "Baseline",
    "PHAZE_AREA_GROUP_MM2",
    "REPEAT_ATTR",
    "SAMPLERS",
    "Session",
    "Strategy",
    "StudyConfig",
    "baseline_points",
    "best_trial",
    "clean_name",
    "compute_baselines",
    "default_storage",
    "finished_trials",
    "is_feasible",
    "quiet_optuna",
    "reference_system_for",
    "render",
    "run_study",
    "strategy_for",
    "strategy_from_flags",
    "study_wall_s",
]
