"""Level-1 cells handed out in batches (`branch_bound.level1_task_s`): the same sweep as one cell a task.

The oracle is the sweep with one cell per task (the order the best-first loop defines, checked
against full enumeration in tests/test_upper_bound.py). With one worker a batch changes only which
cells are computed ahead of their turn, never the loop's steps, so the optimum, the accounting,
the trials and the points file (every bound, bit for bit) must all be the same; with two workers
the order may differ, so the optimum and every point settled once must hold.
"""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import optuna
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from phaze_opt.search import branch_bound
from phaze_opt.search.runner import run_study
from phaze_opt.search.setup import StudyConfig
from test_bound_sampler import space_mapping, spaces

REPO = Path(__file__).resolve().parents[1]
# A slice of the `phaze` space around its optimum (the full sweep's optimum lies inside it).
SLICE = {"num_tc": {"pow2": [16, 64]}, "num_vc": {"pow2": [64, 256]}, "tc_x": {"pow2": [32, 128]}, "tc_y": [128],
         "glb_mib": {"pow2": [16, 64]}, "hbm_gib": [32, 80], "mbs": [1, 2, 4], "recompute": [False, True]}


def slice_file(folder: Path) -> str:
    """The `phaze` space's file with SLICE's choices, in `folder`."""
    spec = yaml.safe_load((REPO / "phaze_opt" / "presets" / "spaces" / "phaze.yaml").read_text())
    path = folder / "slice.yaml"
    path.write_text(yaml.safe_dump({**spec, "name": "phaze-slice", "params": SLICE}))
    return str(path)

ONE_CELL, EVERY_CELL = 0.0, float("inf")  # seconds of work a task carries: one cell, or all the loop allows


def sweep(out: Path, model: str, space: str, task_s: float | None, monkeypatch, workers: int = 1,
          dive_after: int | None = None) -> dict:
    """The sweep's summary, its trials' points and its points file, with tasks of `task_s` seconds
    (None: the rule the sweep ships with) and dives after `dive_after` cells (None: as shipped)."""
    if task_s is not None:
        monkeypatch.setattr(branch_bound, "level1_task_s", lambda _workers: task_s)
    if dive_after is not None:
        monkeypatch.setattr(branch_bound, "DIVE_AFTER", dive_after)
    try:
        summary = run_study(StudyConfig(models=(model,), space=space, hysteresis="off", strategy="branch-and-bound",
                                        tracking_uri="off", output_dir=str(out), progress=False, workers=workers))
    finally:
        monkeypatch.undo()
    trials = optuna.load_study(study_name=summary["study"], storage=summary["storage"]).get_trials(deepcopy=False)
    points = Counter(tuple(sorted((k, str(v)) for k, v in t.user_attrs["point"].items())) for t in trials)
    return {"summary": summary, "points": points,
            "file": gzip.decompress(Path(summary["exhaustive"]["points_file"]).read_bytes())}


ACCOUNTING = ("points", "settled", "cells_expanded", "level1_runs", "optimum", "optimum_proven")


def assert_same_sweep(batched: dict, reference: dict) -> None:
    for key in ACCOUNTING:
        assert batched["summary"]["exhaustive"][key] == reference["summary"]["exhaustive"][key], key
    assert batched["summary"]["best"]["score"] == reference["summary"]["best"]["score"]
    assert batched["points"] == reference["points"]
    assert batched["file"] == reference["file"]


@pytest.mark.slow
def test_batches_settle_small_as_one_cell_a_task(tmp_path, monkeypatch):
    one = sweep(tmp_path / "one", "gpt2-xl", "small", ONE_CELL, monkeypatch)
    ex = one["summary"]["exhaustive"]
    assert ex["level1_tasks"] == ex["cells_expanded"] and ex["level1_unused"] == 0
    for name, task_s in (("shipped", None), ("every", EVERY_CELL)):
        batched = sweep(tmp_path / name, "gpt2-xl", "small", task_s, monkeypatch)
        assert_same_sweep(batched, one)
        assert batched["summary"]["exhaustive"]["level1_tasks"] < ex["level1_tasks"]  # it did batch
    two = sweep(tmp_path / "two", "gpt2-xl", "small", EVERY_CELL, monkeypatch, workers=2)
    assert two["summary"]["best"]["score"] == one["summary"]["best"]["score"]
    assert two["summary"]["exhaustive"]["optimum_proven"]
    assert max(two["points"].values()) == 1  # no point evaluated twice
    assert sum(two["summary"]["exhaustive"]["settled"].values()) == ex["points"]


@pytest.mark.slow
def test_batches_settle_a_phaze_slice_as_one_cell_a_task(tmp_path, monkeypatch):
    """Without dives a task of every cell runs far ahead, and level 0 then settles most of the cells
    it computed (on `small`, or with dives, every cell computed is read)."""
    path = slice_file(tmp_path)
    one = sweep(tmp_path / "one", "gpt3-175b", path, ONE_CELL, monkeypatch, dive_after=10**9)
    every = sweep(tmp_path / "every", "gpt3-175b", path, EVERY_CELL, monkeypatch, dive_after=10**9)
    assert_same_sweep(every, one)
    ex = every["summary"]["exhaustive"]
    assert ex["level1_unused"] > 0  # cells computed ahead and never read: what this test is about
    assert ex["level1_tasks"] < ex["cells_expanded"]


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(spaces())
def test_batches_settle_random_tiny_spaces_as_one_cell_a_task(tmp_path_factory, monkeypatch, space):
    folder = tmp_path_factory.mktemp("drawn")
    path = folder / "drawn.yaml"
    path.write_text(yaml.safe_dump(space_mapping({k: list(v) for k, v in space.params.items()})))
    one = sweep(folder / "one", "gpt2-xl", str(path), ONE_CELL, monkeypatch)
    every = sweep(folder / "every", "gpt2-xl", str(path), EVERY_CELL, monkeypatch)
    assert_same_sweep(every, one)


def test_a_task_carries_at_least_the_engine_rule():
    assert branch_bound.level1_task_s(1) == branch_bound.LEVEL1_TASK_S
    assert branch_bound.LEVEL1_TASK_S >= 20 * branch_bound.ENGINE_TASK_S  # the engine under 5% of a task
    many = branch_bound.level1_task_s(1000)  # the one scheduler hands each worker a task in half a task's time
    assert many == pytest.approx(2 * 1000 * branch_bound.ENGINE_TASK_S)
