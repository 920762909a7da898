"""`python -m phaze_opt.compare STUDY STUDY ...`: the same command as `phaze-opt compare`."""

import sys

from .cli import exit_with, main


def run(argv=None) -> int:
    return main(["compare", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    exit_with(run())
