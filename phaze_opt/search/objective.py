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
  area its real area, energy +inf, cost its real cost where its cluster is known (a design no
  placement fits) and +inf where the point is rejected before (the area rule, no recipe, no cluster).
- The cost objective is the cluster's capital cost in US$ (`hardware/cost.py`, `configs/cost.yaml`):
  every device with its share of the network, on the point's cluster; it is the same for every
  model and recipe, so several models do not turn it into a ratio.
- A design whose layer schedules were not all proven optimal in the ILP time limit is a result,
  not a failure: its score comes from the verified incumbent schedules (a throughput the chip
  reaches), `score_bound` from the proven lower bounds (see design/evaluate.py), and `proven` is
  False. Records and reports carry both, so no unproven number passes for an optimum.
- A design over the area budget is rejected from the space's `area_check` alone, before any
  workload graph, ILP or placement is computed.
- A space with system axes (design/system_axes.py) trains each point on its own cluster: the study's
  system with the point's axes (`SearchSpace.system`). Axes that name no cluster (a device's NIC
  share above its scale-up link, say) make the point infeasible with the rule as the reason; the
  trial records its cluster (`Outcome.system`, `system.<field>` in MLflow).

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

from ..design import system_axes
from ..design.dominance import model_dominators
from ..design.protocols import Evaluator, Result, SearchSpace
from ..errors import PhazeError
from ..hardware.cost import cluster_cost_usd
from ..jsonable import jsonable  # noqa: F401  (re-exported for the sweeps)
from ..system import load_system
from ..training import Training, point_recipe, recipe_points
from ..workload.models import load_model

OBJECTIVES = {"throughput": "maximize", "area": "minimize", "energy": "minimize", "cost": "minimize"}
MIN_AREA_VIOLATION = 0.01


class FatalStudyError(PhazeError):
    """A problem with the study's set-up, not with one design: stops the study instead of failing a trial."""


def parse_objectives(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """`throughput[,area][,energy][,cost]` -> a tuple; throughput first, no repeats, nothing else."""
    if value is None:
        return ("throughput",)
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(v).strip().lower() for v in items)
    allowed = "throughput[,area][,energy][,cost]"
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


def metric_names(objectives: Sequence[str], n_models: int) -> list[str]:
    """Each objective's name with its unit, as Optuna's dashboard labels its axes and columns
    (`Study.set_metric_names`; without them it shows "Objective 0"). With several models the
    throughput and energy are means of ratios to each model's TPUv4 expert baseline (`_score`, `_energy`)."""
    one = n_models == 1
    names = {"throughput": "throughput (seq/s)" if one else "throughput (x TPUv4 expert, mean)",
             "area": "area (mm^2)",
             "energy": "energy per batch (J)" if one else "energy (x TPUv4 expert, mean)",
             "cost": "cluster cost (US$)"}
    return [names[o] for o in objectives]


@dataclass(frozen=True)
class Baseline:
    """A model's TPUv4 reference: the denominator of the ratios every report shows.

    `recipe` is the winning recipe as the space's own point values (microbatch, recompute and every
    further recipe field the space samples), so it can be enqueued as a trial and rebuilt whole as a
    `Training` (`training`); `mbs` and `recompute` repeat two of them for reports and older readers.
    `system` is the cluster the reference ran on (a TPU v4 pod by default, see `reference_system`).
    """

    model: str
    feasible: bool
    throughput: float = 0.0
    tokens_per_s: float = 0.0
    mbs: Any = None
    recompute: Any = None
    placement: str = "expert"  # expert, or optimal when the model has none or it fits at no setting
    energy_j: float | None = None
    reason: str = ""
    recipe: dict = field(default_factory=dict)
    system: str = ""
    stand_in: str = ""  # with placement optimal: why the optimal placement stood in for the expert one

    @property
    def point(self) -> dict:
        """The baseline's recipe as the space's point values: microbatch, recompute and the rest (a
        study stored before `recipe` existed kept only the first two; the others were the defaults)."""
        return {"mbs": self.mbs, "recompute": self.recompute, **(self.recipe or {})}

    @property
    def training(self) -> Training:
        """The baseline's whole recipe, with its placement."""
        return Training.from_point(self.point, self.placement)

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
    system: dict = field(default_factory=dict)  # the point's cluster when the space samples one (system_axes.summary)
    cost_usd: float | None = None  # the cluster's capital cost, with the cost objective (hardware/cost.py)

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
            **({"system": self.system} if self.system else {}),
            **({"cost_usd": self.cost_usd} if self.cost_usd is not None else {}),
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
            **({"system": self.system} if self.system else {}),
            **({"cost_usd": self.cost_usd} if self.cost_usd is not None else {}),
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
        reason = area_reason or f"area {area:.1f} mm^2 is outside the space's area rule ({budget:.1f} mm^2 budget)"
        values = _values(ctx.objectives, 0.0, area, math.inf, math.inf)
        return Outcome(point, False, reason, area, 0.0, values, constraints, {}, accel_fields,
                       time.perf_counter() - start)

    system, cluster = point_system(space, point, ctx.system)
    # the space's axes combine into no recipe or no cluster: infeasible, with the rule it breaks
    training, invalid = point_recipe(point)
    invalid = invalid or (space.system_problem(point, ctx.system) if cluster else "")
    if invalid:
        return Outcome(point, False, invalid, area, 0.0, _values(ctx.objectives, 0.0, area, math.inf, math.inf), constraints,
                       {}, accel_fields, time.perf_counter() - start, system=cluster)
    if cluster:
        system = space.system(point, system)
        cluster = system_axes.summary(system)
    results = {}
    for model in ctx.models:
        results[model] = ctx.evaluator(model, accel, training, system=system)
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
    cost = cluster_cost_usd(accel, load_system(system)) if "cost" in ctx.objectives else None
    values = _values(ctx.objectives, score, area, energy, math.inf if cost is None else cost)
    return Outcome(point, feasible, reason, area, score, values, constraints, results, accel_fields,
                   time.perf_counter() - start, max(score_bound, score), cluster, cost)


def point_system(space: SearchSpace, point: Mapping[str, Any], system):
    """(the study's system, the point's system-axis values) for a space with system axes, which need
    the study's system loaded as their base; (`system` as given, {}) for a space without."""
    axes = {p: point[p] for p in getattr(space, "system_params", ())}
    if not axes:
        return system, {}
    base = load_system(system)
    if base.torus is not None:  # the set-up, not one design: every point would fail alike
        raise FatalStudyError(system_axes.system_problem(axes, base))
    return base, axes


def _values(objectives, score: float, area: float, energy: float, cost: float) -> list[float]:
    table = {"throughput": score, "area": area, "energy": energy, "cost": cost}
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


def undominated_points(points: Sequence[dict], model, system) -> list[dict]:
    """The recipe points no other listed point of the same microbatch provably matches or beats
    (`design.dominance`: rules that hold placement by placement, so for the expert and the optimal
    placement alike); the best of these is the best of all `points`."""
    model, system = load_model(model), load_system(system)
    keep = []
    for mbs in dict.fromkeys(p["mbs"] for p in points):
        same = [p for p in points if p["mbs"] == mbs]
        rest = [{k: v for k, v in p.items() if k != "mbs"} for p in same]
        dom = model_dominators(rest, model, system, int(mbs))
        keep += [p for i, p in enumerate(same) if dom[i] == i]
    return keep


def baseline_points(params: Mapping[str, Sequence], model, system, dominance: bool) -> list[dict]:
    """The recipe points a baseline of `model` evaluates: all the space offers, or with `dominance`
    those no other provably matches or beats."""
    points = recipe_points(params)
    return undominated_points(points, model, system) if dominance else points


def reference_recipes(space: SearchSpace) -> dict[str, dict]:
    """A space's published recipes per model (`reference_recipes`), each completed to a whole point
    of its recipe fields (`SearchSpace.recipe_point`); {} for a space without them."""
    return {m: space.recipe_point(r) for m, r in (getattr(space, "reference_recipes", None) or {}).items()}


def reference_cluster(space: SearchSpace, system) -> dict:
    """The keyword that places a space's reference point in the reference `system`: only for a space
    with system axes, the one kind whose `reference_point` needs it."""
    return {"system": system} if getattr(space, "system_params", None) else {}


NO_EXPERT_FIT = "the expert placement fits TPUv4 at no recipe of the space; the optimal placement stands in"


def compute_baselines(models: Sequence[str], evaluator: Evaluator, reference_arch, system: str,
                      params: Mapping[str, Sequence], dominance: bool = False,
                      references: Mapping[str, dict] | None = None) -> dict[str, Baseline]:
    """Each model on the reference chip with its expert placement, at the best recipe of the space.

    The model configs fix the expert TP/PP/DP but not the recipe, so the baseline gets every recipe
    a trial may get: each combination of the space's microbatch, recompute and further recipe
    choices (`training.recipe_points`, whole `Training`s, nothing converted on the way). The ratios
    we report are then never flattered by a weak baseline. When the expert placement fits at no
    recipe, the optimal placement stands in (marked). A recipe whose evaluation raises (a solver
    error) is left out and its error kept for the reason.

    With `dominance` (only for the real evaluator, whose cost model the rules are facts of) the
    recipes another recipe provably matches or beats are not evaluated (`undominated_points`): the
    same best throughput, in a seventh of the evaluations on a space listing every recipe field.

    `references` (a space's `reference_recipes`, completed by `SearchSpace.recipe_point`): the one
    recipe a model's baseline runs, a published one, where searching every recipe of a space as
    large as `frontier` could not end.
    """
    out = {}
    for model in models:
        points = ([dict(references[model])] if references and model in references
                  else baseline_points(params, model, system, dominance))
        best = None
        errors = []
        for placement in ("expert", "optimal"):
            for point in points:
                training, invalid = point_recipe(point, placement)
                if invalid:  # no recipe: nothing to run (a trial there is infeasible too)
                    continue
                try:
                    r = evaluator(model, reference_arch, training, system=system)
                except PhazeError:
                    raise
                except Exception as exc:  # noqa: BLE001 - reported in the baseline's reason
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                if r.feasible and (best is None or r.throughput > best.throughput):
                    # a model without an expert placement is evaluated at the optimal one (r.note)
                    note = getattr(r, "note", "")
                    used = "optimal" if note else placement
                    stand_in = note or (NO_EXPERT_FIT if used == "optimal" else "")
                    best = Baseline(model, True, float(r.throughput), float(r.tokens_per_s), point["mbs"],
                                    point["recompute"], used, r.energy_j, "",
                                    {k: v for k, v in point.items() if k not in ("mbs", "recompute")}, str(system),
                                    stand_in)
            if best is not None:
                break
        if best is None:
            why = errors[0] if errors else "no placement of the model fits TPUv4 at any recipe of the space"
            best = Baseline(model, False, reason=why, system=str(system))
        out[model] = best
    return out
