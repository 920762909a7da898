"""`python tests/fault_study.py [phaze-opt study options]`: the real study CLI on a fake backend.

Used by `fault_injection.py`: a tiny space (32 designs) and the cheap evaluator of
`test_study_fakes`, slowed to `FAULT_TRIAL_S` seconds a trial (default 0.05) so kills land inside
trials too; with `FAULT_MIP_S` each trial (not the TPUv4 baseline) also runs HiGHS on a hard
schedule for that long (`hard_block`), so a signal can land inside the solver. The reference design (enqueued first, at every microbatch and recompute choice) is the
best design of the space, so a study that loses or repeats a queued trial shows it, and any
complete study's best is the same. Module-level so worker processes can unpickle it. No tests here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_study_fakes import REFERENCE, FakeSpace, check_model, describe_model, fake_evaluate  # noqa: E402

PARAMS = {"num_tc": [1, 2, 4, 8], "tc_x": [8, 16], "glb_mib": [4], "hbm_gib": [32], "mbs": [1, 2],
          "recompute": [False, True]}


class FaultSpace(FakeSpace):
    def __init__(self):
        super().__init__(params={k: list(v) for k, v in PARAMS.items()}, name="fault")

    reference_arch = {"num_tc": 8, "tc_x": 16, "glb_mib": 4, "hbm_gib": 32}


def hard_block(ops: int = 45, seed: int = 0):
    """A layer pass whose exact schedule HiGHS does not find in minutes: one block of `ops` random
    tensor, vector and link ops (few edges) on 2 TCs and 4 VCs. Seed 0 at 45 ops: after 60 s the MIP
    alone is still at 78.33 against a bound of 72.55."""
    import random

    from phaze_opt.solve.schedule.types import ScheduleProblem

    r = random.Random(seed)
    units = tuple(r.choice(["tc", "tc", "vc", "net"]) for _ in range(ops))
    single = tuple(round(r.uniform(1, 10), 3) for _ in range(ops))
    split = tuple(round(s / r.uniform(1.2, 2.2), 3) if u != "net" else s for s, u in zip(single, units))
    edges = tuple((i, j) for i in range(ops) for j in range(i + 1, ops) if r.random() < 0.05)
    return ScheduleProblem(units=units, single=single, split=split, edges=edges, num_tc=2, num_vc=4)


def solve_hard_block(time_limit_s: float, log: str | None = None):
    """The MIP of `hard_block` (ilp.solve_block, as the scheduler runs it after its relaxation) for
    `time_limit_s`; `log` gets a line when it starts and one when it returns."""
    from phaze_opt.solve.schedule.bounds import block_bounds
    from phaze_opt.solve.schedule.heuristic import list_schedule
    from phaze_opt.solve.schedule.ilp import solve_block
    from phaze_opt.solve.schedule.instance import block_view, prepare
    from phaze_opt.solve.schedule.search import ensure_warm

    inst = prepare(hard_block())
    view = block_view(inst, inst.blocks[0])
    lower = max(block_bounds(inst, view).values())
    incumbent = list_schedule(inst, view)
    ensure_warm()  # loading the compiled search takes seconds on a loaded machine: before the mark
    _note(log, "mip-start")
    result = solve_block(inst, view, incumbent, lower, time_limit_s=time_limit_s, phase_s=0.5, quick_search=False)
    _note(log, f"mip-end {result.status}")
    return result


def _note(log: str | None, line: str) -> None:
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {time.time()} {line}\n")


def slow_evaluate(model, arch, training, system="default"):
    time.sleep(float(os.environ.get("FAULT_TRIAL_S", "0.05")))
    if os.environ.get("FAULT_MIP_S") and arch.name != REFERENCE.name:  # each trial's design (not the baseline)
        solve_hard_block(float(os.environ["FAULT_MIP_S"]), os.environ.get("FAULT_MIP_LOG"))
    result = fake_evaluate(model, arch, training, system=system)
    log = os.environ.get("FAULT_EVAL_LOG")
    if log:  # each finished evaluation: pid, time, point (the signal storm checks none is redone)
        point = {"num_tc": arch.num_tc, "tc_x": arch.tc_x, "mbs": training.mbs, "recompute": training.recomputes}
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {time.time()} {json.dumps(point)}\n")
    return result


def backend():
    from phaze_opt.search.setup import Backend

    return Backend(evaluator=slow_evaluate, space=FaultSpace(), reference_arch=REFERENCE, check_model=check_model,
                   describe_model=describe_model)


def best_of_space() -> float:
    """The best throughput of the space (the reference design at mbs 2, no recompute)."""
    from test_study_fakes import fake_throughput

    space = FaultSpace()
    best = 0.0
    for p in space.grid_points(order="grid"):
        if p["num_tc"] == 2 and p["mbs"] == 2:
            continue  # the fake solver fails there
        best = max(best, fake_throughput("m-small", space.accelerator(p), p["mbs"], p["recompute"]))
    return best


def main(argv) -> int:
    from phaze_opt import cli, search

    real = search.run_study  # the name `phaze-opt study` calls, from the search package's face
    search.run_study = lambda config, backend_=None: real(config, backend_ or backend())
    return cli.main(["study", *argv])


if __name__ == "__main__":
    import fault_study  # this file as a module, so spawned workers unpickle `fault_study.*`

    from phaze_opt.cli import exit_with

    exit_with(fault_study.main(sys.argv[1:]))
