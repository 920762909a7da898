"""The FP8 validation suites (NVIDIA's NeMo / Megatron-Bridge pre-training tables on DGX H100 and DGX
B200) and the B200 presets they run on: every row cited and consistent with its published throughput,
rows in a precision the Training recipe does not price yet skipped with that reason (never priced as
BF16), and the B200 preset's derived peak equal to NVIDIA's datasheet."""

from __future__ import annotations

import pytest
import yaml

from phaze_opt import configs
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.system import load_system
from phaze_opt.validation.runner import run_suite
from phaze_opt.validation.suites import MODELLED_PRECISIONS, ROW_PRECISIONS, load_suite, suite_path
from phaze_opt.workload.graphs import active_params
from phaze_opt.workload.models import load_model

from test_validate import _Result

FP8_SUITES = {"nemo-fp8-h100": ("h100-sxm", "dgx-h100"), "nemo-fp8-b200": ("b200", "dgx-b200")}


@pytest.mark.parametrize("name", FP8_SUITES)
def test_fp8_suite_rows_are_cited_and_name_shipped_presets(name):
    suite = load_suite(name)
    assert (suite.arch, suite.system, suite.metric) == (*FP8_SUITES[name], "iteration_time_s")
    assert suite.arch in configs.available("archs") and suite.system in configs.available("systems")
    models = configs.available("models")
    for row in suite.rows:
        assert row.model in models and not row.skip.startswith("model config"), row.source
        assert row.source.paper in suite.papers and row.source.table and row.source.row
        # every citation names where it is printed: the release and table, and a commit of the file
        assert "NeMo" in row.source.table or "FP8" in row.source.table, row.source
        assert "commit" in suite.papers[row.source.paper]
    assert len({(r.source.table, r.source.row) for r in suite.rows}) == len(suite.rows)


@pytest.mark.parametrize("name", FP8_SUITES)
def test_iteration_time_is_the_published_throughput(name):
    """iteration_time_s is derived, batch x seq / (tokens/s/GPU x GPUs), to 4 significant digits; the
    tables' own model TFLOP/s per GPU is kept beside it: their FLOP count is 6 per active parameter and
    token plus attention, so TFLOP/s over tokens/s lies in 4.5-7.5 x the active parameters for every row
    (6.2-7.2 for all but gpt-oss-120b's 4.75, whose sliding-window layers count less attention; a
    dropped or added digit in either column leaves that band)."""
    for row in load_suite(name).rows:
        model = load_model(row.model)
        seq = row.seq or model.seq
        tokens = row.published["tokens_per_s_per_gpu"]
        assert row.value == pytest.approx(row.batch * seq / (tokens * row.gpus), rel=5e-4), row.source
        per_param = row.per_gpu_tflops * 1e12 / tokens / active_params(model)
        assert 4.5 <= per_param <= 7.5, (row.source, per_param)


@pytest.mark.parametrize("name", FP8_SUITES)
def test_each_row_is_priced_in_its_own_precision_never_as_bf16(name):
    suite = load_suite(name)
    assert {r.training.precision for r in suite.rows} <= set(ROW_PRECISIONS)
    assert any(r.training.precision != "bf16" for r in suite.rows) and any(r.training.precision == "bf16" for r in suite.rows)
    for row in suite.rows:
        if row.training.precision in MODELLED_PRECISIONS:
            assert row.skip == "", row.source
        else:
            assert row.skip == f"precision {row.training.precision} not in the Training recipe yet (priced: " \
                               f"{', '.join(MODELLED_PRECISIONS)})", row.source
    calls = []

    def fake(model, arch, training, system):
        # the precision the recipe prices: a Training without the field prices BF16
        calls.append(getattr(training, "precision", "bf16"))
        return _Result(True, 10.0)

    result = run_suite(suite, evaluator=fake)
    priced = [r for r in suite.rows if r.training.precision in MODELLED_PRECISIONS]
    assert len(calls) == len(priced) >= 1
    assert calls == [r.training.precision for r in priced]  # no row reaches the evaluator in another datatype
    assert len(result.skipped) == len(suite.rows) - len(priced)
    for r in result.skipped:
        assert r.predicted is None and "precision" in r.reason and r.config["precision"] in ROW_PRECISIONS
    assert all(r.predicted == 10.0 for r in result.rows if not r.skipped)


def _with_row_field(tmp_path, field, value):
    """The nemo-fp8-h100 suite with row 3's `field` set to `value`, written as bad.yaml."""
    data = yaml.safe_load(suite_path("nemo-fp8-h100").read_text())
    data["rows"][3][field] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_an_unknown_precision_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(PhazeError, match=r"bad\.yaml.*'rows\[3\]\.precision'.*bf16, fp8, mxfp8, nvfp4, got 'fp6'"):
        load_suite(_with_row_field(tmp_path, "precision", "fp6"))


def test_a_rows_optimizer_state_reaches_its_recipe(tmp_path):
    from test_validation_modern import assert_row_field_reaches_the_recipe, assert_row_refused_in_one_line

    row = {"model": "llama3-8b", "tp": 1, "pp": 1, "gpus": 8, "batch": 128, "microbatch": 1, "recompute": "none",
           "per_gpu_tflops": 400, "source": {"paper": "p", "table": "t", "row": "r"}}
    assert_row_field_reaches_the_recipe(tmp_path, row, "optimizer_state", "bf16-adamw", None)
    assert_row_refused_in_one_line(tmp_path, {**row, "optimizer_state": "fp16"}, "optimizer_state",
                                   "must be one of fp32-adam, bf16-moments, bf16-adamw")


def test_b200_preset_matches_the_datasheet():
    """NVIDIA HGX B200 datasheet / Blackwell technical brief: 2.25 PFLOP/s dense BF16 per GPU (36 with
    sparsity over 8 GPUs), 8 TB/s HBM3e (64 TB/s over 8), 148 SMs (Chips and Cheese)."""
    b200 = load_arch("b200")
    assert b200.peak_flops == pytest.approx(2.25e15, rel=0.01)
    assert b200.num_tc == b200.num_vc == 148
    assert b200.hbm_bw == pytest.approx(8e12) and b200.hbm_bytes == 180 * 2**30
    # twice an H100 SM's dense BF16 work per clock, at a similar clock
    h100 = load_arch("h100-sxm")
    assert b200.tc_pes == 2 * h100.tc_pes and abs(b200.clock_hz / h100.clock_hz - 1) < 0.05


def test_dgx_b200_preset():
    """DGX B200 datasheet: NVLink 5 at 1.8 TB/s bidirectional per GPU (900 GB/s a direction), 8 x 400
    Gb/s ConnectX-7 per node, one per GPU; the same NICs as DGX H100."""
    b200, h100 = load_system("dgx-b200"), load_system("dgx-h100")
    assert (b200.devices_per_node, b200.accelerators) == (8, 1024)
    assert b200.nominal_intra_node.bandwidth == pytest.approx(900e9)
    assert b200.nominal_intra_node.bandwidth == pytest.approx(2 * h100.nominal_intra_node.bandwidth)
    assert b200.nominal_inter_node.bandwidth == pytest.approx(50e9) == h100.nominal_inter_node.bandwidth


@pytest.mark.parametrize("name", FP8_SUITES)
def test_every_row_runs_fused_attention(name):
    """NeMo / Megatron-Bridge run attention in TE's fused kernels, which keep no s x s scores: every
    row reaches the evaluator with flash attention, whether its model config or the row says so."""
    suite = load_suite(name)
    seen = []

    def fake(model, arch, training, system):
        config = load_model(model) if isinstance(model, str) else model
        seen.append(training.attention or config.attention)
        return _Result(True, 10.0)

    run_suite(suite, evaluator=fake)
    assert seen and set(seen) == {"flash"}
    assert any(r.training.attention == "flash" for r in suite.rows) or name == "nemo-fp8-b200"


def test_an_unknown_attention_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(PhazeError, match=r"bad\.yaml.*'rows\[3\]\.attention'.*unfused, flash, got 'sdpa'"):
        load_suite(_with_row_field(tmp_path, "attention", "sdpa"))
