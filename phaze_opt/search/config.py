"""A study's settings (`StudyConfig`) and the choices they are checked against (`setup.validate`)."""

from __future__ import annotations

from dataclasses import dataclass

from .objective import directions
from .tracking import DEFAULT_TRACKING_URI

SAMPLERS = ("tpe", "random", "cmaes", "qmc", "gp", "nsga2")
SINGLE_OBJECTIVE_SAMPLERS = ("cmaes",)
ORDERS = ("area", "grid")
# The published sweep groups architectures into area bins of 10,000 um^2 = 0.01 mm^2
# (msr-fiddle/phaze, Solver/solver.py: acc_group_range = 10000, areas in um^2).
PHAZE_AREA_GROUP_MM2 = 0.01


@dataclass(frozen=True)
class StudyConfig:
    models: tuple[str, ...] = ("gpt3-175b",)
    space: str = "phaze"
    system: str = "default"
    sampler: str = "tpe"
    seed: int = 0
    trials: int = 500  # the study's total of finished trials; a resumed study runs only the rest
    objectives: tuple[str, ...] = ("throughput",)
    study_name: str | None = None
    storage: str | None = None  # default sqlite:///<output_dir>/<study-name>.db
    tracking_uri: str | None = DEFAULT_TRACKING_URI  # "off" disables MLflow
    workers: int = 1
    exhaustive: bool = False
    order: str = "area"
    hysteresis: int | None = None  # None: evaluate every grid point
    prune: str = "auto"  # exhaustive: bound | off | auto (bound where it applies, see validate)
    area_group_mm2: float = PHAZE_AREA_GROUP_MM2
    output_dir: str = "studies"
    reference_arch: str = "tpuv4"
    progress: bool | None = None  # None: a bar when stderr is a terminal, else plain lines; True: bar; False: none
    ilp_time_limit_s: float | None = None  # per layer-pass schedule solve; None: evaluate's default (60 s)

    @property
    def mode(self) -> str:
        return "exhaustive" if self.exhaustive else "sampled"

    @property
    def directions(self) -> list[str]:
        return directions(self.objectives)
