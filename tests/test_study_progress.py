"""Progress a log file shows: plain lines at a steady pace when the stream is not a terminal."""

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import phaze_opt
from phaze_opt.hardware.latency import DesignArrays
from phaze_opt.design.space import load_space
from phaze_opt.search import branch_bound as bb
from phaze_opt.design.evaluate import tp_widths as _tp_widths
from phaze_opt.runs.progress import Progress, duration
from phaze_opt.search.runner import run_study
from phaze_opt.design.upper_bound import ideal_throughput, pipeline_throughput, layer_lower_bounds
from phaze_opt.system import load_system
from phaze_opt.workload.models import load_model
from test_study_fakes import backend, config
from test_upper_bound import TINY_SPACE


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(stream) -> list[str]:
    return stream.getvalue().splitlines()


def test_plain_lines_come_every_ten_seconds_with_counts_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    progress = Progress(500, 0, "gpt3-175b-phaze-tpe", "trial", None, lambda v: f"{v:,.1f} seq/s", feasible=0,
                        stream=out, clock=clock)
    assert progress.bar is None
    for i in range(119):  # 9.5 s of trials: nothing yet
        clock.now += 0.08
        progress.update(1, 100.0 + i % 7, feasible=int(i % 3 != 0))
    assert out.getvalue() == ""
    clock.now = 1060.0  # 120 trials in 60 s: 2 trials/s, 380 left, 190 s
    progress.update(1, 118.2, feasible=1)
    assert lines(out) == ["[gpt3-175b-phaze-tpe] 120/500 trials  feasible 80  best 118.2 seq/s  2 trials/s  ETA 3m10s"]
    clock.now += 9.9  # the next line only 10 s after the last one
    progress.update(1)
    assert len(lines(out)) == 1
    clock.now += 0.1
    progress.update(1)
    assert len(lines(out)) == 2 and lines(out)[1].startswith("[gpt3-175b-phaze-tpe] 122/500 trials  feasible 80")
    progress.close()  # and one at the end
    assert len(lines(out)) == 3


def test_a_resumed_study_rates_only_this_run_and_the_last_line_has_no_eta():
    clock, out = Clock(), io.StringIO()
    progress = Progress(50, 40, "s", "trial", None, lambda v: f"{v:.1f}", feasible=30, stream=out, clock=clock)
    clock.now += 20.0
    progress.set_done(50, 3.0, 38)
    progress.close()
    assert lines(out) == ["[s] 50/50 trials  feasible 38  best 3.0  0.5 trials/s"] * 2


def test_unsteady_progress_shows_extras_but_no_rate():
    clock, out = Clock(), io.StringIO()
    progress = Progress(703128, 0, "s", "point", None, lambda v: f"{v:.1f} seq/s", phase="settled", steady=False,
                        stream=out, clock=clock)
    clock.now += 10.0
    assert progress.due()
    progress.set_done(412000, 118.2, evaluated=57)
    assert lines(out) == ["[s] settled 412,000/703,128 points  evaluated 57  best 118.2 seq/s"]
    assert not progress.due()


def test_progress_setting_chooses_bar_lines_or_nothing():
    clock = Clock()
    quiet, terminal = io.StringIO(), Terminal()
    off = Progress(10, 0, "s", "trial", False, stream=quiet, clock=clock)
    bar = Progress(10, 0, "s", "trial", None, stream=terminal, clock=clock)
    assert bar.bar is not None and not bar.lines  # a terminal keeps the tqdm bar
    clock.now += 60.0
    for p in (off, bar):
        p.update(10)
        p.close()
    assert quiet.getvalue() == "" and "[s]" not in terminal.getvalue()


def test_duration():
    assert [duration(s) for s in (4.4, 59.6, 200, 3599, 7500)] == ["4s", "1m00s", "3m20s", "59m59s", "2h05m"]


def test_worker_pool_reports_progress(tmp_path, capsys):
    # The reference trials first, in this process: two workers popping the same enqueued trial from
    # SQLite can collide, which is not what this test is about.
    run_study(config(tmp_path, trials=4, progress=False), backend())
    run_study(config(tmp_path, trials=8, workers=2, progress=None), backend())
    err = capsys.readouterr().err
    assert re.search(r"^\[\S+\] 8/8 trials  feasible \d+  best [\d,.]+ seq/s  [\d.]+ trials/s$", err, re.M), err


def test_level0_in_chunks_is_the_same_bound_and_reports_as_it_goes(tmp_path, monkeypatch):
    (tmp_path / "tiny.yaml").write_text(TINY_SPACE)
    space = load_space(str(tmp_path / "tiny.yaml"))
    model, system = load_model("gpt2-xl"), load_system("default")
    grid = bb.Grid(space)
    monkeypatch.setattr(bb, "_W", {"model": model, "system": system})
    monkeypatch.setattr(bb, "LEVEL0_ROWS", 3)  # 8 designs per microbatch: chunks of 3, 3 and 2
    clock, out = Clock(), io.StringIO()

    def progress(total, unit, **options):
        return Progress(total, 0, "tiny", unit, None, stream=out, clock=clock, **options)

    level0 = bb._level0

    def slow_level0(*args):  # each chunk takes 10 s
        clock.now += 10.0
        return level0(*args)

    monkeypatch.setattr(bb, "_level0", slow_level0)
    session = SimpleNamespace(progress=progress, config=SimpleNamespace(system="default"), space=space)
    ub0, widths = bb._bound_level0(session, grid, bb._Inline(lambda: None, ()))
    shown = lines(out)
    assert [int(re.search(r"bounding (\d+)/16 designs", line).group(1)) for line in shown] == [3, 6, 8, 11, 14, 16, 16]
    assert "designs/s  ETA" in shown[0]
    designs = DesignArrays.from_accelerators(grid.accelerators())
    for m, mbs in enumerate(grid.mbss):  # the same numbers as bounding every design at once
        whole = [layer_lower_bounds(model, designs, mbs, system, tp) for tp in _tp_widths(model, system)]
        expected = np.minimum(ideal_throughput(whole, mbs, system.accelerators),
                              pipeline_throughput(whole, mbs, system.accelerators, system.global_batch))
        assert np.array_equal(ub0[m], expected)
        for a, b in zip(whole, widths[m][0]):  # one attention kernel: the model's own
            assert np.array_equal(a.kind_fwd, b.kind_fwd) and np.array_equal(a.kind_bwd, b.kind_bwd)


def study_log(tmp_path, *args) -> str:
    """`python -m phaze_opt.study ARGS > log 2>&1` with the phaze_opt under test, and the log."""
    root = str(Path(phaze_opt.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    log = tmp_path / "log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "phaze_opt.study", "--model", "gpt2-xl", "--tracking-uri", "off",
                        "--output-dir", str(tmp_path / "studies"), *args], stdout=f, stderr=subprocess.STDOUT,
                       check=True, timeout=300, cwd=tmp_path, env=env)
    return log.read_text()


def test_a_redirected_study_writes_progress_lines(tmp_path):
    text = study_log(tmp_path, "--space", "small", "--trials", "3")
    assert re.search(r"^\[gpt2-xl-small-bound-seed0\] 3/3 trials  feasible \d  best [\d,.]+ seq/s", text, re.M), text
    again = study_log(tmp_path, "--space", "small", "--trials", "3", "--no-progress")  # resumed: nothing to run
    assert "already holds 3 finished trials" in again and "3/3 trials" not in again
    assert "Warning" not in again  # said in one line, without the storage's warnings


def test_a_redirected_exhaustive_sweep_writes_its_bounding_and_settling_lines(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY_SPACE)
    text = study_log(tmp_path, "--space", str(tmp_path / "tiny.yaml"), "--exhaustive")
    assert re.search(r"^\[gpt2-xl-tiny-exhaustive-bound\] bounding 16/16 designs", text, re.M), text
    assert re.search(r"^\[gpt2-xl-tiny-exhaustive-bound\] settled 32/32 points  evaluated \d+  best [\d,.]+ seq/s",
                     text, re.M), text
