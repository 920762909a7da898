"""`phaze-opt validate`: the cost models against published training runs and measured layers."""

from __future__ import annotations

HELP = "compare the model's predictions with published training runs (validation suites)"
DESCRIPTION = (
    "Evaluate every row of the validation suites (presets/validation/; default all shipped) with its "
    "published recipe, print predicted vs published per row with the signed error and per suite the "
    "MAPE on the fit subset (odd rows), the held-out rows (even rows) and all; write validation.md, "
    "validation.json and validation.png to --out, and with --tracking-uri one MLflow run. --fit first "
    "fits the system presets' efficiency blocks on the fit subset and reports the suites with them."
)
DEFAULT_OUT = "reports/validation"


def add_arguments(p) -> None:
    p.add_argument("--suite", action="append", metavar="NAME_OR_PATH",
                   help="a suite name in presets/validation (or --configs DIR) or a path to a suite YAML; repeat (default: all)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for validation.md, validation.json and validation.png (default {DEFAULT_OUT})")
    p.add_argument("--tracking-uri", default="off", metavar="URI",
                   help="MLflow tracking URI for one run with the report, or 'off' (default off)")
    p.add_argument("--system", default=None, metavar="NAME",
                   help="run every training row on this system (configs/systems) instead of its suite's or its own, "
                        "e.g. the TPU v4 rows on default vs tpuv4-pod")
    p.add_argument("--fit", action="store_true",
                   help="fit each training system's fixed cost per microbatch and pipeline stage "
                        "(efficiency.microbatch_overhead, 0-10 ms grid) on the fit subset (odd rows), then report "
                        "with the fitted value (the preset files are not changed)")
    p.add_argument("--fit-links", action="store_true",
                   help="with --fit: fit the achieved link bandwidth fractions too (0.50-1.00 grid) instead of "
                        "keeping the preset's NCCL-sourced values")
    p.add_argument("--fit-tc", action="store_true",
                   help="with --fit: fit the arch's tensor-core fraction (efficiency.tc_fraction) too; minutes: every "
                        "value re-schedules the layers")


def command_line(args) -> str:
    parts = ["phaze-opt validate"]
    for s in args.suite or ():
        parts.append(f"--suite {s}")
    if getattr(args, "system", None):
        parts.append(f"--system {args.system}")
    if args.fit or args.fit_links or args.fit_tc:
        parts.append("--fit")
    if args.fit_links:
        parts.append("--fit-links")
    if args.fit_tc:
        parts.append("--fit-tc")
    return " ".join(parts)


def run(args) -> dict:
    from ..validation.workflow import validate

    result = validate(args.suite, out=args.out, tracking_uri=args.tracking_uri,
                      fit=args.fit or args.fit_links or args.fit_tc, fit_links=args.fit_links, fit_tc=args.fit_tc,
                      command=command_line(args), system=getattr(args, "system", None))
    if getattr(args, "json", False):  # the SuiteResults are for the text renderer; the JSON has `suites`
        result.pop("_suites")
    return result


def render(result: dict) -> str:
    from ..validation.report import render_text

    return render_text(result)


def heartbeat(args) -> str:
    """The label of the line `phaze-opt` prints every 10 s while the suites' rows are evaluated."""
    return "validate " + ", ".join(args.suite or ["every suite"])
