"""The MoE and long-context rows of the published comparison alone, with wall time.

    python benchmarks/published_moe.py [--trials N] [--ilp-time-limit S] [--system S] [--model M ...]

TPUv4 with the expert and with the optimal placement, and the best design of a TPE study
(architecture and placement together; TPUv4 at every microbatch/recompute setting first), for
mixtral-8x7b and llama2-7b-32k by default; writes studies/published-moe/published-moe.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from phaze_opt.experiments.published import (EXTRA_MODELS, PublishedConfig, render_extra,  # noqa: E402
                                             run_extra_only)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--ilp-time-limit", type=float, default=2.0)
    ap.add_argument("--system", default="default")
    ap.add_argument("--model", action="append")
    ap.add_argument("--output-dir", default="studies/published-moe")
    args = ap.parse_args()
    cfg = PublishedConfig(models=(), systems=(args.system,), trials=args.trials, output_dir=args.output_dir,
                          ilp_time_limit_s=args.ilp_time_limit, extra_models=tuple(args.model or EXTRA_MODELS))
    t0 = time.perf_counter()
    result = run_extra_only(cfg, args.system)
    wall = time.perf_counter() - t0
    text = (f"Command: `python benchmarks/published_moe.py {' '.join(sys.argv[1:])}`; wall {wall:.0f} s; "
            f"{args.trials} trials per study, ILP limit {args.ilp_time_limit} s per layer pass.\n\n" + render_extra(result))
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "published-moe.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
