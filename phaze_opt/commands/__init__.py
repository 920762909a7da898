"""Subcommands of `phaze-opt`; see phaze_opt.cli for the contract each module follows."""


def add_ilp_time_limit(p) -> None:
    """`--ilp-time-limit`, the same for every command that schedules layers (None: the default 60 s)."""
    p.add_argument("--ilp-time-limit", type=float, default=None, metavar="SECONDS",
                   help="per layer-pass schedule solve limit in seconds (default 60); a pass not proven optimal "
                        "by then leaves the design unproven, with its throughput bound")
