"""What the study machinery itself costs per trial (Optuna storage, MLflow logging), and the study's
acceptance flow with the real pipeline.

    python benchmarks/bench_study.py [--repeats 3] [--trials 40] [--real]

1. machinery: the `small` space with a trivial evaluator (microseconds), so the time per trial is
   Optuna (SQLite storage, TPE) + our bookkeeping + MLflow (SQLite store, background thread); for a
   sampled study and for the exhaustive sweep (144 points), tracking on and off. Median of runs.
2. --real: the 20-trial gpt2-xl study on `small`, the exhaustive sweep of `small`, and `compare`,
   each in a fresh process as a user runs them (wall-clock, including interpreter start).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from phaze_opt.hardware.arch import load_arch  # noqa: E402
from phaze_opt.design.space import load_space  # noqa: E402
from phaze_opt.search.runner import run_study  # noqa: E402
from phaze_opt.search.setup import Backend, StudyConfig  # noqa: E402


@dataclass
class Result:
    feasible: bool = True
    reason: str = ""
    throughput: float = 0.0
    tokens_per_s: float = 0.0
    time_per_batch_s: float = 1.0
    area_mm2: float = 0.0
    mfu: float = 0.5
    placement: dict = field(default_factory=lambda: {"tp": 1, "pp": 2, "dp": 512, "microbatches": 8, "stages": []})
    timings: dict = field(default_factory=lambda: {"graph_s": 0.0, "estimate_s": 0.0, "ilp_s": 0.0, "dp_s": 0.0})
    layers: list = field(default_factory=list)
    energy_j: float | None = None


def trivial(model, arch, training, system="default"):
    t = arch.peak_flops / 1e12 * (1 + 0.2 * training.mbs) * (0.8 if training.recomputes else 1.0)
    return Result(throughput=t, tokens_per_s=t * 1024)


def machinery(trials: int, repeats: int) -> None:
    space = load_space("small")
    backend = Backend(evaluator=trivial, space=space, reference_arch=load_arch("tpuv4"), check_model=lambda m: m)
    for label, exhaustive in (("sampled (TPE)", False), ("exhaustive", True)):
        for tracking in (False, True):
            per = []
            for _ in range(repeats):
                tmp = Path(tempfile.mkdtemp(prefix="bench-study-"))
                try:
                    cfg = StudyConfig(models=("gpt2-xl",), space="small", trials=trials,
                                      strategy="auto" if exhaustive else "sampled",
                                      output_dir=str(tmp / "studies"), progress=False,
                                      tracking_uri=f"sqlite:///{tmp}/mlruns/mlflow.db" if tracking else "off")
                    t0 = time.perf_counter()
                    summary = run_study(cfg, backend)
                    wall = time.perf_counter() - t0
                    per.append(wall / summary["trials"]["finished"])
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
            n = trials if not exhaustive else space.size()
            print(f"{label:14s} tracking {'on ' if tracking else 'off'}: {n} trials, median "
                  f"{statistics.median(per) * 1000:.1f} ms per trial (runs: {', '.join(f'{p * 1000:.0f}' for p in per)})")


def real() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-study-real-"))
    py = [sys.executable, "-m"]
    steps = [
        ("study --trials 20 (gpt2-xl, small)", py + ["phaze_opt.study", "--model", "gpt2-xl", "--space", "small",
                                                   "--trials", "20", "--no-progress"]),
        ("exhaustive (gpt2-xl, small)", py + ["phaze_opt.study", "--model", "gpt2-xl", "--space", "small",
                                              "--exhaustive", "--no-progress"]),
        ("compare", py + ["phaze_opt.compare", "gpt2-xl-small-tpe-seed0", "gpt2-xl-small-exhaustive-area-hoff"]),
    ]
    total = 0.0
    try:
        for label, cmd in steps:
            t0 = time.perf_counter()
            subprocess.run(cmd, cwd=tmp, check=True, stdout=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            total += wall
            print(f"{label:36s} {wall:6.1f} s")
        print(f"{'end to end':36s} {total:6.1f} s (acceptance limit 180 s)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--real", action="store_true", help="also time the acceptance flow with the real pipeline")
    args = ap.parse_args()
    machinery(args.trials, args.repeats)
    if args.real:
        real()


if __name__ == "__main__":
    main()
