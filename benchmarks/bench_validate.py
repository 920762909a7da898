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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(cache: str, suites: list[str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "phaze_opt", "validate", "--out", out]
        for s in suites:
            cmd += ["--suite", s]
        env = dict(os.environ, PHAZE_OPT_CACHE=cache, PYTHONPATH=str(ROOT))
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"validate failed ({done.returncode}): {done.stderr.strip()}")
    return wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--suite", action="append", default=[])
    args = p.parse_args(argv)
    cold = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(one_run(cache, args.suite))
    with tempfile.TemporaryDirectory() as cache:
        one_run(cache, args.suite)
        warm = [one_run(cache, args.suite) for _ in range(args.repeats)]
    for name, runs in (("cold cache", cold), ("warm cache", warm)):
        print(f"{name}: median {statistics.median(runs):.1f} s, min {min(runs):.1f} s over {len(runs)} runs "
              f"({', '.join(f'{r:.1f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
