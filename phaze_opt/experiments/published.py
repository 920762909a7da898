"""The published comparison (Phaze, ICML 2024): TPUv4 against searched designs, beside Phaze's 3.6x and 2.9x.

For each system and model, five throughputs (sequences/s) and their ratio to the first:

1. ``tpuv4_expert``   TPUv4 with the model's expert placement (`expert_placement` in its config) at the
   best microbatch/recompute setting of the space: the study's own TPUv4 baseline
   (`objective.compute_baselines`), so the ratios here and in every study report are the same numbers;
2. ``tpuv4_optimal``  TPUv4 with the optimal placement (the placement DP), best over the same settings;
3. ``expert_search``  the best design of an architecture search with the placement fixed to the expert
   one (a TPE study whose evaluator is `evaluate` with the placement forced to "expert"), as earlier
   accelerator searches do;
4. ``co_optimised``   the best design of the normal study (architecture and placement together);
5. ``common``         one design for all the models (the multi-model study: mean throughput relative to
   each model's TPUv4 baseline), and each model's throughput on it.

Each study enqueues TPUv4 at every microbatch/recompute choice first (the runner does this), so
row 3 >= row 1 and row 4 >= row 2 whenever the study has at least that many trials. The
per-model co-optimisation study is in addition seeded with the designs rows 3 and 5 found (queued
right after the TPUv4 points), so with the same trial budget its best is never below what the
narrower searches found for that model: row 4 >= rows 2, 3 and 5 by construction, and the table
shows the gain of co-design rather than the luck of one sampler run. `checks` in the result lists
any violated relation (there should be none).

Where the expert placement fits TPUv4 at no setting, row 1 is marked infeasible with the reason,
and the ratios of that model are taken against the study's stand-in baseline (TPUv4 with the
optimal placement, row 2), flagged in the table. Where a study finds no feasible design the row
says so. Nothing here raises for a design that cannot train.

Pure logic apart from running the studies (their Optuna storages go under `output_dir`) and
writing `published.json` / `published.md` there (`write_outputs`).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from ..errors import PhazeError
from ..jsonable import jsonable
from ..design.evaluate import evaluate
from ..design.protocols import BoundedEvaluator, Evaluator, Result
from ..hardware.accelerator import Accelerator
from ..training import RECIPE_FIELDS, Training, describe, point_recipe, recipe_points
from ..runs import say
from ..search import (Backend, Baseline, Session, StudyConfig, baseline_points, clean_name, compute_baselines,
                      default_storage, reference_system_for, run_study)

MODELS = ("gpt3-175b", "opt-1.3b", "llama2-7b", "bert-large", "gpt2-xl")
# Beyond the paper: a mixture of experts and a long context, each TPUv4 (expert and optimal placement) against
# its own co-designed chip (rows 1, 2 and 4; not in the common design, whose objective they would
# dominate). `phaze-opt published` runs them unless --no-extra.
EXTRA_MODELS = ("mixtral-8x7b", "llama2-7b-32k")
EXTRA_ROWS = ("tpuv4_expert", "tpuv4_optimal", "co_optimised")
SYSTEMS = ("default", "phaze")
ROWS = ("tpuv4_expert", "tpuv4_optimal", "expert_search", "co_optimised", "common")
ROW_TITLES = {
    "tpuv4_expert": "1 TPUv4, expert placement",
    "tpuv4_optimal": "2 TPUv4, optimal placement",
    "expert_search": "3 best design, expert placement",
    "co_optimised": "4 co-optimised, per model",
    "common": "5 common design",
}
# Phaze (Wang et al., ICML 2024), abstract: 3.6x (model-specific) and 2.9x (common) over TPUv4 on average.
PUBLISHED = {"co_optimised": 3.6, "common": 2.9}
DEFAULT_TRIALS = 30


# -- evaluators ---------------------------------------------------------------------------------------

def evaluate_fixed_placement(model, arch, training: Training, system="default", *, fixed: str = "expert",
                             evaluator: Evaluator | None = None):
    """`evaluator` (default `evaluate`) with the recipe's placement forced to `fixed`, whatever is asked
    (every other recipe field kept)."""
    if evaluator is None:
        evaluator = evaluate
    return evaluator(model, arch, training.with_placement(fixed), system=system)


def fixed_placement_evaluator(fixed: str, evaluator: Evaluator | None = None) -> Evaluator:
    """A picklable evaluator (for study workers) that always uses placement `fixed`."""
    return functools.partial(evaluate_fixed_placement, fixed=fixed, evaluator=evaluator)


# -- results ------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One cell group of the table: a design's throughput for one model, and how it was found."""

    feasible: bool
    throughput: float = 0.0  # sequences/s
    reason: str = ""  # why infeasible (or a note)
    ratio: float | None = None  # to the model's baseline (row 1, or its stand-in)
    accelerator: dict = field(default_factory=dict)  # Accelerator.fields()
    mbs: Any = None
    recompute: Any = None
    placement: dict = field(default_factory=dict)  # tp, pp, dp, microbatches
    area_mm2: float | None = None
    source: str = ""  # "tpuv4" or the study that found it
    trial: int | None = None
    bound: float | None = None  # proven upper bound when a layer schedule was not proven optimal
    recipe: dict = field(default_factory=dict)  # the further recipe fields (beyond mbs, recompute) it ran with
    system: str = ""  # the cluster it ran on

    def mark_unproven(self, proven, bound, unproven) -> "Row":
        """Flag a throughput that rests on layer schedules not proven optimal (reached, not proven best)."""
        if proven is False:
            self.bound = float(bound)
            note = (f"layer schedules not proven optimal in the ILP time limit ({', '.join(unproven or [])}): "
                    f"{_num(self.throughput)} seq/s is reached, at most {(self.bound / self.throughput - 1) * 100:.2g}% more")
            self.reason = f"{self.reason}; {note}" if self.reason else note
        return self

    def to_json(self) -> dict:
        return jsonable(asdict(self))


@dataclass(frozen=True)
class PublishedConfig:
    models: tuple[str, ...] = MODELS
    systems: tuple[str, ...] = SYSTEMS
    space: str = "phaze"
    trials: int = DEFAULT_TRIALS  # per study (each of rows 3, 4 per model, and row 5)
    seed: int = 0
    sampler: str = "tpe"
    output_dir: str = "studies/published"
    tracking_uri: str = "off"
    workers: int = 1
    reference_arch: str = "tpuv4"
    fresh: bool = True  # delete this table's study storages first (False: resume them)
    progress: bool | None = False
    ilp_time_limit_s: float | None = None  # per layer-pass schedule solve; None: the default (60 s)
    extra_models: tuple[str, ...] = ()  # EXTRA_MODELS from the command line (rows 1, 2 and 4 only)
    reference_system: str | None = None  # rows 1 and 2's cluster; None: the reference chip's own (tpuv4-pod)


def _proof(r: Result) -> tuple:
    """(proven, throughput bound, open passes) of an evaluator result, for `Row.mark_unproven`."""
    return r.proven, r.throughput_bound, r.unproven


def _placement_brief(p: dict | None) -> dict:
    p = p or {}
    return {k: p.get(k) for k in ("tp", "pp", "dp", "ep", "cp", "microbatches")}


def _accel_fields(arch: Accelerator) -> dict:
    return jsonable(arch.fields())


def _tpuv4_row(model, baseline: Baseline, evaluator, reference_arch, system, placement: str) -> Row:
    """Row 1 or 2 from a `Baseline`, re-evaluated once with its whole recipe for the placement details."""
    r = evaluator(model, reference_arch, baseline.training.with_placement(placement), system=system)
    row = Row(True, float(baseline.throughput), "", None, _accel_fields(reference_arch), baseline.mbs,
              baseline.recompute, _placement_brief(r.placement),
              float(r.area_mm2 or 0.0) or None, reference_arch.name or "tpuv4", recipe=dict(baseline.recipe or {}),
              system=_system_tag(system))
    return row.mark_unproven(*_proof(r))


class _Recorder:
    """An evaluator that remembers which calls raised (compute_baselines skips them silently)."""

    def __init__(self, evaluator: Evaluator):
        self.evaluator = evaluator
        self.errors: dict = {}  # (model, placement) -> ["<recipe>: error", ...]

    def __call__(self, model, arch, training: Training, system="default"):
        try:
            return self.evaluator(model, arch, training, system=system)
        except PhazeError:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, then handled by compute_baselines
            text = " ".join(f"{type(exc).__name__}: {exc}".split())
            self.errors.setdefault((model, training.placement.spec()), []).append(f"{_recipe_text(training)}: {text}")
            raise


def _recipe_text(training: Training) -> str:
    recipe = training.recipe()
    del recipe["placement"]  # the row says which placement it tried
    return ", ".join(describe(recipe, always=("mbs", "recompute")))


def least_memory_recipe(params) -> dict:
    """The space's recipe that keeps the least in memory, field by field (why the expert placement
    fits at no recipe is asked at this one): the smallest microbatch, the most recompute, sequence
    parallelism on, the deepest ZeRO, one virtual stage (more keep more microbatches in flight) and
    flash attention (no s x s scores kept), each where the space offers it."""
    recipes = [(point, recipe) for point in recipe_points(params) if (recipe := point_recipe(point)[0]) is not None]
    return min(recipes, key=lambda pair: pair[1].memory_rank())[0]


def _errors_note(errors: list, settings: int) -> str:
    if not errors:
        return ""
    return f"{len(errors)} of {settings} recipes could not be evaluated ({errors[0]})"


def tpuv4_rows(models: Sequence[str], evaluator: Evaluator, reference_arch, system: str,
               params) -> tuple[dict, dict, dict]:
    """Rows 1 and 2 per model, and the baselines (row 1 or its stand-in) the ratios divide by.

    Both rows are the best over every recipe the space offers (`objective.compute_baselines`: the
    microbatch, recompute and each further recipe field), each evaluated as a whole `Training`.
    A recipe whose evaluation raises (a solver error) is left out of the best, as the study's
    baseline does; the row then carries a note saying so. A recipe whose layer schedules were not
    all proven optimal counts with the throughput it reaches, flagged (`Row.mark_unproven`).
    """
    rec, rec_opt = _Recorder(evaluator), _Recorder(evaluator)
    real = isinstance(evaluator, BoundedEvaluator)  # dominated recipes need no evaluation (compute_baselines)
    baselines = compute_baselines(models, rec, reference_arch, system, params, dominance=real)
    optimal = compute_baselines(models, fixed_placement_evaluator("optimal", rec_opt), reference_arch, system, params,
                                dominance=real)
    row1, row2 = {}, {}
    tag = _system_tag(system)
    for m in models:
        settings = len(baseline_points(params, m, system, real))
        b = baselines[m]
        expert_errors = rec.errors.get((m, "expert"), [])
        if b.feasible and b.placement == "expert":
            row1[m] = _tpuv4_row(m, b, evaluator, reference_arch, system, "expert")
            row1[m].reason = "; ".join(x for x in (_errors_note(expert_errors, settings), row1[m].reason) if x)
        elif len(expert_errors) >= settings:
            row1[m] = Row(False, 0.0, f"TPUv4 with the expert placement could not be evaluated at any recipe "
                                      f"({expert_errors[0]})",
                          accelerator=_accel_fields(reference_arch), source="tpuv4", system=tag)
        else:
            # Why the expert placement does not fit: at the space's least memory-hungry recipe.
            probe = Training.from_point(least_memory_recipe(params), "expert")
            try:
                r = evaluator(m, reference_arch, probe, system=system)
                why = r.reason or "infeasible"
            except PhazeError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported, never a crash
                why = f"{type(exc).__name__}: {exc}"
            row1[m] = Row(False, 0.0, f"expert placement does not fit TPUv4 at any recipe of the space "
                                      f"({_recipe_text(probe)}: {why})",
                          accelerator=_accel_fields(reference_arch), source="tpuv4", system=tag)
        o = optimal[m]
        optimal_errors = rec_opt.errors.get((m, "optimal"), [])
        if o.feasible:
            row2[m] = _tpuv4_row(m, o, evaluator, reference_arch, system, "optimal")
            row2[m].reason = "; ".join(x for x in (_errors_note(optimal_errors, settings), row2[m].reason) if x)
        else:
            why = (f"could not be evaluated at any recipe ({optimal_errors[0]})" if len(optimal_errors) >= settings
                   else (o.reason or "no placement fits TPUv4"))
            row2[m] = Row(False, 0.0, why, accelerator=_accel_fields(reference_arch), source="tpuv4", system=tag)
    return row1, row2, baselines


def row_from_summary(summary: dict | None, model: str, reason_if_none: str) -> Row:
    """A study's best design, as seen by `model` (its throughput and placement for that model)."""
    best = (summary or {}).get("best")
    if not best:
        return Row(False, 0.0, reason_if_none, source=(summary or {}).get("study", ""))
    s = (best.get("models") or {}).get(model) or {}
    design = best.get("design") or {}
    feasible = bool(s.get("feasible", True)) and s.get("throughput") is not None
    row = Row(feasible, float(s.get("throughput") or 0.0), s.get("reason", "") or "", None,
              best.get("accelerator") or {}, design.get("mbs"), design.get("recompute"),
              _placement_brief(s.get("placement")), best.get("area_mm2"), summary.get("study", ""),
              best.get("trial"), recipe=_further_recipe(design), system=_system_tag(summary.get("system") or ""))
    return row.mark_unproven(s.get("proven", True), s.get("throughput_bound"), s.get("unproven"))


def _further_recipe(point: dict) -> dict:
    """The recipe fields of a point beyond microbatch and recompute (as the space wrote them)."""
    return {k: point[k] for k in RECIPE_FIELDS if k in point and k not in ("mbs", "recompute")}


def common_design_row(summary: dict | None, model: str, evaluator: Evaluator, space, system: str,
                      reason_if_none: str) -> Row:
    """A model left out of the common study (no TPUv4 baseline): its throughput on the common design."""
    best = (summary or {}).get("best")
    if not best or not best.get("design"):
        return Row(False, 0.0, reason_if_none, source=(summary or {}).get("study", ""))
    design = best["design"]
    note = "not part of the common objective (no TPUv4 baseline); evaluated on the common design afterwards"
    try:
        r = evaluator(model, space.accelerator(dict(design)), Training.from_point(design), system=system)
    except PhazeError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported, never a crash
        return Row(False, 0.0, f"{note}: {type(exc).__name__}: {exc}", source=summary.get("study", ""))
    if not r.feasible:
        return Row(False, 0.0, f"{note}: {r.reason}", source=summary.get("study", ""))
    row = Row(True, float(r.throughput), note, None, best.get("accelerator") or {}, design.get("mbs"),
              design.get("recompute"), _placement_brief(r.placement), best.get("area_mm2"), summary.get("study", ""),
              best.get("trial"), recipe=_further_recipe(design), system=_system_tag(system))
    return row.mark_unproven(*_proof(r))


def apply_ratios(rows: dict, baselines: dict) -> None:
    """Ratio of every feasible row to the model's baseline throughput (row 1, or its stand-in)."""
    for m, by_row in rows.items():
        b = baselines.get(m)
        denom = b.throughput if b is not None and b.feasible and b.throughput > 0 else None
        for row in by_row.values():
            row.ratio = (row.throughput / denom) if (denom and row.feasible) else None


def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def mean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarise_ratios(rows: dict) -> dict:
    out = {}
    for key in ROWS:
        ratios = [rows[m][key].ratio for m in rows if rows[m][key].ratio is not None]
        out[key] = {"geomean": geomean(ratios), "mean": mean(ratios), "models": len(ratios)}
    return out


REL_TOL = 1e-9


def check_relations(rows: dict, same_system: bool = True) -> list[str]:
    """The relations the construction guarantees; each violation is one line (expected: none).

    Rows 3 and 4 are at least rows 1 and 2 only when the TPUv4 rows ran on the studies' own system
    (the studies evaluate TPUv4 there first); on its own cluster the reference may beat them."""
    out = []

    def ge(m, a, b, why):
        ra, rb = rows[m][a], rows[m][b]
        if rb.feasible and (not ra.feasible or ra.throughput < rb.throughput * (1 - REL_TOL)):
            notes = "".join(f"; row {ROW_TITLES[k]}: {r.reason}" for k, r in ((a, ra), (b, rb)) if r.reason)
            out.append(f"{m}: row {ROW_TITLES[a]} ({ra.throughput:.6g}) < row {ROW_TITLES[b]} "
                       f"({rb.throughput:.6g}); expected >= ({why}){notes}")

    for m in rows:
        ge(m, "tpuv4_optimal", "tpuv4_expert", "the optimal placement at the same design")
        if same_system:
            ge(m, "expert_search", "tpuv4_expert", "the expert-placement study evaluates TPUv4 first")
            ge(m, "co_optimised", "tpuv4_optimal", "the study evaluates TPUv4 first")
        ge(m, "co_optimised", "expert_search", "seeded with the expert-search design")
        ge(m, "co_optimised", "common", "seeded with the common design")
    return out


# -- running the studies ------------------------------------------------------------------------------

def _study_config(cfg: PublishedConfig, system: str, models: tuple[str, ...], name: str) -> StudyConfig:
    return StudyConfig(models=models, space=cfg.space, system=system, sampler=cfg.sampler, seed=cfg.seed,
                       trials=cfg.trials, study_name=name, storage=default_storage(name, cfg.output_dir),
                       tracking_uri=cfg.tracking_uri, workers=cfg.workers, output_dir=cfg.output_dir,
                       reference_arch=cfg.reference_arch, progress=cfg.progress, ilp_time_limit_s=cfg.ilp_time_limit_s,
                       reference_system=reference_system_for(cfg.reference_arch, cfg.reference_system, system))


def _system_tag(system: str) -> str:
    text = str(system)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        text = Path(text).stem
    return clean_name(text)


def study_names(cfg: PublishedConfig, system: str) -> dict:
    tag = f"{_system_tag(system)}-{cfg.sampler}-seed{cfg.seed}"
    names = {"common": f"published-{tag}-common"}
    for m in (*cfg.models, *cfg.extra_models):
        mt = Path(m).stem if str(m).endswith((".yaml", ".yml")) else m
        names[("expert_search", m)] = f"published-{tag}-{mt}-expert"
        names[("co_optimised", m)] = f"published-{tag}-{mt}-coopt"
    return names


def _remove_storage(name: str, output_dir: str) -> None:
    base = Path(output_dir)
    for suffix in (".db", ".db-wal", ".db-shm", ".db-journal", "-summary.json"):
        p = base / f"{name}{suffix}"
        if p.exists():
            p.unlink()


def _run(config: StudyConfig, backend: Backend, seeds: Sequence[tuple[str, dict]] = ()) -> dict:
    """run_study, after queueing `seeds` (label, point) behind the TPUv4 points of a new study."""
    if seeds:
        session = Session(replace(config, tracking_uri="off"), backend)
        session.begin()  # the references it queues include each model's baseline recipe
        try:
            if not session.resumed:
                session.enqueue_references()
                for label, point in seeds:
                    session.study.enqueue_trial(session.codec.encode(dict(point)), user_attrs={"seeded_from": label},
                                                skip_if_exists=True)
        finally:
            session.close()
    return run_study(config, backend)


def min_trials(space) -> int:
    """TPUv4 at every microbatch/recompute choice and at the baseline's recipe, plus the three seeds
    of the co-optimisation study (TPUv4 at row 2's recipe, the designs of rows 3 and 5)."""
    return len(space.params["mbs"]) * len(space.params["recompute"]) + 1 + 3


def _reference_seed(space, reference_arch: str, row: Row) -> list[tuple[str, dict]]:
    """The reference chip at a TPUv4 row's whole recipe, as a seed (so the co-optimisation study
    evaluates the recipe row 2 found best); none when the row is infeasible or the space cannot
    build it."""
    if not row.feasible:
        return []
    try:
        point = space.reference_point(reference_arch, recipe={"mbs": row.mbs, "recompute": row.recompute,
                                                              **(row.recipe or {})})
    except PhazeError:
        return []
    return [("tpuv4_optimal", point)]


def run_system(cfg: PublishedConfig, system: str, backend: Backend) -> dict:
    """The table of one system: rows per model, ratio means, the studies run, checks."""
    t0 = time.perf_counter()
    base = backend.resolved(StudyConfig(space=cfg.space, reference_arch=cfg.reference_arch,
                                        ilp_time_limit_s=cfg.ilp_time_limit_s))
    space, evaluator, reference = base.space, base.evaluator, base.reference_arch
    names = study_names(cfg, system)
    if cfg.fresh:
        for n in names.values():
            _remove_storage(n, cfg.output_dir)
    timings = {}

    ref_system = reference_system_for(cfg.reference_arch, cfg.reference_system, system)
    say(f"[{system}] TPUv4 rows on {ref_system} (expert and optimal placement, the best of "
        f"{len(recipe_points(space.params))} recipes each)")
    t = time.perf_counter()
    row1, row2, baselines = tpuv4_rows(cfg.models, evaluator, reference, ref_system, space.params)
    timings["tpuv4_s"] = time.perf_counter() - t
    rows = {m: {"tpuv4_expert": row1[m], "tpuv4_optimal": row2[m]} for m in cfg.models}
    summaries: dict[str, Any] = {}

    expert_backend = replace(base, evaluator=fixed_placement_evaluator("expert", evaluator))
    timings["expert_search_s"] = {}
    for m in cfg.models:
        name = names[("expert_search", m)]
        say(f"[{system}] row 3, {m}: {cfg.trials} trials with the expert placement ({name})")
        t = time.perf_counter()
        summary = _run(_study_config(cfg, system, (m,), name), expert_backend)
        timings["expert_search_s"][m] = time.perf_counter() - t
        summaries[name] = summary
        rows[m]["expert_search"] = row_from_summary(summary, m, f"no feasible design with the expert placement "
                                                                f"in {cfg.trials} trials")

    name = names["common"]
    common_models = tuple(m for m in cfg.models if baselines[m].feasible and baselines[m].throughput > 0)
    left_out = [m for m in cfg.models if m not in common_models]
    say(f"[{system}] row 5: {cfg.trials} trials, one design for {', '.join(common_models) or 'no model'} ({name})"
         + (f"; left out (no TPUv4 baseline to normalise by): {', '.join(left_out)}" if left_out else ""))
    t = time.perf_counter()
    common = None
    why = "no model has a TPUv4 baseline to normalise by"
    if common_models:
        try:
            common = _run(_study_config(cfg, system, common_models, name), base)
            why = f"no design feasible for every model in {cfg.trials} trials"
        except PhazeError as exc:
            why = f"common study not run: {exc}"
    summaries[name] = common
    for m in common_models:
        rows[m]["common"] = row_from_summary(common, m, why)
    for m in left_out:
        rows[m]["common"] = common_design_row(common, m, evaluator, space, system, why)
    timings["common_s"] = time.perf_counter() - t

    timings["co_optimised_s"] = {}
    for m in cfg.models:
        name = names[("co_optimised", m)]
        seeds = _reference_seed(space, cfg.reference_arch, rows[m]["tpuv4_optimal"])
        for key in ("expert_search", "common"):
            row = rows[m][key]
            best = (summaries.get(row.source) or {}).get("best") if row.feasible else None
            if best and best.get("design"):
                same = [i for i, (_, d) in enumerate(seeds) if d == best["design"]]
                if same:  # one design found by both searches: queue it once
                    seeds[same[0]] = (f"{seeds[same[0]][0]}+{key}", seeds[same[0]][1])
                else:
                    seeds.append((key, best["design"]))
        say(f"[{system}] row 4, {m}: {cfg.trials} trials, co-optimised, seeded with the designs of "
             f"{', '.join(k for k, _ in seeds) or 'none'} ({name})")
        t = time.perf_counter()
        summary = _run(_study_config(cfg, system, (m,), name), base, seeds)
        timings["co_optimised_s"][m] = time.perf_counter() - t
        summaries[name] = summary
        rows[m]["co_optimised"] = row_from_summary(summary, m, f"no feasible design in {cfg.trials} trials")

    rows = {m: {k: rows[m][k] for k in ROWS} for m in cfg.models}
    apply_ratios(rows, baselines)
    extra_rows, extra_baselines = _run_extra(cfg, system, base, names, timings)
    timings["wall_s"] = time.perf_counter() - t0
    return {
        "extra_rows": extra_rows,
        "extra_baselines": extra_baselines,
        "system": system,
        "rows": rows,
        "baselines": {m: b.to_json() for m, b in baselines.items()},
        "ratio_means": summarise_ratios(rows),
        "checks": check_relations(rows, _system_tag(ref_system) == _system_tag(system)),
        "reference_system": _system_tag(ref_system),
        "studies": {(k if isinstance(k, str) else f"{k[0]}:{k[1]}"): n for k, n in names.items()},
        "trials": {n: (s or {}).get("trials") for n, s in summaries.items()},
        "timings": timings,
    }


def _run_extra(cfg: PublishedConfig, system: str, base: Backend, names: dict, timings: dict) -> tuple[dict, dict]:
    """Rows 1, 2 and 4 of the MoE and long-context models (EXTRA_MODELS), ratios to row 1."""
    if not cfg.extra_models:
        return {}, {}
    say(f"[{system}] MoE and long-context rows: {', '.join(cfg.extra_models)}")
    t = time.perf_counter()
    row1, row2, baselines = tpuv4_rows(cfg.extra_models, base.evaluator, base.reference_arch,
                                       reference_system_for(cfg.reference_arch, cfg.reference_system, system),
                                       base.space.params)
    rows = {}
    for m in cfg.extra_models:
        name = names[("co_optimised", m)]
        say(f"[{system}] row 4, {m}: {cfg.trials} trials, co-optimised ({name})")
        summary = _run(_study_config(cfg, system, (m,), name), base)
        rows[m] = {"tpuv4_expert": row1[m], "tpuv4_optimal": row2[m],
                   "co_optimised": row_from_summary(summary, m, f"no feasible design in {cfg.trials} trials")}
    apply_ratios(rows, baselines)
    timings["extra_s"] = time.perf_counter() - t
    return rows, {m: b.to_json() for m, b in baselines.items()}


def run_extra_only(cfg: PublishedConfig, system: str, backend: Backend | None = None) -> dict:
    """Only the MoE / long-context rows of one system (benchmarks/published_moe.py), rendered by
    `render_extra`."""
    backend = backend or Backend()
    base = backend.resolved(StudyConfig(space=cfg.space, reference_arch=cfg.reference_arch,
                                        ilp_time_limit_s=cfg.ilp_time_limit_s))
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    names = study_names(cfg, system)
    if cfg.fresh:
        for n in names.values():
            _remove_storage(n, cfg.output_dir)
    timings: dict = {}
    rows, baselines = _run_extra(cfg, system, base, names, timings)
    return {"system": system, "extra_rows": rows, "extra_baselines": baselines, "timings": timings}


def render_extra(result: dict) -> str:
    """The MoE / long-context table: TPUv4 against each model's co-designed chip, and the designs."""
    rows = result.get("extra_rows") or {}
    if not rows:
        return ""
    lines = [f"### MoE and long context, system `{result['system']}`", "",
             "| model | " + " | ".join(ROW_TITLES[k] for k in EXTRA_ROWS) + " |", "|---|" + "---|" * len(EXTRA_ROWS)]
    for m, by_row in rows.items():
        lines.append(f"| {m} | " + " | ".join(_cell(by_row[k]) for k in EXTRA_ROWS) + " |")
    lines += ["", "| model | row | design |", "|---|---|---|"]
    for m, by_row in rows.items():
        for k in EXTRA_ROWS:
            lines.append(f"| {m} | {ROW_TITLES[k]} | {design_brief(by_row[k])} |")
            if by_row[k].reason:
                lines.append(f"| | | note: {by_row[k].reason} |")
    return "\n".join(lines)


def run_published(cfg: PublishedConfig, backend: Backend | None = None) -> dict:
    """Every system's table; `backend` as for `run_study` (the real pipeline when None)."""
    backend = backend or Backend()
    if isinstance(cfg.trials, bool) or not isinstance(cfg.trials, int) or cfg.trials <= 0:
        raise PhazeError(f"--trials: expected a positive whole number, got {cfg.trials!r}")
    if not cfg.models or not cfg.systems:
        raise PhazeError("give at least one model and one system")
    space = backend.resolved(StudyConfig(space=cfg.space, reference_arch=cfg.reference_arch,
                                         ilp_time_limit_s=cfg.ilp_time_limit_s)).space
    need = min_trials(space)
    if cfg.trials < need:
        raise PhazeError(f"--trials {cfg.trials}: each study first evaluates TPUv4 at every microbatch/recompute "
                         f"choice and at its baseline's recipe, and the co-optimisation study three seed designs; "
                         f"give at least {need}")
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    systems = {s: run_system(cfg, s, backend) for s in cfg.systems}
    return {
        "config": jsonable(asdict(cfg)),
        "published": dict(PUBLISHED),
        "systems": systems,
        "wall_s": time.perf_counter() - t0,
    }


# -- rendering ----------------------------------------------------------------------------------------

def _num(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _cell(row: Row) -> str:
    if not row.feasible:
        return "infeasible"
    return f"{_num(row.throughput)} ({_ratio(row.ratio)})" + (" †" if row.bound is not None else "")


def design_brief(row: Row) -> str:
    """`8x128x128 TC, 2 VC x128, GLB 128 MiB, HBM 32 GiB; mbs 1, rc off; TP/PP/DP 4/32/8`."""
    if not row.feasible:
        return "-"
    a = row.accelerator or {}
    parts = []
    if a:
        glb = a.get("glb_bytes", 0) / 2**20
        hbm = a.get("hbm_bytes", 0) / 2**30
        parts.append(f"{a.get('num_tc')}x{a.get('tc_x')}x{a.get('tc_y')} TC, {a.get('num_vc')} VC x{a.get('vc_width')}, "
                     f"GLB {glb:g} MiB, HBM {hbm:g} GiB")
    rc = row.recompute
    rc_text = rc if isinstance(rc, str) else ("on" if rc else "off")
    parts.append(f"mbs {row.mbs}, rc {rc_text}" + "".join(f", {k} {v}" for k, v in (row.recipe or {}).items()))
    p = row.placement or {}
    if p.get("tp") is not None:
        parts.append(f"TP/PP/DP {p.get('tp')}/{p.get('pp')}/{p.get('dp')}"
                     + (f", EP {p['ep']}" if (p.get("ep") or 1) > 1 else "") + (f", CP {p['cp']}" if (p.get("cp") or 1) > 1 else ""))
    return "; ".join(parts)


def render_system(result: dict, trials: int | None = None) -> str:
    system = result["system"]
    rows = result["rows"]
    baselines = result["baselines"]
    ref_system = result.get("reference_system") or _system_tag(system)
    lines = [f"### System `{system}`", "",
             f"Rows 1 and 2 (TPUv4, each at the best of every recipe the space offers) ran on system "
             f"`{ref_system}`; rows 3 to 5 on `{_system_tag(system)}`.", ""]
    lines.append("| model | " + " | ".join(ROW_TITLES[k] for k in ROWS) + " |")
    lines.append("|---|" + "---|" * len(ROWS))
    notes = []
    for m, by_row in rows.items():
        mark = ""
        b = baselines.get(m) or {}
        if not by_row["tpuv4_expert"].feasible:
            mark = " *"
            denom = ("TPUv4 with the optimal placement (row 2)" if b.get("feasible") else "nothing (no TPUv4 baseline)")
            notes.append(f"\\* {m}: {by_row['tpuv4_expert'].reason}; ratios are to {denom}.")
        lines.append(f"| {m}{mark} | " + " | ".join(_cell(by_row[k]) for k in ROWS) + " |")
    means = result["ratio_means"]
    lines.append("| geomean ratio | " + " | ".join(_ratio(means[k]["geomean"]) for k in ROWS) + " |")
    lines.append("| mean ratio | " + " | ".join(_ratio(means[k]["mean"]) for k in ROWS) + " |")
    lines.append("| Phaze (published) | 1x | | | " + f"{PUBLISHED['co_optimised']}x | {PUBLISHED['common']}x |")
    lines.append("")
    lines.append("Throughput in sequences/s (ratio to row 1)." + (f" {trials} trials per study." if trials else "")
                 + (" †: a layer schedule behind it was not proven optimal in the ILP time limit; the throughput "
                    "is reached by verified schedules, its proven bound is in the note below."
                    if any(r.bound is not None for by_row in rows.values() for r in by_row.values()) else ""))
    for n in notes:
        lines.append("")
        lines.append(n)
    for m, by_row in rows.items():
        for k in ROWS:
            r = by_row[k]
            if not r.feasible and k != "tpuv4_expert":
                lines.append("")
                lines.append(f"{m}, row {ROW_TITLES[k]}: infeasible: {r.reason}")
            elif r.feasible and r.reason:
                lines.append("")
                lines.append(f"{m}, row {ROW_TITLES[k]}: note: {r.reason}")
    lines.append("")
    lines.append("Designs (TCs x PE array, VCs x lanes, GLB, HBM; microbatch, recompute; TP/PP/DP):")
    lines.append("")
    lines.append("| model | row | design |")
    lines.append("|---|---|---|")
    for m, by_row in rows.items():
        for k in ROWS:
            lines.append(f"| {m} | {ROW_TITLES[k]} | {design_brief(by_row[k])} |")
    checks = result.get("checks") or []
    lines.append("")
    if checks:
        lines.append("Relations violated (a bug):")
        lines += [f"- {c}" for c in checks]
    else:
        lines.append("Checked: row 2 >= row 1, row 3 >= row 1, row 4 >= rows 2, 3 and 5 for every model."
                     if ref_system == _system_tag(system) else
                     "Checked: row 2 >= row 1, row 4 >= rows 3 and 5 for every model (rows 1 and 2 ran on another "
                     "system, so rows 3 and 4 need not beat them).")
    return "\n".join(lines)


def render(result: dict) -> str:
    cfg = result["config"]
    head = [f"## Published comparison: {', '.join(cfg['models'])}",
            "",
            f"Space `{cfg['space']}`, {cfg['sampler'].upper()} seed {cfg['seed']}, {cfg['trials']} trials per study "
            f"(rows 3 and 4 per model, row 5 once per system); wall {result['wall_s']:.0f} s. "
            f"Phaze (ICML 2024): {PUBLISHED['co_optimised']}x model-specific, {PUBLISHED['common']}x common over TPUv4.",
            ""]
    body = [render_system(s, cfg["trials"]) + ("\n\n" + render_extra(s) if s.get("extra_rows") else "")
            for s in result["systems"].values()]
    return "\n".join(head) + "\n" + "\n\n".join(body) + "\n"


def write_outputs(result: dict, output_dir: str | Path, stem: str = "published") -> dict:
    """`<output_dir>/<stem>.json` (all numbers, SI) and `<stem>.md` (the rendered tables)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    import json

    js, md = out / f"{stem}.json", out / f"{stem}.md"
    js.write_text(json.dumps(jsonable(result), indent=1, default=str))
    md.write_text(render(result))
    return {"json": str(js), "markdown": str(md)}
