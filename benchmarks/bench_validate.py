"""Wall time of `phaze-opt validate` over every shipped suite (target: under 2 minutes).

    python benchmarks/bench_validate.py [--repeats 3] [--suite NAME ...]

Each run is a fresh `python -m phaze_opt validate --out <tmp>` process. `cold` runs get an empty
schedule/graph cache of their own ($PHAZE_OPT_CACHE in a temporary folder: every layer traced and
scheduled anew, as on a fresh checkout); `warm` runs reuse one cache filled by a first, untimed run
(the usual case: the schedules of the published rows are cached after the first validation).
Prints the median and the minimum of each.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from cold_warm import cli_seconds, cold_and_warm, report


def one_run(cache: str, suites: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        return cli_seconds(["validate", "--out", out, *(a for s in suites for a in ("--suite", s))], cache)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--suite", action="append", default=[])
    args = p.parse_args(argv)
    cold, warm = cold_and_warm(lambda cache: one_run(cache, args.suite), args.repeats)
    report("cold cache", cold)
    report("warm cache", warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
