"""`phaze-opt ui`: the MLflow UI on the studies' store, opened on a study's trials."""

from __future__ import annotations

from pathlib import Path

from ..configs import Limit, positive_arg
from ..errors import PhazeError
from ..runs import DEFAULT_TRACKING_URI

HELP = ("start the MLflow UI on the studies' store (127.0.0.1, a free port) and open a study's trials; "
        "--optuna: Optuna's dashboard on a study's storage")
DESCRIPTION = (
    "Start MLflow's server on the tracking store the studies log to (run it from the folder the studies ran "
    "in), on 127.0.0.1 and a free port; print the experiments' trial tables and, on a desktop, open the "
    "study's (or the experiments list). With --optuna, start Optuna's dashboard on the study's storage "
    "instead and print the study's page (optimization history, Pareto front, parameter importances). "
    "Ctrl-C stops it."
)


heartbeat = None  # a server that waits for Ctrl-C: its addresses are its output, not "still working" lines


def add_arguments(p) -> None:
    p.add_argument("--study", default=None, metavar="NAME",
                   help="the study (its MLflow experiment) to open; default the only one, else the experiments list")
    p.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, metavar="URL",
                   help=f"MLflow tracking URI the studies logged to (default {DEFAULT_TRACKING_URI})")
    p.add_argument("--optuna", action="store_true",
                   help="start Optuna's dashboard (optuna-dashboard) on the study's storage instead of MLflow")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="with --optuna: the study's Optuna storage (default sqlite:///studies/<study>.db, else the "
                        "only storage in studies/)")
    p.add_argument("--port", type=int, default=None, help="port to serve on (default a free one)")
    p.add_argument("--no-browser", dest="browser", action="store_false", default=None,
                   help="only print the addresses (default: open a browser when a desktop is present)")


def run(args) -> int:
    from ..runs import serve, serve_optuna

    if args.port is not None:
        positive_arg(args.port, "--port", Limit(65535, "TCP ports end at 65,535"))
    if args.optuna:
        return serve_optuna(storage_of(args.storage, args.study), args.study, port=args.port,
                            open_browser=args.browser)
    if args.storage is not None:
        raise PhazeError("--storage is for --optuna (Optuna's dashboard); MLflow's store is --tracking-uri")
    return serve(args.tracking_uri, args.study, port=args.port, open_browser=args.browser)


def storage_of(storage: str | None, study: str | None, output_dir: str = "studies") -> str:
    """The Optuna storage to open: the one given, the study's default one, else the only one in
    `output_dir` (several or none is a one-line error naming them)."""
    from ..search import default_storage

    if storage is not None:
        return storage
    if study is not None:
        return default_storage(study, output_dir)
    found = sorted(Path(output_dir).glob("*.db"))
    if len(found) != 1:
        names = ", ".join(p.stem for p in found) or "(none)"
        raise PhazeError(f"{len(found)} study storages in {Path(output_dir).resolve()}; give --study (one of: "
                         f"{names}) or --storage")
    return default_storage(found[0].stem, output_dir)
