"""`phaze-opt ui`: the MLflow UI on the studies' store, opened on a study's trials."""

from __future__ import annotations

from ..configs import Limit, positive_arg
from ..runs import DEFAULT_TRACKING_URI

HELP = "start the MLflow UI on the studies' store (127.0.0.1, a free port) and open a study's trials"
DESCRIPTION = (
    "Start MLflow's server on the tracking store the studies log to (run it from the folder the studies ran "
    "in), on 127.0.0.1 and a free port; print the experiments' trial tables and, on a desktop, open the "
    "study's (or the experiments list). Ctrl-C stops it."
)


heartbeat = None  # a server that waits for Ctrl-C: its addresses are its output, not "still working" lines


def add_arguments(p) -> None:
    p.add_argument("--study", default=None, metavar="NAME",
                   help="the study (its MLflow experiment) to open; default the only one, else the experiments list")
    p.add_argument("--tracking-uri", default=DEFAULT_TRACKING_URI, metavar="URL",
                   help=f"MLflow tracking URI the studies logged to (default {DEFAULT_TRACKING_URI})")
    p.add_argument("--port", type=int, default=None, help="port to serve on (default a free one)")
    p.add_argument("--no-browser", dest="browser", action="store_false", default=None,
                   help="only print the addresses (default: open a browser when a desktop is present)")


def run(args) -> int:
    from ..runs import serve

    if args.port is not None:
        positive_arg(args.port, "--port", Limit(65535, "TCP ports end at 65,535"))
    return serve(args.tracking_uri, args.study, port=args.port, open_browser=args.browser)
