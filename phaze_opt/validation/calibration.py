"""Fit a system preset's efficiency block (`SystemEfficiency`) on the declared fit subset of the suites.

    fit_system(suites, system_name) -> Fit

Global physical parameters, one value each for the whole preset (no per-row, per-model or per-suite
parameter): the achieved fractions of the intra-node and the inter-node link bandwidth, and the fixed
host cost of one schedule step, per microbatch and model chunk (`SystemEfficiency.microbatch_overhead_s`;
see system.SystemEfficiency for what each means physically). There is no flat per-iteration constant to
fit: the once-per-step work (the optimizer step, its gradient-norm pass, zeroing the gradients) is priced
from the bytes it moves (`solve.placement.types.optimizer_pass_bytes`).

What is fitted. The link fractions are measured quantities with a source (NCCL's achieved bus
bandwidth, cited in the preset files), so by default they stay at the preset's values and only the
per-step cost, which no microbenchmark here gives, is fitted. `fit_links=True` (`phaze-opt validate
--fit-links`) fits the fractions as well, on the grid `FRACTIONS` (0.50 to 1.00 in steps of 0.05); on
the shipped suites (with the bare a100-80gb template) it drove the NVLink fraction to the grid's floor,
far below anything NCCL measures, i.e. it absorbs an error that is not the link's (README,
Validation), which is why it is not the default.

Only the rows of the fit subset (`runner.in_fit_subset`: odd 0-based index in each training suite)
enter the objective; the held-out rows are never read here, so changing a held-out row's published
number cannot move a fitted value (tested). The objective is the mean absolute relative error over
the fit rows of every suite that runs on the preset.

Search. A validation row runs its published layout, so the per-step cost moves its iteration time
analytically: every stage's time per microbatch grows by v c, the batch by c (m v + S - 1)
(`solve.placement.evaluate`), with m microbatches per pipeline, S stages and v model chunks per
stage. For each pair of fractions every fit row is evaluated once with no per-step cost, giving its
iteration time T; the best cost is then found on the grid `MICROBATCH_OVERHEADS` (0 to 10 ms in
0.1 ms steps). The evaluations are the project's own `evaluate` (memoised per-layer schedules): one
evaluation per fit row and pair of fractions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from ..design.evaluate import evaluate
from ..errors import PhazeError
from ..hardware.arch import load_arch
from ..hardware.efficiency import Efficiency
from ..system import SystemEfficiency, load_system
from .runner import METRIC_SI, evaluate_row, in_fit_subset, predicted_value
from .suites import TRAINING_METRICS, Suite

FRACTIONS = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))  # 0.50 .. 1.00
TC_COARSE = tuple(round(0.7 + 0.05 * i, 2) for i in range(7))  # 0.70 .. 1.00
# 0 .. 10 ms per microbatch and stage: a schedule step's launches and p2p set-up take well under 1 ms
# on an idle host; 10x that bounds a slow one.
MICROBATCH_OVERHEADS = tuple(round(1e-4 * i, 4) for i in range(101))


@dataclass(frozen=True)
class Fit:
    system: str
    efficiency: SystemEfficiency
    objective: float  # MAPE over the fit rows at the fitted values
    rows: int  # fit rows used
    suites: tuple[str, ...]
    grid: dict = field(default_factory=dict)  # the search grid, for the report
    fitted: tuple[str, ...] = ("microbatch_overhead_s",)  # which fields were fitted (the rest: the preset's)
    arch: str = ""
    arch_efficiency: Efficiency | None = None  # the arch's efficiency with the fitted tc_fraction (fit_tc)

    def to_json(self) -> dict:
        return {"system": self.system, "efficiency": self.efficiency.to_dict(), "fitted": list(self.fitted),
                "arch": self.arch,
                "arch_efficiency": self.arch_efficiency.fields() if self.arch_efficiency is not None else None,
                "fit_mape": self.objective,
                "fit_rows": self.rows, "suites": list(self.suites), "grid": self.grid}


def fit_rows(suites: Sequence[Suite], system_name: str) -> list[tuple[Suite, int]]:
    """(suite, row index) of every fit-subset row of the training suites that runs on `system_name`
    (the row's own system, else its suite's); rows skipped for a missing model config are not fitted."""
    return [(s, i) for s in suites if s.metric in TRAINING_METRICS
            for i, r in enumerate(s.rows) if in_fit_subset(i) and not r.skip
            and (r.system or s.system) == system_name]


def _times(chosen, eff: SystemEfficiency, arch_eff, evaluator) -> np.ndarray:
    """Each fit row's predicted iteration time with no per-step cost (inf where infeasible)."""
    out = []
    for s, i in chosen:
        r = evaluate_row(s, s.rows[i], i, eff, evaluator, arch_efficiency=arch_eff)
        out.append(r.time_per_batch_s if r.feasible else np.inf)
    return np.array(out)


def schedule_steps(row) -> int:
    """Times a batch pays the fixed cost per microbatch and stage: m v + S - 1 (module docstring)."""
    return row.training.pipeline_steps(row.microbatches, row.pp)


def _best_per_step(chosen, times: np.ndarray, published: np.ndarray, per_microbatch: np.ndarray) -> tuple[float, float]:
    """(MAPE, per-microbatch cost) on the grid `per_microbatch` with the least MAPE over the fit rows
    (the smallest value on a tie). Rows the model finds infeasible have no time for a cost to move;
    they are left out (all infeasible: MAPE inf, the grid's first value)."""
    feasible = np.isfinite(times)
    if not feasible.any():
        return float("inf"), float(per_microbatch[0])
    chosen = [c for c, ok in zip(chosen, feasible) if ok]
    times, published = times[feasible], published[feasible]
    steps = np.array([schedule_steps(s.rows[i]) for s, i in chosen], dtype=float)
    t = times[None, :] + per_microbatch[:, None] * steps[None, :]
    # each row's metric as a function of its iteration time: a x t (seconds) or a / t (FLOP/s)
    inverse = np.array([s.metric == "per_gpu_tflops" for s, _ in chosen])
    scale = np.array([predicted_value(s, s.rows[i], 1.0) / METRIC_SI[s.metric] for s, i in chosen])
    with np.errstate(divide="ignore"):
        pred = np.where(inverse, scale / t, scale * t)
    err = np.mean(np.abs(pred / published - 1.0), axis=1)
    c = int(np.argmin(err))
    return float(err[c]), float(per_microbatch[c])


def fit_system(suites: Sequence[Suite], system_name: str, evaluator: Callable = evaluate, fit_links: bool = False,
               intra_fractions: Sequence[float] | None = None, inter_fractions: Sequence[float] | None = None,
               per_step: Sequence[float] = MICROBATCH_OVERHEADS, fit_tc: bool = False) -> Fit:
    """The efficiency block of `system_name` that minimises the MAPE over the fit rows (see the module
    docstring). Fractions not given: the preset's own (`fit_links`: the grid `FRACTIONS`). `fit_tc`
    also fits the tensor-core fraction of the suites' arch (`hardware.efficiency.Efficiency.tc_fraction`,
    coarse grid `TC_COARSE`, then 0.01 steps around the best), its other efficiencies kept. Ties go to
    the value nearest the identity (larger fractions, smaller per-step cost)."""
    chosen = fit_rows(suites, system_name)
    if not chosen:
        raise PhazeError(f"no training suite with fit rows runs on system '{system_name}'")
    archs = sorted({s.arch for s, _ in chosen})
    if fit_tc and len(archs) > 1:
        raise PhazeError(f"--fit-tc: the suites on system '{system_name}' use several archs ({', '.join(archs)}); "
                         "fit one arch at a time (--suite)")
    base_arch = load_arch(archs[0]).efficiency
    preset = load_system(system_name).efficiency
    if intra_fractions is None:
        intra_fractions = FRACTIONS if fit_links else (preset.intra_node_bandwidth,)
    if inter_fractions is None:
        inter_fractions = FRACTIONS if fit_links else (preset.inter_node_bandwidth,)
    published = np.array([s.rows[i].value for s, i in chosen], dtype=float)
    per_mb = np.asarray(per_step, dtype=float)
    tried: dict[float, tuple] = {}

    def at_tc(tc: float) -> tuple:
        """(MAPE, intra, inter, per-microbatch cost) at the best link fractions and cost for this tc fraction."""
        if tc not in tried:
            arch_eff = replace(base_arch, tc_fraction=tc) if fit_tc else None
            best = None
            for intra in sorted(intra_fractions, reverse=True):  # larger first: ties keep the larger
                for inter in sorted(inter_fractions, reverse=True):
                    eff = SystemEfficiency(intra_node_bandwidth=intra, inter_node_bandwidth=inter)
                    err, mb = _best_per_step(chosen, _times(chosen, eff, arch_eff, evaluator), published, per_mb)
                    if best is None or err < best[0] - 1e-12:
                        best = (err, intra, inter, mb)
            tried[tc] = best
        return tried[tc]

    if fit_tc:
        coarse = min(TC_COARSE, key=lambda tc: (at_tc(tc)[0], -tc))
        fine = [round(coarse + 0.01 * k, 2) for k in range(-4, 5) if 0 < coarse + 0.01 * k <= 1.0]
        tc = min(fine, key=lambda t: (at_tc(t)[0], -t))
    else:
        tc = base_arch.tc_fraction
    objective, intra, inter, mb = at_tc(tc)
    fitted = tuple(k for k, grid in (("intra_node_bandwidth", intra_fractions),
                                     ("inter_node_bandwidth", inter_fractions)) if len(grid) > 1)
    return Fit(system=system_name,
               efficiency=SystemEfficiency(intra_node_bandwidth=intra, inter_node_bandwidth=inter,
                                           microbatch_overhead_s=mb),
               objective=objective, rows=len(chosen),
               fitted=fitted + ("microbatch_overhead_s",) + (("tc_fraction",) if fit_tc else ()),
               suites=tuple(sorted({s.name for s, _ in chosen})),
               arch=archs[0], arch_efficiency=replace(base_arch, tc_fraction=tc) if fit_tc else None,
               grid={"intra_node_bandwidth": sorted(intra_fractions), "inter_node_bandwidth": sorted(inter_fractions),
                     "microbatch_overhead_s": [float(per_mb[0]), float(per_mb[-1]), len(per_mb)],
                     **({"tc_fraction": sorted(tried)} if fit_tc else {})})
