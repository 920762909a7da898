"""No long silence from a long command: the longest gap between two output lines stays within the
heartbeat's interval, in every phase (the first schedule solves, the TPUv4 baselines, the
bound-guided sampler's first proposal, a trial, the exhaustive sweep's bounding, the summary and
the final flush).

Independent of the machine's speed: the interval (`progress.EVERY_S`, 10 s for users) is lowered to
0.2 s and each phase is slowed by a sleep of a few seconds (15 intervals), so a phase that printed
nothing would leave a gap of seconds however fast the real work is, while the heartbeat keeps every
gap to about one interval. The bound allows for a loaded machine waking the heartbeat's thread late.
"""

from __future__ import annotations

import io
import sys
import time

import pytest

from phaze_opt import cli
from phaze_opt.runs import progress

INTERVAL_S = 0.2
SLOW_S = 3.0  # each slowed phase: 15 intervals
MAX_GAP_S = 1.5  # 7.5 intervals: a silent phase (SLOW_S) fails it, a heartbeat a few intervals late does not


class TimedLines(io.TextIOBase):
    """A stream that keeps each line it is given with the time it was completed."""

    def __init__(self, lines: list):
        self.lines, self.partial = lines, ""

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False  # as a log file: plain lines, no bar

    def write(self, text: str) -> int:
        self.partial += text
        *done, self.partial = self.partial.split("\n")
        now = time.monotonic()
        self.lines.extend((now, line) for line in done)
        return len(text)


def slowed_once(fn, seconds: float = SLOW_S):
    """`fn`, whose first call first sleeps `seconds` (a phase that takes long on a large model)."""
    calls = []

    def slow(*args, **kwargs):
        if not calls:
            calls.append(1)
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


def run_timed(monkeypatch, argv: list[str]) -> tuple[int, list[tuple[float, str]], float]:
    """(exit status, [(time, line)] of stdout and stderr together, the largest gap in seconds),
    the gaps counted from the call's start to its end."""
    lines: list = []
    stream = TimedLines(lines)
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "stderr", stream)
    start = time.monotonic()
    status = cli.main(argv)
    end = time.monotonic()
    monkeypatch.undo()
    times = [start, *(t for t, _ in lines), end]
    return status, lines, max(b - a for a, b in zip(times, times[1:]))


def describe(lines, start: float) -> str:
    return "\n".join(f"{t - start:6.2f} {line[:150]}" for t, line in lines)


@pytest.fixture
def fast_heartbeat(monkeypatch, tmp_path):
    # the heavy imports of a first command (torch, the solvers) happen before the clock starts
    import optuna  # noqa: F401
    import torch  # noqa: F401

    from phaze_opt.design import evaluate  # noqa: F401
    from phaze_opt.search import runner  # noqa: F401

    monkeypatch.setattr(progress, "EVERY_S", INTERVAL_S)
    monkeypatch.chdir(tmp_path)
    return monkeypatch


def check(status, lines, gap, *phrases):
    start = lines[0][0] if lines else 0.0
    assert status == 0, describe(lines, start)
    assert gap < MAX_GAP_S, f"a gap of {gap:.2f} s:\n{describe(lines, start)}"
    text = "\n".join(line for _, line in lines)
    for phrase in phrases:  # the heartbeat named the phase it waited on
        assert phrase in text, f"no line says {phrase!r}:\n{describe(lines, start)}"


def test_evaluate_speaks_through_a_slow_first_schedule_solve(fast_heartbeat):
    from phaze_opt.design import evaluate

    # the layer costs an earlier test in this process memoised would skip the solve altogether
    fast_heartbeat.setattr(evaluate, "_COSTS_MEMO", {})
    fast_heartbeat.setattr(evaluate, "schedule_graph", slowed_once(evaluate.schedule_graph))
    status, lines, gap = run_timed(fast_heartbeat, ["evaluate", "--model", "gpt2-xl"])
    check(status, lines, gap, "still solving gpt2-xl's")


def test_a_study_speaks_through_baselines_first_proposal_trials_and_summary(fast_heartbeat):
    from phaze_opt.design.best_first import BoundOrder
    from phaze_opt.search import report, sampled, session

    fast_heartbeat.setattr(session, "compute_baselines", slowed_once(session.compute_baselines))
    fast_heartbeat.setattr(BoundOrder, "next_point", slowed_once(BoundOrder.next_point))
    fast_heartbeat.setattr(sampled, "evaluate_point", slowed_once(sampled.evaluate_point))
    fast_heartbeat.setattr(report, "write_whole", slowed_once(report.write_whole))  # the summary's file
    # 6 trials: the space's 4 TPUv4 reference designs come first, so the sampler proposes the rest
    status, lines, gap = run_timed(fast_heartbeat, ["study", "--model", "gpt2-xl", "--space", "small", "--trials", "6",
                                                    "--tracking-uri", "off"])
    check(status, lines, gap, "still computing the TPUv4 baselines", "still bounding the designs",
          "still evaluating trial 0", "0/6 trials", "still writing the summary")


def test_an_exhaustive_sweep_speaks_through_its_bounding(fast_heartbeat):
    from phaze_opt.search import branch_bound

    fast_heartbeat.setattr(branch_bound, "_bound_level0", slowed_once(branch_bound._bound_level0))
    status, lines, gap = run_timed(fast_heartbeat, ["study", "--model", "gpt2-xl", "--space", "small", "--exhaustive",
                                                    "--tracking-uri", "off"])
    check(status, lines, gap, "bounding", "still bounding the designs")


def test_no_progress_means_no_heartbeat_either(fast_heartbeat):
    from phaze_opt.search import session

    fast_heartbeat.setattr(session, "compute_baselines", slowed_once(session.compute_baselines, 1.0))
    status, lines, _ = run_timed(fast_heartbeat, ["study", "--model", "gpt2-xl", "--space", "small", "--trials", "2",
                                                  "--tracking-uri", "off", "--no-progress"])
    assert status == 0 and not any("still " in line for _, line in lines)
