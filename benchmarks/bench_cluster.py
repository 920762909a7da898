"""The pruned sweep on a Dask cluster: speed-up from 1 to 2 workers, the engine's per-task overhead,
and a projection to 1,000 cores for a 10^9-point space.

    python benchmarks/bench_cluster.py [--space phaze] [--model gpt3-175b] [--workers 1,2]
                                       [--noop 2000] [--points 1e9] [--cores 1000]
                                       [--out benchmarks/results/cluster.json] [--from-json FILE]

For each worker count, back to back: a fresh `distributed.LocalCluster` of that many worker
processes (one thread each) with a fresh schedule cache (every run starts cold), and the sweep run
on it as `phaze-opt study --exhaustive --cluster ADDRESS --workers N` would (MLflow off). The
scheduler's task stream gives each task's compute time by kind (level 0, level 1, evaluation).
Then the engine alone: `--noop` empty tasks through the same executor, one in flight (a task's
round trip) and 2 and 16 in flight (the engine's rate). Prints the figures and writes JSON.

The projection (a model, not a measurement): a space of `--points` points shaped like
`phaze-recipes` (`RECIPES_SHAPE`: its recipes a cell, its fractions of cells expanded and points
evaluated), priced at the measured run's unit costs (level 0 per cell, level 1 per recipe computed,
one evaluation) and spread over `--cores`. Its tasks are sized as the sweep sizes them on that many
workers (level 0: `LEVEL0_ROWS` rows; level 1: `level1_task_s(cores)` seconds, filled as fully as
the measured run filled its own), and every task pays the engine's measured per-task cost on its
one scheduler and one parent. Level 0 ends before level 1 starts, each phase takes at least one of
its tasks, and one evaluation is the critical path's floor (it cannot be split). `--from-json FILE`
recomputes it from a saved result.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phaze_opt.runs import cluster  # noqa: E402
from phaze_opt.search.branch_bound import LEVEL0_ROWS, level1_task_s  # noqa: E402
from phaze_opt.search.runner import run_study  # noqa: E402
from phaze_opt.search.setup import StudyConfig  # noqa: E402

KINDS = ("level0", "level1", "evaluate")


def _noop():
    return None


def _cpu_s() -> float:
    """This process's CPU seconds (user + system): a rate per core that other jobs' load does not move."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def sweep_on_cluster(args, workers: int, out: Path) -> dict:
    from distributed import Client, LocalCluster, get_task_stream

    os.environ["PHAZE_OPT_CACHE"] = tempfile.mkdtemp(prefix="bench-cluster-cache-")  # the workers inherit it
    seen = []
    shutdown = cluster.ClusterExecutor.shutdown

    def keep_stats(self, *a, **k):
        seen.append(dict(self.stats))
        return shutdown(self, *a, **k)

    cluster.ClusterExecutor.shutdown = keep_stats
    try:
        with (LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0") as lc,
              Client(lc) as client, get_task_stream(client=client) as stream):
            t0, cpu0 = time.perf_counter(), _cpu_s()
            summary = run_study(StudyConfig(models=(args.model,), space=args.space, hysteresis="off",
                                            strategy="branch-and-bound", tracking_uri="off", output_dir=str(out), progress=False,
                                            cluster=lc.scheduler_address, workers=workers))
            wall, parent_cpu = time.perf_counter() - t0, _cpu_s() - cpu0  # the parent holds the scheduler too
            tasks = stream.data
            worker_cpu = sum(client.run(_cpu_s).values())
    finally:
        cluster.ClusterExecutor.shutdown = shutdown
    compute = defaultdict(lambda: [0, 0.0])
    for t in tasks:
        kind = t["key"].split("-")[0] if isinstance(t["key"], str) else "other"
        for s in t["startstops"]:
            if s["action"] == "compute":
                compute[kind][1] += s["stop"] - s["start"]
        compute[kind][0] += 1
    ex = summary["exhaustive"]
    return {"workers": workers, "wall_s": wall, "sweep_s": ex["wall_s"], "level0_s": ex["level0_s"],
            "points": ex["points"], "settled": ex["settled"], "cells": ex["cells"],
            "cells_expanded": ex["cells_expanded"], "level1_runs": ex["level1_runs"],
            "level1_unused": ex["level1_unused"], "optimum": ex["optimum"], "optimum_proven": ex["optimum_proven"],
            "executor": seen[-1] if seen else None,
            "compute": {k: {"tasks": n, "s": s} for k, (n, s) in compute.items()},
            "points_per_s_per_core": ex["points"] / ex["wall_s"] / workers,
            "worker_cpu_s": worker_cpu, "parent_cpu_s": parent_cpu,
            "points_per_worker_cpu_s": ex["points"] / worker_cpu}


def engine_overhead(n: int) -> dict:
    """Seconds per empty task through ClusterExecutor: one in flight (round trip) and two (rate)."""
    from concurrent.futures import FIRST_COMPLETED, wait

    from distributed import LocalCluster

    out = {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as lc:
        pool = cluster.ClusterExecutor(lc.scheduler_address)
        try:
            pool.submit(_noop).result()
            t0 = time.perf_counter()
            for _ in range(n):
                pool.submit(_noop).result()
            out["round_trip_s"] = (time.perf_counter() - t0) / n
            for inflight in (2, 16):
                t0 = time.perf_counter()
                live, done = set(), 0
                while done < n:
                    while len(live) < inflight and done + len(live) < n:
                        live.add(pool.submit(_noop))
                    finished, live = wait(live, return_when=FIRST_COMPLETED)
                    done += len(finished)
                out[f"per_task_s_{inflight}_in_flight"] = (time.perf_counter() - t0) / n
        finally:
            pool.shutdown()
    return out


# The projected space: phaze-recipes' shape (BENCHMARKS.md, "Exhaustive sweep of the phaze-recipes
# space"): 144 recipes a cell, two attention kernels bounded at level 0, 1,311 of 351,564 cells
# expanded, 25,968 recipes bounded at level 1 in them (the rest dominated), 252 points evaluated.
RECIPES_SHAPE = {"recipes": 144, "attention": 2, "expanded": 1311 / 351564, "level1_per_cell": 25968 / 1311,
                 "evaluated_per_cell": 252 / 351564}


def project(run: dict, engine: dict, points: float, cores: int, shape: dict = RECIPES_SHAPE) -> dict:
    """The model of the module docstring. Unit costs come from the measured run (one worker, so no
    task waits on another): level 0 per cell and kernel, level 1 per recipe computed (read or not),
    one evaluation; counts from the projected space's shape, scaled linearly with its cells
    (pessimistic for the evaluations: the points near the optimum do not multiply with the grid)."""
    c = run["compute"]
    computed = run["level1_runs"] + run.get("level1_unused", 0)
    per_l0 = c["level0"]["s"] / run["cells"]  # phaze: one kernel
    per_l1 = c["level1"]["s"] / computed
    per_eval = c["evaluate"]["s"] / max(1, c["evaluate"]["tasks"])
    # how full the measured run's level-1 tasks were against their CPU-second target (a batch stops
    # early where an evaluation is due; the workers' CPU split by kind as their compute time is),
    # and the share of level-1 work computed ahead and never read
    l1_cpu = run["worker_cpu_s"] * c["level1"]["s"] / sum(k["s"] for k in c.values())
    fill = min(1.0, l1_cpu / c["level1"]["tasks"] / level1_task_s(run["workers"]))
    ahead = computed / run["level1_runs"]
    cells = points / shape["recipes"]
    expanded = cells * shape["expanded"]
    evaluated = cells * shape["evaluated_per_cell"]
    work = {"level0": per_l0 * cells * shape["attention"],
            "level1": per_l1 * expanded * shape["level1_per_cell"] * ahead, "evaluate": per_eval * evaluated}
    l1_task = max(level1_task_s(cores) * fill, work["level1"] / expanded)  # at least one cell a task
    tasks = {"level0": cells * shape["attention"] / LEVEL0_ROWS, "level1": work["level1"] / l1_task,
             "evaluate": evaluated}
    per_task = engine["per_task_s_16_in_flight"]  # one scheduler and one parent hand out every task
    phases = {"level0": max(work["level0"] / cores, per_l0 * LEVEL0_ROWS, tasks["level0"] * per_task),
              "settle": max((work["level1"] + work["evaluate"]) / cores, l1_task,
                            (tasks["level1"] + tasks["evaluate"]) * per_task)}
    engine_s = sum(tasks.values()) * per_task
    total = sum(phases.values()) + per_eval  # one evaluation cannot be split: the critical path's floor
    return {"points": points, "cores": cores, "cells": cells,
            "unit_s": {"level0_cell": per_l0, "level1_recipe": per_l1, "evaluation": per_eval},
            "level1_fill": fill, "level1_computed_per_read": ahead, "level1_task_s": l1_task,
            "work_core_s": work, "tasks": tasks, "phases_s": phases, "spread_s": sum(work.values()) / cores,
            "engine_s": engine_s, "time_s": total, "engine_share": engine_s / total}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--space", default="phaze")
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--workers", default="1,2", help="worker counts, run back to back (default 1,2)")
    ap.add_argument("--noop", type=int, default=2000, help="empty tasks for the engine's overhead (default 2000)")
    ap.add_argument("--points", type=float, default=1e9, help="the projected space's points (default 1e9)")
    ap.add_argument("--cores", type=int, default=1000, help="the projected cluster's cores (default 1000)")
    ap.add_argument("--from-json", default=None, metavar="FILE", help="recompute the projection from a saved result")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cluster.json"))
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        result["projection"] = project(result["runs"][0], result["engine"], args.points, args.cores)
        Path(args.from_json).write_text(json.dumps(result, indent=1, default=str))
        print(json.dumps(result["projection"], indent=1))
        return result
    load = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp:
        for n in (int(w) for w in args.workers.split(",")):
            runs.append(sweep_on_cluster(args, n, Path(tmp) / f"w{n}"))
            r = runs[-1]
            print(f"{n} worker(s): sweep {r['sweep_s']:.1f} s (wall {r['wall_s']:.1f} s), "
                  f"{r['points_per_s_per_core']:.0f} points/s/core, optimum {r['optimum']!r}, tasks "
                  f"{r['executor']}", flush=True)
    engine = engine_overhead(args.noop)
    base = runs[0]
    result = {"space": args.space, "model": args.model, "load_before": load, "load_after": os.getloadavg(),
              "runs": runs, "engine": engine,
              "speedup": {r["workers"]: base["sweep_s"] / r["sweep_s"] for r in runs},
              "engine_share": {r["workers"]: (r["executor"]["tasks"] * engine["per_task_s_2_in_flight"]) / r["sweep_s"]
                               for r in runs if r["executor"]},
              "projection": project(base, engine, args.points, args.cores)}
    assert len({r["optimum"] for r in runs}) == 1, "the worker counts disagree on the optimum"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("load_before", "load_after", "speedup", "engine_share", "engine")}, indent=1))
    print(json.dumps(result["projection"], indent=1))
    print(f"median of the worker counts' points/s/core: {statistics.median(r['points_per_s_per_core'] for r in runs):.0f}")
    return result


if __name__ == "__main__":
    main()
