"""What one trial measures: a search-space point in, objective values and constraints out.

Shared by the sampled study and the exhaustive sweep, so both record the same things and the
convergence comparison treats them alike.

How an infeasible design is reported (so samplers learn from it and reports never crash):

- Constraints, in Optuna's convention (<= 0 feasible), are set on every evaluated trial:
  `area` = (area - budget) / budget, the relative excess over the area budget; when the space
  rejects a design for another area rule (e.g. below its minimum-area fraction) it is at least
  0.01. `memory` = the number of models for which no placement fits the HBM (0 when all fit).
  TPE, NSGA-II and GP rank infeasible trials below every feasible one, and among themselves by the
  summed violation, so a design 3% over budget counts as closer than one 50% over.
- Objective values of an infeasible trial: throughput 0 (an infeasible design trains nothing),
  area its real area, energy +inf.
- A design whose layer schedules were not all proven optimal in the ILP time limit is a result,
  not a failure: its score comes from the verified incumbent schedules (a throughput the chip
  reaches), `score_bound` from the proven lower bounds (see design/evaluate.py), and `proven` is
  False. Records and reports carry both, so no unproven number passes for an optimum.
- A design over the area budget is rejected from the space's `area_check` alone, before any
  workload graph, ILP or placement is computed.

With several models the design is shared ("common", as in the published system) and the
throughput objective is the mean over models of throughput / that model's TPUv4 baseline
throughput (TPUv4 with the model's expert placement, at the best microbatch and recompute setting
of the space); every model's placement is still optimised on its own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..design.protocols import Evaluator, Result, SearchSpace
from ..errors import PhazeError
from ..jsonable import jsonable  # noqa: F401  (re-exported for the sweeps)
from ..training import Training, recompute_flag  # noqa: F401  (recompute_flag: re-exported)

OBJECTIVES = {"throughput": "maximize", "area": "minimize", "energy": "minimize"}
MIN_AREA_VIOLATION = 0.01


class FatalStudyError(PhazeError):
    """A problem with the study's set-up, not with one design: stops the study instead of failing a trial."""


def parse_objectives(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """`throughput[,area][,energy]` -> a tuple; throughput first, no repeats, nothing else."""
    if value is None:
        return ("throughput",)
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(v).strip().lower() for v in items)
    allowed = "throughput[,area][,energy]"
    if not names or any(not n for n in names):
        raise PhazeError(f"--objectives: empty objective name; use {allowed}")
    for n in names:
        if n not in OBJECTIVES:
            raise PhazeError(f"--objectives: unknown objective '{n}'; choose from {allowed}")
    if len(set(names)) != len(names):
        raise PhazeError(f"--objectives: '{','.join(names)}' repeats an objective; use {allowed}")
    if names[0] != "throughput":
        raise PhazeError(f"--objectives: throughput must come first; use {allowed}")
    return names


def directions(objectives: Sequence[str]) -> list[str]:
    return [OBJECTIVES[o] for o in objectives]


@dataclass(frozen=True)
class Baseline:
    """A model's TPUv4 reference: the denominator of the ratios every report shows."""

    model: str
    feasible: bool
    throughput: float = 0.0
    tokens_per_s: float = 0.0
    mbs: Any = None
    recompute: Any = None
    placement: str = "expert"  # expert, or optimal when the expert placement fits at no setting
    energy_j: float | None = None
    reason: str = ""

    def to_json(self) -> dict:
        return jsonable(self.__dict__)

    @classmethod
    def from_json(cls, data: Mapping) -> "Baseline":
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__ if k in data})


@dataclass
class Context:
    """Everything a trial needs besides its point; picklable so worker processes can get it."""

    models: tuple[str, ...]
    system: str
    space: SearchSpace
    evaluator: Evaluator
    objectives: tuple[str, ...] = ("throughput",)
    baselines: dict[str, Baseline] = field(default_factory=dict)


@dataclass
class Outcome:
    point: dict
    feasible: bool
    reason: str
    area_mm2: float
    score: float  # the throughput objective: sequences/s, or the mean ratio to TPUv4 with several models
    values: list[float]
    constraints: dict[str, float]
    results: dict[str, Result] = field(default_factory=dict)  # model -> DesignResult
    accelerator: dict = field(default_factory=dict)
    trial_s: float = 0.0
    score_bound: float = 0.0  # proven upper bound on the score (== score when every schedule is proven)

    @property
    def proven(self) -> bool:
        return all(r.proven for r in self.results.values())

    def model_summary(self, model: str) -> dict:
        r = self.results[model]
        return jsonable({
            "feasible": r.feasible,
            "reason": r.reason,
            "throughput": r.throughput,
            "tokens_per_s": r.tokens_per_s,
            "time_per_batch_s": r.time_per_batch_s,
            "mfu": r.mfu,
            "energy_j": r.energy_j,
            "proven": r.proven,
            "throughput_bound": r.throughput_bound,
            "unproven": list(r.unproven),
            "placement": r.placement,
            "timings": r.timings,
        })

    def result_attr(self) -> dict:
        """What Optuna keeps of the trial besides its point, as one user attribute (one storage write).

        Compact: no per-layer table (that goes to the MLflow artifact).
        """
        return jsonable({
            "feasible": self.feasible,
            "reason": self.reason,
            "area_mm2": self.area_mm2,
            "score": self.score,
            "score_bound": self.score_bound,
            "proven": self.proven,
            "trial_s": self.trial_s,
            "accelerator": self.accelerator,
            "models": {m: self.model_summary(m) for m in self.results},
        })

    def artifact(self) -> dict:
        """`placement.json`: the stages, devices and per-layer costs of every model."""
        models = {}
        for m, r in self.results.items():
            models[m] = {**self.model_summary(m), "layers": r.layers}
        return jsonable({
            "design": self.point,
            "accelerator": self.accelerator,
            "feasible": self.feasible,
            "reason": self.reason,
            "area_mm2": self.area_mm2,
            "score": self.score,
            "score_bound": self.score_bound,
            "proven": self.proven,
            "models": models,
        })


def accelerator_fields(space: SearchSpace, point) -> dict:
    """The accelerator of a point, for the records of a trial that failed before its outcome existed."""
    try:
        return jsonable(space.accelerator(dict(point)).fields())
    except Exception:  # noqa: BLE001 - best effort only
        return {}


def area_violation(ok: bool, area: float, budget: float) -> float:
    excess = (area - budget) / budget
    if ok:
        return min(excess, 0.0)
    return max(excess, MIN_AREA_VIOLATION)


def recompute_arg(training: Training):
    """The recompute argument of an Evaluator call: a bool for none/full (what every evaluator
    takes), the mode name for selective."""
    return training.recompute if training.recompute == "selective" else training.recompute == "full"


def recipe_kwargs(training: Training) -> dict:
    """The recipe fields beyond mbs/recompute/placement that differ from their defaults (so an
    evaluator without them keeps working for today's spaces)."""
    defaults = Training()
    return {k: getattr(training, k) for k in ("sequence_parallel", "virtual_stages", "zero", "overlap_grad_reduce",
                                               "attention") if getattr(training, k) != getattr(defaults, k)}


def evaluate_point(point: Mapping[str, Any], ctx: Context) -> Outcome:
    """Evaluate one design point for every model of the study (see the module docstring)."""
    start = time.perf_counter()
    point = dict(point)
    space = ctx.space
    budget = float(space.area_budget_mm2)
    ok, area, area_reason = space.area_check(point)
    area = float(area)
    constraints = {"area": area_violation(ok, area, budget), "memory": 0.0}
    accel = space.accelerator(point)
    accel_fields = jsonable(accel.fields())
    if not ok:
        reason = area_reason or f"area {area:.1f} mm² is outside the space's area rule ({budget:.1f} mm² budget)"
        values = _values(ctx.objectives, 0.0, area, math.inf)
        return Outcome(point, False, reason, area, 0.0, values, constraints, {}, accel_fields,
                       time.perf_counter() - start)

    training = Training.from_point(point)
    results = {}
    for model in ctx.models:
        results[model] = ctx.evaluator(model, accel, training.mbs, recompute_arg(training), system=ctx.system,
                                       placement=training.placement, **recipe_kwargs(training))
    infeasible = [m for m, r in results.items() if not r.feasible]
    constraints["memory"] = float(len(infeasible))
    if len(ctx.models) == 1:
        reason = results[ctx.models[0]].reason if infeasible else ""
    else:
        reason = "; ".join(f"{m}: {results[m].reason}" for m in infeasible)
    feasible = not infeasible
    score = _score(ctx, results) if feasible else 0.0
    score_bound = _score(ctx, results, bound=True) if feasible else 0.0
    energy = _energy(ctx, results) if feasible and "energy" in ctx.objectives else math.inf
    values = _values(ctx.objectives, score, area, energy)
    return Outcome(point, feasible, reason, area, score, values, constraints, results, accel_fields,
                   time.perf_counter() - start, max(score_bound, score))


def _values(objectives, score: float, area: float, energy: float) -> list[float]:
    table = {"throughput": score, "area": area, "energy": energy}
    return [float(table[o]) for o in objectives]


def _throughput(result: Result, bound: bool) -> float:
    return result.throughput_bound if bound else result.throughput


def _score(ctx: Context, results: Mapping[str, Result], bound: bool = False) -> float:
    """The score from each model's throughput (or, with `bound`, its proven upper bound)."""
    if len(ctx.models) == 1:
        return float(_throughput(results[ctx.models[0]], bound))
    ratios = []
    for m in ctx.models:
        base = ctx.baselines.get(m)
        if base is None or not base.feasible or not base.throughput > 0:
            raise FatalStudyError(f"model '{m}' has no TPUv4 baseline throughput to normalise by")
        ratios.append(_throughput(results[m], bound) / base.throughput)
    return float(sum(ratios) / len(ratios))


def _energy(ctx: Context, results: Mapping) -> float:
    for m, r in results.items():
        if r.energy_j is None:
            raise FatalStudyError("objective 'energy' needs energy per batch, which the hardware model did not give "
                                  f"for model '{m}'; drop it from --objectives")
    if len(ctx.models) == 1:
        return float(results[ctx.models[0]].energy_j)
    ratios = []
    for m in ctx.models:
        base = ctx.baselines.get(m)
        if base is None or not base.energy_j:
            raise FatalStudyError(f"objective 'energy' with several models needs the TPUv4 baseline energy of '{m}'")
        ratios.append(results[m].energy_j / base.energy_j)
    return float(sum(ratios) / len(ratios))


def compute_baselines(models: Sequence[str], evaluator: Evaluator, reference_arch, system: str,
                      mbs_choices: Sequence, recompute_choices: Sequence) -> dict[str, Baseline]:
    """Each model on TPUv4 with its expert placement, at the best microbatch/recompute of the space.

    The model configs fix the expert TP/PP/DP but not the microbatch, so the baseline gets the best
    of the space's settings: the ratios we report are then never flattered by a weak baseline.
    When the expert placement fits at no setting, the TPUv4 optimal placement stands in (marked).
    """
    out = {}
    for model in models:
        best = None
        errors = []
        for placement in ("expert", "optimal"):
            for mbs in mbs_choices:
                for rc in recompute_choices:
                    try:
                        r = evaluator(model, reference_arch, int(mbs), recompute_flag(rc), system=system,
                                      placement=placement)
                    except PhazeError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - reported in the baseline's reason
                        errors.append(f"{type(exc).__name__}: {exc}")
                        continue
                    if r.feasible and (best is None or r.throughput > best.throughput):
                        # a model without an expert placement is evaluated at the optimal one (r.note)
                        used = "optimal" if getattr(r, "note", "") else placement
                        best = Baseline(model, True, float(r.throughput), float(r.tokens_per_s), mbs, rc,
                                        used, r.energy_j)
            if best is not None:
                break
        if best is None:
            why = errors[0] if errors else "no placement of the model fits TPUv4 at any microbatch/recompute setting"
            best = Baseline(model, False, reason=why)
        out[model] = best
    return out
