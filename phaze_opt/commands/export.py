"""`phaze-opt export STUDY`: a study's trials as one table (CSV, Parquet or JSON)."""

from __future__ import annotations

HELP = "write a study's trials as a table: design, recipe, placement, metrics with units, feasibility, timings"
DESCRIPTION = (
    "One row per finished trial: the design point, the training recipe (recipe.*), the accelerator (arch.*), "
    "the placement, every metric with its unit in the column name, the state and the reason a trial is "
    "infeasible or failed, repeat_of (an earlier trial that tried the same design) and the solver times. "
    "From Python: phaze_opt.results(STUDY) gives the same as a pandas DataFrame."
)


def add_arguments(p) -> None:
    p.add_argument("study", metavar="STUDY", help="study name (studies/<name>.db) or a path to its .db file")
    p.add_argument("--format", default="csv", metavar="csv|parquet|json", help="file format (default csv)")
    p.add_argument("--out", default=None, metavar="FILE",
                   help="where to write (default <output-dir>/<study>-trials.<format>)")
    p.add_argument("--storage", default=None, metavar="URL", help="Optuna storage URL holding the study")
    p.add_argument("--output-dir", default="studies", help="where the study's storage lies (default studies)")


def run(args) -> dict:
    from pathlib import Path

    from ..errors import PhazeError
    from ..experiments.results import FORMATS, load, results, write

    if args.format not in FORMATS:
        raise PhazeError(f"--format {args.format}: choose one of {', '.join(FORMATS)}")
    name, url, _ = load(args.study, args.storage, args.output_dir)
    frame = results(args.study, args.storage, args.output_dir)
    out = Path(args.out) if args.out else Path(args.output_dir) / f"{name}-trials.{args.format}"
    write(frame, out, args.format)
    return {"study": name, "rows": len(frame), "columns": len(frame.columns), "file": str(out), "format": args.format}


def render(result: dict) -> str:
    return (f"{result['rows']} trials of {result['study']}, {result['columns']} columns: {result['file']}\n"
            f"  in Python: phaze_opt.results({result['study']!r})")
