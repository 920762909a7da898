"""`phaze-opt validate` end to end: run the suites (optionally after a fit), write the report, log MLflow.

Side effects live here (files, MLflow); runner.py, calibration.py and report.py stay pure or write only
what they are asked to.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Sequence

from ..errors import PhazeError
from ..runs import MlflowTracker, tracking_enabled
from ..system import load_system
from .calibration import fit_rows, fit_system
from .report import to_json, write_report
from .runner import run_suite
from .suites import TRAINING_METRICS, list_suites, load_suite, with_system

EXPERIMENT = "phaze_opt-validate"


def validate(names: Sequence[str] | None = None, *, out: str | Path | None = "reports/validation",
             tracking_uri: str | None = "off", fit: bool = False, fit_links: bool = False, fit_tc: bool = False,
             command: str = "phaze-opt validate",
             system: str | None = None) -> dict:
    """Run the suites and write the report. The returned dict is what `--json` prints (its `_suites`
    entry holds the SuiteResults for the text and Markdown renderers and is dropped from the JSON).
    `system`: every training row on that system instead of its own (to compare networks)."""
    suites = [load_suite(n) for n in (names or list_suites())]  # every name checked before any work
    if system is not None:
        suites = [with_system(s, system) for s in suites]
    fits = {}
    if fit:
        # a system whose rows are all held out or skipped has nothing to fit: it keeps its preset
        for system in sorted({s.system for s in suites if s.metric in TRAINING_METRICS}):
            if fit_rows(suites, system):  # a system whose fit rows are all skipped keeps its preset
                fits[system] = fit_system(suites, system, fit_links=fit_links, fit_tc=fit_tc)
    results = [run_suite(s, fits[s.system].efficiency, arch_efficiency=fits[s.system].arch_efficiency)
               if s.system in fits and s.metric in TRAINING_METRICS else run_suite(s) for s in suites]
    result = {"command": command, "generated": datetime.now().astimezone().isoformat(timespec="seconds"),
              "_suites": results}
    if fits:
        result["fits"] = {k: v.to_json() for k, v in fits.items()}
    if out is not None:
        try:
            write_report(result, Path(out))
        except OSError as exc:
            raise PhazeError(f"--out {out}: cannot write the report: {exc.strerror or exc}") from None
    result["mlflow"] = _log_mlflow(result, tracking_uri) if tracking_enabled(tracking_uri) else None
    json_view = to_json(result)
    json_view["_suites"] = results
    return json_view


def _log_mlflow(result: dict, tracking_uri: str) -> dict:
    suites = result["_suites"]
    presets = sorted({f"{s.arch}/{s.system}" if s.system else s.arch for s in suites})
    params = {"suites": ",".join(s.name for s in suites), "presets": ",".join(presets), "fit": bool(result.get("fit"))}
    for system in sorted({s.system for s in suites if s.system}):
        eff = next(s.efficiency for s in suites if s.system == system and s.efficiency) or \
            load_system(system).efficiency.to_dict()
        for k, v in eff.items():
            params[f"efficiency.{system}.{k}"] = v
    metrics = {}
    for s in suites:
        for part, value in s.mape().items():
            if value is not None:
                metrics[f"mape.{s.name}.{part}"] = value
    tracker = MlflowTracker.start(
        tracking_uri, EXPERIMENT, run_name=f"validate {datetime.now():%Y-%m-%d %H:%M:%S}", params=params,
        tags={"mode": "validate"}, context={"study_name": "validate", "sampler": "", "models": [], "mode": "validate"},
        background=False)
    tracker.log_parent(metrics=metrics)
    for path in (result.get("files") or {}).values():
        tracker.log_parent_file(path)
    tracker.close()
    return {"experiment": EXPERIMENT, "experiment_id": tracker.experiment_id, "run_id": tracker.parent_run_id,
            "errors": list(tracker.errors)}
