"""Cold- and warm-cache wall time of a `python -m phaze_opt ...` command, for the benchmarks that time
a whole CLI process (bench_validate.py, bench_evaluate.py).

`cold` runs each get an empty schedule and graph cache of their own ($PHAZE_OPT_CACHE in a temporary
folder: every layer traced and scheduled anew, as on a fresh checkout); `warm` runs reuse one cache a
first, untimed run filled.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli_seconds(args: list[str], cache: str, check=None) -> float:
    """Wall seconds of one `python -m phaze_opt *args` process on `cache`; exits on a failed run, and
    on one whose output `check` (given the stdout) answers with a reason."""
    cmd = [sys.executable, "-m", "phaze_opt", *args]
    env = dict(os.environ, PHAZE_OPT_CACHE=cache, PYTHONPATH=str(ROOT), MLFLOW_DISABLE_TELEMETRY="true")
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        sys.exit(f"{args[0]} failed ({done.returncode}): {done.stderr.strip()}")
    problem = check(done.stdout) if check else None
    if problem:
        sys.exit(f"{' '.join(args)}: {problem}")
    return wall


def cold_and_warm(run, repeats: int) -> tuple[list[float], list[float]]:
    """(cold, warm) seconds of `repeats` calls each of `run(cache)`."""
    cold = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as cache:
            cold.append(run(cache))
    with tempfile.TemporaryDirectory() as cache:
        run(cache)
        warm = [run(cache) for _ in range(repeats)]
    return cold, warm


def report(label: str, runs: list[float]) -> None:
    print(f"{label}: median {statistics.median(runs):.1f} s, min {min(runs):.1f} s over {len(runs)} runs "
          f"({', '.join(f'{r:.1f}' for r in runs)}); load average now {os.getloadavg()[0]:.2f}", flush=True)
