"""The seams of design evaluation, as `typing.Protocol`s: what the study drivers may rely on.

- `Evaluator`: scores one design, trained by one whole `Training` recipe, for one model
  (`evaluate.DesignEvaluator`, a study's fake in the tests, `experiments.published`'s
  fixed-placement evaluator).
- `BoundedEvaluator`: an evaluator that runs the real hardware model, layer schedules and placement
  DP, so `upper_bound`'s proven throughput bounds hold for it (bound pruning needs one).
- `DesignResult`-like results: what the drivers read of a result (`Result`).
- `SearchSpace`: a space a study samples; `GridSpace`: one whose architecture grid (with HBM
  capacities) the exhaustive sweep can bound (`space.SearchSpace` is both).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from ..hardware.accelerator import Accelerator
from ..training import Training


@runtime_checkable
class Result(Protocol):
    """What the study drivers read of one model's evaluation."""

    feasible: bool
    reason: str
    throughput: float
    tokens_per_s: float
    time_per_batch_s: float
    area_mm2: float
    mfu: float
    placement: dict
    timings: dict
    layers: list
    energy_j: float | None
    proven: bool
    throughput_bound: float
    unproven: list

    def to_json(self) -> dict: ...


@runtime_checkable
class Evaluator(Protocol):
    """`evaluator(model, arch, training, system=...) -> Result`; picklable when a study runs worker
    processes (module-level functions, partials of them, small dataclasses).

    The recipe is one `Training` (microbatch, recompute mode, placement and every further field),
    never its fields one by one: an evaluator cannot drop a field it was not written for, and a
    recording fake sees exactly what the real evaluator would."""

    def __call__(self, model: str, arch: Accelerator, training: Training, system: Any = "default") -> Result: ...


@runtime_checkable
class BoundedEvaluator(Evaluator, Protocol):
    """The real evaluator, with its per-pass ILP time limit: the proven throughput bounds hold for it."""

    ilp_time_limit_s: float


@runtime_checkable
class SearchSpace(Protocol):
    """A study's space: sampled parameters and their ordered choices, the area rule, the grid."""

    name: str
    params: dict[str, list]
    area_budget_mm2: float

    def accelerator(self, point: dict) -> Accelerator: ...

    def area_check(self, point: dict) -> tuple[bool, float, str]: ...

    def grid_points(self, order: str = "area") -> list[dict]: ...

    # A space that samples the cluster (`system_params`) also takes `system=`, the reference cluster
    # (`search/objective.reference_cluster` passes it only to such a space).
    def reference_point(self, arch: str = "tpuv4", recipe: dict | None = None) -> dict: ...


@runtime_checkable
class GridSpace(SearchSpace, Protocol):
    """A space with an architecture grid: what area grouping and bound pruning need."""

    @property
    def area_params(self) -> list[str]: ...

    def architectures(self, order: str = "area") -> list[dict]: ...


def area_params(space: SearchSpace) -> Sequence[str] | None:
    """The parameters that change a point's area, when the space says (else None: all of them)."""
    return space.area_params if isinstance(space, GridSpace) else None

