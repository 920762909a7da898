"""`python tests/fault_study.py [phaze-opt study options]`: the real study CLI on a fake backend.

Used by `fault_injection.py`: a tiny space (32 designs) and the cheap evaluator of
`test_study_fakes`, slowed to `FAULT_TRIAL_S` seconds a trial (default 0.05) so kills land inside
trials too. The reference design (enqueued first, at every microbatch and recompute choice) is the
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


def slow_evaluate(model, arch, training, system="default"):
    time.sleep(float(os.environ.get("FAULT_TRIAL_S", "0.05")))
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

    sys.exit(fault_study.main(sys.argv[1:]))
