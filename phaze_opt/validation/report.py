"""The validation report: text table, Markdown, JSON and a predicted-vs-published scatter plot.

Values are SI inside (FLOP/s, seconds); here they are shown in the units the papers print:
per-GPU TFLOP/s, seconds per iteration, milliseconds per layer pass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..figures import pyplot, write_figure
from ..hardware.efficiency import IDENTITY
from ..jsonable import jsonable
from ..training import describe
from .runner import FIT_SUBSET, RowResult, SuiteResult

# (display scale from SI, unit) per metric
DISPLAY = {"per_gpu_tflops": (1e-12, "TFLOP/s per GPU"), "iteration_time_s": (1.0, "s per iteration"),
           "layer_seconds": (1e3, "ms per layer, forward + backward")}
BAND = 0.10  # the +-10% band drawn around y = x (the target)
SCHEMA = "phaze_opt.validation/1"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _config(r: RowResult, suite_system: str | None = None) -> str:
    c = r.config
    if "pp" not in c:  # a layer row
        return f"{c['model']} tp{c['tp']} mbs {c['mbs']} {c['attention']}"
    extras = f"rc {c['recompute']}" + "".join(f", {words}" for words in describe({k: v for k, v in c.items() if k not in ("mbs", "recompute")})) + \
        (f" on {c['system']}" if c.get("system") and c["system"] != suite_system else "")
    parallel = "".join(f" {k}{c[k]}" for k in ("cp", "ep", "etp") if k in c) + (f" seq {c['seq']}" if "seq" in c else "")
    return (f"{c['model']} tp{c['tp']} pp{c['pp']} dp{c['dp']}{parallel} gpus {c['gpus']} batch {c['batch']} "
            f"mbs {c['mbs']} {extras}")


def table_rows(suite: SuiteResult) -> list[list[str]]:
    scale, _ = DISPLAY[suite.metric]
    out = []
    for r in suite.rows:
        pred = "skipped" if r.skipped else "infeasible" if r.predicted is None else f"{r.predicted * scale:.4g}"
        out.append([str(r.index), r.label, _config(r, suite.system), pred, f"{r.published * scale:.4g}", _signed(r.error),
                    "fit" if r.fitted else "held out"])
    return out


HEADER = ["#", "row", "configuration", "predicted", "published", "error", "subset"]


def _mape_line(suite: SuiteResult) -> str:
    m = suite.mape()
    return (f"MAPE fitted {_pct(m['fitted'])} ({len(suite.fitted)} rows), held out {_pct(m['held_out'])} "
            f"({len(suite.held_out)} rows), all {_pct(m['all'])}"
            + (f"; {len(suite.infeasible)} infeasible" if suite.infeasible else "")
            + (f"; {len(suite.skipped)} skipped (model config, precision or recipe not modelled yet)" if suite.skipped else "")
            + _gap_note(suite))


def _gap_note(suite: SuiteResult) -> str:
    """Layer rows whose schedule search stopped at its time limit, and how far above the proven bound."""
    open_rows = [r for r in suite.rows if r.schedule_gap > 0]
    if not open_rows:
        return ""
    return (f"; {len(open_rows)} rows' schedules within {_pct(max(r.schedule_gap for r in open_rows))}"
            " of their proven bound (search time limit)")


def _reason_lines(suite: SuiteResult) -> list[str]:
    """Why each row without a prediction has none (skipped or infeasible)."""
    return [f"#{r.index} {'skipped' if r.skipped else 'infeasible'}: {r.reason}" for r in suite.rows
            if r.predicted is None and r.reason]


def _efficiency_line(suite: SuiteResult) -> str:
    e = suite.efficiency
    if not e:
        return ""
    a = {k: v for k, v in (suite.arch_efficiency or {}).items() if v != IDENTITY.fields()[k]}
    return (f"system efficiency: intra-node bandwidth x{e['intra_node_bandwidth']:.3g}, inter-node x"
            f"{e['inter_node_bandwidth']:.3g}"
            + (f", {e['microbatch_overhead_s']:.3g} s per microbatch and stage" if e.get("microbatch_overhead_s") else "")
            + ("; arch efficiency: " + ", ".join(f"{k} {v:g}" for k, v in a.items()) if a else ""))


def fit_lines(result: dict) -> list[str]:
    """One line per fitted system, and the `efficiency:` block to put in its preset file."""
    lines = []
    for system, f in (result.get("fits") or {}).items():
        e = f["efficiency"]
        lines += [f"fit of {system} on {f['fit_rows']} rows (odd 0-based index) of {', '.join(f['suites'])}; fitted "
                  f"{', '.join(f['fitted'])}; fit MAPE {_pct(f['fit_mape'])}:",
                  "  efficiency:",
                  f"    intra_node_bandwidth: {e['intra_node_bandwidth']:g}",
                  f"    inter_node_bandwidth: {e['inter_node_bandwidth']:g}",
                  f"    microbatch_overhead: {e.get('microbatch_overhead_s', 0.0):g} s"]
        if f.get("arch_efficiency"):
            lines += [f"  and in {f['arch']}'s arch file:", "  efficiency:"]
            lines += [f"    {k}: {v:g}" for k, v in f["arch_efficiency"].items()]
    return lines


def render_text(result: dict) -> str:
    lines = []
    for s in result["_suites"]:
        _, unit = DISPLAY[s.metric]
        lines.append(f"{s.name} ({unit}; arch {s.arch}" + (f", system {s.system}" if s.system else "") + ")")
        rows = [HEADER] + table_rows(s)
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) if i in (1, 2, 6) else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))))
        lines.append("  " + _mape_line(s))
        lines += ["  " + line for line in _reason_lines(s)]
        if _efficiency_line(s):
            lines.append("  " + _efficiency_line(s))
        lines.append("")
    lines += fit_lines(result)
    files = result.get("files") or {}
    if files:
        lines.append("wrote " + ", ".join(str(v) for v in files.values()))
    if result.get("mlflow"):
        lines.append(f"MLflow run {result['mlflow']['run_id']} in experiment {result['mlflow']['experiment']}")
    return "\n".join(lines).rstrip()


def render_markdown(result: dict) -> str:
    lines = ["# Validation against published training runs", "", preamble(result), ""]
    lines += summary_table(result["_suites"]) + [""]
    if result.get("fits"):
        lines += ["```"] + fit_lines(result) + ["```", ""]
    if result.get("plot"):
        lines += [f"![predicted vs published]({Path(result['plot']).name})", ""]
    lines += suite_sections(result["_suites"])
    return "\n".join(lines)


def preamble(result: dict) -> str:
    """Which command made the report, and how to read its errors and subsets."""
    return ("Generated by `" + result["command"] + "`. Signed error = predicted / published - 1 "
            "(for TFLOP/s, positive means the model is too fast; for seconds, too slow). "
            f"Fit subset: {FIT_SUBSET}.")


def summary_table(suites: Sequence[SuiteResult]) -> list[str]:
    """One line per suite: its metric, MAPE over the fit subset, the held-out rows and all, its rows."""
    lines = ["| suite | metric | MAPE fitted | MAPE held out | MAPE all | rows |", "|---|---|---|---|---|---|"]
    for s in suites:
        m = s.mape()
        lines.append(f"| {s.name} | {s.metric} | {_pct(m['fitted'])} | {_pct(m['held_out'])} | {_pct(m['all'])} "
                     f"| {len(s.rows)} |")
    return lines


def suite_sections(suites: Sequence[SuiteResult], level: int = 2) -> list[str]:
    """Each suite's heading (at Markdown `level`), description, metric, efficiencies and every row."""
    lines = []
    for s in suites:
        _, unit = DISPLAY[s.metric]
        lines += [f"{'#' * level} {s.name}", "", s.description + ".", "",
                  f"Metric: {unit}; arch `{s.arch}`" + (f", system `{s.system}`" if s.system else "") +
                  (f"; FLOP formula `{s.flops_formula}`" if s.flops_formula else "") + ".", ""]
        if _efficiency_line(s):
            lines += [_efficiency_line(s).capitalize() + ".", ""]
        lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        lines += ["| " + " | ".join(r) + " |" for r in table_rows(s)]
        lines += ["", _mape_line(s) + ".", ""] + [f"- {line}" for line in _reason_lines(s)]
    return lines


def to_json(result: dict) -> dict:
    out = {k: v for k, v in result.items() if not k.startswith("_")}
    out["schema"] = SCHEMA
    out["fit_subset"] = FIT_SUBSET
    out["suites"] = [s.to_json() for s in result["_suites"]]
    return jsonable(out)


def plot(suites: Sequence[SuiteResult], path: Path) -> Path:
    """Predicted vs published, every row of every suite normalised to its published value's unit, one
    colour per suite, filled markers for fitted rows and hollow for held-out ones, y = x and +-10%."""
    plt = pyplot()
    fig, axes = plt.subplots(1, max(1, len({s.metric for s in suites if s.rows})), figsize=(11, 5), squeeze=False)
    metrics = sorted({s.metric for s in suites if s.rows})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes[0], metrics):
        scale, unit = DISPLAY[metric]
        lo, hi = float("inf"), 0.0
        for k, s in enumerate(x for x in suites if x.rows):
            if s.metric != metric:
                continue
            colour = colours[k % len(colours)]
            for fitted in (True, False):
                pts = [(r.published * scale, r.predicted * scale) for r in s.rows
                       if r.fitted == fitted and r.predicted is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
                ax.scatter(xs, ys, s=42, edgecolors=colour, facecolors=colour if fitted else "none", linewidths=1.5,
                           label=f"{s.name} ({'fit' if fitted else 'held out'}, MAPE "
                                 f"{_pct(s.mape()['fitted' if fitted else 'held_out'])})")
        if hi <= 0:
            continue
        log = metric == "iteration_time_s" and hi / lo > 20
        if log:
            a, b = lo / 1.3, hi * 1.3
            ax.set_xscale("log"), ax.set_yscale("log")
        else:
            pad = 0.08 * (hi - lo) if hi > lo else 0.1 * hi
            a, b = max(lo - pad, 0.0), hi + pad
        ax.plot([a, b], [a, b], color="black", linewidth=1, label="y = x")
        xs = [a * (b / a) ** (i / 50) for i in range(51)] if log else [a, b]
        ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs],
                        color="grey", alpha=0.18, label=f"±{BAND:.0%}")
        ax.set_xlim(a, b)
        ax.set_ylim(a, b)
        ax.set_xlabel(f"published ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(metric)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
        ax.grid(True, alpha=0.3)
    fig.suptitle("phaze_opt validate: predicted vs published")
    fig.tight_layout()
    return write_figure(fig, path, tight=True)


def write_report(result: dict, out: Path) -> dict:
    """validation.md, validation.json and validation.png in `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    png = plot(result["_suites"], out / "validation.png")
    result["plot"] = str(png)
    md = out / "validation.md"
    md.write_text(render_markdown(result))
    js = out / "validation.json"
    files = {"markdown": str(md), "json": str(js), "plot": str(png)}
    result["files"] = files
    js.write_text(json.dumps(to_json(result), indent=2) + "\n")
    return files
