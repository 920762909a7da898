"""Wall time of `phaze-opt evaluate` of a 405B-class run on H100 (target: under 30 s).

    python benchmarks/bench_evaluate.py [--repeats 3] [--cases fixed,search,deepseek-v3,llama3-405b]

Two runs of Llama 3.1 405B on `h100-sxm` / `dgx-h100`, the NeMo recipe of the dgxc-h100-bf16 suite
(2,304 GPUs, global batch 1008, TP 8 CP 2 VP 7, sequence parallelism with TP-communication overlap,
the distributed optimizer with both overlaps, Transformer Engine's kernels):
- `fixed`: its published placement (tp=8,pp=9,dp=16,cp=2), what `validate` evaluates;
- `search`: the exact placement DP over every TP / PP / DP / CP the recipe allows (`--placement`
  left out), what a user asking "how should I split it" runs.
and each 2024 model with the command's defaults alone (`evaluate --model NAME`: the chip, system and
ILP limit its file names, the machine's cores as --jobs), each run checked feasible.
Each run is a fresh `python -m phaze_opt evaluate` process. `cold` runs get an empty schedule and
graph cache of their own (every layer traced and scheduled anew); `warm` runs reuse one cache filled
by a first, untimed run. Prints the median and the minimum of each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from cold_warm import cli_seconds, cold_and_warm, report

RECIPE = ["--model", "llama3-405b", "--arch", "h100-sxm", "--system", "dgx-h100", "--devices", "2304",
          "--global-batch", "1008", "--mbs", "1", "--seq", "8192", "--recompute", "none", "--sequence-parallel",
          "--tp-comm-overlap", "--virtual-stages", "7", "--zero", "1", "--overlap-grad-reduce",
          "--overlap-param-gather", "--stack", "megatron-te", "--json"]
CASES = {"fixed": [*RECIPE, "--placement", "tp=8,pp=9,dp=16,cp=2"], "search": RECIPE,
         "deepseek-v3": ["--model", "deepseek-v3", "--json"], "llama3-405b": ["--model", "llama3-405b", "--json"]}


def infeasible(stdout: str) -> str | None:
    r = json.loads(stdout)
    return None if r["feasible"] else f"infeasible: {r['reason']}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = p.parse_args(argv)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    for name in args.cases.split(","):
        cmd = ["evaluate", *CASES[name]]
        cold, warm = cold_and_warm(lambda cache: cli_seconds(cmd, cache, infeasible), args.repeats)
        report(f"{name} cold", cold)
        report(f"{name} warm", warm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
