"""Validation rows of modern runs: CP/EP/sequence fields, Megatron-Core's FLOP count, rows whose model
config is still pending (skipped with their reason), and published recipes the project cannot express
(infeasible with the reason, never a crash)."""

from __future__ import annotations

import pytest
import yaml

from phaze_opt.training import Fixed, Layout
from phaze_opt import configs
from phaze_opt.errors import PhazeError
from phaze_opt.validation.calibration import fit_rows
from phaze_opt.validation.report import render_text
from phaze_opt.validation.runner import run_suite
from phaze_opt.validation.suites import iteration_flops, load_suite
from phaze_opt.workload.models import load_model

from test_validate import _Result

MIXTRAL = {"model": "mixtral-8x7b", "tp": 1, "pp": 4, "ep": 8, "gpus": 64, "batch": 256, "microbatch": 1,
           "virtual_stages": 8, "recompute": "none", "zero": 1, "overlap_grad_reduce": True, "per_gpu_tflops": 438,
           "source": {"paper": "p", "table": "t", "row": "mixtral"}}
PENDING = {"model": "llama3-405b-not-yet", "pending_model": "added on another branch", "tp": 8, "pp": 16, "cp": 16,
           "seq": 131072, "gpus": 16384, "batch": 128, "microbatch": 1, "recompute": "none", "per_gpu_tflops": 380,
           "source": {"paper": "p", "table": "t", "row": "pending"}}


def _suite(tmp_path, *rows, name="modern.yaml"):
    data = {"suite": "modern", "description": "modern rows", "arch": "h100-sxm", "system": "dgx-h100",
            "metric": "per_gpu_tflops", "flops_formula": "megatron-core", "papers": {"p": "a source"},
            "rows": [dict(r) for r in rows]}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def assert_row_field_reaches_the_recipe(tmp_path, row: dict, field: str, value, default):
    """A suite row's recipe `field` set to `value` reaches its Training and its report configuration;
    left out, the Training holds `default` and the configuration leaves the field out (old reports
    stay as they were)."""
    from phaze_opt.validation.runner import row_config

    suite = load_suite(_suite(tmp_path, {**row, field: value}))
    (r,) = suite.rows
    assert getattr(r.training, field) == value and row_config(r, suite)[field] == value
    plain = load_suite(_suite(tmp_path, row, name="plain.yaml"))
    (r,) = plain.rows
    assert getattr(r.training, field) == default and field not in row_config(r, plain)


def assert_row_refused_in_one_line(tmp_path, row: dict, field: str, words: str):
    """Loading a suite with `row` fails with one line naming the file, the row's `field` and `words`."""
    path = _suite(tmp_path, row)
    with pytest.raises(PhazeError) as info:
        load_suite(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"field 'rows[0].{field}'" in message and words in message


def test_megatron_core_flops_by_hand():
    """Megatron-LM's num_floating_point_operations (MCore v0.8) for Mixtral 8x7B, one sequence of 4096:
    12 s l h^2 [(1 + 8/32 + s/h) x 1 + 14336/4096 x 2 x 3/2 + 32000 / (2 x 32 x 4096)]."""
    s, l, h = 4096, 32, 4096
    expected = 12 * s * l * h**2 * ((1 + 8 / 32 + s / h) + 14336 / h * 2 * 1.5 + 32000 / (2 * l * h))
    assert iteration_flops("megatron-core", "mixtral-8x7b", 1) == pytest.approx(expected, rel=1e-12)
    # a longer sequence only grows the attention term
    assert iteration_flops("megatron-core", "mixtral-8x7b", 1, 8192) == pytest.approx(
        2 * expected + 12 * 2 * s * l * h**2 * (2 * s / h - s / h), rel=1e-12)
    # a dense GPT with h = heads x head size and no GQA reduces to Korthikanti et al.'s model FLOPs
    gpt = load_model("megatron-gpt-22b")
    assert iteration_flops("megatron-core", gpt, 4) == pytest.approx(iteration_flops("megatron-model", gpt, 4), rel=1e-12)


def test_pending_rows_are_skipped_with_their_reason_and_run_once_the_model_exists(tmp_path):
    suite = load_suite(_suite(tmp_path, MIXTRAL, PENDING))
    assert suite.rows[1].skip.startswith("model config 'llama3-405b-not-yet' not in configs/models yet")
    assert "added on another branch" in suite.rows[1].skip and suite.rows[0].skip == ""
    assert (suite.rows[0].ep, suite.rows[0].dp, suite.rows[1].cp, suite.rows[1].dp) == (8, 16, 16, 8)
    calls = []

    def fake(model, arch, training, system):
        calls.append((model, training))
        return _Result(True, 3.0)

    result = run_suite(suite, evaluator=fake)
    assert len(calls) == 1 and calls[0][0] == "mixtral-8x7b"
    skipped = result.rows[1]
    assert skipped.skipped and skipped.predicted is None and "added on another branch" in skipped.reason
    assert result.infeasible == () and result.skipped == (skipped,) and result.fitted == ()
    assert result.mape()["all"] == pytest.approx(abs(iteration_flops("megatron-core", "mixtral-8x7b", 256)
                                                     / (3.0 * 64) / 438e12 - 1))
    text = render_text({"_suites": [result]})
    assert "skipped" in text and "1 skipped (model config, precision or recipe not modelled yet)" in text and "added on another branch" in text
    assert fit_rows([suite], "dgx-h100") == []  # a skipped row is never fitted
    # the same row with a model that exists is an ordinary, checked row
    present = load_suite(_suite(tmp_path, {**MIXTRAL, "pending_model": "was pending"}, name="present.yaml"))
    assert present.rows[0].skip == ""
    with pytest.raises(PhazeError, match=r"'rows\[0\].ep': must divide mixtral-8x7b's routed experts \(8\), got 3"):
        load_suite(_suite(tmp_path, {**MIXTRAL, "pending_model": "x", "ep": 3}, name="bad.yaml"))


def test_the_row_recipe_reaches_the_evaluator(tmp_path):
    row = load_suite(_suite(tmp_path, MIXTRAL, {**MIXTRAL, "tp": 2, "pp": 1, "ep": 4, "cp": 2, "seq": 8192,
                                               "virtual_stages": 1, "source": {"paper": "p", "table": "t", "row": "cp"}})).rows
    t = row[0].training
    assert t.placement == Fixed(Layout(tp=1, pp=4, dp=16, ep=8)) and t.zero == 1 and t.overlap_grad_reduce
    assert t.virtual_stages == 8
    t = row[1].training
    assert t.placement == Fixed(Layout(tp=2, pp=1, dp=16, ep=4, cp=2)) and row[1].seq == 8192


def test_a_pipeline_split_counting_the_embedding_and_loss_interleaves_any_layer_count(tmp_path):
    """Llama 3 405B's 126 layers at PP 16 x VP 8: refused unless the split counts the embedding and
    the loss as layers (128 = 16 x 8, Megatron-Core `--account-for-*-in-pipeline-split`), and then
    the row's recipe carries both flags to the evaluator."""
    llama = {"model": "llama3-405b", "tp": 8, "pp": 16, "gpus": 8192, "batch": 2048, "microbatch": 1,
             "virtual_stages": 8, "recompute": "none", "sequence_parallel": True, "per_gpu_tflops": 430,
             "source": {"paper": "p", "table": "t", "row": "405b"}}
    with pytest.raises(PhazeError, match=r"'rows\[0\].virtual_stages': pp x virtual_stages \(16 x 8\) needs"):
        load_suite(_suite(tmp_path, llama))
    with pytest.raises(PhazeError, match=r"must divide the 127 layers counted in the split"):
        load_suite(_suite(tmp_path, {**llama, "account_for_embedding": True}, name="one.yaml"))
    (row,) = load_suite(_suite(tmp_path, {**llama, "account_for_embedding": True, "account_for_loss": True},
                               name="both.yaml")).rows
    t = row.training
    assert (t.virtual_stages, t.account_for_embedding, t.account_for_loss) == (8, True, True)


def test_a_recipe_the_project_cannot_express_is_an_infeasible_row(tmp_path):
    suite = load_suite(_suite(tmp_path, MIXTRAL))

    def refuses(model, arch, training, system):
        raise PhazeError("placement ep=8: must divide dp")

    (row,) = run_suite(suite, evaluator=refuses).rows
    assert not row.feasible and not row.skipped and row.reason == "not expressible: placement ep=8: must divide dp"


@pytest.mark.parametrize("change, field, words", [
    ({"cp": 3, "gpus": 96}, "rows[0].cp", "2 x cp (6) must divide the sequence (4096 tokens)"),
    ({"cp": 2, "gpus": 60}, "rows[0].tp", "tp x pp x cp (1 x 4 x 2 = 8) must divide gpus (60)"),
    ({"ep": 16}, "rows[0].ep", "must divide mixtral-8x7b's routed experts (8), got 16"),
    ({"zero": 4}, "rows[0].zero", "must be one of 0, 1, 2, 3"),
    ({"overlap_grad_reduce": "yes"}, "rows[0].overlap_grad_reduce", "must be true or false"),
    ({"flops_formula": "6N"}, "rows[0].flops_formula", "must be one of"),
    ({"seq": 0}, "rows[0].seq", "must be a positive integer"),
    ({"fp8_param_gather": True}, "rows[0].fp8_param_gather", "needs precision fp8 or mxfp8 (1-byte parameters), got precision bf16"),
    ({"fp8_param_gather": 1}, "rows[0].fp8_param_gather", "must be true or false"),
    ({"model": "gpt-9"}, "rows[0].model", "unknown model 'gpt-9'"),  # no pending_model: a typo stays an error
])
def test_modern_row_fields_are_checked_in_one_line(tmp_path, change, field, words):
    path = _suite(tmp_path, {**MIXTRAL, **change})
    with pytest.raises(PhazeError) as info:
        load_suite(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and f"field '{field}'" in message and words in message


def test_ep_on_a_dense_model_and_an_empty_pending_reason_are_refused(tmp_path):
    dense = {**MIXTRAL, "model": "llama2-7b", "ep": 2, "virtual_stages": 1}
    with pytest.raises(PhazeError, match=r"'rows\[0\].ep': llama2-7b has no experts"):
        load_suite(_suite(tmp_path, dense))
    with pytest.raises(PhazeError, match=r"'rows\[0\].pending_model': must say why"):
        load_suite(_suite(tmp_path, {**PENDING, "pending_model": " "}, name="p.yaml"))


def test_shipped_modern_suite():
    """megatron-core-h100: H100 BF16, a MoE row that runs today, a >100-layer dense model and CP rows
    waiting for their model configs."""
    suite = load_suite("megatron-core-h100")
    assert (suite.arch, suite.system, suite.flops_formula) == ("h100-sxm", "dgx-h100", "megatron-core")
    runnable = [r for r in suite.rows if not r.skip]
    assert runnable[0].model == "mixtral-8x7b" and runnable[0].ep == 8
    # a row waits only while its model config is not shipped
    assert all(r.model not in configs.available("models") for r in suite.rows if r.skip)
    assert any(r.cp > 1 for r in suite.rows) and any(r.model == "llama3-405b" for r in suite.rows)
    assert all(r.source.paper in suite.papers for r in suite.rows)


def test_a_rows_configuration_names_every_switch_it_sets(tmp_path):
    """The report's configuration is the recipe as `Training.recipe()` lists it: switches that are
    on (a boolean equal to 1 once slipped through a `not in (1, ...)` filter), ZeRO from 2 up, the
    expert TP as `etp`; nothing a row leaves unset."""
    from phaze_opt.validation.runner import row_config

    zero2 = {**MIXTRAL, "zero": 2, "expert_tensor_parallel": 1, "source": {**MIXTRAL["source"], "row": "zero2"}}
    suite = load_suite(_suite(tmp_path, MIXTRAL, zero2))
    plain, zero2 = (row_config(r, suite) for r in suite.rows)
    assert plain["overlap_grad_reduce"] is True and "zero" not in plain and "etp" not in plain
    assert "overlap_param_gather" not in plain and "cp" not in plain and plain["ep"] == 8
    assert zero2["zero"] == 2 and zero2["etp"] == 1
