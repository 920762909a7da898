"""Level 1 of the bounds (`design/upper_bound.placement_throughput`) per cell, the work that dominates
a sweep of a large model's `phaze-recipes` space: one (architecture, HBM, microbatch) cell's recipes
that dominance leaves, each bounded by the optimal placement on the design's layer lower bounds.

    python benchmarks/bench_level1.py [--model llama3-70b] [--space phaze-recipes] [--system default] [--runs 3]

Cells: the largest HBM of the space, the first, middle and last architecture of its grid order, at
its two smallest microbatches. Every cell is bounded once untimed (graphs traced or read, the
designs' layer bounds scheduled); then each is timed `--runs` times in this process, warm. Prints the median
seconds per cell and a checksum of the bounds (a faster version must print the same checksum).
"""

from __future__ import annotations

import argparse
import statistics
import time

from phaze_opt.design.best_first import BoundOrder
from phaze_opt.design.front_order import cell_recipe_bounds
from phaze_opt.design.space import load_space
from phaze_opt.system import load_system
from phaze_opt.workload.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--space", default="phaze-recipes")
    p.add_argument("--system", default="default")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    order = BoundOrder(load_model(args.model), load_system(args.system), load_space(args.space))
    last = len(order.archs) - 1
    cells = [(a, len(order.hbms) - 1, m) for a in (0, last // 2, last) for m in range(min(2, len(order.mbss)))]
    for cell in cells:
        cell_recipe_bounds(order, *cell)  # warm: graphs, layer lower bounds of the designs
    times, checksum, recipes = [], 0.0, 0
    for _ in range(args.runs):
        for cell in cells:
            start = time.perf_counter()
            bounds = cell_recipe_bounds(order, *cell)
            times.append(time.perf_counter() - start)
            checksum += sum(b for _, b in bounds)
            recipes += len(bounds)
    print(f"{args.model} on {args.space}: {len(cells)} cells x {args.runs} runs, {recipes // args.runs} recipe "
          f"bounds a run; median {statistics.median(times):.3f} s per cell (min {min(times):.3f}, max "
          f"{max(times):.3f}); checksum {checksum / args.runs:.9g}")


if __name__ == "__main__":
    main()
