"""The TPU v4 validation suite and the suite schema it needs: rows on their own system and chip,
ZeRO stages, rows whose model is not shipped yet (skipped with the reason), `validate --system`."""

from __future__ import annotations

import pytest
import yaml

from phaze_opt import cli
from phaze_opt.errors import PhazeError
from phaze_opt.validation.report import render_text
from phaze_opt.validation.runner import evaluate_row, run_suite
from phaze_opt.validation.suites import load_suite, with_system
from test_validate import _Result

# PaLM 540B's published shape (Chowdhery et al. 2022, Table 1 and Appendix B): parameters, layers,
# heads, head width; sequence 2048.
PALM_N, PALM_L, PALM_H, PALM_Q, PALM_T = 540.35e9, 118, 48, 256, 2048


def test_palm_row_is_consistent_with_its_published_utilisation():
    row = load_suite("tpuv4-pod").rows[0]
    assert (row.model, row.tp, row.pp, row.dp, row.gpus, row.batch, row.training.zero) == \
        ("palm-540b", 12, 1, 512, 6144, 2048, 3)
    tokens_per_s = row.batch * PALM_T / row.iteration_time_s
    assert tokens_per_s == pytest.approx(238.3e3, rel=1e-3)  # Table 3's throughput
    # PaLM's MFU (Appendix B): 6N + 12 L H Q T FLOPs per token over 6144 chips at 275 TFLOP/s (bf16)
    mfu = tokens_per_s * (6 * PALM_N + 12 * PALM_L * PALM_H * PALM_Q * PALM_T) / (row.gpus * 275e12)
    assert 100 * mfu == pytest.approx(row.published["mfu_percent"], abs=0.1)


def _pending_copy(tmp_path):
    """The shipped tpuv4-pod suite with its model renamed to one that is not shipped (pending)."""
    from phaze_opt import configs

    text = configs.resolve("validation", "tpuv4-pod").read_text()
    path = tmp_path / "tpuv4-pending.yaml"
    path.write_text(text.replace("model: palm-540b", "model: palm-9000b\n    pending_model: its config is not written yet"))
    return path


def test_a_row_whose_model_is_not_shipped_is_skipped_with_the_reason(tmp_path):
    suite = load_suite(_pending_copy(tmp_path))
    calls = []
    result = run_suite(suite, evaluator=lambda *a: calls.append(a))
    assert not calls  # never evaluated
    (r,) = result.rows
    assert r.skipped and r.predicted is None and "palm-9000b" in r.reason and "configs/models" in r.reason
    assert result.infeasible == () and result.mape()["all"] is None
    assert r.config["system"] == "tpuv4-2x3072" and r.config["arch"] == "tpuv4"
    text = render_text({"command": "x", "generated": "now", "_suites": [result]})
    assert "skipped" in text and "palm-9000b" in text


def _suite(tmp_path, **row):
    base = {"model": "megatron-gpt-1.7b", "tp": 1, "pp": 1, "gpus": 8, "batch": 64, "microbatch": 4,
            "recompute": "full", "iteration_time_s": 1.0, "source": {"paper": "p", "table": "1", "row": "r"}}
    data = {"suite": "t", "description": "d", "arch": "a100-like", "system": "dgx-a100", "metric": "iteration_time_s",
            "flops_formula": "megatron-model", "papers": {"p": "a paper"},
            "rows": [{k: v for k, v in {**base, **row}.items() if v is not None}]}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_row_runs_on_its_own_system_chip_and_zero_stage(tmp_path):
    suite = load_suite(_suite(tmp_path, system="tpuv4-pod", arch="tpuv4", zero=3))
    seen = {}

    def evaluator(model, arch, training, system):
        seen.update(arch=arch.name, system=system.name, zero=training.zero, devices=system.accelerators)
        return _Result(True, 2.0)

    r = evaluate_row(suite, suite.rows[0], 0, evaluator=evaluator)
    assert seen == {"arch": "tpuv4", "system": "tpuv4-pod", "zero": 3, "devices": 8}
    assert r.predicted == 2.0 and not r.skipped
    # --system prices the same rows on another network, the row's own set aside
    other = with_system(suite, "default")
    evaluate_row(other, other.rows[0], 0, evaluator=evaluator)
    assert seen["system"] == "default" and seen["arch"] == "tpuv4"


@pytest.mark.parametrize("row, field, words", [
    ({"system": "nope"}, "rows[0].system", "unknown system"),
    ({"arch": "nope"}, "rows[0].arch", "unknown arch"),
    ({"zero": 4}, "rows[0].zero", "must be one of 0, 1, 2, 3"),
    ({"pending_model": True, "model": "palm-9000b"}, "rows[0].pending_model", "must say why"),
    ({"model": "not-a-model"}, "rows[0].model", "unknown model"),  # a typo is an error, not a skip
    ({"pending_model": "its branch", "tp": 3}, "rows[0].tp", "TP widths"),  # checked once the model exists
    ({"pending_model": "its branch", "model": "palm-9000b", "iteration_time_s": None}, "rows[0]",
     "iteration_time_s"),
])
def test_bad_rows_are_one_line_errors(tmp_path, row, field, words):
    with pytest.raises(PhazeError) as err:
        load_suite(_suite(tmp_path, **row))
    message = str(err.value)
    assert "\n" not in message and field in message and words in message, message


def test_validate_system_flag(tmp_path):
    with pytest.raises(PhazeError, match="unknown system 'nope'"):
        with_system(load_suite("tpuv4-pod"), "nope")
    args = cli.build_parser().parse_args(["validate", "--suite", "tpuv4-pod", "--system", "default"])
    from phaze_opt.commands.validate import command_line

    assert command_line(args) == "phaze-opt validate --suite tpuv4-pod --system default"


def test_fit_leaves_a_system_with_no_rows_to_fit_at_its_preset(tmp_path):
    from phaze_opt.validation import workflow
    from phaze_opt.validation.calibration import fit_rows

    path = _pending_copy(tmp_path)
    suite = load_suite(path)
    assert fit_rows([suite], "tpuv4-pod") == [] and fit_rows([suite], "tpuv4-2x3072") == []
    result = workflow.validate([str(path)], out=None, fit=True)  # nothing to fit: no error, no fit
    assert "fits" not in result and result["suites"][0]["skipped"] == 1
