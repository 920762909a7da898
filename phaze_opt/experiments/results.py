"""A study's trials as a table: one row per finished trial, for pandas, CSV, Parquet or JSON.

The columns are the MLflow run's (`runs.tracking.trial_record`), so a study reads the same in
the UI, in a notebook and in a spreadsheet:

    trial, state, feasible, reason     COMPLETE / INFEASIBLE / FAIL, and why (the infeasible reason
                                       or the error) when it is not COMPLETE
    repeat_of, retry_of                an earlier trial that tried the same design / this one retries
    <field>, recipe.<f>, arch.<f>      the design point, the training recipe, the accelerator
    <metric>_<unit>                    score, throughput_seq_per_s, tokens_per_s, time_per_batch_s,
                                       mfu, energy_j, area_mm2, objective.*; with several models each
                                       model's prefixed `<model>.`
    tp, pp, dp, ep, cp, microbatches   the placement
    graph_s, estimate_s, ilp_s, dp_s,  solver times, the trial's wall time, the study's search time at
    trial_s, elapsed_s                 its end (seconds)
    started, completed                 the trial's start and end (UTC)
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import optuna
import pandas as pd

from ..errors import PhazeError
from ..runs import design_fields, trial_record
from ..search import REPEAT_ATTR, finished_trials, quiet_optuna
from .convergence import read_storage, resolve_study, study_names

FORMATS = ("csv", "parquet", "json")
LEADING = ["trial", "state", "feasible", "reason", "repeat_of", "retry_of"]


def trial_row(trial, attrs: dict) -> dict:
    """One finished trial as a flat mapping of column -> value (see the module docstring)."""
    models = attrs.get("models") or []
    rec = trial_record(trial, study_name="", sampler=str(attrs.get("sampler", "")), models=models,
                       mode=str(attrs.get("mode", "")), objectives=attrs.get("objectives") or ("throughput",))
    result = trial.user_attrs.get("result") or {}
    state = rec.tags["trial_state"]
    row = {
        "trial": trial.number,
        "state": state,
        "feasible": state == "COMPLETE",
        "reason": result.get("reason") or result.get("error") or None if state != "COMPLETE" else None,
        "repeat_of": trial.user_attrs.get(REPEAT_ATTR),
        "retry_of": trial.user_attrs.get("retry_of"),
    }
    row.update(design_fields(trial))
    row.update(rec.metrics)
    row["started"] = trial.datetime_start
    row["completed"] = trial.datetime_complete
    return {k: None if v == "" else v for k, v in row.items()}  # an empty field is a missing one (CSV cannot tell)


def load(study: str, storage: str | None = None, output_dir: str = "studies") -> tuple[str, str, optuna.Study]:
    """A study by name (`<output_dir>/<name>.db`), by its `.db` file, or by name in `storage`."""
    quiet_optuna()
    name, url = resolve_study(study, storage, output_dir)
    if name not in study_names(url):
        raise PhazeError(f"unknown study '{name}' in {url}; it holds {', '.join(study_names(url)) or 'no study'}")
    return name, url, optuna.load_study(study_name=name, storage=read_storage(url))


def results(study: str, storage: str | None = None, output_dir: str = "studies") -> pd.DataFrame:
    """Every finished trial of `study` as a DataFrame, one row per trial, in trial order."""
    _, _, loaded = load(study, storage, output_dir)
    attrs = loaded.user_attrs
    rows = [trial_row(t, attrs) for t in sorted(finished_trials(loaded.get_trials(deepcopy=False)),
                                                key=lambda t: t.number)]
    frame = pd.DataFrame(rows)
    if frame.empty:
        return pd.DataFrame(columns=LEADING)
    for col in ("repeat_of", "retry_of"):
        frame[col] = frame[col].astype("Int64")  # integers with gaps, not floats
    return frame[LEADING + [c for c in frame.columns if c not in LEADING]]


def write(frame: pd.DataFrame, path: Path, fmt: str) -> Path:
    """`frame` as CSV, Parquet or JSON records (ISO times; NaN as null) at `path`."""
    if fmt not in FORMATS:
        raise PhazeError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        frame.to_csv(path, index=False)
    elif fmt == "parquet":
        frame.to_parquet(path, index=False)
    else:
        records = [{k: _json_value(v) for k, v in r.items()} for r in frame.astype(object).to_dict("records")]
        path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")  # floats exactly (repr)
    return path


def _json_value(value):
    """A cell as JSON: missing and non-finite numbers as null, times as ISO 8601, numpy scalars as Python's."""
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, datetime):  # pd.Timestamp too
        return value.isoformat()
    return value.item() if hasattr(value, "item") else value


def read(path: Path, fmt: str) -> pd.DataFrame:
    """What `write` wrote, back as a DataFrame with the same columns and values (the round trip)."""
    if fmt == "csv":
        frame = pd.read_csv(path, parse_dates=["started", "completed"])
    elif fmt == "parquet":
        return pd.read_parquet(path)
    else:
        frame = pd.DataFrame(json.loads(path.read_text(encoding="utf-8")))
        for col in ("started", "completed"):
            frame[col] = pd.to_datetime(frame[col])
    for col in ("repeat_of", "retry_of"):
        frame[col] = frame[col].astype("Int64")
    return frame
