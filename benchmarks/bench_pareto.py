"""The exact throughput-area front against sampled fronts: points pruned, hypervolume reached.

    python benchmarks/bench_pareto.py [--space phaze] [--samplers bound,nsga2,tpe] [--seeds 0] [--trials 500]
                                      [--workers 1] [--sweep-max-s S | --no-sweep] [--out DIR]

The exhaustive sweep (`--exhaustive --objectives throughput,area`) settles the exact front; then one
sampled study per sampler and seed runs `--trials` trials with the same objectives. Every study runs
as a user would run it (`python -m phaze_opt.study`, MLflow off, a cache folder of its own), and is
reused when its summary exists (a study resumes otherwise). The numbers come from the studies'
storages through `phaze-opt compare`: each study's hypervolume as a fraction of the exact front's
(reference point: throughput 0, area = the space's budget), trials and seconds to 95% of it. Prints
the sweep's counts (front size, points pruned, wall time) and the comparison table.

With `--sweep-max-s` the sweep is interrupted (SIGINT) after S seconds; it visits area groups
smallest first and drains each, so every group below the largest area it evaluated is settled
exactly. The comparison is then made in that window (areas below it): the exact front there, the
points of the window's designs pruned, and each sampled study's hypervolume in the window (reference
point: throughput 0, area = the window's edge) as a fraction of the exact front's. A rerun resumes
the sweep from its storage.

Over the whole space, without the sweep, each sampled study's hypervolume (reference point:
throughput 0, area = the space's budget) is divided by two numbers. The proven ceiling is the
hypervolume of the bound front (`design.front_order.bound_front`): every cell's level-0 throughput
bound at its exact area, with level 1 in place of level 0 for the cells the front rests on
(`refine_front_cells`; a recipe some study evaluated counts at its evaluated proven bound, its
throughput where the schedules were proven), capped at `--proven-optimum` when given (the single-objective sweep's proven
best throughput: no design exceeds it). Every design's true vector is weakly dominated by its cell's bound vector,
so the ceiling is at least the exact front's hypervolume, and the study's share of it is a proven
LOWER bound on the share of the exact front it reached. The best known front (every study's points
together, the sweep's too) lies on or under the exact front, so the share of it is an UPPER bound.

`--exact-study DB`: the storage of a front-sampler study (`--sampler bound --objectives
throughput,area`) run until it settled (its sampler found no point outside its trials that could
join its front; every trial's schedules proven). Its front is then the space's exact front, and each
study's share of it is exact (the settled study's own share is printed by trial as well); a study
that did not settle, or holds an unproven or failed trial, is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES = "throughput,area"


def study(args, space: str, out: Path, tag: str, extra: list[str], max_s: float | None = None) -> dict | None:
    """Run one study (or reuse its summary); returns the summary, None when it was cut at `max_s`."""
    done = out / f"{tag}.json"
    if done.is_file():
        return json.loads(done.read_text())
    cmd = [sys.executable, "-m", "phaze_opt.study", "--model", args.model, "--space", space, "--objectives", OBJECTIVES,
           "--workers", str(args.workers), "--tracking-uri", "off", "--output-dir", str(out), "--no-progress", "--json",
           *extra]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PHAZE_OPT_CACHE": str(out / f"cache-{tag}")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=max_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the study stops cleanly; its trials stay in its storage
        proc.communicate()
        return None
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {stderr.strip().splitlines()[-1:]}")
    done.write_text(stdout)
    return json.loads(stdout)


def points(out: Path, name: str) -> np.ndarray:
    """(throughput, area) of a study's feasible evaluated trials."""
    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{out / name}.db").get_trials(deepcopy=False)
    return np.array([(t.values[0], t.user_attrs["result"]["area_mm2"]) for t in trials
                     if t.state.name == "COMPLETE" and "point" in t.user_attrs
                     and all(v <= 0 for v in t.constraints.values())], dtype=float).reshape(-1, 2)


def window(args, out: Path, sweep_name: str, sampled: list[str]) -> None:
    """The comparison inside the area window the interrupted sweep settled (module docstring)."""
    from phaze_opt.design.pareto import front, hypervolume
    from phaze_opt.design.space import load_space

    exact = points(out, sweep_name)
    if len(exact) == 0:
        raise SystemExit("the sweep evaluated no design before it was cut; give a longer --sweep-max-s")
    edge = float(exact[:, 1].max())  # the group at the edge may be unfinished: the window stops below it
    inside = exact[exact[:, 1] < edge]
    areas = np.array([a["area_mm2"] for a in load_space(args.space).architectures(order="grid")])
    trials = optuna.load_study(study_name=sweep_name, storage=f"sqlite:///{out / sweep_name}.db").get_trials(
        deepcopy=False)
    evaluated = sum(1 for t in trials if (t.user_attrs.get("result") or {}).get("settled") == "evaluated"
                    and t.user_attrs["result"].get("area_mm2", np.inf) < edge)
    per_design = len(points_per_design(args.space))
    n = int(np.sum(areas < edge)) * per_design
    ref = np.array([0.0, edge])
    base = hypervolume(np.column_stack([-inside[:, 0], inside[:, 1]]), ref)
    print(f"## {args.space}, window area < {edge:.4g} mm^2 ({np.sum(areas < edge):,} of {areas.size:,} designs): "
          f"exact front of {len(front(np.column_stack([-inside[:, 0], inside[:, 1]])))} vectors, {n:,} points, "
          f"{evaluated:,} evaluated, {n - evaluated:,} pruned ({(n - evaluated) / n * 100:.2f}%)")
    print("| study | points in window | hypervolume fraction |\n|---|---|---|")
    for name in sampled:
        pts = points(out, name)
        pts = pts[pts[:, 1] < edge]
        hv = hypervolume(np.column_stack([-pts[:, 0], pts[:, 1]]), ref) if len(pts) else 0.0
        print(f"| {name} | {len(pts)} | {hv / base * 100:.2f}% |")


def pruned_at_least(args, known: np.ndarray) -> tuple[int, int]:
    """(points whose level-0 bound is at or below the best known throughput of a smaller design, all
    points): the exact sweep starts each area group with at least that incumbent (the exact front is
    at least the known one), so it never hands such a cell out: a lower bound on its pruning."""
    from phaze_opt.design.best_first import level0_throughput
    from phaze_opt.design.evaluate import tp_widths
    from phaze_opt.design.pareto import best_at_or_below
    from phaze_opt.design.space import load_space
    from phaze_opt.design.upper_bound import layer_lower_bounds
    from phaze_opt.hardware.latency import DesignArrays
    from phaze_opt.system import load_system
    from phaze_opt.training import kernel_choices, most_virtual_stages, recipe_choices
    from phaze_opt.workload.models import load_model

    space, model, system = load_space(args.space), load_model(args.model), load_system("default")
    params = space.params
    archs = space.architectures(order="grid")
    points = [{**{k: v for k, v in a.items() if k != "area_mm2"}, "hbm_gib": h, "mbs": 1, **recipe_choices(params)[0]}
              for a in archs for h in params["hbm_gib"]]
    designs = DesignArrays.from_accelerators([space.accelerator(p) for p in points])
    row_area = np.repeat([a["area_mm2"] for a in archs], len(params["hbm_gib"]))
    floor = best_at_or_below(known[:, 1], known[:, 0])(np.nextafter(row_area, -np.inf))  # strictly smaller areas
    pruned = 0
    for mbs in params["mbs"]:
        widths = [[layer_lower_bounds(model, designs, int(mbs), system, tp, a) for tp in tp_widths(model, system)]
                  for a in kernel_choices(params)]
        ub0 = level0_throughput(widths, int(mbs), system, most_virtual_stages(params))
        pruned += int(np.sum(ub0 <= floor))
    n_r = len(recipe_choices(params))
    return pruned * n_r, len(points) * len(params["mbs"]) * n_r


def hv(rows: np.ndarray, ref_area: float) -> float:
    """Hypervolume of (throughput, area) rows against (throughput 0, ref_area)."""
    from phaze_opt.design.pareto import hypervolume

    rows = np.asarray(rows, dtype=float).reshape(-1, 2)
    return hypervolume(np.column_stack([-rows[:, 0], rows[:, 1]]), [0.0, ref_area])


def evaluated_bounds(order, out: Path, names: list[str]) -> dict:
    """Each point the studies `names` evaluated, as `order`'s (a, h, m, r), with its proven upper
    bound (`score_bound`: the throughput where every schedule was proven optimal; 0 where no
    placement fits); the smallest where several studies hold it."""
    known: dict = {}
    for name in names:
        trials = optuna.load_study(study_name=name, storage=f"sqlite:///{out / name}.db").get_trials(deepcopy=False)
        for t in trials:
            result = t.user_attrs.get("result") or {}
            bound = result.get("score_bound")
            index = order.index_of(t.user_attrs["point"]) if "point" in t.user_attrs else None
            if t.state.name == "COMPLETE" and bound is not None and index is not None:
                known[index] = min(float(bound), known.get(index, np.inf))
    return known


def ceiling(args, out: Path, evaluated: list[str]) -> dict:
    """The proven ceiling on the exact front's hypervolume (module docstring), level 0 and refined
    (with the evaluated points of the studies `evaluated` in place of their bounds)."""
    from phaze_opt.design.best_first import BoundOrder
    from phaze_opt.design.front_order import bound_front, level0_cells, refine_front_cells
    from phaze_opt.design.space import load_space
    from phaze_opt.system import load_system
    from phaze_opt.workload.models import load_model

    space = load_space(args.space)
    order = BoundOrder(load_model(args.model), load_system("default"), space)
    areas = np.array([d["area_mm2"] for d in space.dies()], dtype=float)
    cells = level0_cells(order)
    known = evaluated_bounds(order, out, evaluated)
    refined, count = refine_front_cells(order, areas, cells, limit=args.refine_cells, known=known)
    ref = float(space.area_budget_mm2)
    top = bound_front(areas, refined)
    top[:, 0] = np.minimum(top[:, 0], args.proven_optimum or np.inf)  # no design beats a proven optimum
    return {"ref": ref, "level0": hv(bound_front(areas, cells), ref), "refined": hv(top, ref),
            "cells_refined": count, "front": top, "evaluated": len(known)}


def exact_front(args, out: Path, names: list[str], summaries: dict) -> None:
    """Every study against the front of a settled front-sampler study (module docstring)."""
    from phaze_opt.design.pareto import front
    from phaze_opt.design.space import load_space
    from phaze_opt.search.bound_sampler import SETTLED_ATTR

    db = Path(args.exact_study)
    if not db.is_file():
        raise SystemExit(f"--exact-study: no such storage file: {db}")
    storage = f"sqlite:///{db}"
    found = optuna.get_all_study_summaries(storage)
    if len(found) != 1:
        raise SystemExit(f"{db}: --exact-study needs a storage holding one study, it holds {len(found)}")
    summary = found[0]
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    open_trials = [t.number for t in trials if t.state.name == "FAIL"
                   or (t.user_attrs.get("result") or {}).get("proven") is False]
    if SETTLED_ATTR not in study.user_attrs or open_trials:
        raise SystemExit(f"{db}: not a settled front study (settled: {SETTLED_ATTR in study.user_attrs}; "
                         f"unproven or failed trials: {open_trials[:5]})")
    ref = float(load_space(args.space).area_budget_mm2)
    exact_pts = points(db.parent, summary.study_name)
    exact = hv(exact_pts, ref)
    size = len(front(np.column_stack([-exact_pts[:, 0], exact_pts[:, 1]])))
    settled_at = study.user_attrs[SETTLED_ATTR]["trial"]
    print(f"## {args.space}: exact throughput-area front (settled by {summary.study_name} after trial {settled_at}, "
          f"{len(trials):,} trials): {size} vectors, hypervolume {exact:.6g} (reference: throughput 0, area {ref:.2f} mm^2)")
    feasible = [(t.number, t.values[0], t.user_attrs["result"]["area_mm2"]) for t in trials
                if t.state.name == "COMPLETE" and "point" in t.user_attrs and all(v <= 0 for v in t.constraints.values())]
    by_trial = []
    for n in (50, 100, 200, 300, 400, 500, 750, 1000, len(trials)):
        pts = np.array([(v, a) for k, v, a in feasible if k < n]).reshape(-1, 2)
        by_trial.append(f"{n}: {hv(pts, ref) / exact * 100:.2f}%")
    print("its share of the exact front by trial: " + ", ".join(by_trial))
    print("| study | trials | wall (s) | best seq/s | share of the exact front |\n|---|---|---|---|---|")
    for name in names:
        pts = points(out, name)
        s = summaries[name]
        print(f"| {name} | {s.get('trials', {}).get('finished', len(pts))} | "
              f"{s.get('elapsed_s', s.get('wall_s', float('nan'))):.0f} | {pts[:, 0].max() if len(pts) else 0:.4g} | "
              f"{hv(pts, ref) / exact * 100:.2f}% |")


def whole_space(args, out: Path, names: list[str], summaries: dict, sweep_name: str | None) -> None:
    """Each sampled study against the proven ceiling (a lower bound on its share of the exact front)
    and against the best known front (an upper bound): module docstring."""
    sweep_name = sweep_name or f"{args.model}-{args.space}-exhaustive-bound-throughput+area"
    swept = [sweep_name] if (out / f"{sweep_name}.db").is_file() else []  # a sweep's points, cut or not
    c = ceiling(args, out, swept + names)
    known = np.vstack([points(out, n) for n in swept + names])
    best_known = hv(known, c["ref"])
    cap = f", capped at the proven optimum {args.proven_optimum:g} seq/s" if args.proven_optimum else ""
    print(f"## {args.space}, whole space: proven ceiling on the exact front's hypervolume {c['refined']:.6g} "
          f"(level 0 alone {c['level0']:.6g}; {c['cells_refined']:,} cells refined to level 1, with the "
          f"{c['evaluated']:,} points the studies evaluated at their proven bounds{cap}; "
          f"{len(c['front'])} bound vectors); best known front {best_known:.6g} "
          f"(reference: throughput 0, area {c['ref']:.2f} mm^2)")
    print("| study | trials | wall (s) | best seq/s | share of the ceiling (proven lower bound) | "
          "share of the best known front (upper bound) |\n|---|---|---|---|---|---|")
    for name in names:
        pts = points(out, name)
        mine = hv(pts, c["ref"])
        s = summaries[name]
        print(f"| {name} | {s.get('trials', {}).get('finished', len(pts))} | {s.get('elapsed_s', s.get('wall_s', float('nan'))):.0f} | "
              f"{pts[:, 0].max() if len(pts) else 0:.4g} | {mine / c['refined'] * 100:.2f}% | "
              f"{mine / best_known * 100:.2f}% |")


def points_per_design(space: str) -> list:
    """The (HBM, microbatch, recipe) choices every design of the space is swept with."""
    from phaze_opt.design.space import load_space
    from phaze_opt.training import recipe_choices

    params = load_space(space).params
    return [(h, m, r) for h in params["hbm_gib"] for m in params["mbs"] for r in recipe_choices(params)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--space", default="phaze")
    p.add_argument("--samplers", default="bound,nsga2,tpe")
    p.add_argument("--seeds", default="0", help="comma-separated seeds")
    p.add_argument("--trials", type=int, default=500)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sweep-max-s", type=float, default=None, help="interrupt the sweep after this many seconds")
    p.add_argument("--no-sweep", action="store_true", help="no exhaustive sweep: the whole-space comparison only")
    p.add_argument("--proven-optimum", type=float, default=None,
                   help="the space's proven best throughput (seq/s, from `study --exhaustive` of the same model, "
                        "space and system): caps the ceiling")
    p.add_argument("--refine-cells", type=int, default=200,
                   help="cells of the bound front bounded at level 1 for the proven ceiling (each a placement DP)")
    p.add_argument("--exact-study", default=None,
                   help="storage (.db) of a front-sampler study run until it settled: compare against its exact front")
    p.add_argument("--out", default="benchmarks/results/pareto")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from phaze_opt.experiments.convergence import compare

    out = Path(args.out) / args.space
    out.mkdir(parents=True, exist_ok=True)
    names, summaries = [], {}
    for sampler in args.samplers.split(","):
        for seed in args.seeds.split(","):
            s = study(args, args.space, out, f"{sampler}-{seed}",
                      ["--sampler", sampler, "--seed", seed, "--trials", str(args.trials)])
            names.append(s["study"])
            summaries[s["study"]] = s
    if args.exact_study:
        exact_front(args, out, names, summaries)
        return
    if args.no_sweep:
        whole_space(args, out, names, summaries, None)
        return
    sweep = study(args, args.space, out, "sweep", ["--exhaustive"], args.sweep_max_s)
    if sweep is None:
        sweep_name = f"{args.model}-{args.space}-exhaustive-bound-throughput+area"
        window(args, out, sweep_name, names)
        known = np.vstack([points(out, n) for n in [sweep_name, *names]])
        pruned, total = pruned_at_least(args, known)
        print(f"whole space: at least {pruned:,} of {total:,} points ({pruned / total * 100:.2f}%) are pruned by "
              "level 0 alone against the front the studies found")
        whole_space(args, out, names, summaries, sweep_name)
        return
    ex = sweep["exhaustive"]
    pruned = ex["points"] - ex["settled"]["evaluated"]
    print(f"## {args.space}: exact front of {len(sweep['pareto']['trials'])} designs; {ex['points']:,} points, "
          f"{ex['settled']['evaluated']:,} evaluated, {pruned:,} pruned ({pruned / ex['points'] * 100:.2f}%), "
          f"front proven: {ex.get('front_proven')}, wall {sweep['wall_s']:.1f} s")
    result = compare([sweep["study"], *names], out_dir=str(out), tracking_uri="off", name=f"pareto-{args.space}")
    print(result["fronts"]["markdown"])
    print(f"plot: {result['fronts']['plot']}")


if __name__ == "__main__":
    main()
