"""Sampled search against the proven optimum: fraction reached, trials and wall time to 99%.

    python benchmarks/bench_search.py [--space phaze --space phaze-recipes] [--seeds 0-4] [--trials 500]
                                      [--workers 1] [--sampler auto] [--max-wall-s S] [--paired] [--out DIR]

For each space: the exact pruned sweep (`--exhaustive`, same worker count) proves the optimum, then
one sampled study per seed runs `--trials` trials (or until the sampler has settled the space, or
`--max-wall-s` per study, after which the study is read as it stands). Every study runs as a user
would run it (`python -m phaze_opt.study`, MLflow off, cold caches in a fresh folder), and its
numbers are read back from its Optuna storage: best throughput / the sweep's optimum, the trial
and the elapsed seconds (the study's own clock, from opening it) at which 99% was first reached,
and the study's wall time. Prints one markdown table per space and writes it as JSON under --out.
The sweep is reused when its summary exists; a sampled study resumes (a settled one runs nothing).

`--paired`: on a shared machine whose load moves timings 2-3x between runs, one sweep timed once
cannot be compared with studies run minutes later. With it, every seed's study is paired with a
sweep of its own run right beside it in time (the sweep first for even seeds, the study first for
odd ones), and each pair's ratio of times to 99% is reported: the comparison is between runs under
the same load. Every pair's sweep must prove the same optimum; a study resumed from an earlier
invocation has no sweep beside it and is not paired.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna

ROOT = Path(__file__).resolve().parent.parent
optuna.logging.set_verbosity(optuna.logging.WARNING)


def study_cmd(args, space: str, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "phaze_opt.study", "--model", args.model, "--space", space,
            "--workers", str(args.workers), "--tracking-uri", "off", "--output-dir", str(out), "--no-progress",
            "--json", *extra]


def run(cmd: list[str], out: Path, tag: str, max_wall_s: float | None) -> dict | None:
    """Run a study with caches of its own (every study starts cold: none inherits another's
    schedules); its summary, or {"cut_at_s": ...} when it was cut at max_wall_s."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PHAZE_OPT_CACHE": str(out / f"cache-{tag}")}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max_wall_s)
    except subprocess.TimeoutExpired:
        return {"cut_at_s": time.perf_counter() - t0}
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout)


def trials_of(out: Path, name: str):
    storage = f"sqlite:///{out / name}.db"
    study = optuna.load_study(study_name=name, storage=storage)
    return study, study.get_trials(deepcopy=False)


def curve(trials, optimum: float) -> dict:
    """Best, and the first trial (by elapsed time) reaching 99% of the optimum."""
    rows = []
    for t in trials:
        ok = t.state.name == "COMPLETE" and t.values and all(v <= 0 for v in t.constraints.values())
        elapsed = (t.user_attrs.get("result") or {}).get("elapsed_s")
        if ok and isinstance(elapsed, (int, float)):
            rows.append((float(elapsed), t.number, float(t.values[0])))
    rows.sort()
    best, hit = 0.0, None
    for elapsed, number, value in rows:
        best = max(best, value)
        if hit is None and best >= 0.99 * optimum:
            hit = {"trial": number, "trials": sum(1 for t in trials if t.number <= number), "elapsed_s": elapsed}
    return {"best": best, "fraction": best / optimum if optimum else None, "to_99": hit,
            "wall_s": max([r[0] for r in rows], default=0.0)}


def bench_space(args, space: str) -> dict:
    out = Path(args.out) / space
    out.mkdir(parents=True, exist_ok=True)
    sweep_name = f"{args.model}-{space}-exhaustive-bound"
    sweep_file = out / f"{sweep_name}-summary.json"
    fresh = not sweep_file.is_file()  # run now: it pairs with the first seed's study, run next
    if fresh:
        print(f"[{space}] the exact sweep ({args.workers} worker(s)) ...", flush=True)
        run(study_cmd(args, space, out, ["--exhaustive", "--prune", "bound"]), out, "sweep", None)
    sweep = json.loads(sweep_file.read_text())
    optimum = float(sweep["best"]["score"])
    _, s_trials = trials_of(out, sweep_name)
    sweep_row = {"study": sweep_name, "workers": args.workers, "optimum": optimum, **curve(s_trials, optimum),
                 "wall_s": float(sweep["wall_s"]), "proven": sweep["exhaustive"].get("optimum_proven")}
    rows = []
    for seed in args.seeds:
        extra = ["--trials", str(args.trials), "--seed", str(seed), "--sampler", args.sampler]
        pair = None
        # a study run before this invocation (resumed) has no sweep beside it in time: not paired
        paired = args.paired and not any(out.glob(f"{args.model}-{space}-*-seed{seed}.db"))
        if paired and seed == args.seeds[0] and fresh:
            pair = {k: sweep_row[k] for k in ("to_99", "wall_s")}
        elif paired and seed % 2 == 0:
            pair = paired_sweep(args, space, out, seed, optimum)
        summary = run(study_cmd(args, space, out, extra), out, f"seed{seed}", args.max_wall_s)
        if paired and seed % 2 == 1:
            pair = paired_sweep(args, space, out, seed, optimum)
        name = next(p.stem for p in out.glob(f"{args.model}-{space}-*-seed{seed}.db"))
        study, trials = trials_of(out, name)
        row = {"study": name, "seed": seed, "trials": len(trials), **curve(trials, optimum),
               "settled": "bound_settled" in study.user_attrs,
               "repeats": len(trials) - len({tuple(sorted(t.params.items())) for t in trials}),
               "over_area": sum(1 for t in trials if t.constraints.get("area", 0) > 0)}
        if pair is not None:
            row["pair"] = pair
            if row["to_99"] and pair["to_99"]:
                row["pair_ratio"] = row["to_99"]["elapsed_s"] / pair["to_99"]["elapsed_s"]
        if summary and "cut_at_s" in summary:
            row["cut_at_s"] = summary["cut_at_s"]
        elif summary:
            row["wall_s"] = float(summary.get("wall_s", row["wall_s"]))
        rows.append(row)
        hit = row["to_99"]
        print(f"[{space}] seed {seed}: {row['fraction']:.4f} of the optimum, 99% at "
              f"{'trial %d, %.1f s' % (hit['trials'], hit['elapsed_s']) if hit else 'never'}, "
              f"{row['trials']} trials in {row.get('cut_at_s', row['wall_s']):.0f} s", flush=True)
    return {"space": space, "model": args.model, "workers": args.workers, "trials": args.trials,
            "sampler": args.sampler, "sweep": sweep_row, "seeds": rows}


def paired_sweep(args, space: str, out: Path, seed: int, optimum: float) -> dict:
    """A fresh sweep (cold caches, a folder of its own) run next to seed `seed`'s study: its time to
    99% and its wall, under the load that study saw."""
    where = out / f"pair-seed{seed}"
    where.mkdir(parents=True, exist_ok=True)
    name = f"{args.model}-{space}-exhaustive-bound"
    if not (where / f"{name}-summary.json").is_file():
        run(study_cmd(args, space, where, ["--exhaustive", "--prune", "bound"]), where, "sweep", None)
    summary = json.loads((where / f"{name}-summary.json").read_text())
    found = float(summary["best"]["score"])
    if abs(found - optimum) > 1e-9 * optimum:
        raise SystemExit(f"the paired sweep of seed {seed} proved {found}, the first sweep {optimum}")
    _, trials = trials_of(where, name)
    return {**curve(trials, optimum), "wall_s": float(summary["wall_s"])}


def table(result: dict) -> str:
    sweep = result["sweep"]
    hit = sweep["to_99"] or {}
    lines = [f"`{result['space']}`, {result['model']}, {result['workers']} worker(s); proven optimum "
             f"{sweep['optimum']:.2f} seq/s (sweep: 99% at {hit.get('elapsed_s', float('nan')):.1f} s, "
             f"done at {sweep['wall_s']:.1f} s)", "",
             "| seed | fraction of optimum | trials to 99% | time to 99% (s) | trials | wall (s) | settled | repeats | over area |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["seeds"]:
        h = r["to_99"]
        wall = f"{r['cut_at_s']:.0f} (cut)" if "cut_at_s" in r else f"{r['wall_s']:.1f}"
        lines.append(f"| {r['seed']} | {r['fraction']:.4f} | {h['trials'] if h else 'never'} | "
                     f"{h['elapsed_s']:.1f} | {r['trials']} | {wall} | {'yes' if r['settled'] else 'no'} | "
                     f"{r['repeats']} | {r['over_area']} |" if h else
                     f"| {r['seed']} | {r['fraction']:.4f} | never | never | {r['trials']} | {wall} | "
                     f"{'yes' if r['settled'] else 'no'} | {r['repeats']} | {r['over_area']} |")
    pairs = [r for r in result["seeds"] if "pair" in r]
    if pairs:
        lines += ["", "| seed | study: time to 99% (s) | its paired sweep: time to 99% (s) | sweep done (s) | ratio |",
                  "|---|---|---|---|---|"]
        for r in pairs:
            ph = r["pair"]["to_99"] or {}
            mine = f"{r['to_99']['elapsed_s']:.1f}" if r["to_99"] else "never"
            ratio = f"{r['pair_ratio']:.2f}" if "pair_ratio" in r else "-"
            lines.append(f"| {r['seed']} | {mine} | {ph.get('elapsed_s', float('nan')):.1f} | "
                         f"{r['pair']['wall_s']:.1f} | {ratio} |")
        ratios = [r["pair_ratio"] for r in pairs if "pair_ratio" in r]
        if ratios:
            lines += ["", f"paired: the study reached 99% first in {sum(x < 1 for x in ratios)} of {len(pairs)} pairs; "
                          f"median ratio of times to 99% {statistics.median(ratios):.2f}"]
    times = [r["to_99"]["elapsed_s"] for r in result["seeds"] if r["to_99"]]
    if times:
        lines += ["", f"median time to 99%: {statistics.median(times):.1f} s over {len(times)} of "
                      f"{len(result['seeds'])} seeds reaching it; the sweep's: {hit.get('elapsed_s', float('nan')):.1f} s "
                      f"(done and proven at {sweep['wall_s']:.1f} s)"]
    return "\n".join(lines)


def seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--space", action="append", default=None)
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--seeds", type=seeds, default=list(range(5)))
    p.add_argument("--trials", type=int, default=500)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sampler", default="auto")
    p.add_argument("--max-wall-s", type=float, default=None)
    p.add_argument("--paired", action="store_true",
                   help="pair every seed's study with a fresh sweep run beside it in time (see the docstring)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "search"))
    args = p.parse_args()
    for space in args.space or ["phaze", "phaze-recipes"]:
        result = bench_space(args, space)
        (Path(args.out) / f"{space}.json").write_text(json.dumps(result, indent=2))
        print(table(result), flush=True)


if __name__ == "__main__":
    main()
