"""A study's settings (`StudyConfig`) and the choices they are checked against (`setup.validate`)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import configs
from .objective import directions
from ..runs.tracking import DEFAULT_TRACKING_URI
from .strategy import (  # noqa: F401  (re-exported)
    AUTO,
    SAMPLED_NAME,
    SAMPLERS,
    SINGLE_OBJECTIVE_SAMPLERS,
    STRATEGY_NAMES,
    Strategy,
    strategy_for,
)

ORDERS = ("area", "grid")
# The published sweep groups architectures into area bins of 10,000 um^2 = 0.01 mm^2
# (msr-fiddle/phaze, Solver/solver.py: acc_group_range = 10000, areas in um^2).
PHAZE_AREA_GROUP_MM2 = 0.01
# The cluster a reference chip really trains on, when the study names none: TPU v4 in its pod's 3D
# torus of inter-chip links (Jouppi et al., ISCA 2023), not in the study's GPU-like nodes.
REFERENCE_SYSTEMS = {"tpuv4": "tpuv4-pod"}


def reference_system_for(reference_arch: str, reference_system: str | None, system: str) -> str:
    """The system the baseline runs on: the one named, else the reference chip's own cluster where
    one is shipped (`REFERENCE_SYSTEMS`), else the study's system."""
    if reference_system:
        return reference_system
    own = REFERENCE_SYSTEMS.get(str(reference_arch))
    return own if own and own in configs.available("systems") else system


@dataclass(frozen=True)
class StudyConfig:
    models: tuple[str, ...] = ("gpt3-175b",)
    space: str = "phaze"
    system: str = "default"
    sampler: str = "auto"  # `setup.resolve_sampler`: bound where the proven bounds apply, else tpe
    seed: int = 0
    trials: int = 500  # the study's total of finished trials; a resumed study runs only the rest
    objectives: tuple[str, ...] = ("throughput",)
    study_name: str | None = None
    storage: str | None = None  # default sqlite:///<output_dir>/<study-name>.db
    tracking_uri: str | None = DEFAULT_TRACKING_URI  # "off" disables MLflow
    workers: int = 1
    strategy: str = SAMPLED_NAME  # one of STRATEGY_NAMES; "auto" is resolved by validation (`setup.resolve_strategy`)
    order: str = "area"
    hysteresis: int | None = None  # None: evaluate every grid point
    area_group_mm2: float = PHAZE_AREA_GROUP_MM2
    output_dir: str = "studies"
    reference_arch: str = "tpuv4"
    progress: bool | None = None  # None: a bar when stderr is a terminal, else plain lines; True: bar; False: none
    ilp_time_limit_s: float | None = None  # per layer-pass schedule solve; None: evaluate's default (60 s)
    reference_system: str | None = None  # the baseline's cluster; None: `reference_system_for`'s choice
    cluster: str | None = None  # a Dask scheduler's address: the tasks run on its workers (`runs.cluster`)

    @property
    def searcher(self) -> Strategy:
        """The strategy `strategy` names: its rules and its `run`."""
        return strategy_for(self)

    @property
    def mode(self) -> str:
        return self.searcher.mode

    @property
    def baseline_system(self) -> str:
        """The system the reference chip's baseline runs on (see `reference_system_for`)."""
        return reference_system_for(self.reference_arch, self.reference_system, self.system)

    @property
    def directions(self) -> list[str]:
        return directions(self.objectives)
