"""Energy model: per-op energies checked by hand, batch energy accounting, config validation, and the
figure `evaluate` reports for a real model."""

import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from phaze_opt import cli
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.accelerator import Accelerator
from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.energy import (
    COMPONENTS, batch_energy, constants_path, load_constants, op_energy,
)
from phaze_opt.design.evaluate import evaluate, tp_layer_energies, training_problem
from phaze_opt.training import Training
from phaze_opt.solve.placement.types import LayerCosts
from phaze_opt.system import load_system
from phaze_opt.workload.graphs import build_layer_graph
from phaze_opt.workload.ops import NET, NONE, TC, TCVC, VC, Op, OpGraph

E = 2
C = load_constants()
SYSTEM = load_system("default")
TPU = load_arch("tpuv4")


def gemm(b, m, k, n, unit=TC, **kw):
    return Op("g", "gemm", unit, flops=2.0 * b * m * k * n, bytes_read=E * b * (m * k + k * n),
              bytes_written=E * b * m * n, gemm=(b, m, k, n), **kw)


def graph(*ops):
    return OpGraph("t", "fwd", tuple(ops), ())


def chip(**kw):
    base = dict(num_tc=4, tc_x=8, tc_y=8, num_vc=1, vc_width=16, glb_bytes=2**20, glb_bw=1e12,
                hbm_bytes=2**30, hbm_bw=1e12, clock_hz=1e9)
    return Accelerator(**{**base, **kw})


# ---- constants ---------------------------------------------------------------------------------------

def test_shipped_constants_and_node_scaling():
    assert (C.reference_node_nm, C.node_nm) == (45, 7)
    assert C.node_scale == pytest.approx(0.75**5)  # 45 -> 32 -> 22 -> 14 -> 10 -> 7
    assert C.mac_j == pytest.approx(2.0e-12 * 0.75**5)  # Horowitz: fp16 mult 1.1 + fp32 add 0.9 pJ
    assert C.hbm_j_per_byte == pytest.approx(3.9e-12 * 8)  # O'Connor et al.: HBM2 3.9 pJ/bit
    # SRAM: Horowitz's 8 KB point exactly, ~100 pJ / 64 bit at 1 MiB, banks cap the growth
    assert C.glb_j_per_byte(8192) == pytest.approx(10e-12 / 8 * C.node_scale)
    assert C.glb_j_per_byte(2**20) / C.node_scale * 8 == pytest.approx(100e-12, rel=0.02)
    assert C.glb_j_per_byte(128 * 2**20) == C.glb_j_per_byte(2 * 2**20) == C.glb_j_per_byte(2**20)
    assert C.glb_j_per_byte(32 * 1024) / C.glb_j_per_byte(8192) == pytest.approx(2.0, rel=0.05)  # fit residual 3%
    at45 = replace(C, node_nm=45)
    assert at45.node_scale == 1.0 and at45.mac_j == pytest.approx(2.0e-12)


# ---- per operator ------------------------------------------------------------------------------------

def test_gemm_energy_scales_linearly_with_flops():
    d = chip()
    base = op_energy(graph(gemm(1, 64, 32, 32)), [d])
    twice_m = op_energy(graph(gemm(1, 128, 32, 32)), [d])
    twice_batch = op_energy(graph(gemm(2, 64, 32, 32)), [d])
    flops = 2.0 * 64 * 32 * 32
    assert base.macs[0, 0] == flops / 2
    assert base.compute[0, 0] == pytest.approx(flops / 2 * C.mac_j, rel=1e-12)
    assert twice_m.compute[0, 0] == pytest.approx(2 * base.compute[0, 0], rel=1e-12)
    # a batch of two identical GEMMs does exactly twice the work and moves exactly twice the bytes
    assert twice_batch.total[0, 0] == pytest.approx(2 * base.total[0, 0], rel=1e-12)
    for c in COMPONENTS:
        assert getattr(twice_batch, c)[0, 0] == pytest.approx(2 * getattr(base, c)[0, 0], rel=1e-12)


def test_hbm_and_sram_energy_by_hand():
    d = chip(glb_bytes=2**20, num_tc=4, tc_x=8)
    # vector op: reads 2 x 1000 elements, writes 1000, all through the GLB from and to HBM
    v = Op("v", "elementwise", VC, flops=1000.0, bytes_read=4000.0, bytes_written=2000.0, elements=1000,
           vector_ops=("add",))
    e = op_energy(graph(v), [d])
    assert e.hbm_bytes[0, 0] == 6000.0 and e.glb_bytes[0, 0] == 6000.0
    assert e.hbm[0, 0] == pytest.approx(6000 * 8 * 3.9e-12, rel=1e-12)
    assert e.sram[0, 0] == pytest.approx(6000 * C.glb_j_per_byte(2**20), rel=1e-12)
    assert e.lane_ops[0, 0] == 1000 and e.compute[0, 0] == pytest.approx(1000 * C.vector_op_j)
    # a GEMM whose operands fit the GLB: every byte once from HBM
    g = gemm(1, 64, 32, 32)
    fit = op_energy(graph(g), [d])
    nbytes = g.bytes_read + g.bytes_written
    assert fit.hbm[0, 0] == pytest.approx(nbytes * C.hbm_j_per_byte, rel=1e-12)
    # GLB: A once per column tile (32 / 8 = 4), B and the output once
    assert fit.glb_bytes[0, 0] == E * (64 * 32 * 4 + 32 * 32 + 64 * 32)


def test_gemm_spilling_the_glb_share_rereads_hbm_only_on_one_core():
    # A 1024x1024 bf16 weight (2 MiB) and 256 x 1024 activations (0.5 MiB); GLB 4 MiB over 4 TCs.
    d = chip(glb_bytes=4 * 2**20, num_tc=4)
    g = gemm(1, 256, 1024, 1024)
    nbytes = g.bytes_read + g.bytes_written
    split = op_energy(graph(g), [d], split=[True])
    single = op_energy(graph(g), [d], split=[False])
    assert split.hbm_bytes[0, 0] == nbytes  # half the GLB (2 MiB) holds the 0.5 MiB operand: no re-reads
    # one core: 1 MiB share, half of it (0.5 MiB) holds a resident chunk: A fits in one chunk, so B
    # streams once (no re-reads); keeping B resident (4 chunks) would re-read A 3 times: the cheaper wins
    assert single.hbm_bytes[0, 0] == nbytes
    big = gemm(1, 1024, 1024, 1024)  # both operands 2 MiB: each needs 4 chunks of the 0.5 MiB half-share
    one = op_energy(graph(big), [d], split=[False])
    assert one.hbm_bytes[0, 0] == big.bytes_read + big.bytes_written + 3 * E * 1024 * 1024
    assert op_energy(graph(big), [d]).hbm_bytes[0, 0] == big.bytes_read + big.bytes_written  # 2 MiB half-GLB
    assert one.compute[0, 0] == op_energy(graph(big), [d]).compute[0, 0]  # the mode never changes the work


def test_fused_epilogue_collectives_and_views():
    d = chip()
    fused = gemm(1, 64, 32, 32, unit=TCVC, elements=64 * 32, vector_ops=("gelu",))
    plain = op_energy(graph(gemm(1, 64, 32, 32)), [d])
    e = op_energy(graph(fused), [d])
    assert e.compute[0, 0] == pytest.approx(plain.compute[0, 0] + 64 * 32 * 10 * C.vector_op_j)
    ar = Op("ar", "collective", NET, collective="allreduce", comm_bytes=1e6, group=8)
    ag = Op("ag", "collective", NET, collective="all_gather", comm_bytes=4e6, group=4)
    solo = Op("s", "collective", NET, collective="allreduce", comm_bytes=1e6, group=1)
    e = op_energy(graph(ar, ag, solo, Op("view", "noop", NONE)), [d], intra_node=True)
    assert list(e.link_bytes[0]) == [2 * 7 / 8 * 1e6, 3 / 4 * 4e6, 0.0, 0.0]
    assert e.link[0, 0] == pytest.approx(1.75e6 * 8 * 8e-12)
    inter = op_energy(graph(ar), [d], intra_node=False)
    assert inter.link[0, 0] == pytest.approx(1.75e6 * 8 * 20e-12)
    assert e.total[0, 3] == 0.0


def test_vectorised_over_designs_matches_one_at_a_time():
    designs = [chip(), chip(num_tc=1, glb_bytes=2**16, tc_x=16), chip(num_tc=16, glb_bytes=2**24)]
    g = graph(gemm(2, 300, 500, 700), Op("v", "softmax", VC, flops=5e4, bytes_read=2e5, bytes_written=1e5,
                                         elements=10000, vector_ops=("softmax",)))
    split = np.array([[True, False], [False, False], [False, True]])
    together = op_energy(g, designs, split=split)
    for i, d in enumerate(designs):
        alone = op_energy(g, [d], split=split[i])
        np.testing.assert_allclose(together.total[i], alone.total[0], rtol=1e-12)


# ---- per batch ---------------------------------------------------------------------------------------

def _costs(n=4, tp=2):
    return LayerCosts(tp=tp, fwd_s=[1.0] * n, bwd_s=[2.0] * n, params=[1000.0] * n,
                      activation_bytes=[10.0] * n, boundary_bytes=[500.0] * n, input_bytes=[8.0] * n)


def _layer_j(n=4):
    fwd = np.tile([1.0, 0.1, 0.2, 0.01], (n, 1))
    return fwd, 2 * fwd


def test_batch_energy_by_hand():
    costs = _costs()
    fwd, bwd = _layer_j()
    stages = [[0, 1], [2, 3]]
    b = batch_energy(fwd, bwd, costs, stages, dp=3, microbatches=5, recompute=False, time_per_batch_s=10.0,
                     area_mm2=100.0, system=SYSTEM)
    scale = 3 * 5 * 2  # dp x microbatches x tp
    assert b.compute_j == pytest.approx(4 * 3.0 * scale)
    assert b.hbm_j == pytest.approx(4 * 0.6 * scale) and b.tp_link_j == pytest.approx(4 * 0.03 * scale)
    # pipeline: 2 stages x 2 tp = 4 devices per replica; link of pp*t = 4 devices: inside a node of 8
    # stage 1 receives layer 1's output, stage 0 receives its gradient: 2 x 500 bytes per TP rank
    assert b.pipeline_link_j == pytest.approx(2 * 500 * 2 * 3 * 5 * 8 * 8e-12)
    # data parallel: 12 devices > 8 per node -> inter-node ring; per device 2 (d-1)/d x 2000 params x 2 B
    assert b.dp_link_j == pytest.approx(2 * 2 * 3 * (2 * 2 / 3 * 2000 * 2) * 8 * 20e-12)
    assert b.static_j == pytest.approx(0.1 * 100.0 * 12 * 10.0)
    assert b.total_j == pytest.approx(b.dynamic_j + b.static_j) and b.recompute_j == 0.0


def test_recompute_increases_energy_by_the_forwards_of_every_stage():
    costs = _costs()
    fwd, bwd = _layer_j()
    args = dict(costs=costs, stages=[[0], [1, 2], [3]], dp=2, microbatches=4, time_per_batch_s=1.0,
                area_mm2=50.0, system=SYSTEM)
    off = batch_energy(fwd, bwd, recompute=False, **args)
    on = batch_energy(fwd, bwd, recompute=True, **args)
    assert on.total_j > off.total_j
    assert on.recompute_j == pytest.approx(4 * fwd[0].sum() * 2 * 4 * 2)  # every layer, the last stage's too; dp x m x tp
    assert on.dynamic_j - off.dynamic_j == pytest.approx(on.recompute_j)


def test_larger_area_pays_more_static_energy():
    costs = _costs()
    fwd, bwd = _layer_j()
    args = dict(costs=costs, stages=[[0, 1, 2, 3]], dp=1, microbatches=2, recompute=False, time_per_batch_s=3.0,
                system=SYSTEM)
    small = batch_energy(fwd, bwd, area_mm2=100.0, **args)
    large = batch_energy(fwd, bwd, area_mm2=250.0, **args)
    assert large.static_j == pytest.approx(2.5 * small.static_j) and large.static_j > small.static_j
    assert large.dynamic_j == small.dynamic_j
    assert small.pipeline_link_j == 0.0 and small.dp_link_j == 0.0


# ---- the real pipeline -------------------------------------------------------------------------------

def test_gpt2_energy_matches_its_flops_and_recompute_costs_more():
    off = evaluate("gpt2-xl", TPU, Training(1, False, "tp=1,pp=4,dp=64"), "default")
    on = evaluate("gpt2-xl", TPU, Training(1, True, "tp=1,pp=4,dp=64"), "default")
    assert off.feasible and on.feasible and off.energy_j > 0
    assert on.energy_j > off.energy_j
    # the MAC energy of one batch is the model's training FLOPs / 2 x the MAC energy, within the
    # per-device sharding's rounding: a missed factor (tp, dp, microbatches) would be off by >= 2x
    model, system, problem, per_tp = training_problem("gpt2-xl", TPU, Training(1, False), "default", (1,))
    fwd, bwd = tp_layer_energies(model, TPU, Training(1), system, per_tp[1])
    stages = [s["layers"] for s in off.placement["stages"]]
    b = batch_energy(fwd, bwd, per_tp[1].costs, stages, 64, off.placement["microbatches"], False,
                     off.time_per_batch_s, off.area_mm2, system)
    assert b.total_j == pytest.approx(off.energy_j, rel=1e-12)
    macs_j = problem.model_flops_per_sequence * system.global_batch / 2 * C.mac_j
    assert 1.0 <= b.compute_j / macs_j < 1.2
    assert b.static_j == pytest.approx(0.1 * off.area_mm2 * 4 * 64 * off.time_per_batch_s)
    # average power per device in a plausible range for a ~280 mm^2 7 nm chip
    watts = off.energy_j / (4 * 64 * off.time_per_batch_s)
    assert 20 < watts < 400
    # the second call reuses the memoised per-layer energies and gives the same figure
    assert evaluate("gpt2-xl", TPU, Training(1, False, "tp=1,pp=4,dp=64"), "default").energy_j == off.energy_j


def test_infeasible_design_has_no_energy():
    r = evaluate("gpt3-175b", TPU, Training(1, False, "expert"), "default")
    assert not r.feasible and r.energy_j is None


# ---- config errors -----------------------------------------------------------------------------------

GOOD = constants_path().read_text()


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("mac_pj: 2.0", "mac_pj: two"), "field 'mac_pj': must be a number, got 'two'"),
    (lambda t: t.replace("hbm_pj_per_bit: 3.9", "hbm_pj_per_bit: -3.9"), "field 'hbm_pj_per_bit': must be >= 0"),
    (lambda t: t.replace("node_nm: 7 ", "node_nm: 6 "), "field 'node_nm': must be one of 45, 32, 22, 14, 10, 7, 5, 3"),
    (lambda t: t.replace("static_w_per_mm2: 0.1", "static_w_per_mm2: 0.1\nleakage: 3"), "field 'leakage': unknown field"),
    (lambda t: t.replace("vector_op_pj: 0.9", ""), "field 'vector_op_pj': missing required field"),
    (lambda t: t.replace("sram_ref_bytes: 8192", "sram_ref_bytes: 0"), "field 'sram_ref_bytes': must be > 0"),
    (lambda t: t + "\n  - [unclosed", "malformed YAML"),
    (lambda t: "- 1\n- 2\n", "expected a mapping"),
])
def test_bad_energy_yaml_is_one_line_error(tmp_path, edit, message):
    p = tmp_path / "energy.yaml"
    p.write_text(edit(GOOD))
    with pytest.raises(PhazeError) as info:
        load_constants(p)
    text = str(info.value)
    assert message in text and "\n" not in text and str(p) in text


def test_bad_energy_yaml_through_the_cli(tmp_path, monkeypatch, capsys):
    configs_dir = Path(constants_path()).parent
    shutil.copytree(configs_dir, tmp_path / "configs")
    (tmp_path / "configs" / "energy.yaml").write_text(GOOD.replace("mac_pj: 2.0", "mac_pj: [2]"))
    monkeypatch.setenv("PHAZE_OPT_CONFIGS", str(tmp_path / "configs"))
    code = cli.main(["evaluate", "--model", "gpt2-xl", "--arch", "tpuv4", "--mbs", "1", "--recompute",
                     "--placement", "tp=1,pp=4,dp=64", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and "energy.yaml: field 'mac_pj': must be a number" in err and err.count("\n") == 1


# ---- energy per MAC by number format -------------------------------------------------------------

@pytest.mark.parametrize("fmt, pj, operand", [("fp8", 0.275 + 0.9, 1.0), ("mxfp8", 0.275 + 0.9, 1.0 + 1 / 32),
                                               ("nvfp4", 1.1 / 16 + 0.9, 0.5 + 1 / 16)])
def test_low_precision_gemm_pays_its_own_mac_energy(fmt, pj, operand):
    """A GEMM in a narrower format: the multiplier's 1.1 pJ x (significand bits / 8)^2 plus the same
    FP32 accumulate (Horowitz 2014), and its operands through the GLB at the format's width; the
    output stays BF16 and a BF16 GEMM is charged as before."""
    d = chip(glb_bytes=2**20, num_tc=4, tc_x=8)
    bf16 = gemm(1, 64, 32, 32)
    low = replace(bf16, datatype=fmt)
    a, b = op_energy(graph(bf16), [d]), op_energy(graph(low), [d])
    macs = 64 * 32 * 32
    assert C.format_mac_j("") == C.format_mac_j("bf16") == C.mac_j
    assert C.format_mac_j(fmt) == pytest.approx(pj * 1e-12 * C.node_scale, rel=1e-12)
    assert b.compute[0, 0] == pytest.approx(macs * pj * 1e-12 * C.node_scale, rel=1e-12)
    assert a.compute[0, 0] == pytest.approx(macs * C.mac_j, rel=1e-12)
    # GLB: A once per column tile (32 / 8 = 4) and B at the format's width, the output in BF16
    assert b.glb_bytes[0, 0] == pytest.approx(operand * (64 * 32 * 4 + 32 * 32) + E * 64 * 32, rel=1e-12)
    assert b.total[0, 0] < a.total[0, 0]


def test_mac_multiply_share_checked(tmp_path):
    path = tmp_path / "energy.yaml"
    path.write_text(GOOD.replace("mac_multiply_pj: 1.1", "mac_multiply_pj: 2.5"))
    with pytest.raises(PhazeError, match="mac_multiply_pj.*at most mac_pj"):
        load_constants(path)
    path.write_text("\n".join(line for line in GOOD.splitlines() if not line.startswith("mac_multiply_pj")))
    assert load_constants(path).mac_multiply_pj == 1.1  # optional: the cited default
