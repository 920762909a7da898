"""`phaze-opt validate`, its report, the efficiency fit on the declared subset, and the
identity default of the system efficiency block."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml

from phaze_opt import cli
from phaze_opt.design.evaluate import evaluate
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.system import IDENTITY_EFFICIENCY, SystemEfficiency, load_system, system_from_dict
from phaze_opt.training import Training
from phaze_opt.validation.calibration import fit_system, schedule_steps
from phaze_opt.validation.report import SCHEMA, fit_lines, render_markdown, render_text, write_report
from phaze_opt.validation.runner import in_fit_subset, run_suite
from phaze_opt.validation.suites import load_suite

REPO = Path(__file__).resolve().parent.parent

# ---- a hand-made tiny suite, evaluated by a fake evaluator with known iteration times ------------------

# megatron-gpt-1.7b: 24 layers, hidden 2304, sequence 2048, vocabulary 51200 (Narayanan et al., Table 1).
L, H, S, V = 24, 2304, 2048, 51200


def _tiny_suite(tmp_path, metric="per_gpu_tflops", values=(100.0, 120.0, 140.0, 160.0), name="tiny.yaml"):
    rows = []
    for i, value in enumerate(values):
        rows.append({"model": "megatron-gpt-1.7b", "tp": 1, "pp": 1, "gpus": 4 * (i + 1), "batch": 64 * (i + 1),
                     "microbatch": 4, "recompute": "full", metric: value,
                     "source": {"paper": "p", "table": "1", "row": f"r{i}"}})
    data = {"suite": "tiny", "description": "a hand-made suite", "arch": "a100-like", "system": "dgx-a100",
            "metric": metric, "flops_formula": "megatron-hardware-full-recompute", "papers": {"p": "a paper"},
            "rows": rows}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


TINY_STEPS = 4  # schedule steps of every tiny row: batch 64 (i + 1) over dp 4 (i + 1) at microbatch 4


@dataclass
class _Result:
    feasible: bool
    time_per_batch_s: float
    reason: str = ""


def _fake_evaluator(times):
    """Iteration time by the row's device count (each tiny row has its own), shifted by the system's
    cost per schedule step (every tiny row runs 4 microbatches on one stage: 4 steps) and slowed by the
    intra-node link's achieved fraction, as the real model is."""

    def run(model, arch, training, system):
        base = times[system.accelerators]
        eff = system.efficiency
        return _Result(True, base * (0.7 + 0.3 / eff.intra_node_bandwidth) / (0.9 + 0.1 * eff.inter_node_bandwidth)
                       / arch.efficiency.tc_fraction + TINY_STEPS * eff.microbatch_overhead_s)

    return run


def test_rows_and_mape_by_hand(tmp_path):
    suite = load_suite(_tiny_suite(tmp_path))
    times = {4: 2.0, 8: 3.0, 12: 4.0, 16: 5.0}
    result = run_suite(suite, IDENTITY_EFFICIENCY, evaluator=_fake_evaluator(times))
    errors = []
    for i, row in enumerate(result.rows):
        gpus, batch = 4 * (i + 1), 64 * (i + 1)
        # Narayanan et al. SC'21, eq. (3), written out here independently of suites.py.
        flops = 96 * batch * S * L * H**2 * (1 + S / (6 * H) + V / (16 * L * H))
        predicted = flops / (times[gpus] * gpus)
        published = (100.0, 120.0, 140.0, 160.0)[i] * 1e12
        assert row.predicted == pytest.approx(predicted, rel=1e-12)
        assert row.published == published
        assert row.error == pytest.approx(predicted / published - 1, rel=1e-12)  # sign: + is too fast
        assert row.fitted == (i % 2 == 1)
        errors.append(predicted / published - 1)
    mape = result.mape()
    assert mape["all"] == pytest.approx(sum(map(abs, errors)) / 4)
    assert mape["fitted"] == pytest.approx((abs(errors[1]) + abs(errors[3])) / 2)
    assert mape["held_out"] == pytest.approx((abs(errors[0]) + abs(errors[2])) / 2)


def test_iteration_time_error_sign(tmp_path):
    suite = load_suite(_tiny_suite(tmp_path, metric="iteration_time_s", values=(1.0, 2.0, 3.0, 4.0)))
    result = run_suite(suite, IDENTITY_EFFICIENCY, evaluator=_fake_evaluator({4: 1.5, 8: 1.0, 12: 3.0, 16: 4.4}))
    assert [round(r.error, 9) for r in result.rows] == [0.5, -0.5, 0.0, 0.1]  # + means too slow


def test_declared_subset_is_odd_rows():
    assert [in_fit_subset(i) for i in range(5)] == [False, True, False, True, False]


# ---- the fit reads only the fit subset ------------------------------------------------------------------

FRACTIONS = (0.6, 0.8, 1.0)
PER_STEP = tuple(0.005 * i for i in range(101))


def _fit(tmp_path, values, name):
    suite = load_suite(_tiny_suite(tmp_path, metric="iteration_time_s", values=values, name=name))
    times = {4: 1.0, 8: 2.0, 12: 3.0, 16: 4.0}
    return fit_system([suite], "dgx-a100", evaluator=_fake_evaluator(times), intra_fractions=FRACTIONS,
                      inter_fractions=FRACTIONS, per_step=PER_STEP)


def test_fit_uses_only_the_declared_subset(tmp_path):
    base = (1.5, 2.5, 3.5, 4.5)
    fit = _fit(tmp_path, base, "a.yaml")
    # The fake model: T = base x (0.7 + 0.3 / intra) / (0.9 + 0.1 inter) + 4 c; rows 1 and 3 are
    # fitted exactly by the identity fractions with c = 0.125 s per schedule step.
    assert fit.efficiency == SystemEfficiency(1.0, 1.0, pytest.approx(0.125))
    assert TINY_STEPS == 4 and [schedule_steps(r) for r in load_suite(_tiny_suite(tmp_path)).rows] == [4] * 4
    assert fit.objective == pytest.approx(0.0, abs=1e-9) and fit.rows == 2
    moved_held_out = _fit(tmp_path, (9.0, 2.5, 0.1, 4.5), "b.yaml")
    assert moved_held_out.efficiency == fit.efficiency and moved_held_out.objective == fit.objective
    moved_fitted = _fit(tmp_path, (1.5, 2.9, 3.5, 4.5), "c.yaml")  # the test can fail: a fit row moves it
    assert moved_fitted.efficiency != fit.efficiency


def test_fit_of_the_tensor_core_fraction_uses_only_the_declared_subset(tmp_path):
    times = {4: 1.0, 8: 2.0, 12: 3.0, 16: 4.0}

    def fit(values, name):
        suite = load_suite(_tiny_suite(tmp_path, metric="iteration_time_s", values=values, name=name))
        return fit_system([suite], "dgx-a100", evaluator=_fake_evaluator(times), intra_fractions=(1.0,),
                          inter_fractions=(1.0,), per_step=PER_STEP, fit_tc=True)

    # rows 1 and 3 as a chip at 83% of its tensor-core peak with 75 ms per schedule step would run them
    exact = [t / 0.83 + 4 * 0.075 for t in times.values()]
    base = fit((9.0, exact[1], 9.0, exact[3]), "tc-a.yaml")
    assert base.arch_efficiency.tc_fraction == pytest.approx(0.83) and "tc_fraction" in base.fitted
    assert base.efficiency.microbatch_overhead_s == pytest.approx(0.075) and base.objective < 1e-9
    assert fit((0.5, exact[1], 20.0, exact[3]), "tc-b.yaml").arch_efficiency == base.arch_efficiency
    assert fit((9.0, exact[1] * 1.2, 9.0, exact[3]), "tc-c.yaml").arch_efficiency != base.arch_efficiency


def test_fit_needs_rows_on_the_system(tmp_path):
    suite = load_suite(_tiny_suite(tmp_path))
    with pytest.raises(PhazeError, match="dgx-h100"):
        fit_system([suite], "dgx-h100", evaluator=_fake_evaluator({}))


# ---- the efficiency block: identity by default, one-line errors ------------------------------------------

def _system_yaml(**efficiency):
    data = yaml.safe_load((REPO / "phaze_opt/presets/systems/default.yaml").read_text())
    if efficiency:
        data["efficiency"] = efficiency
    return data


def test_presets_without_a_block_are_the_identity():
    for name in ("default", "phaze"):
        assert load_system(name).efficiency is IDENTITY_EFFICIENCY
    explicit = system_from_dict(_system_yaml(intra_node_bandwidth=1, inter_node_bandwidth=1.0,
                                             microbatch_overhead="0 s"), "x.yaml")
    assert explicit == system_from_dict(_system_yaml(), "x.yaml")


def test_identity_leaves_evaluate_unchanged():
    arch, training = load_arch("a100-80gb"), Training(1, "full", "tp=1,pp=1,dp=8")
    plain = replace(load_system("default"), accelerators=8, global_batch=8)
    a = evaluate("megatron-gpt-1.7b", arch, training, plain).to_json()
    b = evaluate("megatron-gpt-1.7b", arch, training, plain.with_efficiency(SystemEfficiency(1.0, 1.0, 0.0))).to_json()
    a.pop("timings"), b.pop("timings")
    assert a == b
    # dp 8 inside one node: the ring runs on the intra-node link; half its bandwidth, twice the bytes' time
    # (plus the unchanged 2 (d - 1) link latencies)
    slower = evaluate("megatron-gpt-1.7b", arch, training, plain.with_efficiency(SystemEfficiency(0.5, 1.0, 0.0)))
    latency = 2 * 7 * plain.intra_node.latency
    assert slower.placement["allreduce_s"] - latency == pytest.approx(2 * (a["placement"]["allreduce_s"] - latency),
                                                                      rel=1e-9)


def test_a_flat_per_iteration_overhead_is_refused_in_one_line():
    with pytest.raises(PhazeError, match=r"x.yaml.*efficiency.iteration_overhead.*priced from the bytes"):
        system_from_dict(_system_yaml(iteration_overhead="0.1 s"), "x.yaml")


@pytest.mark.parametrize("block, field, words", [
    ({"intra_node_bandwidth": 1.5}, "efficiency.intra_node_bandwidth", "fraction in (0, 1]"),
    ({"inter_node_bandwidth": 0}, "efficiency.inter_node_bandwidth", "fraction in (0, 1]"),
    ({"microbatch_overhead": "-1 s"}, "efficiency.microbatch_overhead", ""),
    ({"microbatch_overhead": "2 parsecs"}, "efficiency.microbatch_overhead", "unit"),
    ({"launch": 1}, "efficiency.launch", "allowed fields"),
    ({"intra_node_bandwidth": 0.01}, "efficiency.intra_node_bandwidth", "below the inter-node"),
])
def test_bad_efficiency_blocks_are_one_line_errors(block, field, words):
    with pytest.raises(PhazeError) as err:
        system_from_dict(_system_yaml(**block), "sys.yaml")
    text = str(err.value)
    assert "\n" not in text and "sys.yaml" in text and field in text and words in text


# ---- the command: one-line errors, JSON schema, report files ---------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "phaze_opt", "validate", *args], capture_output=True, text=True,
                          timeout=600, cwd=REPO)


def test_unknown_suite_is_one_line(tmp_path):
    out = _cli("--suite", "no-such-suite", "--out", str(tmp_path))
    # the progress heartbeat ("[validate ...] still working") may precede the error on a slow machine
    errors = [line for line in out.stderr.strip().splitlines() if not line.startswith("[validate ")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr
    assert "no-such-suite" in out.stderr and "narayanan-sc21" in out.stderr


def test_malformed_suite_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load(_tiny_suite(tmp_path).read_text())
    data["rows"][1]["tp"] = 3
    bad.write_text(yaml.safe_dump(data))
    broken = tmp_path / "broken.yaml"
    broken.write_text("suite: [unclosed\n")
    for path, words in ((bad, "rows[1].tp"), (broken, str(broken))):
        out = _cli("--suite", str(path), "--out", str(tmp_path / "out"))
        # the progress heartbeat ("[validate ...] still working") may precede the error on a slow machine
        errors = [line for line in out.stderr.strip().splitlines() if not line.startswith("[validate ")]
        assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr
        assert words in out.stderr
    assert not (tmp_path / "out").exists()  # nothing ran, nothing was written


def test_unwritable_out_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = _cli("--suite", "korthikanti-2022", "--out", str(blocker / "sub"))
    # the progress heartbeat ("[validate ...] still working") may precede the error on a slow machine
    errors = [line for line in out.stderr.strip().splitlines() if not line.startswith("[validate ")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr
    assert "--out" in out.stderr


def test_json_schema_and_report(tmp_path, capsys):
    code = cli.main(["validate", "--suite", "korthikanti-2022", "--out", str(tmp_path), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema"] == SCHEMA and out["mlflow"] is None and "fit_subset" in out and "_suites" not in out
    assert set(out["files"]) == {"markdown", "json", "plot"}
    (suite,) = out["suites"]
    assert suite["suite"] == "korthikanti-2022" and suite["metric"] == "iteration_time_s"
    assert set(suite["mape"]) == {"fitted", "held_out", "all"} and suite["infeasible"] == 0
    assert len(suite["rows"]) == 8
    for i, row in enumerate(suite["rows"]):
        assert {"model", "tp", "pp", "dp", "gpus", "batch", "mbs", "recompute",
                "published", "predicted", "error", "fitted", "feasible", "source"} <= set(row)
        assert row["fitted"] == (i % 2 == 1) and row["feasible"]
        assert row["error"] == pytest.approx(row["predicted"] / row["published"] - 1)
    errors = [abs(r["error"]) for r in suite["rows"]]
    assert suite["mape"]["all"] == pytest.approx(sum(errors) / len(errors))
    on_disk = json.loads((tmp_path / "validation.json").read_text())
    assert on_disk["suites"] == out["suites"]
    assert (tmp_path / "validation.png").stat().st_size > 10_000
    md = (tmp_path / "validation.md").read_text()
    assert "| korthikanti-2022 |" in md and "validation.png" in md


def test_text_report_names_every_row(tmp_path):
    suite = load_suite(_tiny_suite(tmp_path))
    result = {"command": "phaze-opt validate", "_suites": [
        run_suite(suite, IDENTITY_EFFICIENCY, evaluator=_fake_evaluator({4: 2.0, 8: 3.0, 12: 4.0, 16: 5.0}))]}
    files = write_report(result, tmp_path / "r")
    text, md = render_text(result), render_markdown(result)
    for label in ("r0", "r1", "r2", "r3"):
        assert label in text and label in md
    assert "held out" in text and "MAPE fitted" in text
    assert Path(files["plot"]).is_file()


def test_fit_lines_print_a_zero_cost_per_step(tmp_path):
    """A fit that lands on no per-step cost still prints the whole block to paste into the preset."""
    suite = load_suite(_tiny_suite(tmp_path, metric="iteration_time_s", values=(1.0, 2.0, 3.0, 4.0)))
    fit = fit_system([suite], "dgx-a100", evaluator=_fake_evaluator({4: 1.0, 8: 2.0, 12: 3.0, 16: 4.0}),
                     intra_fractions=(1.0,), inter_fractions=(1.0,), per_step=PER_STEP)
    assert fit.efficiency.microbatch_overhead_s == 0.0
    lines = fit_lines({"fits": {"dgx-a100": fit.to_json()}})
    assert "    microbatch_overhead: 0 s" in lines and not any("iteration_overhead" in line for line in lines)


# ---- selective recompute: the attention core at the chip's speed, not one core's ------------------------

def test_selective_recompute_costs_the_attention_core_not_the_forward():
    """Korthikanti et al. 2022 (Sec. 5, Table 4): recomputing only the attention core adds a few
    percent to a 22B layer (tp 8, microbatch 4), full recompute a whole forward. The core's ops
    (Q K^T, softmax/mask/dropout over the scores, P V) each spread over all cores, added up."""
    from phaze_opt.design.evaluate import attention_core_s, layer_costs
    from phaze_opt.hardware.latency import estimate
    from phaze_opt.workload.graphs import build_layer_graph
    from phaze_opt.workload.models import load_model

    model, arch, system = load_model("megatron-gpt-22b"), load_arch("a100-80gb"), load_system("default")
    costs = layer_costs(model, arch, Training(mbs=4), system, 8).costs
    graph = build_layer_graph(model, 8, 4)
    fwd = graph.op_graphs["block"]["fwd"]
    lat = estimate(fwd, [arch], interconnect=system.tp_link(8))
    scores = max(op.gemm[0] * op.gemm[1] * op.gemm[3] for op in fwd.ops if op.kind == "bgemm")
    core = [i for i, op in enumerate(fwd.ops)
            if op.kind == "bgemm" or (op.unit != "tc" and op.elements == scores)]
    assert len(core) >= 4  # two batched GEMMs and at least softmax and dropout over the scores
    by_hand = sum(float(lat.split[0][i]) for i in core)
    block = costs.names.index("block.0")
    assert costs.selective_s[block] == pytest.approx(by_hand, rel=1e-12)
    assert 0 < costs.selective_s[block] < 0.25 * costs.fwd_s[block]
    # what the single-core sum made of it: more than the whole forward (then capped at it)
    assert attention_core_s(fwd, lat.single[0]) > costs.fwd_s[block]


def test_layer_suite_rows_come_from_the_layer_comparison(monkeypatch):
    """layers-h100 rows: published = measured fwd + bwd, predicted = layers.compare_layers's, fitted = the
    operator fit's declared TP widths (fit_operators.FIT_TP)."""
    from phaze_opt.validation import runner
    from phaze_opt.validation.fit_operators import FIT_TP
    from phaze_opt.validation.layers import LayerResult

    suite = load_suite("layers-h100")
    fake = [LayerResult(row=r, fwd_s=r.fwd_s * 1.1, bwd_s=r.bwd_s * 0.9, proven=i % 2 == 0, gap=0.001 * (i % 2))
            for i, r in enumerate(suite.rows)]
    monkeypatch.setattr(runner, "compare_layers", lambda s, arch=None, time_limit_s=None: fake)
    result = run_suite(suite)
    assert len(result.rows) == len(suite.rows) and result.metric == "layer_seconds"
    for got, r in zip(result.rows, suite.rows):
        assert got.published == r.fwd_bwd_s
        assert got.predicted == pytest.approx(r.fwd_s * 1.1 + r.bwd_s * 0.9)
        assert got.fitted == (r.tp in FIT_TP)
        assert got.schedule_gap == (0.001 if got.index % 2 else 0.0)
        assert got.config == {"model": r.model, "tp": r.tp, "mbs": r.microbatch,
                              "attention": "flash" if r.flash else "unfused"}
    assert {r.fitted for r in result.rows} == {True, False}


def test_tracking_uri_logs_one_mlflow_run(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    from phaze_opt.validation import runner, workflow
    from test_study_fakes import mlflow_uri  # tests/ is on sys.path (rootdir conftest)

    monkeypatch.setattr(runner, "evaluate", _fake_evaluator({4: 2.0, 8: 3.0, 12: 4.0, 16: 5.0}))
    uri = mlflow_uri(tmp_path)
    result = workflow.validate([str(_tiny_suite(tmp_path))], out=tmp_path / "out", tracking_uri=uri)
    assert not result["mlflow"]["errors"]
    client = MlflowClient(uri)
    run = client.get_run(result["mlflow"]["run_id"])
    assert run.data.params["suites"] == "tiny" and run.data.params["presets"] == "a100-like/dgx-a100"
    assert float(run.data.params["efficiency.dgx-a100.intra_node_bandwidth"]) == \
        load_system("dgx-a100").efficiency.intra_node_bandwidth
    (suite,) = result["suites"]
    for part in ("fitted", "held_out", "all"):
        assert run.data.metrics[f"mape.tiny.{part}"] == pytest.approx(suite["mape"][part])
    assert {f.path for f in client.list_artifacts(run.info.run_id)} == \
        {"validation.md", "validation.json", "validation.png"}


def test_shipped_calibration_is_a_point_of_the_fit_grids():
    """The committed fitted values are answers the fit can give (the command in the preset comments
    reproduces them; it re-schedules every layer per value, minutes, so it is not run here)."""
    from phaze_opt.validation.calibration import MICROBATCH_OVERHEADS, TC_COARSE

    a100 = load_arch("a100-80gb").efficiency
    fine = {round(c + 0.01 * k, 2) for c in TC_COARSE for k in range(-4, 5)}
    assert a100.tc_fraction in fine
    dgx = load_system("dgx-a100").efficiency
    for name in ("dgx-a100", "dgx-h100"):
        cost = load_system(name).efficiency.microbatch_overhead_s
        assert any(abs(cost - o) < 1e-12 for o in MICROBATCH_OVERHEADS)
    # the fractions are the NCCL figures cited in the file, not fitted
    assert (dgx.intra_node_bandwidth, dgx.inter_node_bandwidth) == (0.80, 0.96)
