"""Fit a system preset's efficiency block (`SystemEfficiency`) on the declared fit subset of the suites.

    fit_system(suites, system_name) -> Fit

Three global physical parameters, one value each for the whole preset (no per-row, per-model or
per-suite parameter): the achieved fractions of the intra-node and the inter-node link bandwidth, and a
fixed per-iteration overhead in seconds (see system.SystemEfficiency for what each means physically).

What is fitted. The link fractions are measured quantities with a source (NCCL's achieved bus
bandwidth, cited in the preset files), so by default they stay at the preset's values and only the
overhead, which no microbenchmark gives, is fitted. `fit_links=True` (`phaze-opt validate --fit-links`)
fits the fractions as well, on the grid `FRACTIONS` (0.50 to 1.00 in steps of 0.05); on the shipped
suites it drives the NVLink fraction to the grid's floor, far below anything NCCL measures, i.e. it
absorbs an error that is not the link's (see docs/validation.md), which is why it is not the default.

Only the rows of the fit subset (`runner.in_fit_subset`: odd 0-based index in each training suite)
enter the objective; the held-out rows are never read here, so changing a held-out row's published
number cannot move a fitted value (tested). The objective is the mean absolute relative error over
the fit rows of every suite that runs on the preset.

Search. For each pair of fractions every fit row is evaluated once with no overhead, giving its
iteration time T; an overhead o then moves each row analytically (T + o), so the best overhead is
found on a fine 1-D grid (`OVERHEADS`, 0 to 2 s in 5 ms steps). The evaluations are the project's
own `evaluate` (memoised per-layer schedules): one evaluation per fit row and pair of fractions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..design.evaluate import evaluate
from ..errors import PhazeError
from ..system import SystemEfficiency, load_system
from .runner import METRIC_SI, evaluate_row, in_fit_subset, predicted_value
from .suites import TRAINING_METRICS, Suite

FRACTIONS = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))  # 0.50 .. 1.00
OVERHEADS = tuple(round(0.005 * i, 3) for i in range(401))  # 0 .. 2 s


@dataclass(frozen=True)
class Fit:
    system: str
    efficiency: SystemEfficiency
    objective: float  # MAPE over the fit rows at the fitted values
    rows: int  # fit rows used
    suites: tuple[str, ...]
    grid: dict = field(default_factory=dict)  # the search grid, for the report
    fitted: tuple[str, ...] = ("iteration_overhead_s",)  # which fields were fitted (the rest: the preset's)

    def to_json(self) -> dict:
        return {"system": self.system, "efficiency": self.efficiency.to_dict(), "fitted": list(self.fitted),
                "fit_mape": self.objective,
                "fit_rows": self.rows, "suites": list(self.suites), "grid": self.grid}


def fit_rows(suites: Sequence[Suite], system_name: str) -> list[tuple[Suite, int]]:
    """(suite, row index) of every fit-subset row of the training suites that run on `system_name`."""
    return [(s, i) for s in suites if s.metric in TRAINING_METRICS and s.system == system_name
            for i in range(len(s.rows)) if in_fit_subset(i)]


def fit_system(suites: Sequence[Suite], system_name: str, evaluator: Callable = evaluate, fit_links: bool = False,
               intra_fractions: Sequence[float] | None = None, inter_fractions: Sequence[float] | None = None,
               overheads: Sequence[float] = OVERHEADS) -> Fit:
    """The efficiency block of `system_name` that minimises the MAPE over the fit rows (see the module
    docstring). Fractions not given: the preset's own (`fit_links`: the grid `FRACTIONS`). Ties go to
    the value nearest the identity (larger fractions, smaller overhead)."""
    chosen = fit_rows(suites, system_name)
    if not chosen:
        raise PhazeError(f"no training suite with fit rows runs on system '{system_name}'")
    preset = load_system(system_name).efficiency
    if intra_fractions is None:
        intra_fractions = FRACTIONS if fit_links else (preset.intra_node_bandwidth,)
    if inter_fractions is None:
        inter_fractions = FRACTIONS if fit_links else (preset.inter_node_bandwidth,)
    published = np.array([s.rows[i].value for s, i in chosen], dtype=float)
    over = np.asarray(overheads, dtype=float)
    best = None
    # Larger fractions first, so that on a tie the value nearest the identity is kept.
    for intra in sorted(intra_fractions, reverse=True):
        for inter in sorted(inter_fractions, reverse=True):
            eff = SystemEfficiency(intra_node_bandwidth=intra, inter_node_bandwidth=inter)
            times = []
            for s, i in chosen:
                r = evaluate_row(s, s.rows[i], i, eff, evaluator)
                times.append(r.time_per_batch_s if r.feasible else np.inf)
            times = np.array(times)
            # predicted metric per (overhead, row), in the suite's published units
            pred = np.array([[predicted_value(s, s.rows[i], t + o) / METRIC_SI[s.metric] for (s, i), t in zip(chosen, times)]
                             for o in over])
            err = np.mean(np.abs(pred / published - 1.0), axis=1)
            k = int(np.argmin(err))  # first minimum: the smallest overhead
            if best is None or err[k] < best[0] - 1e-12:
                best = (float(err[k]), intra, inter, float(over[k]))
    objective, intra, inter, overhead = best
    return Fit(system=system_name,
               efficiency=SystemEfficiency(intra_node_bandwidth=intra, inter_node_bandwidth=inter,
                                           iteration_overhead_s=overhead),
               objective=objective, rows=len(chosen),
               fitted=tuple(k for k, grid in (("intra_node_bandwidth", intra_fractions),
                                              ("inter_node_bandwidth", inter_fractions)) if len(grid) > 1)
               + ("iteration_overhead_s",), suites=tuple(sorted({s.name for s, _ in chosen})),
               grid={"intra_node_bandwidth": sorted(intra_fractions), "inter_node_bandwidth": sorted(inter_fractions),
                     "overhead_s": [min(overheads), max(overheads), len(overheads)]})

