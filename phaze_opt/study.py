"""`python -m phaze_opt.study [--trials 500] ...`: the same command as `phaze-opt study`."""

import sys

from .cli import exit_with, main


def run(argv=None) -> int:
    return main(["study", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    exit_with(run())
