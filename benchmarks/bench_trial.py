"""Benchmark: one study trial end to end on gpt3-175b, by stage (target: a new design <= 2 s, a seen one <= 50 ms).

    python benchmarks/bench_trial.py [--designs 20] [--seed 0] [--model gpt3-175b] [--ilp-time-limit S]

For `--designs` random architectures of the phaze space (seeded; HBM, microbatch and recompute
drawn too), each trial runs `objective.evaluate_point` exactly as the study does (area check,
workload graphs, latency estimates, per-layer ILPs at every TP width, placement DP, energy):

- new: the compute architecture and microbatch have not been seen, so every latency and ILP is
  computed (the schedule cache is a fresh temporary folder; the layer graphs, which depend only
  on the model, TP width and microbatch, are built once beforehand, as any study that has
  sampled that microbatch has them);
- seen: the same point again in the same process (the in-process cost memo hits; only the
  placement DP and bookkeeping run).

Prints the median and maximum of each and the median time per stage. Targets: new <= 2 s,
seen <= 50 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ["PHAZE_OPT_CACHE"] = os.environ.get("PHAZE_OPT_BENCH_GRAPHS") or tempfile.mkdtemp(prefix="phaze-trial-")

from phaze_opt.design.space import load_space  # noqa: E402
from phaze_opt.design.evaluate import design_evaluator, tp_widths  # noqa: E402
from phaze_opt.search.objective import Context, evaluate_point  # noqa: E402
from phaze_opt.system import load_system  # noqa: E402
from phaze_opt.workload.graphs import build_layer_graph  # noqa: E402
from phaze_opt.workload.models import load_model  # noqa: E402

STAGES = ("graph_s", "estimate_s", "ilp_s", "dp_s")


def random_points(space, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    archs = space.architectures(order="grid")
    out = []
    for k in rng.sample(range(len(archs)), n):
        p = {name: v for name, v in archs[k].items() if name != "area_mm2"}
        for name in ("hbm_gib", "mbs", "recompute"):
            p[name] = rng.choice(list(space.params[name]))
        out.append(p)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--designs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--ilp-time-limit", type=float, default=None,
                    help="per layer-pass ILP limit in seconds (default: the evaluator's, 60)")
    args = ap.parse_args(argv)
    space = load_space("phaze")
    model, system = load_model(args.model), load_system("default")
    for mbs in space.params["mbs"]:  # layer graphs: built once per (model, TP, microbatch) in any study
        for tp in tp_widths(model, system):
            build_layer_graph(model, tp, int(mbs))
    evaluator = design_evaluator(args.ilp_time_limit)
    ctx = Context(models=(args.model,), system="default", space=space, evaluator=evaluator)
    new, seen, failed, stages = [], [], [], {s: [] for s in STAGES}
    for p in random_points(space, args.designs, args.seed):
        t0 = time.perf_counter()
        try:
            out = evaluate_point(p, ctx)
        except Exception as exc:  # noqa: BLE001 - a study records this trial as failed and goes on
            new.append(time.perf_counter() - t0)
            failed.append(f"{p}: {exc}")
            print(f"{p}  new {new[-1]:.3f} s  FAILED: {exc}", flush=True)
            continue
        new.append(time.perf_counter() - t0)
        r = out.results.get(args.model) if out.results else None
        if r is not None:
            for s in STAGES:
                stages[s].append(r.timings.get(s, 0.0))
        t0 = time.perf_counter()
        evaluate_point(p, ctx)
        seen.append(time.perf_counter() - t0)
        print(f"{p}  new {new[-1]:.3f} s  seen {seen[-1] * 1e3:.1f} ms  "
              f"{'feasible' if out.feasible else 'infeasible: ' + out.reason[:60]}", flush=True)
    print(f"\n{len(new)} trials of {args.model}; new compute architecture + microbatch: median {statistics.median(new):.3f} s, "
          f"max {max(new):.3f} s; seen: median {statistics.median(seen) * 1e3:.1f} ms, max {max(seen) * 1e3:.1f} ms")
    if failed:
        print(f"{len(failed)} trial(s) failed (a study records them as failed trials):\n  " + "\n  ".join(failed))
    if stages["ilp_s"]:
        print("median per stage of a new trial: " + ", ".join(f"{s[:-2]} {statistics.median(v) * 1e3:.1f} ms"
                                                          for s, v in stages.items()))
    ok = not failed and statistics.median(new) <= 2.0 and statistics.median(seen) <= 0.05
    print(f"targets (new <= 2 s, seen <= 50 ms, medians): {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
