"""Inputs and outputs of the per-layer scheduler, independent of where the numbers came from."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...workload.ops import UNITS


@dataclass(frozen=True)
class ScheduleProblem:
    """One layer pass to schedule on `num_tc` tensor cores and `num_vc` vector cores.

    For op i: `units[i]` in UNITS; `single[i]` its latency on one core of its type (one TC and one
    VC for "tc+vc"); `split[i]` its latency split across all cores of its type (it then runs alone
    on those cores). "net" ops use the interconnect, "none" ops take zero time.
    """

    units: tuple[str, ...]
    single: tuple[float, ...]
    split: tuple[float, ...]
    edges: tuple[tuple[int, int], ...]
    num_tc: int
    num_vc: int
    names: tuple[str, ...] = ()

    def __post_init__(self):
        n = len(self.units)
        if len(self.single) != n or len(self.split) != n:
            raise ValueError("units, single and split must have one entry per op")
        for u in self.units:
            if u not in UNITS:
                raise ValueError(f"unit {u!r} not in {UNITS}")


@dataclass(frozen=True)
class Schedule:
    """A solved schedule. `status` is "optimal" only when optimality is proven (gap zero)."""

    makespan: float
    lower_bound: float
    status: str  # optimal | time_limit | error
    method: str  # bound (heuristic met the lower bound) | ilp | search (the branch and bound proved it) | cache
    solve_s: float
    start: tuple[float, ...]
    split: tuple[bool, ...]  # True: op ran split across all cores of its type
    cores: tuple[tuple[str, ...], ...]  # per op, the cores it occupied, e.g. ("tc0",) or ("tc0".."tc7")
    duration: tuple[float, ...]
    extra: dict = field(default_factory=dict)
