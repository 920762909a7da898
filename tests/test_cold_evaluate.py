"""A cold `phaze-opt evaluate` of a large model: its widths' layer costs computed side by side in
worker processes give what one process computes alone, the command takes its processes from
--jobs (else the machine's cores), and the shipped 2024 models resolve to a chip and system they
fit on."""

import dataclasses
import json

import numpy as np
import pytest

from phaze_opt import cli
from phaze_opt.cache import BoundedMemo
from phaze_opt.commands import evaluate as evaluate_command
from phaze_opt.design import evaluate as ev
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.system import load_system
from phaze_opt.training import Training
from phaze_opt.workload.models import load_model

TASK = ("bert-large", "tpuv4", "default")  # 3.4e8 parameters, TP 1-8: seconds to trace


def _costs(widths, jobs):
    model, arch, system = load_model(TASK[0]), load_arch(TASK[1]), load_system(TASK[2])
    training = Training(mbs=1)
    side = ev.costs_side_by_side([(model, t) for t in widths], arch, training, system, 60.0, jobs)
    here = {t: ev.layer_costs(model, arch, training, system, t, 60.0) for t in widths}
    return model, side, here


def test_side_by_side_costs_are_the_ones_computed_here(tmp_path, monkeypatch):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "workers"))
    monkeypatch.setattr(ev, "SIDE_BY_SIDE_MIN_PARAMS", 0)  # bert-large is far below it: let it fan out
    monkeypatch.setattr(ev, "_COSTS_MEMO", BoundedMemo(64))
    model, side, memoised = _costs((1, 2), jobs=2)
    assert set(side) == {(model, 1), (model, 2)}  # both widths ran in the workers
    # the same work again in this process alone, from an empty memo and an empty disk cache
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "here"))
    monkeypatch.setattr(ev, "_COSTS_MEMO", BoundedMemo(64))
    for t in (1, 2):
        alone = ev.layer_costs(model, load_arch(TASK[1]), Training(mbs=1), load_system(TASK[2]), t, 60.0)
        got = side[(model, t)]
        assert got.key == alone.key and got.unproven == alone.unproven == ()
        for f in dataclasses.fields(alone.costs):  # every layer time and memory fact
            assert np.array_equal(getattr(got.costs, f.name), getattr(alone.costs, f.name)), (t, f.name)
        assert got.table == alone.table and got.modes == alone.modes
        assert memoised[t].costs is got.costs  # the workers' results were memoised here


def test_side_by_side_leaves_small_models_and_one_job_to_this_process(monkeypatch):
    monkeypatch.setattr(ev, "_COSTS_MEMO", BoundedMemo(64))
    model, arch, system = load_model(TASK[0]), load_arch(TASK[1]), load_system(TASK[2])
    tasks = [(model, 1), (model, 2)]
    assert ev.costs_side_by_side(tasks, arch, Training(mbs=1), system, 60.0, jobs=4) == {}  # below the size
    monkeypatch.setattr(ev, "SIDE_BY_SIDE_MIN_PARAMS", 0)
    assert ev.costs_side_by_side(tasks, arch, Training(mbs=1), system, 60.0, jobs=1) == {}
    assert ev.costs_side_by_side(tasks[:1], arch, Training(mbs=1), system, 60.0, jobs=4) == {}  # one task


class _Result:
    def to_json(self):
        return {"feasible": True, "placement": {}, "timings": {}}


def _resolved(monkeypatch, capsys, *argv) -> dict:
    """What `evaluate` would run (model, chip, system, ILP limit, jobs), without running it."""
    seen = {}

    def fake(ilp_time_limit_s=None, jobs=1):
        def run(model, arch, training, system):
            seen.update(model=model.name, arch=arch.name, system=system.name, hbm_gib=arch.hbm_bytes / 2**30,
                        devices=system.accelerators)
            return _Result()
        run.ilp_time_limit_s = ilp_time_limit_s or ev.DEFAULT_ILP_TIME_LIMIT_S
        seen.update(ilp=ilp_time_limit_s, jobs=jobs)
        return run

    monkeypatch.setattr(ev, "design_evaluator", fake)
    assert cli.main(["evaluate", *argv, "--json"]) == 0
    json.loads(capsys.readouterr().out)
    return seen


@pytest.mark.parametrize("name, ilp", [("deepseek-v3", 1.0), ("llama3-405b", None)])
def test_the_2024_models_default_to_a_chip_and_system_they_were_trained_on(monkeypatch, capsys, name, ilp):
    monkeypatch.setattr(evaluate_command, "default_jobs", lambda: 2)
    seen = _resolved(monkeypatch, capsys, "--model", name)
    assert seen == {"model": name, "arch": "h100-sxm", "system": "dgx-h100", "hbm_gib": pytest.approx(80.0),
                    "devices": 1024, "ilp": ilp, "jobs": 2}
    assert _resolved(monkeypatch, capsys, "--model", name, "--jobs", "1")["jobs"] == 1


def test_default_jobs_is_the_cores_at_most_the_cap():
    assert 1 <= evaluate_command.default_jobs() <= evaluate_command.DEFAULT_JOBS_MAX


def test_jobs_below_one_is_a_one_line_error(capsys):
    with pytest.raises(PhazeError, match=r"^--jobs must be a positive number of processes, got 0$"):
        evaluate_command.run(cli.build_parser().parse_args(["evaluate", "--jobs", "0"]))


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-moe-16b", "deepseek-v3", "qwen3-30b-a3b", "gpt-oss-120b"])
def test_a_routed_experts_parameters_from_its_config_are_the_built_modules(name):
    from phaze_opt.workload.graphs import routed_expert_params
    from phaze_opt.workload.layers import build_layer

    model = load_model(name)
    moe = build_layer(model, "block", 1).mlp
    assert routed_expert_params(model) * model.experts == moe.w1.numel() + moe.w2.numel()
