"""Subcommands of `phaze-opt`; see phaze_opt.cli for the contract each module follows."""

from ..configs import positive_arg
from ..system import MBS_LIMIT


def add_mbs(p) -> None:
    """`--mbs`, the same for every command that builds a layer graph at one microbatch size."""
    p.add_argument("--mbs", type=int, default=1, help="microbatch size in sequences (default 1)")


def check_mbs(args) -> int:
    """The one-line error names the flag the user typed (the model layers below only know `mbs`)."""
    return positive_arg(args.mbs, "--mbs", MBS_LIMIT)


def add_ilp_time_limit(p) -> None:
    """`--ilp-time-limit`, the same for every command that schedules layers (None: the default 60 s)."""
    p.add_argument("--ilp-time-limit", type=float, default=None, metavar="SECONDS",
                   help="per layer-pass schedule solve limit in seconds (default 60); a pass not proven optimal "
                        "by then leaves the design unproven, with its throughput bound")
