"""Convergence comparison of two or more studies: how fast each found its best design.

For every study, the finished trials in wall-clock order (`elapsed_s`, the study's own search time
summed over invocations; Optuna timestamps when a study lacks it) give a best-so-far curve over the
feasible trials' throughput objective. The table reports per study: best score, workers, trials,
wall time, and the trials and time it needed to reach `threshold` (99%) of the best score that ANY
of the compared studies found -- for a sampled and an exhaustive study of one space, that is how
close and how fast sampling gets to the exhaustive optimum.

Wall time is `search.session.study_wall_s`, the number the study printed at its end (`wall_s` of a single
run's summary, `elapsed_s` over all runs): search time summed over the study's invocations, each
from opening the study to its summary. Workers come from the study attribute `workers_per_run`
(one entry per invocation). The plot draws each study's best-so-far curve, the target line, a dot
where each study first reached it, and, for an exhaustive sweep with bound pruning, its bounding
phases (attribute `bounding_phases`) as a shaded span: no design evaluated yet, so no curve.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Sequence

import optuna

from ..errors import PhazeError
from ..figures import pyplot, write_figure
from . import fronts
from ..runs import (OPTUNA_TABLES, MlflowTracker, check_sqlite_storage, driver_url, probe_database, redact, sqlite_path,
                    sqlite_read_uri, tracking_enabled)
from ..search import best_trial as first_best, clean_name, default_storage, finished_trials, is_feasible, quiet_optuna, study_wall_s


@dataclass
class Curve:
    name: str
    storage: str
    mode: str
    sampler: str
    models: list | None
    objective: str
    trials: int
    wall_s: float
    # one row per finished trial, in wall-clock order: (elapsed_s, trials so far, best so far or None)
    steps: list = field(default_factory=list)
    best_trial: int | None = None
    workers: list = field(default_factory=list)  # per invocation; empty when the study did not record them
    bounding: list = field(default_factory=list)  # [(start_s, end_s)]: bound-pruned sweep, nothing evaluated yet
    optimum: bool = False  # an exhaustive study that settled every point: its best is the optimum

    @property
    def kind(self) -> str:
        return self.mode if self.sampler in (self.mode, "?") else f"{self.mode} ({self.sampler})"

    @property
    def workers_text(self) -> str:
        """'2', or '1/2' for a study resumed with other workers ('?' when not recorded)."""
        return "/".join(dict.fromkeys(str(w) for w in self.workers)) or "?"

    @property
    def best(self) -> float | None:
        return self.steps[-1][2] if self.steps else None


def resolve_study(arg: str, storage: str | None, out_dir: str = "studies") -> tuple[str, str]:
    """A STUDY argument -> (study name, storage URL).

    NAME uses --storage, else the study's default `sqlite:///<out_dir>/NAME.db`; a path to a
    `.db` file names the (single) study inside that SQLite file.
    """
    text = str(arg)
    if text.endswith(".db") and not storage:
        if not Path(text).is_file():
            raise PhazeError(f"{text}: no such study database")
        url = f"sqlite:///{text}"
        names = study_names(url)
        if len(names) != 1:
            raise PhazeError(f"{text}: holds {len(names)} studies ({', '.join(names) or 'none'}); "
                             "name one with --storage sqlite:///" + text + " NAME")
        return names[0], url
    url = storage or default_storage(clean_name(text), out_dir)
    if not storage and not Path(url[len("sqlite:///"):]).is_file():
        raise PhazeError(f"unknown study '{text}': no {url[len('sqlite:///'):]}; give --storage URL for a "
                         "study stored elsewhere")
    return text, url


@functools.lru_cache(maxsize=8)  # a comparison reads a handful of storages; each holds a connection pool
def read_storage(url: str):
    """The storage at `url`, for reading: it must exist and hold Optuna's tables, looked for before
    Optuna opens it (its RDBStorage creates any table it misses, in any database: an MLflow one, or
    another program's PostgreSQL database), so a comparison or an export never creates or changes a
    database; a SQLite file is opened read-only."""
    path = sqlite_path(url)
    if path is not None and not path.is_file():
        raise PhazeError(f"--storage {url}: no such file")
    check_sqlite_storage(url)
    if not OPTUNA_TABLES <= _tables(url):
        raise PhazeError(f"--storage {redact(url)}: not an Optuna storage (no Optuna tables); compare and export "
                         "only read a study, they never create one")
    if path is None:
        return optuna.storages.RDBStorage(driver_url(url))
    return optuna.storages.RDBStorage(f"sqlite:///{sqlite_read_uri(path)}&uri=true")


def _tables(url: str) -> set[str]:
    """The names of the tables in the database at `url`, read without writing to it."""
    path = sqlite_path(url)
    if path is not None:
        import sqlite3

        con = sqlite3.connect(sqlite_read_uri(path), uri=True, timeout=30)
        try:
            return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            con.close()
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    probe_database(url, option="--storage")  # an unreachable server: one line, not minutes of retries
    try:
        engine = sqlalchemy.create_engine(driver_url(url), poolclass=NullPool)
        try:
            return set(sqlalchemy.inspect(engine).get_table_names())
        finally:
            engine.dispose()
    except Exception as exc:  # noqa: BLE001 - the user's URL
        raise PhazeError(f"--storage {redact(url)}: cannot open: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def study_names(url: str) -> list[str]:
    quiet_optuna()
    try:
        return list(optuna.study.get_all_study_names(read_storage(url)))
    except PhazeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's URL
        raise PhazeError(f"--storage {redact(url)}: cannot open: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None


def _elapsed(trials) -> dict[int, float]:
    """trial number -> seconds into the study (its own elapsed_s, else from Optuna's timestamps)."""
    out = {}
    starts = [t.datetime_start for t in trials if t.datetime_start is not None]
    first = min(starts) if starts else None
    for t in trials:
        e = (t.user_attrs.get("result") or {}).get("elapsed_s")
        if isinstance(e, (int, float)) and math.isfinite(e):
            out[t.number] = float(e)
        elif t.datetime_complete is not None and first is not None:
            out[t.number] = (t.datetime_complete - first).total_seconds()
        else:
            out[t.number] = math.inf
    return out


def load_curve(name: str, url: str) -> Curve:
    quiet_optuna()
    names = study_names(url)
    if name not in names:
        raise PhazeError(f"unknown study '{name}' in {redact(url)}; it holds {', '.join(names) or 'no study'}")
    study = optuna.load_study(study_name=name, storage=read_storage(url))
    return curve_from_trials(name, url, study.get_trials(deepcopy=False), study.user_attrs)


def curve_from_trials(name: str, url: str, trials, attrs: dict) -> Curve:
    """The best-so-far curve of a study's finished trials, in wall-clock order."""
    stored_wall = study_wall_s(attrs, trials)
    trials = finished_trials(trials)
    elapsed = _elapsed(trials)
    trials = sorted(trials, key=lambda t: (elapsed[t.number], t.number))
    steps, best = [], None
    for i, t in enumerate(trials, 1):
        if is_feasible(t) and (best is None or t.values[0] > best):
            best = t.values[0]
        steps.append((elapsed[t.number], i, best))
    winner = first_best(trials)
    best_trial = winner.number if winner is not None else None
    # a foreign study without elapsed_s: its Optuna timestamps
    wall = max([stored_wall] + [e for e in elapsed.values() if math.isfinite(e)])
    objectives = attrs.get("objectives") or ["throughput"]
    status = attrs.get("exhaustive_status") or {}
    optimum = bool(status) and bool(status.get("optimum_proven", not status.get("stopped_early")
                                               and status.get("evaluated", 0) >= status.get("points", 1)))
    return Curve(name=name, storage=url, mode=attrs.get("mode", "?"), sampler=str(attrs.get("sampler", "?")),
                 models=attrs.get("models"), objective=objectives[0], trials=len(trials), wall_s=wall, steps=steps,
                 best_trial=best_trial, workers=list(attrs.get("workers_per_run") or []),
                 bounding=[(float(a), float(b)) for a, b in attrs.get("bounding_phases") or []], optimum=optimum)


def table(curves: Sequence[Curve], threshold: float = 0.99) -> tuple[list[dict], float | None]:
    """One row per study (see the module docstring); returns (rows, target score)."""
    bests = [c.best for c in curves if c.best is not None]
    top = max(bests) if bests else None
    target = threshold * top if top is not None and top > 0 else None
    rows = []
    for c in curves:
        reach = None
        if target is not None:
            reach = next(((e, n) for e, n, b in c.steps if b is not None and b >= target), None)
        rows.append({
            "study": c.name,
            "mode": c.mode,
            "sampler": c.sampler,
            "kind": c.kind,
            "workers": c.workers_text,
            "best_score": c.best,
            "best_trial": c.best_trial,
            "best_vs_overall": (c.best / top) if c.best is not None and top else None,
            "trials": c.trials,
            "wall_s": c.wall_s,
            "trials_to_target": reach[1] if reach else None,
            "time_to_target_s": reach[0] if reach else None,
        })
    times = [r["time_to_target_s"] for r in rows if r["time_to_target_s"] is not None]
    fastest = min(times) if times else None
    for r in rows:  # how many times the fastest study's time to the target each one took
        t = r["time_to_target_s"]
        r["time_vs_fastest"] = t / fastest if t is not None and fastest else (1.0 if t is not None else None)
    return rows, target


def verdict(rows: list[dict], threshold: float) -> str:
    """The answer in one sentence: which study reached the target first, how many times as long
    each other took (or how far it got), and whether their worker counts differ."""
    pct = f"{threshold * 100:g}%"
    reached = sorted((r for r in rows if r["time_to_target_s"] is not None), key=lambda r: r["time_to_target_s"])
    if not reached:
        return f"No study reached {pct} of the best score found."
    first = reached[0]
    parts = [f"{first['study']} reached {pct} first: {first['time_to_target_s']:.1f} s, "
             f"{first['trials_to_target']} trials ({first['workers']} worker{'' if first['workers'] == '1' else 's'})"]
    for r in rows:
        if r is first:
            continue
        workers = f"{r['workers']} worker{'' if r['workers'] == '1' else 's'}"
        if r["time_to_target_s"] is not None:
            parts.append(f"{r['study']} took {r['time_vs_fastest']:.2f}x as long ({r['time_to_target_s']:.1f} s, "
                         f"{r['trials_to_target']} trials, {workers})")
        else:
            share = "n/a" if r["best_vs_overall"] is None else f"{r['best_vs_overall'] * 100:.2f}%"
            parts.append(f"{r['study']} never did: {share} of the best after {r['trials']} trials and "
                         f"{r['wall_s']:.1f} s ({workers})")
    line = "; ".join(parts) + "."
    if len({r["workers"] for r in rows}) > 1:
        line += " The studies ran with different worker counts, so their times are not like for like."
    return line


def _pct(threshold: float) -> str:
    return f"{threshold * 100:g}pct"


def rows_csv(rows: list[dict], threshold: float) -> str:
    pct = _pct(threshold)
    cols = ["study", "mode", "sampler", "workers", "best_score", "best_trial", "best_vs_overall", "trials", "wall_s",
            f"trials_to_{pct}", f"time_to_{pct}_s", "time_vs_fastest"]
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow([r["study"], r["mode"], r["sampler"], r["workers"], _num(r["best_score"]), _num(r["best_trial"]),
                    _num(r["best_vs_overall"]), r["trials"], _num(r["wall_s"]), _num(r["trials_to_target"]),
                    _num(r["time_to_target_s"]), _num(r["time_vs_fastest"])])
    return buf.getvalue()


def _num(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return str(v)


def rows_markdown(rows: list[dict], threshold: float, target: float | None, objective: str) -> str:
    pct = f"{threshold * 100:g}%"
    head = ["study", "mode", "workers", "best " + objective, "vs best overall", "trials", "wall (s)",
            f"trials to {pct}", f"time to {pct} (s)", "time vs fastest"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["study"], r["kind"], r["workers"],
                 "n/a" if r["best_score"] is None else f"{r['best_score']:.6g}",
                 "n/a" if r["best_vs_overall"] is None else f"{r['best_vs_overall'] * 100:.2f}%",
                 str(r["trials"]), f"{r['wall_s']:.1f}",
                 "not reached" if r["trials_to_target"] is None else str(r["trials_to_target"]),
                 "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
                 "not reached" if r.get("time_vs_fastest") is None else f"{r['time_vs_fastest']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    tail = (f"\n{verdict(rows, threshold)}\n\nTarget: {pct} of the best score any study found"
            + (f" = {target:.6g}." if target else " (none feasible).") + f"\n{WALL_NOTE}\n{WORKERS_NOTE}")
    return "\n".join(lines) + "\n" + tail + "\n"


WALL_NOTE = ("Wall: the study's search time summed over its runs, each from opening the study to its summary "
             "(the wall time the study printed); times to the target are on the same clock.")
WORKERS_NOTE = "Workers: processes per run of the study (1/2: resumed with another count)."


def plot(curves: Sequence[Curve], target: float | None, path: Path, title: str,
         ylabel: str = "best feasible score so far", threshold: float = 0.99) -> list[str]:
    """Save the best-so-far plot; returns its legend labels, one per mark drawn (see the module docstring)."""
    pct = f"{threshold * 100:g}%"
    top = max((c for c in curves if c.best is not None), key=lambda c: c.best, default=None)
    goal = "the optimum" if top is not None and top.optimum else "the best found"
    fig, ax = pyplot().subplots(figsize=(8, 5.2))
    finite = [e for c in curves for e, _, b in c.steps if b is not None and math.isfinite(e) and e > 0]
    log = bool(finite) and max(finite) / max(min(finite), 1e-9) > 100
    left = min(finite) / 2 if log else 0.0  # a span from 0 has no place on a log axis
    for i, c in enumerate(curves):
        for k, (a, b) in enumerate(c.bounding):
            if b > a:
                ax.axvspan(max(a, left), b, color=f"C{i}", alpha=0.15, lw=0,
                           label=f"{c.name}: bounding (no design evaluated yet)" if k == 0 else None)
        xs = [e for e, _, b in c.steps if b is not None and math.isfinite(e)]
        ys = [b for e, _, b in c.steps if b is not None and math.isfinite(e)]
        if not xs:
            continue
        xs.append(max(c.wall_s, xs[-1]))
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", color=f"C{i}",
                label=f"{c.name} ({c.kind}, {c.workers_text} worker{'' if c.workers_text == '1' else 's'}): "
                      f"best so far, to its wall time {c.wall_s:.1f} s")
        if target is not None:
            hit = next(((e, n) for e, n, b in c.steps if b is not None and b >= target and math.isfinite(e)), None)
            if hit:
                ax.plot([hit[0]], [target], "o", color=f"C{i}", ms=6,
                        label=f"{c.name}: time to {pct} of {goal} ({hit[0]:.1f} s, {hit[1]} trials)")
    if target is not None:
        ax.axhline(target, color="0.4", ls="--", lw=1, label=f"target: {pct} of {goal} ({target:.6g})")
    if log:
        ax.set_xscale("log")
    ax.set_xlabel("wall-clock (s): the study's search time, summed over its runs")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, frameon=False)
    write_figure(fig, path, tight=True)
    return labels


def output_stem(names: Sequence[str]) -> str:
    stem = "compare-" + "-vs-".join(clean_name(n) for n in names)
    if len(stem) > 120:
        stem = stem[:100] + "-" + hashlib.sha1(stem.encode()).hexdigest()[:8]
    return stem


def compare(studies: Sequence[str], *, storage: str | None = None, out_dir: str = "studies",
            tracking_uri: str | None = None, threshold: float = 0.99, name: str | None = None) -> dict:
    """Compare studies; writes `<out_dir>/<name>.csv`, `.md` and `.png` and logs them to MLflow."""
    if len(studies) < 2:
        raise PhazeError("compare: give at least two studies")
    if not 0 < threshold <= 1:
        raise PhazeError(f"--threshold: expected a fraction in (0, 1], got {threshold}")
    resolved = [resolve_study(s, storage, out_dir) for s in studies]
    if len(set(resolved)) != len(resolved):
        raise PhazeError("compare: a study is named twice")
    curves = [load_curve(n, u) for n, u in resolved]
    models = {tuple(c.models) for c in curves if c.models is not None}
    if len(models) > 1:
        raise PhazeError("compare: the studies optimise different models (" +
                         "; ".join(f"{c.name}: {', '.join(c.models or [])}" for c in curves) +
                         "), so their scores are not comparable")
    rows, target = table(curves, threshold)
    stem = clean_name(name) if name else output_stem([c.name for c in curves])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path, png_path = out / f"{stem}.csv", out / f"{stem}.md", out / f"{stem}.png"
    csv_path.write_text(rows_csv(rows, threshold))
    single = not curves[0].models or len(curves[0].models) == 1
    objective = "throughput (seq/s)" if single else "mean ratio to TPUv4"
    ylabel = "best throughput so far (sequences/s)" if single else "best mean throughput / TPUv4 so far"
    md_path.write_text(f"# {stem}\n\n" + rows_markdown(rows, threshold, target, objective))
    legend = plot(curves, target, png_path, "best-so-far vs wall-clock\n" + ", ".join(c.name for c in curves),
                  ylabel, threshold)
    result = {"studies": [{"name": c.name, "storage": redact(c.storage)} for c in curves], "threshold": threshold,
              "target": target, "rows": rows, "csv": str(csv_path), "markdown": str(md_path), "plot": str(png_path),
              "legend": legend, "mlflow": None, "fronts": None}
    outputs = [csv_path, md_path, png_path]
    front_result = compare_fronts(resolved, out / f"{stem}-fronts.png", stem)
    if front_result is not None:
        result["fronts"] = front_result
        with md_path.open("a") as f:
            f.write("\n## Throughput-area fronts\n\n" + front_result["markdown"])
        outputs.append(Path(front_result["plot"]))
    if tracking_enabled(tracking_uri):
        tracker = MlflowTracker.start(
            tracking_uri, "phaze_opt-compare", run_name=f"{stem} {datetime.now():%Y-%m-%d %H:%M:%S}",
            params={"studies": ",".join(c.name for c in curves), "threshold": threshold},
            tags={"mode": "compare", "models": ",".join(curves[0].models or [])},
            context={"study_name": stem, "sampler": "", "models": curves[0].models or [], "mode": "compare"},
            background=False)
        metrics = {}
        for r in rows + (front_result or {}).get("rows", []):
            key = clean_name(r["study"])[:150]
            for k in ("best_score", "trials", "wall_s", "trials_to_target", "time_to_target_s", "best_vs_overall",
                      "time_vs_fastest", "hypervolume", "fraction"):
                if isinstance(r.get(k), (int, float)):
                    metrics[f"{key}.{'front_' if 'hypervolume' in r else ''}{k}"] = r[k]
        tracker.log_parent(metrics=metrics)
        for p in outputs:
            tracker.log_parent_file(p)
        tracker.close()
        result["mlflow"] = {"experiment": "phaze_opt-compare", "experiment_id": tracker.experiment_id,
                            "run_id": tracker.parent_run_id, "errors": list(tracker.errors)}
    return result


def compare_fronts(resolved: Sequence[tuple[str, str]], path: Path, title: str) -> dict | None:
    """The throughput-area fronts (`fronts`), when any compared study has several objectives or
    proved its front; None otherwise."""
    studies = [optuna.load_study(study_name=n, storage=read_storage(u)) for n, u in resolved]
    if not any(len(s.user_attrs.get("objectives") or []) > 1 for s in studies):
        return None
    curves = []
    for s in studies:
        trials = s.get_trials(deepcopy=False)
        points, times, counts = fronts.study_points(trials, _elapsed(trials))
        exact = bool((s.user_attrs.get("exhaustive_status") or {}).get("front_proven"))
        curves.append(fronts.FrontCurve(s.study_name, exact, points, times, counts))
    ref = fronts.reference_point(studies[0].user_attrs.get("space"), curves)
    curves = [fronts.with_hypervolume(c, ref) for c in curves]
    rows, base, what = fronts.table(curves, ref)
    fronts.plot(curves, base, path, f"throughput-area fronts and hypervolume\n{title}")
    return {"rows": rows, "reference_hypervolume": base, "reference_front": what, "reference_point": list(ref),
            "markdown": fronts.rows_markdown(rows, base, what, ref), "plot": str(path)}


def render(result: dict) -> str:
    rows = result["rows"]
    lines = [rows_markdown(rows, result["threshold"], result["target"], "score").rstrip(),
             f"table: {result['csv']} and {result['markdown']}", f"plot: {result['plot']}"]
    if result.get("fronts"):
        lines += [result["fronts"]["markdown"].rstrip(), f"fronts: {result['fronts']['plot']}"]
    if result.get("mlflow"):
        m = result["mlflow"]
        lines.append(f"MLflow: experiment '{m['experiment']}', run {m['run_id']}")
    return "\n".join(lines)
