"""Run validation suites: every published row evaluated by the project's own `evaluate`, compared.

    run_suite(suite, efficiency=None) -> SuiteResult     one suite (training or layer suite)
    run_suites(names, efficiency=None) -> list[SuiteResult]

A training row is evaluated exactly as `phaze-opt evaluate` would with the row's published recipe:
the suite's arch and system, `--devices` = the row's GPUs, `--global-batch` = its batch, the placement
tp=T,pp=P,dp=D, its microbatch, recompute, sequence parallelism and virtual stages. The prediction is
then put in the suite's metric (SI units: FLOP/s, seconds):

    per_gpu_tflops    iteration_flops(formula, model, batch, seq) / (predicted iteration s x GPUs), the
                      row's own formula or else the suite's (the FLOP count the source used, not the
                      project's own, so both sides count alike)
    iteration_time_s  the predicted iteration time

The signed error is predicted / published - 1: positive means the model predicts more of the metric
than was published (more FLOP/s: too fast; more seconds: too slow).

Fit subset (declared once, here, for every training suite): rows with an odd 0-based index in their
suite are the calibration's fit subset (`validation/calibration.py`), rows with an even index are held
out. MAPE (mean absolute percentage error, as a fraction) is reported over each part and over all.

A row whose model config is still missing (`pending_model`) is skipped: its RowResult has no
prediction, `skipped` set and the reason, and counts in no MAPE and not as infeasible.

Layer suites (`layer_seconds`) are compared by `validation/layers.py` (the per-layer comparison): one
RowResult per measured block (forward + backward seconds), fitted = the operator fit's own declared
subset (`fit_operators.FIT_TP`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterable, Sequence

from ..design.evaluate import evaluate
from ..errors import PhazeError
from ..hardware.accelerator import Accelerator
from ..hardware.arch import load_arch
from ..hardware.efficiency import Efficiency
from ..system import System, SystemEfficiency, load_system
from ..training import FIELDS, plain
from ..workload.models import load_model
from .fit_operators import FIT_TP
from .layers import compare_layers, layer_row_config
from .suites import LAYER_METRICS, Row, Suite, iteration_flops, list_suites, load_suite

# Published values are stored in the paper's units; these convert them to SI.
METRIC_SI = {"per_gpu_tflops": 1e12, "iteration_time_s": 1.0, "layer_seconds": 1.0}
FIT_SUBSET = ("training suites: odd 0-based row index (held out: even); layer suites: the operator fit's "
              f"rows at TP {' and '.join(map(str, FIT_TP))} (validation/fit_operators.py; held out: the other widths)")


def in_fit_subset(index: int) -> bool:
    """The declared fit subset: odd 0-based indices (rows 1, 3, 5, ... of each training suite)."""
    return index % 2 == 1


@dataclass(frozen=True)
class RowResult:
    suite: str
    index: int
    label: str  # the row's source row ("1.7B", "22B, present work", ...)
    config: dict  # model, tp, pp, dp, gpus, batch, mbs, recompute, sequence_parallel, virtual_stages
    published: float  # SI (FLOP/s per GPU or seconds)
    predicted: float | None  # SI; None when the model finds the row infeasible
    fitted: bool  # in the calibration's fit subset
    feasible: bool = True
    reason: str = ""
    time_per_batch_s: float | None = None
    source: dict = field(default_factory=dict)
    schedule_gap: float = 0.0  # layer rows: the schedules' largest distance above their proven bound
    skipped: bool = False  # not run (its `reason` says why); no prediction, in no MAPE

    @property
    def error(self) -> float | None:
        """Signed relative error: predicted / published - 1."""
        return None if self.predicted is None else self.predicted / self.published - 1.0

    def to_json(self) -> dict:
        return {"suite": self.suite, "index": self.index, "label": self.label, **self.config,
                "published": self.published, "predicted": self.predicted, "error": self.error,
                "fitted": self.fitted, "feasible": self.feasible, "reason": self.reason,
                "time_per_batch_s": self.time_per_batch_s, "schedule_gap": self.schedule_gap,
                "skipped": self.skipped, "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> "RowResult":
        """The row `to_json` wrote: a report renders from a saved run as from a live one. The
        configuration is every key that is not a field (`to_json` spreads it into the row)."""
        names = {f.name for f in fields(cls)} - {"config"}
        return cls(config={k: v for k, v in d.items() if k not in names and k != "error"},
                   **{k: d[k] for k in names})


def mape(rows: Iterable[RowResult]) -> float | None:
    """Mean absolute relative error over the feasible rows (None when there are none)."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    return sum(errors) / len(errors) if errors else None


@dataclass(frozen=True)
class SuiteResult:
    name: str
    description: str
    metric: str
    arch: str
    system: str | None
    rows: tuple[RowResult, ...]
    efficiency: dict = field(default_factory=dict)  # the system efficiency the rows ran with
    arch_efficiency: dict = field(default_factory=dict)  # the arch's (hardware/efficiency.py)
    flops_formula: str | None = None

    @property
    def fitted(self) -> tuple[RowResult, ...]:
        return tuple(r for r in self.rows if r.fitted and not r.skipped)

    @property
    def held_out(self) -> tuple[RowResult, ...]:
        return tuple(r for r in self.rows if not r.fitted and not r.skipped)

    @property
    def infeasible(self) -> tuple[RowResult, ...]:
        return tuple(r for r in self.rows if not r.feasible and not r.skipped)

    @property
    def skipped(self) -> tuple[RowResult, ...]:
        return tuple(r for r in self.rows if r.skipped)

    def mape(self) -> dict:
        return {"fitted": mape(self.fitted), "held_out": mape(self.held_out), "all": mape(self.rows)}

    def to_json(self) -> dict:
        return {"suite": self.name, "description": self.description, "metric": self.metric, "arch": self.arch,
                "system": self.system, "flops_formula": self.flops_formula, "efficiency": self.efficiency,
                "arch_efficiency": self.arch_efficiency,
                "mape": self.mape(), "infeasible": len(self.infeasible), "skipped": len(self.skipped),
                "rows": [r.to_json() for r in self.rows]}

    @classmethod
    def from_json(cls, d: dict) -> "SuiteResult":
        """The suite `to_json` wrote (its MAPEs and counts are recomputed from the rows)."""
        return cls(name=d["suite"], description=d["description"], metric=d["metric"], arch=d["arch"],
                   system=d["system"], rows=tuple(RowResult.from_json(r) for r in d["rows"]),
                   efficiency=d["efficiency"], arch_efficiency=d["arch_efficiency"],
                   flops_formula=d["flops_formula"])


def row_config(row: Row, suite: Suite) -> dict:
    """The row's configuration as the report prints it: its cluster and layout, then its recipe as
    `Training.recipe()` lists it. Fields at their defaults or at a value every suite runs
    (`Knob.quiet`: ZeRO 1, Megatron's distributed optimizer) are left out but the microbatch and recompute (`CORE`), so each configuration names what sets the row apart; a field is named by its
    report name (`Knob.short`) where it has one."""
    recipe = row.training.recipe()
    del recipe["placement"]  # the layout below says it
    core = {k: recipe.pop(k) for k in CORE}
    rest = {FIELDS[k].short or k: v for k, v in recipe.items()
            if v != _plain_default(k) and v not in FIELDS[k].quiet}
    layout = {k: v for k, v in (("cp", row.cp), ("ep", row.ep), ("seq", row.seq),
                                ("qkv_projection", row.qkv_projection)) if v not in (1, None)}
    return {"model": row.model, "tp": row.tp, "pp": row.pp, "dp": row.dp, "gpus": row.gpus, "batch": row.batch,
            **core, "system": row.system or suite.system, "arch": row.arch or suite.arch, **layout, **rest}


# Recipe fields every report line shows, default or not: what a reader of a training table looks for first.
CORE = ("mbs", "recompute")


def _plain_default(name: str):
    return plain(FIELDS[name].default)


def row_system(suite: Suite, row: Row, efficiency: SystemEfficiency | None = None) -> System:
    """The row's system (its own, else the suite's) sized to the row (`--devices`, `--global-batch`),
    with `efficiency` if given (None: the preset's own); `efficiency` belongs to the suite's system,
    so a row on another system keeps its own preset's."""
    own = row.system is not None and row.system != suite.system
    system = replace(load_system(row.system or suite.system), accelerators=row.gpus, global_batch=row.batch)
    return system if efficiency is None or own else system.with_efficiency(efficiency)


def row_model(row: Row):
    """The row's model config at the row's sequence length, with its code's QKV projection layout."""
    model = load_model(row.model)
    if row.qkv_projection is not None:
        model = replace(model, qkv_projection=row.qkv_projection)
    return model if row.seq is None else replace(model, seq=row.seq)


def predicted_value(suite: Suite, row: Row, time_per_batch_s: float) -> float:
    """The suite's metric (SI) for a predicted iteration time (see the module docstring)."""
    if suite.metric == "per_gpu_tflops":
        return iteration_flops(row.flops_formula or suite.flops_formula, row.model, row.batch, row.seq) / (
            time_per_batch_s * row.gpus)
    if suite.metric == "iteration_time_s":
        return time_per_batch_s
    raise ValueError(f"predicted_value: {suite.metric} is not a training metric")


def row_arch(suite: Suite, arch_efficiency: Efficiency | None = None, row: Row | None = None) -> Accelerator:
    """The row's arch (its own, else the suite's), with `arch_efficiency` in place of its preset's
    efficiency if given."""
    arch = load_arch(row.arch if row is not None and row.arch else suite.arch)
    return arch if arch_efficiency is None else replace(arch, efficiency=arch_efficiency)


def evaluate_row(suite: Suite, row: Row, index: int, efficiency: SystemEfficiency | None = None,
                 evaluator: Callable | None = None, arch_efficiency: Efficiency | None = None) -> RowResult:
    """One training row through `evaluator` (default: design.evaluate.evaluate, looked up at call time).
    A published recipe the project cannot express (e.g. an EP width that does not divide DP) is a
    result: infeasible with the reason."""
    common = dict(suite=suite.name, index=index, label=row.source.row, config=row_config(row, suite),
                  published=row.value * METRIC_SI[suite.metric], fitted=in_fit_subset(index),
                  source={"paper": row.source.paper, "table": row.source.table, "row": row.source.row})
    if row.skip:
        return RowResult(predicted=None, feasible=False, reason=row.skip, skipped=True, **common)
    try:
        result = (evaluator or evaluate)(row_model(row) if row.seq or row.qkv_projection else row.model,
                                         row_arch(suite, arch_efficiency, row), row.training,
                                         row_system(suite, row, efficiency))
    except PhazeError as exc:
        return RowResult(predicted=None, feasible=False, reason=f"not expressible: {exc}", **common)
    predicted = predicted_value(suite, row, result.time_per_batch_s) if result.feasible else None
    return RowResult(predicted=predicted, feasible=result.feasible, reason=result.reason,
                     time_per_batch_s=result.time_per_batch_s if result.feasible else None, **common)


def run_suite(suite: Suite | str, efficiency: SystemEfficiency | None = None,
              evaluator: Callable | None = None, arch_efficiency: Efficiency | None = None) -> SuiteResult:
    """Every row of a suite, evaluated (training) or compared (layers); `efficiency` overrides the
    system preset's efficiency block, `arch_efficiency` the arch's (None: the presets' own, as shipped)."""
    suite = suite if isinstance(suite, Suite) else load_suite(suite)
    common = dict(name=suite.name, description=suite.description, metric=suite.metric, arch=suite.arch,
                  system=suite.system, flops_formula=suite.flops_formula)
    if suite.metric in LAYER_METRICS:
        arch = row_arch(suite, arch_efficiency)
        return SuiteResult(rows=tuple(layer_rows(suite, arch)), arch_efficiency=arch.efficiency.fields(), **common)
    rows = tuple(evaluate_row(suite, row, i, efficiency, evaluator, arch_efficiency)
                 for i, row in enumerate(suite.rows))
    used = (efficiency if efficiency is not None else load_system(suite.system).efficiency).to_dict()
    return SuiteResult(rows=rows, efficiency=used, arch_efficiency=row_arch(suite, arch_efficiency).efficiency.fields(),
                       **common)


# Seconds each layer pass's exact schedule search may take before its best verified schedule is used
# (its distance above the proven lower bound goes into the row's `schedule_gap`). A cold validation
# spent 124 of its 227 s in 11 backward passes of Llama-2 70B that run to any limit unproven; at 5 s
# and at 60 s their makespans are identical (within 0.24% of the bound), so the longer search buys
# nothing a validation can see.
LAYER_TIME_LIMIT_S = 5.0


def layer_rows(suite: Suite, arch: Accelerator | None = None) -> list[RowResult]:
    """A layer suite's rows compared by validation/layers.py (one block's TP shard, forward + backward
    seconds, compute only), as RowResults; fitted = in the operator fit's declared subset
    (fit_operators.FIT_TP: TP 1 and 4; TP 2 and 8 held out)."""
    out = []
    for i, r in enumerate(compare_layers(suite, arch, time_limit_s=LAYER_TIME_LIMIT_S)):
        row = r.row
        out.append(RowResult(suite=suite.name, index=i, label=row.source.row,
                             config=layer_row_config(row),
                             published=row.fwd_bwd_s, predicted=r.fwd_bwd_s, fitted=row.tp in FIT_TP,
                             schedule_gap=r.gap,
                             source={"paper": row.source.paper, "table": row.source.table, "row": row.source.row}))
    return out


def run_suites(names: Sequence[str] | None = None, efficiency: SystemEfficiency | None = None) -> list[SuiteResult]:
    """The named suites (names or YAML paths; default every shipped suite), loaded first so that a bad
    name or file fails before any evaluation."""
    suites = [load_suite(n) for n in (names or list_suites())]
    return [run_suite(s, efficiency) for s in suites]
