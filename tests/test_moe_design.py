"""Expert and context parallelism at the design level: the widths searched, the per-layer
terms read off the traced graphs, `evaluate --placement ...,ep=E,cp=C` and `--seq`, the recipe
fields, and the MLflow metrics."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import yaml

from phaze_opt.training import Layout
from phaze_opt import cli
from phaze_opt.design.evaluate import evaluate, training_problem
from phaze_opt.design.parallel import cp_widths, ep_widths, with_parallel_terms
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.arch import load_arch
from phaze_opt.runs.tracking import trial_note, trial_record
from phaze_opt.solve.placement.expert import optimal_placement
from phaze_opt.solve.placement.evaluate import evaluate_placement
from phaze_opt.system import load_system
from phaze_opt.training import Training
from phaze_opt.workload.graphs import routed_expert_params
from phaze_opt.workload.models import load_model, parse_model

from test_mlflow_logging import frozen

TINY = dict(name="tiny-moe", family="llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, seq=8192,
            vocab=512, activation="swiglu", norm="rmsnorm", position="rotary", tied_embeddings=False, bias=False,
            dropout=0.0, attention="flash", experts=4, top_k=2, expert_ffn=128, expert_placement={"tp": 1, "pp": 1, "dp": 8})


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "moe-design-cache"))


@pytest.fixture
def tiny_file(tmp_path):
    path = tmp_path / "tiny-moe.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


def small_system(n=16, batch=16):
    return dataclasses.replace(load_system("default"), accelerators=n, global_batch=batch)


def test_widths_searched():
    assert ep_widths(load_model("mixtral-8x7b")) == (1, 2, 4, 8)
    assert ep_widths(load_model("deepseek-moe-16b")) == (1, 2, 4, 8, 16, 32, 64)
    assert ep_widths(load_model("gpt3-175b")) == (1,)
    llama = load_model("llama2-7b")
    assert cp_widths(llama) == (1,)  # 4096 tokens: not split
    assert cp_widths(dataclasses.replace(llama, seq=32768)) == (1, 2, 4, 8, 16, 32)
    assert cp_widths(dataclasses.replace(llama, seq=8192 + 8)) == (1, 2, 4)  # 2c must divide the sequence


def test_parallel_terms_read_off_the_graph():
    m = parse_model(dict(TINY, seq=256), "tiny.yaml")
    arch = load_arch("tpuv4")
    system = small_system()
    tr = Training(2)
    _, _, problem, per_tp = training_problem(m, arch, tr, system, (2,), 2.0)
    lc = with_parallel_terms(per_tp[2].costs, m, arch, tr, system)
    blocks = [i for i, n in enumerate(lc.names) if n.startswith("block")]
    for i in range(lc.n_layers):
        if i in blocks:
            assert lc.expert_params[i] == 4 * routed_expert_params(m) // 2 == 4 * 3 * 128 * 128 // 2
            assert lc.dispatch_bytes[i] == 2 * 256 * 2 * 128 * 2  # tokens x k x capacity 1 x hidden x bf16
            assert lc.kv_bytes[i] == 2 * 2 * 256 * 1 * 32 * 2  # K and V, 1 KV head per TP rank, head size 32
            assert 0 < lc.expert_fwd_s[i] < lc.fwd_s[i] and 0 < lc.expert_bwd_s[i] < lc.bwd_s[i]
            assert 0 < lc.core_fwd_s[i] < lc.fwd_s[i] and 0 < lc.core_bwd_s[i] < lc.bwd_s[i]
        else:
            assert lc.expert_params[i] == lc.dispatch_bytes[i] == lc.kv_bytes[i] == lc.core_fwd_s[i] == 0
    cf = with_parallel_terms(per_tp[2].costs, dataclasses.replace(m, capacity_factor=1.5), arch, tr, system)
    assert cf.dispatch_bytes[blocks[0]] == math.ceil(1.5 * 2 * 256 * 2) * 128 * 2
    # sequence parallelism: each of the 2 TP ranks dispatches its half of the tokens (Megatron-Core)
    sp = with_parallel_terms(per_tp[2].costs, m, arch, dataclasses.replace(tr, sequence_parallel=True), system)
    assert sp.dispatch_bytes[blocks[0]] == 256 * 2 * 128 * 2 == lc.dispatch_bytes[blocks[0]] // 2


def test_design_problem_has_ep_and_cp_and_the_dp_beats_every_fixed_choice():
    m = parse_model(TINY, "tiny.yaml")
    arch = load_arch("tpuv4")
    system = small_system()
    _, _, problem, _ = training_problem(m, arch, Training(1), system, (1,), 2.0)
    assert problem.ep_widths == (1, 2, 4) and problem.cp_widths == (1, 2, 4, 8, 16, 32)
    assert {c.cp for c in problem.cp_costs} == {2, 4, 8, 16}  # 32 x tp 1 > the 16 devices
    best = optimal_placement(problem)
    assert best.feasible
    # the optimum is no slower than any placement the evaluator scores (all splits of pp 1 and 2)
    for t in problem.tp_widths:
        for e in problem.ep_widths:
            for c in problem.cp_widths:
                for d in range(e, system.accelerators // (t * c) + 1, e):
                    for stages in (tuple([tuple(range(problem.n_layers))]), ((0, 1), (2, 3))):
                        p = dataclasses.replace(best.placement(), tp=t, dp=d, ep=e, cp=c, stages=stages)
                        r = evaluate_placement(problem, p)
                        if r.feasible:
                            assert best.time_per_batch_s <= r.time_per_batch_s * (1 + 1e-9)


def test_evaluate_fixed_placement_with_ep_and_cp():
    m = parse_model(TINY, "tiny.yaml")
    r = evaluate(m, load_arch("tpuv4"), Training(1, placement="tp=1,pp=1,dp=4,ep=2,cp=2"), small_system(), 2.0)
    assert r.feasible and (r.placement["ep"], r.placement["cp"], r.placement["devices_used"]) == (2, 2, 8)
    imbalanced = evaluate(m, load_arch("tpuv4"), Training(1, placement="tp=1,pp=1,dp=4,ep=2,cp=2", load_imbalance=2.0),
                          small_system(), 2.0)
    assert imbalanced.time_per_batch_s > r.time_per_batch_s
    with pytest.raises(PhazeError, match="ep=3: must divide the 4 experts"):
        evaluate(m, load_arch("tpuv4"), Training(1, placement="tp=1,pp=1,dp=3,ep=3"), small_system(), 2.0)
    with pytest.raises(PhazeError, match="has no experts"):
        evaluate("llama2-7b", load_arch("tpuv4"), Training(1, placement="tp=1,pp=1,dp=4,ep=2"), small_system(), 2.0)


@pytest.mark.parametrize("bad, match", [({"capacity_factor": 0}, "capacity_factor"),
                                         ({"load_imbalance": 0.9}, "load_imbalance"),
                                         ({"load_imbalance": "x"}, "load_imbalance")])
def test_recipe_fields_are_checked(bad, match):
    with pytest.raises(PhazeError, match=match):
        Training(1, **bad)


def test_evaluate_cli_seq_and_placement(capsys, monkeypatch, tiny_file):
    monkeypatch.setattr(cli, "COMMANDS", ("evaluate",))
    code = cli.main(["evaluate", "--model", tiny_file, "--seq", "8192", "--devices", "16", "--global-batch", "16",
                     "--placement", "tp=1,pp=1,dp=4,ep=4,cp=4", "--capacity-factor", "1.25", "--ilp-time-limit", "1", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    r = json.loads(out)
    assert r["seq"] == 8192 and r["capacity_factor"] == 1.25
    assert (r["placement"]["ep"], r["placement"]["cp"]) == (4, 4)
    code = cli.main(["evaluate", "--model", tiny_file, "--devices", "16", "--global-batch", "16",
                     "--placement", "tp=1,pp=1,dp=4,ep=2,cp=2", "--ilp-time-limit", "1"])
    out, _ = capsys.readouterr()
    assert code == 0 and "TP 1 x PP 1 x DP 4 (EP 2) x CP 2" in out
    code = cli.main(["evaluate", "--model", tiny_file, "--seq", "0"])
    _, err = capsys.readouterr()
    assert code == 2 and "--seq" in err and err.count("\n") == 1


def test_mlflow_logs_ep_and_cp():
    result = {"feasible": True, "reason": "", "area_mm2": 250.0, "score": 1.0, "elapsed_s": 1.0, "trial_s": 0.5,
              "accelerator": {"num_tc": 8},
              "models": {"m": {"throughput": 1.0, "tokens_per_s": 5.0, "mfu": 0.4, "time_per_batch_s": 3.0,
                               "placement": {"tp": 8, "pp": 4, "dp": 32, "ep": 8, "cp": 2, "microbatches": 64},
                               "timings": {}}}}
    rec = trial_record(frozen(result=result), study_name="s", sampler="tpe", models=["m"], mode="sampled")
    assert (rec.metrics["ep"], rec.metrics["cp"]) == (8, 2)
    assert "TP 8 x PP 4 x DP 32 (EP 8) x CP 2" in trial_note("COMPLETE", result)


def test_published_comparison_gains_the_extra_rows(tmp_path):
    """The MoE / long-context section: rows 1, 2 and 4 per extra model, ratios to row 1, rendered."""
    from phaze_opt.experiments.published import EXTRA_ROWS, PublishedConfig, render, run_published
    from test_study_fakes import backend

    cfg = PublishedConfig(models=("m-small",), systems=("default",), space="fake", trials=12,
                          output_dir=str(tmp_path / "published"), tracking_uri="off", extra_models=("m-big",))
    result = run_published(cfg, backend())
    extra = result["systems"]["default"]["extra_rows"]
    assert list(extra) == ["m-big"] and list(extra["m-big"]) == list(EXTRA_ROWS)
    rows = extra["m-big"]
    assert rows["tpuv4_expert"].ratio == pytest.approx(1.0)
    assert rows["co_optimised"].throughput >= rows["tpuv4_optimal"].throughput  # the study evaluates TPUv4 first
    text = render(result)
    assert "### MoE and long context, system `default`" in text and "| m-big |" in text


def test_published_cli_defaults_to_the_moe_and_long_context_models():
    from phaze_opt.commands.published import add_arguments, config_from_args
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args([])).extra_models == ("mixtral-8x7b", "llama2-7b-32k")
    assert config_from_args(p.parse_args(["--no-extra"])).extra_models == ()


def test_expert_placements_may_name_ep_and_cp():
    assert load_model("mixtral-8x7b").expert_placement == Layout(tp=4, pp=8, dp=32, ep=8)
    assert load_model("llama2-7b-32k").expert_placement == Layout(tp=8, pp=4, dp=8, cp=4)
    with pytest.raises(PhazeError, match="'xp': unknown field; allowed fields are cp, dp, ep, pp, tp"):
        parse_model(dict(TINY, expert_placement={"tp": 1, "pp": 1, "dp": 1, "xp": 2}), "t.yaml")
