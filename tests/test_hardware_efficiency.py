"""Software efficiency of a preset (hardware/efficiency.py): parsing, identity, and each parameter's
term checked against a hand computation, so a wrong formula fails."""

from dataclasses import replace

import numpy as np
import pytest
import yaml

from phaze_opt.errors import PhazeError
from phaze_opt.hardware.accelerator import Accelerator
from phaze_opt.hardware.arch import accelerator_from_mapping, load_arch
from phaze_opt.hardware.efficiency import IDENTITY, Efficiency, efficiency_from_mapping
from phaze_opt.hardware.latency import DesignArrays, estimate, estimate_one
from phaze_opt.workload.ops import NET, NONE, TC, TCVC, VC, Op, OpGraph

E = 2


def gemm(b, m, k, n, unit=TC, **kw):
    return Op("g", "gemm", unit, flops=2.0 * b * m * k * n, bytes_read=E * b * (m * k + k * n),
              bytes_written=E * b * m * n, gemm=(b, m, k, n), **kw)


def vec(elements, inputs=2):
    return Op("v", "elementwise", VC, flops=float(elements), bytes_read=E * elements * inputs,
              bytes_written=E * elements, elements=elements, vector_ops=("add",))


def chip(eff=IDENTITY, **kw):
    base = dict(num_tc=1, tc_x=4, tc_y=4, num_vc=1, vc_width=16, glb_bytes=2**20, glb_bw=1e12,
                hbm_bytes=2**30, hbm_bw=1e12, clock_hz=1e9)
    return Accelerator(**{**base, **kw}, efficiency=eff)


def one(op, acc):
    s, p = estimate_one(OpGraph("t", "fwd", (op,), ()), acc)
    return s[0], p[0]


# ---- parsing ----------------------------------------------------------------------------------------

ARCH = dict(num_tc=4, tc_x=16, tc_y=16, num_vc=4, vc_width=32, glb_mib=8, hbm_gib=16, hbm_bw_gbps=1000, clock_ghz=1.0)


def test_arch_file_without_efficiency_is_the_identity():
    assert accelerator_from_mapping(dict(ARCH), "x.yaml").efficiency == IDENTITY
    assert accelerator_from_mapping({**ARCH, "efficiency": None}, "x.yaml").efficiency == IDENTITY


def test_arch_file_efficiency_is_read():
    eff = {"gemm_tile_reuse": 4, "gemm_wave_balance": 1, "tc_fraction": 0.8, "hbm_fraction": 0.9, "op_overhead_s": 3e-6}
    acc = accelerator_from_mapping({**ARCH, "efficiency": eff}, "x.yaml")
    assert acc.efficiency == Efficiency(gemm_tile_reuse=4.0, gemm_wave_balance=1.0, tc_fraction=0.8, hbm_fraction=0.9,
                                        op_overhead_s=3e-6)


@pytest.mark.parametrize("eff, field, words", [
    ({"tile_reuse": 2}, "efficiency.tile_reuse", "unknown field"),
    ({"tc_fraction": 0}, "efficiency.tc_fraction", "greater than 0"),
    ({"tc_fraction": 1.2}, "efficiency.tc_fraction", "at most 1"),
    ({"hbm_fraction": -0.5}, "efficiency.hbm_fraction", "greater than 0"),
    ({"hbm_fraction": float("nan")}, "efficiency.hbm_fraction", "must be a number"),
    ({"gemm_tile_reuse": 0.5}, "efficiency.gemm_tile_reuse", "at least 1"),
    ({"gemm_tile_reuse": True}, "efficiency.gemm_tile_reuse", "must be a number"),
    ({"gemm_wave_balance": -0.1}, "efficiency.gemm_wave_balance", "at least 0"),
    ({"gemm_wave_balance": 2}, "efficiency.gemm_wave_balance", "at most 1"),
    ({"op_overhead_s": -1e-6}, "efficiency.op_overhead_s", "at least 0"),
    ({"op_overhead_s": 1.0}, "efficiency.op_overhead_s", "at most"),
    ({"op_overhead_s": "3us"}, "efficiency.op_overhead_s", "must be a number"),
])
def test_efficiency_errors_name_file_and_field(eff, field, words):
    with pytest.raises(PhazeError) as err:
        accelerator_from_mapping({**ARCH, "efficiency": eff}, "my-chip.yaml")
    msg = str(err.value)
    assert "\n" not in msg and "my-chip.yaml" in msg and f"'{field}'" in msg and words in msg


def test_efficiency_must_be_a_mapping(tmp_path):
    path = tmp_path / "chip.yaml"
    path.write_text(yaml.safe_dump({**ARCH, "efficiency": [0.9]}))
    with pytest.raises(PhazeError, match=r"chip.yaml: field 'efficiency': must be a mapping"):
        load_arch(path)
    with pytest.raises(PhazeError):
        efficiency_from_mapping(3, "f.yaml")


def test_identity_keeps_keys_and_fields_of_the_presets():
    acc = load_arch("h100-like")
    assert acc.efficiency.is_identity and "efficiency" not in acc.fields() and len(acc.compute_key) == 9
    tuned = replace(acc, efficiency=Efficiency(hbm_fraction=0.9))
    assert tuned.compute_key != acc.compute_key  # the schedule memo must not mix the two
    assert Accelerator(**tuned.fields()) == tuned  # fields() round-trips (published JSON rebuilds archs)


def test_shipped_search_presets_are_uncalibrated():
    # The default search space's reference designs keep the bare template (studies stay uncalibrated).
    for name in ("h100-like", "a100-like", "tpuv4"):
        assert load_arch(name).efficiency == IDENTITY


# ---- identity: every existing number unchanged -----------------------------------------------------

def golden_graph():
    b, s, d = 4, 2048, 128
    ops = (
        Op("qkv", "gemm", TC, flops=2.0 * 2048 * 12288 * 36864, bytes_read=E * (2048 * 12288 + 12288 * 36864),
           bytes_written=E * 2048 * 36864, gemm=(1, 2048, 12288, 36864)),
        Op("up", "fused", TCVC, flops=2.0 * 4096 * 4096 * 11008 + 10 * 4096 * 11008,
           bytes_read=E * (4096 * 4096 + 4096 * 11008), bytes_written=E * 4096 * 11008, gemm=(1, 4096, 4096, 11008),
           elements=4096 * 11008, vector_ops=("gelu",)),
        Op("qk", "bgemm", TC, flops=2.0 * 96 * 2048 * 128 * 2048, bytes_read=E * 96 * 2 * 2048 * 128,
           bytes_written=E * 96 * 2048 * 2048, gemm=(96, 2048, 128, 2048)),
        Op("sm", "softmax", VC, flops=5.0 * 96 * 2048 * 2048, bytes_read=E * 96 * 2048 * 2048,
           bytes_written=E * 96 * 2048 * 2048, elements=96 * 2048 * 2048, vector_ops=("softmax",)),
        Op("ln", "norm", VC, bytes_read=E * 2048 * 12288, bytes_written=E * 2048 * 12288, elements=2048 * 12288,
           vector_ops=("layernorm",)),
        Op("fa", "flash_attention", TCVC, flops=4.0 * b * s * s * d + 5.0 * b * s * s, bytes_read=E * b * s * d * 3,
           bytes_written=E * b * s * d, gemm=(b, s, 2 * d, s), gemms=((b, s, d, s), (b, s, s, d)), elements=b * s * s,
           vector_ops=("softmax",)),
        Op("ar", "collective", NET, bytes_read=E * 2048 * 12288, collective="allreduce", comm_bytes=E * 2048 * 12288,
           group=8),
        Op("nop", "noop", NONE),
    )
    return OpGraph("golden", "fwd", ops, ())


# Computed by the template before efficiencies existed (main at 9548f60), on h100-like, a100-80gb,
# tpuv4, a100-like: the identity must reproduce them bit for bit.
GOLDEN_SINGLE = [[9.075201792458508, 0.6053770426459701, 0.03966434349850746, 0.06346294959761194, 0.003966434349850746, 0.002452228196721312, 0.00030760128000000003, 0.0], [12.487185599340854, 0.8328789284786661, 0.0609903114893617, 0.08530955148994607, 0.005331846968121629, 0.0046119217021276596, 0.00030760128000000003, 0.0], [0.06398537142857143, 0.011736624761904763, 0.00603979776, 0.02396745142857143, 0.00131072, 0.0009986438095238095, 0.00030760128000000003, 0.0], [16.373872306788424, 1.0921158425517685, 0.06991405767202573, 0.11186249227524116, 0.006991405767202572, 0.0046119217021276596, 0.00030760128000000003, 0.0]]
GOLDEN_SPLIT = [[0.0032069665573770494, 0.000635215737704918, 0.0002704387056716418, 0.00048077992119402983, 3.0048745074626864e-05, 1.8577486338797815e-05, 0.00030760128000000003, 0.0], [0.008178056170212765, 0.0016238751773049644, 0.0005647251063829787, 0.0007899032545365375, 4.936895340853359e-05, 4.2702978723404254e-05, 0.00030760128000000003, 0.0], [0.007998171428571428, 0.001677409523809524, 0.00075497472, 0.011983725714285715, 0.00065536, 0.0004993219047619048, 0.00030760128000000003, 0.0], [0.008178056170212765, 0.0016238751773049644, 0.000582617147266881, 0.001035763817363344, 6.4735238585209e-05, 4.2702978723404254e-05, 0.00030760128000000003, 0.0]]


def test_identity_is_bit_identical_to_the_bare_template():
    # (a100-80gb is calibrated now: its bare template is the identity put back)
    accs = [replace(load_arch(n), efficiency=IDENTITY) for n in ("h100-like", "a100-80gb", "tpuv4", "a100-like")]
    lat = estimate(golden_graph(), accs)
    assert lat.single.tolist() == GOLDEN_SINGLE and lat.split.tolist() == GOLDEN_SPLIT
    arrays = DesignArrays.from_accelerators(accs)
    assert arrays.efficiency == IDENTITY
    assert estimate(golden_graph(), arrays).single.tolist() == GOLDEN_SINGLE


def test_designs_with_different_efficiencies_are_not_mixed():
    with pytest.raises(ValueError, match="different efficiencies"):
        DesignArrays.from_accelerators([chip(), chip(Efficiency(tc_fraction=0.5))])


def test_design_arrays_carry_the_efficiency_through_slices():
    eff = Efficiency(hbm_fraction=0.5)
    arrays = DesignArrays.from_accelerators([chip(eff), chip(eff, num_tc=2)])
    assert arrays.rows(1, 2).efficiency == eff and len(arrays.rows(1, 2)) == 1
    assert DesignArrays.from_columns(efficiency=eff, **{f: getattr(arrays, f) for f in DesignArrays.FIELDS}).efficiency == eff


# ---- each parameter, by hand ------------------------------------------------------------------------

def test_tile_reuse_divides_the_activation_stream_by_hand():
    # (1, M=64, K=8, N=64) on a 4x4 array: 16 column tiles. GLB traffic: A (64*8*2 = 1024 B) once per
    # tile, B 1024 B and C 8192 B once: 16*1024 + 9216 = 25600 B at 1 MB/s = 25.6 ms (GLB-bound; the
    # compute, 16*2 folds of 74 cycles = 2.4 us, and HBM, 10240 B at 1 TB/s, are far below).
    op = gemm(1, 64, 8, 64)
    assert one(op, chip(glb_bw=1e6))[0] == pytest.approx(25600 / 1e6)
    # reuse 4: A streams ceil(16/4) = 4 times: 4*1024 + 9216 = 13312 B
    assert one(op, chip(Efficiency(gemm_tile_reuse=4), glb_bw=1e6))[0] == pytest.approx(13312 / 1e6)
    # reuse 3: ceil(16/3) = 6 passes (a partial group still streams A whole): 6*1024 + 9216 = 15360 B
    assert one(op, chip(Efficiency(gemm_tile_reuse=3), glb_bw=1e6))[0] == pytest.approx(15360 / 1e6)
    # reuse beyond the tiles: once, then the GEMM is bound by what else it moves
    assert one(op, chip(Efficiency(gemm_tile_reuse=64), glb_bw=1e6))[0] == pytest.approx(10240 / 1e6)


def test_wave_balance_fills_the_last_round_by_hand():
    # (1, M=64, K=4, N=12) on two 4x4 arrays: 3 column tiles, one fold each of 2*4 + 4 + 64 - 2 = 74
    # cycles. Split over both cores: ceil(3/2) = 2 rounds = 148 ns; Stream-K at 1: 3/2 rounds = 111 ns;
    # at 0.5: 1.75 rounds = 129.5 ns. On one core (single) 3 rounds, nothing to balance: 222 ns.
    op = gemm(1, 64, 4, 12)
    assert one(op, chip(num_tc=2)) == pytest.approx((222e-9, 148e-9))
    assert one(op, chip(Efficiency(gemm_wave_balance=1.0), num_tc=2)) == pytest.approx((222e-9, 111e-9))
    assert one(op, chip(Efficiency(gemm_wave_balance=0.5), num_tc=2)) == pytest.approx((222e-9, 129.5e-9))
    # 2 tiles on 3 cores: one round of 74 cycles; balanced, the work over 3 cores: 2/3 x 74
    assert one(gemm(1, 64, 4, 8), chip(Efficiency(gemm_wave_balance=1.0), num_tc=3))[1] == pytest.approx(74e-9 * 2 / 3)
    # 1 tile on 2 cores: both cut the stream already (32 rows each: 2*4 + 4 + 32 - 2 = 42 cycles)
    assert one(gemm(1, 64, 4, 4), chip(Efficiency(gemm_wave_balance=1.0), num_tc=2))[1] == pytest.approx(42e-9)


def test_tc_fraction_slows_compute_by_hand():
    # (1, 64, 8, 8) on one 4x4 array: 4 folds of 74 cycles = 296 ns at 1 GHz (compute-bound); at 80%
    # of the peak 370 ns.
    op = gemm(1, 64, 8, 8)
    assert one(op, chip())[0] == pytest.approx(296e-9)
    single, split = one(op, chip(Efficiency(tc_fraction=0.8)))
    assert single == split == pytest.approx(296e-9 / 0.8)


def test_tc_fraction_leaves_a_memory_bound_gemm_alone():
    op = gemm(1, 64, 64, 64)  # HBM-bound at 100 MB/s: 24576 B = 245.76 us
    assert one(op, chip(Efficiency(tc_fraction=0.5), hbm_bw=1e8))[0] == pytest.approx(24576 / 1e8)


def test_hbm_fraction_slows_memory_bound_ops_by_hand():
    # GEMM (1, 64, 64, 64): 24576 B compulsory at 100 MB/s = 245.76 us; at half the bandwidth 491.52 us
    assert one(gemm(1, 64, 64, 64), chip(Efficiency(hbm_fraction=0.5), hbm_bw=1e8))[0] == pytest.approx(2 * 24576 / 1e8)
    # vector add of 1000 elements: 6000 B at 1 GB/s = 6 us (compute 63 ns); at 40%: 15 us
    assert one(vec(1000), chip(hbm_bw=1e9))[0] == pytest.approx(6e-6)
    assert one(vec(1000), chip(Efficiency(hbm_fraction=0.4), hbm_bw=1e9))[0] == pytest.approx(6e-6 / 0.4)
    # ... but never faster than the GLB: HBM at 10 TB/s x 0.5 = 5 TB/s, GLB 1 TB/s sets the pace (6 ns;
    # the lanes need 63 ns)
    assert one(vec(1000), chip(Efficiency(hbm_fraction=0.5), hbm_bw=1e13))[0] == pytest.approx(63e-9)


def test_op_overhead_adds_to_every_op_on_the_cores_only():
    eff = Efficiency(op_overhead_s=5e-6)
    ops = (gemm(1, 64, 8, 8), vec(1000),
           Op("ar", "collective", NET, bytes_read=1000, collective="allreduce", comm_bytes=1000, group=2),
           Op("nop", "noop", NONE))
    g = OpGraph("t", "fwd", ops, ())
    base_s, base_p = estimate_one(g, chip())
    s, p = estimate_one(g, chip(eff))
    np.testing.assert_allclose(s - base_s, [5e-6, 5e-6, 0.0, 0.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(p - base_p, [5e-6, 5e-6, 0.0, 0.0], rtol=0, atol=1e-15)


def test_efficiency_never_makes_the_big_gemm_slower_with_reuse():
    # the QKV projection of GPT-3 on h100-like is GLB-bound in the bare template (see the issue):
    # reuse can only help, and enough of it leaves the compute bound.
    acc = load_arch("h100-like")
    op = gemm(1, 2048, 12288, 36864)
    times = [one(op, replace(acc, efficiency=Efficiency(gemm_tile_reuse=r)))[1] for r in (1, 2, 4, 8, 16)]
    assert all(a >= b for a, b in zip(times, times[1:])) and times[0] > 1.2 * times[-1]
