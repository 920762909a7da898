"""Cold extraction of GPT-3's layer graphs at all four TP widths, microbatch 1.

Each run is a fresh Python process with an empty cache folder, so nothing is warm: the time
includes importing torch and tracing. Reports the median of the runs for the whole process (wall and CPU
time: on a shared machine the CPU time is the steadier number), the extraction alone, and the peak
RSS; then the same graphs read back from the disk cache.
Target: under 10 s and under 1 GB RSS, cold.

    python benchmarks/bench_workload.py [--model gpt3-175b] [--runs 3]
    python benchmarks/bench_workload.py --model llama3-8b,deepseek-v3 --runs 1   # one row per model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, resource, sys, time
start = time.perf_counter()
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.models import load_model
model = load_model(sys.argv[1])
t0 = time.perf_counter()
sources = [build_layer_graph(model, tp, 1).extra["source"] for tp in model.tp_widths]
done = time.perf_counter()
print(json.dumps({
    "widths": list(model.tp_widths), "sources": sources,
    "extract_s": done - t0, "process_s": done - start,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "cpu_s": resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime,
}))
"""


def child(model: str, cache: str) -> dict:
    env = {"PHAZE_OPT_CACHE": cache, "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3-175b", help="a model, or several separated by commas")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for model in args.model.split(","):
        bench(model.strip(), args.runs)


def bench(model: str, runs: int) -> None:
    cold, warm = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as cache:
            run = child(model, cache)
            assert all(s == "traced" for s in run["sources"]), run
            cold.append(run)
            again = child(model, cache)
            assert all(s == "disk cache" for s in again["sources"]), again
            warm.append(again)

    def med(rows, key):
        return statistics.median(r[key] for r in rows)

    print(f"{model}, TP widths {cold[0]['widths']}, microbatch 1, median of {runs} fresh processes")
    print(f"  cold: process wall {med(cold, 'wall_s'):.2f} s (in-process {med(cold, 'process_s'):.2f} s, "
          f"extraction {med(cold, 'extract_s'):.2f} s), CPU {med(cold, 'cpu_s'):.2f} s, "
          f"peak RSS {med(cold, 'peak_rss_mib'):.0f} MiB")
    print(f"  disk cache: process wall {med(warm, 'wall_s'):.2f} s (extraction {med(warm, 'extract_s') * 1e3:.1f} ms), "
          f"peak RSS {med(warm, 'peak_rss_mib'):.0f} MiB")
    print("  target (set for gpt3-175b): cold < 10 s and < 1024 MiB:",
          "met" if med(cold, "wall_s") < 10 and med(cold, "peak_rss_mib") < 1024 else "NOT met")


if __name__ == "__main__":
    main()
