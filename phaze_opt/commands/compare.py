"""`phaze-opt compare` (also `python -m phaze_opt.compare`): sampled vs exhaustive convergence."""

from __future__ import annotations

from ..runs import DEFAULT_TRACKING_URI

HELP = "compare how fast studies converge: a table and a best-so-far vs wall-clock plot, logged to MLflow"
DESCRIPTION = (
    "Compare two or more studies (typically one sampled and one exhaustive study of the same model and space): "
    "best throughput, workers, trials, wall time, and the trials and time each needed to reach 99% of the best value "
    "any of them found. Wall time is the one each study printed: its search time summed over its runs. The plot "
    "shows best-so-far curves, the target line, where each study reached it, and a bound-pruned sweep's bounding "
    "phase. When a study has several objectives, it adds each study's throughput-area hypervolume (reference point: "
    "throughput 0, area = the space's budget) as a fraction of the exact front's where an exhaustive study proved one, "
    "the trials and time to 95% of it, and a plot of the fronts (<name>-fronts.png). "
    "Writes <output-dir>/<name>.csv, .md and .png and logs them to MLflow."
)


def add_arguments(p) -> None:
    p.add_argument("studies", nargs="+", metavar="STUDY",
                   help="study names (stored in sqlite:///<output-dir>/<name>.db unless --storage is given), "
                        "or paths to study .db files")
    p.add_argument("--storage", default=None, metavar="URL", help="Optuna storage URL holding all the studies")
    p.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, metavar="URL",
                   help=f"MLflow tracking URI, or 'off' (default {DEFAULT_TRACKING_URI})")
    p.add_argument("--threshold", type=float, default=0.99,
                   help="fraction of the best value found that counts as converged (default 0.99)")
    p.add_argument("--output-dir", default="studies", help="where the table and plot go (default studies)")
    p.add_argument("--name", default=None, help="file name stem for the outputs (default compare-<A>-vs-<B>)")


def run(args) -> dict:
    from ..experiments.convergence import compare

    return compare(args.studies, storage=args.storage, out_dir=args.output_dir, tracking_uri=args.tracking_uri,
                   threshold=args.threshold, name=args.name)


def render(result: dict) -> str:
    from ..experiments.convergence import render as _render

    return _render(result)
