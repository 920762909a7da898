"""The end of a study: its summary (best design, placement, ratios), Pareto plot and text report.

Units: the summary keeps SI (sequences/s, s, mm^2); only `render` formats for people.
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..activity import phase
from ..design.pareto import front as front_vectors, minimised
from ..figures import pyplot, write_figure
from ..runs.disk import write_whole
from ..runs.reconcile import count_own
from .session import best_trial, finished_trials, is_feasible, repeated_designs
from .setup import default_storage, default_study_name, resolve_sampler, resolve_strategy
from ..runs.tracking import FRONT_TAG, DEFAULT_TRACKING_URI, MODEL_METRICS, redact, run_url, trials_url, ui_command, venv_command


def phaze_opt_ui(study: str, tracking_uri: str) -> str:
    """`phaze-opt ui` for this study, as the user can type it from the folder the study ran in."""
    uri = "" if tracking_uri == DEFAULT_TRACKING_URI else f" --tracking-uri {redact(tracking_uri)}"
    return f"{venv_command('phaze-opt')} ui --study {study}{uri}"


def pareto_front(trials, directions: Sequence[str]) -> list:
    """Feasible trials no other feasible trial dominates (all objectives at least as good, one better);
    trials with the same values are all kept."""
    feasible = [t for t in trials if is_feasible(t)]
    if not feasible:
        return []
    values = minimised([t.values for t in feasible], directions)
    on_front = {tuple(v) for v in front_vectors(values)}
    return sorted((t for t, v in zip(feasible, values) if tuple(v) in on_front), key=lambda t: -t.values[0])


def unproven_points(trials: Iterable) -> list[dict]:
    """Feasible finished trials whose score rests on layer schedules not proven optimal, with their bound."""
    out = []
    for t in finished_trials(trials):
        res = t.user_attrs.get("result") or {}
        if is_feasible(t) and res.get("proven") is False:
            out.append({"trial": t.number, "point": t.user_attrs.get("point"), "score": float(t.values[0]),
                        "bound": float(res.get("score_bound", math.inf))})
    return out


def baseline_recipe_text(base: dict) -> str:
    """`mbs=2, recompute=selective, sequence_parallel=True, ..., expert placement, on system tpuv4-pod`:
    the baseline's whole recipe and the cluster it ran on, as a summary line names them."""
    recipe = {"mbs": base.get("mbs"), "recompute": base.get("recompute"), **(base.get("recipe") or {})}
    text = ", ".join(f"{k}={v}" for k, v in recipe.items())
    return f"{text}, {base.get('placement')} placement" + (f", on system {base['system']}" if base.get("system") else "")


def reference_label(reference_arch: str | None) -> str:
    """How a summary names its reference chip: TPUv4 (Phaze's), else the design's own name."""
    return "TPUv4" if reference_arch in (None, "tpuv4") else str(reference_arch)


def baseline_lines(ratio: float | None, base: dict, reference: str = "TPUv4") -> list[str]:
    """What a model's best throughput was measured against: the reference chip's baseline with the
    placement it really ran (the optimal one stands in when the model has no expert placement or it
    fits at no recipe, and the lines say so and why, rather than call it expert)."""
    if ratio is None:
        return [f"      no {reference} expert baseline: {base.get('reason') or 'not available'}"]
    placement = base.get("placement") or "expert"
    lines = [f"      {ratio:.3f}x {reference} with the {placement} placement "
             f"({_fmt(base.get('throughput'), ' seq/s', 5)}; {baseline_recipe_text(base)})"]
    if placement != "expert":  # a study stored before stand_in existed: the reason is not known
        lines.append(f"        ({base.get('stand_in') or 'the optimal placement stood in for the expert one'})")
    return lines


def describe_trial(trial, baselines: dict) -> dict:
    result = trial.user_attrs.get("result") or {}
    models = {}
    for m, s in (result.get("models") or {}).items():
        base = baselines.get(m)
        ratio = None
        if base is not None and base.feasible and base.throughput and s.get("throughput") is not None:
            ratio = s["throughput"] / base.throughput
        models[m] = {**s, "ratio_to_tpuv4_expert": ratio}
    ratios = [v["ratio_to_tpuv4_expert"] for v in models.values()]
    return {
        "trial": trial.number,
        "design": trial.user_attrs.get("point"),
        "accelerator": result.get("accelerator"),
        **({"system": result["system"]} if result.get("system") else {}),  # a space with system axes
        "score": trial.values[0] if trial.values else None,
        "proven": result.get("proven", True),
        "score_bound": result.get("score_bound"),
        "values": list(trial.values or []),
        "area_mm2": result.get("area_mm2"),
        **({"cost_usd": result["cost_usd"]} if result.get("cost_usd") is not None else {}),  # the cost objective
        "elapsed_s": result.get("elapsed_s"),
        "models": models,
        "ratio_to_tpuv4_expert": (sum(ratios) / len(ratios)) if ratios and None not in ratios else None,
    }


def plot_pareto(trials, objectives: Sequence[str], directions: Sequence[str], path: Path, title: str) -> Path | None:
    """All feasible trials and their Pareto front, one panel per pair of objectives."""
    feasible = [t for t in trials if is_feasible(t)]
    if len(objectives) < 2 or not feasible:
        return None
    front = {t.number for t in pareto_front(trials, directions)}
    pairs = [(0, j) for j in range(1, len(objectives))]
    if len(objectives) == 3:
        pairs.append((1, 2))
    fig, axes = pyplot().subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.5), squeeze=False)
    labels = {"throughput": "throughput objective", "area": "area (mm$^2$)", "energy": "energy objective",
              "cost": "cluster cost (US\\$)"}
    for ax, (i, j) in zip(axes[0], pairs):
        xs = [t.values[j] for t in feasible]
        ys = [t.values[i] for t in feasible]
        ax.scatter(xs, ys, s=12, c="0.7", label="feasible trials")
        pts = sorted(((t.values[j], t.values[i]) for t in feasible if t.number in front))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color="C3", ms=5, label="Pareto front")
        ax.set_xlabel(labels.get(objectives[j], objectives[j]))
        ax.set_ylabel(labels.get(objectives[i], objectives[i]))
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return write_figure(fig, path, write=write_whole)


def _study_flags(config) -> list[str]:
    """The `study`/`compare` options that say where a study lives, when they are not the defaults."""
    flags = []
    if config.output_dir != "studies":
        flags += ["--output-dir", str(config.output_dir)]
    if config.storage:
        flags += ["--storage", redact(config.storage)]
    if str(config.tracking_uri) != DEFAULT_TRACKING_URI:
        flags += ["--tracking-uri", redact(config.tracking_uri)]
    return flags


def next_steps(session) -> dict:
    """The study to compare this one with, and the commands: for a sampled study the exhaustive sweep
    of the same models, space, system and objectives (what `compare` is for); for a sweep, TPE."""
    c = session.config
    other, what, extra = c.searcher.counterpart(c)
    other = replace(other, strategy=resolve_strategy(other, session.backend),
                    sampler=resolve_sampler(other, session.backend))
    name = default_study_name(other)
    exe = venv_command("phaze-opt")
    study = [exe, "study"] + [a for m in c.models for a in ("--model", str(m))] + ["--space", str(c.space)]
    if str(c.system) != "default":
        study += ["--system", str(c.system)]
    if str(c.reference_arch) != "tpuv4":
        study += ["--reference-arch", str(c.reference_arch)]
    if c.reference_system:
        study += ["--reference-system", str(c.reference_system)]
    if tuple(c.objectives) != ("throughput",):
        study += ["--objectives", ",".join(c.objectives)]
    flags = _study_flags(c)
    exists = None if c.storage else Path(default_storage(name, c.output_dir)[len("sqlite:///"):]).is_file()
    return {"other_study": name, "other_is": f"{what} of the same models and space", "other_exists": exists,
            "run_other": shlex.join(study + extra + flags),
            "compare": shlex.join([exe, "compare", session.name, name] + flags)}


def known_optimum(config, sweep: str) -> dict | None:
    """The optimum the exhaustive sweep of the same models, space and objectives proved, when its
    summary sits beside this study's; None otherwise (not run, not proven, or several objectives)."""
    path = Path(config.output_dir) / f"{sweep}-summary.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    status = data.get("exhaustive") or {}
    best = data.get("best") or {}
    if not status.get("optimum_proven") or not isinstance(best.get("score"), (int, float)) or best["score"] <= 0:
        return None
    return {"study": sweep, "score": float(best["score"])}


def own_trials(session, done) -> int:
    """This invocation's finished trials (not another process's on the same storage, see `reconcile`)."""
    session_id = getattr(session, "session_id", None)
    return count_own(done, session_id) if session_id else len(done) - session.trials_before


def crash_notes(session, done) -> list[str]:
    """What the start-up reconciliation did, and a `--trials` overshoot by concurrent processes."""
    notes = []
    zombies = getattr(session, "zombies", None)
    if zombies:
        notes.append(f"trials {', '.join(map(str, zombies))} were left by a process that is gone: failed as "
                     "interrupted (not counted) and their points queued again")
    fixed = getattr(session, "reconciled", None) or {}
    if any(fixed.values()):
        notes.append(f"MLflow reconciled with the study: {fixed.get('logged', 0)} missing trial runs logged, "
                     f"{fixed.get('closed', 0)} runs left RUNNING closed as KILLED, "
                     f"{fixed.get('deleted', 0)} incomplete or duplicate runs deleted")
    over = len(done) - session.config.trials
    if session.config.searcher.counts_trials and over > 0 and own_trials(session, done) > 0:
        notes.append(f"{len(done)} finished trials, {over} over --trials {session.config.trials}: they were in "
                     "flight in other processes or workers when the study reached its total")
    return notes


def finish(session, worker_stats: Sequence[dict], extra: dict | None = None) -> dict:
    """Build the summary, save the Pareto plot and summary.json, log them to the parent run."""
    with phase("writing the summary and flushing MLflow"):
        return _summary(session, worker_stats, extra)


def _summary(session, worker_stats: Sequence[dict], extra: dict | None) -> dict:
    config = session.config
    trials = session.all_trials()
    done = finished_trials(trials)
    feasible = [t for t in done if is_feasible(t)]
    failed = [t for t in done if t.state.name == "FAIL"]
    best = best_trial(done)
    wall = session.end_wall()
    summary: dict[str, Any] = {
        "study": session.name,
        "storage": redact(session.url),
        "mode": config.mode,
        "resumed": session.resumed,
        "models": list(config.models),
        "space": getattr(session.space, "name", config.space),
        "system": config.system,
        "reference_arch": config.reference_arch,
        "sampler": config.searcher.sampler_label(config),
        "seed": config.seed,
        "objectives": list(config.objectives),
        "score": ("mean throughput / TPUv4-expert throughput over the models" if len(config.models) > 1
                  else "throughput, sequences/s"),
        "trials": {"finished": len(done), "feasible": len(feasible), "infeasible": len(done) - len(feasible) - len(failed),
                   "failed": len(failed), "unproven": len(unproven_points(done)), "this_run": own_trials(session, done),
                   "repeated_designs": repeated_designs(done)},
        "wall_s": wall - session.offset_s,
        "elapsed_s": wall,  # the study's wall time over all its runs (session.study_wall_s), as compare shows it
        "baselines": {m: b.to_json() for m, b in session.baselines.items()},
        "best": describe_trial(best, session.baselines) if best is not None else None,
        "notes": list(session.notes) + crash_notes(session, done),
    }
    errors = [e for s in worker_stats for e in s.get("tracking_errors", [])]
    if len(config.objectives) > 1:
        front = pareto_front(done, config.directions)
        summary["pareto"] = {"trials": [describe_trial(t, session.baselines) for t in front]}
        path = plot_pareto(done, config.objectives, config.directions,
                           Path(config.output_dir) / f"{session.name}-pareto.png",
                           f"{session.name}\n{len(front)} Pareto-optimal of {len(feasible)} feasible designs")
        summary["pareto"]["plot"] = str(path) if path else None
        if path:
            session.tracker.log_parent_file(path)
        session.tracker.tag_trials(session.name, [t.number for t in front], {FRONT_TAG: "true"})
    if extra:
        summary.update(extra)
    tracker = session.tracker
    summary["mlflow"] = None
    out = Path(config.output_dir) / f"{session.name}-summary.json"
    summary["summary_file"] = str(out)
    summary["next"] = next_steps(session)
    optimum = known_optimum(config, summary["next"]["other_study"])
    if config.mode == "sampled" and optimum is not None and summary["best"] is not None:
        fraction = summary["best"]["score"] / optimum["score"]
        summary["optimum"] = {**optimum, "fraction": fraction}
        summary["notes"].append(f"{fraction * 100:.2f}% of the proven optimum {optimum['score']:.6g} "
                                f"(exhaustive sweep {optimum['study']})")
    if tracker.enabled:
        summary["mlflow"] = {"tracking_uri": redact(config.tracking_uri),
                             "experiment": getattr(tracker, "experiment_name", None) or session.name,
                             "experiment_id": tracker.experiment_id, "parent_run_id": tracker.parent_run_id,
                             "parent_run_name": tracker.run_name, "ui": ui_command(config.tracking_uri),
                             "phaze_opt_ui": phaze_opt_ui(session.name, config.tracking_uri),
                             "run_url": run_url(tracker.experiment_id, tracker.parent_run_id),
                             "trials_url": trials_url(tracker.experiment_id)}
        tracker.log_best_final(trials)  # best_score stays the series by trial number
        metrics = {"trials": len(done), "feasible_trials": len(feasible), "wall_s": summary["wall_s"]}
        if best is not None:
            b = summary["best"]
            metrics.update({"best_area_mm2": b["area_mm2"] or float("nan"), "best_trial": best.number})
            if b["ratio_to_tpuv4_expert"] is not None:
                metrics["ratio_to_tpuv4_expert"] = b["ratio_to_tpuv4_expert"]
            for m, s in b["models"].items():
                prefix = "" if len(b["models"]) == 1 else f"{m}."
                for k in ("throughput", "tokens_per_s", "mfu"):
                    if isinstance(s.get(k), (int, float)):
                        metrics[f"best_{prefix}{MODEL_METRICS[k]}"] = s[k]
        tracker.log_parent(metrics=metrics, tags={"best_trial": str(best.number) if best else "none"})
    write_whole(out, json.dumps(summary, indent=1, default=str))
    if tracker.enabled:
        tracker.log_parent_file(out)
        tracker.flush()
        errors += list(tracker.errors)
        summary["mlflow"]["errors"] = errors
    return summary


def _fmt(value, unit="", digits=3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}g}{unit}" if abs(value) < 1e4 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def render(summary: dict) -> str:
    """The human-readable end-of-study report."""
    lines = []
    t = summary["trials"]
    lines.append(f"study {summary['study']} ({summary['mode']}, {summary['sampler']}) on "
                 f"{', '.join(summary['models'])}, space {summary['space']}, system {summary['system']}")
    lines.append(f"  storage {summary['storage']}")
    lines.append(f"  trials: {t['finished']} finished ({t['this_run']} this run): {t['feasible']} feasible, "
                 f"{t['infeasible']} infeasible, {t['failed']} failed; wall {summary['wall_s']:.1f} s this run"
                 + (f", {summary['elapsed_s']:.1f} s over all runs" if summary.get("resumed") else ""))
    if t.get("repeated_designs"):
        lines.append(f"  {t['repeated_designs']} trial(s) repeat a design an earlier trial tried (user attribute "
                     f"repeat_of names it); {t['finished'] - t['repeated_designs']} distinct designs")
    if t.get("unproven"):
        lines.append(f"  {t['unproven']} feasible trial(s) rest on layer schedules not proven optimal in the ILP time "
                     f"limit: their score is reached by a verified schedule, their proven bound is higher")
    ex = summary.get("exhaustive")
    if ex:
        stop = (f"stopped by hysteresis after {ex['groups_done']} of {ex['groups']} area groups"
                if ex.get("stopped_early") else "every point")
        if ex.get("prune") == "bound":
            c = ex["settled"]
            lines.append(f"  exhaustive: all {ex['points']:,} grid points settled: {c['evaluated']:,} evaluated, "
                         f"{ex['evaluated_by_bound']:,} by a proven bound ({c['bound-ideal']:,} ideal-scaling, "
                         f"{c['bound-placement']:,} placement DP on lower-bound layer times, "
                         f"{c.get('dominated', 0):,} dominated by another recipe of their design)")
            lines.append(f"    every point and how it was settled: {ex['points_file']}")
            if not ex.get("optimum_proven", True):
                bound = ex.get("optimum_upper_bound")
                open_points = [f for f in ex["failed"] if f["bound"] is None or f["bound"] > ex["optimum"]]
                open_points += [u for u in ex.get("unproven", []) if u["bound"] > ex["optimum"]]
                lines.append(f"    NOT proven optimal: {len(open_points)} point(s) failed or rest on unproven layer "
                             f"schedules with a bound above the best; the best below is the best reached"
                             + (f", the optimum is at most {bound:.6g}" if bound is not None else ""))
        else:
            lines.append(f"  exhaustive: {ex['evaluated']} of {ex['points']} grid points evaluated ({stop})")
        for h in ex.get("best_history", [])[-5:]:
            lines.append(f"    new best at {h['elapsed_s']:.1f} s (trial {h['trial']}): {h['score']:.6g}")
    best = summary.get("best")
    if best is None:
        lines.append("  no feasible design found")
    else:
        lines.append(f"  best design (trial {best['trial']}): " +
                     ", ".join(f"{k}={v}" for k, v in (best["design"] or {}).items()))
        lines.append(f"    area {_fmt(best['area_mm2'], ' mm^2', 4)}")
        if best.get("cost_usd") is not None:
            lines.append(f"    cluster cost ${best['cost_usd']:,.0f} (configs/cost.yaml)")
        if best.get("system"):
            lines.append("    system " + ", ".join(f"{k}={v}" for k, v in best["system"].items()))
        if best.get("proven") is False:
            lines.append(f"    score {best['score']:.6g} from verified schedules not all proven optimal; "
                         f"proven bound {best['score_bound']:.6g}")
        for m, s in best["models"].items():
            p = s.get("placement") or {}
            stages = p.get("stages") or []
            lines.append(f"    {m}: {_fmt(s.get('throughput'), ' seq/s', 5)} ({_fmt(s.get('tokens_per_s'), ' tokens/s', 4)}), "
                         f"MFU {'n/a' if s.get('mfu') is None else format(s['mfu'], '.1%')}, "
                         f"time/batch {_fmt(s.get('time_per_batch_s'), ' s', 4)}")
            lines.append(f"      placement TP={p.get('tp')} PP={p.get('pp')} DP={p.get('dp')}, "
                         f"{p.get('microbatches')} microbatches, {len(stages)} stages")
            if s.get("proven") is False:
                lines.append(f"      not proven: at most {_fmt(s.get('throughput_bound'), ' seq/s', 5)}; "
                             f"open layer schedules: {', '.join(s.get('unproven') or [])}")
            lines += baseline_lines(s.get("ratio_to_tpuv4_expert"), summary["baselines"].get(m, {}),
                                    reference_label(summary.get("reference_arch")))
        if len(best["models"]) > 1 and best.get("ratio_to_tpuv4_expert") is not None:
            used = {summary["baselines"].get(m, {}).get("placement") or "expert" for m in best["models"]}
            label = "expert placement" if used == {"expert"} else "expert placement, else the optimal one"
            lines.append(f"    mean ratio to {reference_label(summary.get('reference_arch'))} ({label}): "
                         f"{best['ratio_to_tpuv4_expert']:.3f}x")
    pareto = summary.get("pareto")
    if pareto:
        proven = (summary.get("exhaustive") or {}).get("front_proven")
        exact = {True: " (exact: every point off it is matched or beaten by an evaluated design)",
                 False: " (NOT proven: a point that failed or rests on unproven schedules could join it)"}.get(proven, "")
        lines.append(f"  Pareto front: {len(pareto['trials'])} designs{exact}; plot {pareto.get('plot')}")
    for note in summary.get("notes", []):
        lines.append(f"  note: {note}")
    if summary.get("summary_file"):
        lines.append(f"  summary: {summary['summary_file']}")
    ml = summary.get("mlflow")
    if ml:
        lines.append(f"  MLflow: experiment '{ml['experiment']}' (id {ml['experiment_id']}), "
                     f"parent run '{ml.get('parent_run_name') or ml['parent_run_id']}'")
        if ml.get("phaze_opt_ui"):
            lines.append(f"    the UI here:  {ml['phaze_opt_ui']}  (a free port, opens the trials)")
        lines.append(f"    open the UI:  {ml['ui']}")
        lines.append(f"    this run:     {ml['run_url']}")
        lines.append(f"    the trials:   {ml['trials_url']}")
        if ml.get("errors"):
            lines.append(f"    {len(ml['errors'])} MLflow writes failed, first: {ml['errors'][0]}")
    else:
        lines.append("  MLflow tracking was off")
    nxt = summary.get("next")
    if nxt:
        lines.append(f"  compare with {nxt['other_is']} ({nxt['other_study']}):")
        if not nxt.get("other_exists"):
            lines.append(f"    run it{'' if nxt.get('other_exists') is False else ' (if not done yet)'}: "
                         f"{nxt['run_other']}")
        lines.append(f"    {'compare' if nxt.get('other_exists') else 'then compare'}: {nxt['compare']}")
    return "\n".join(lines)
