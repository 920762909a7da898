"""Per-operator latency: hand-computed cases, an explicit fold-by-fold oracle, roofline and
monotonicity properties."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.hardware.accelerator import Accelerator
from phaze_opt.hardware.arch import load_arch
from phaze_opt.hardware.latency import (
    DesignArrays, Interconnect, cycles_per_element, estimate, estimate_one,
)
from phaze_opt.system import Link
from phaze_opt.workload.ops import NET, NONE, TC, TCVC, VC, Op, OpGraph

E = 2


def gemm(b, m, k, n, unit=TC, **kw):
    return Op("g", "gemm", unit, flops=2.0 * b * m * k * n, bytes_read=E * b * (m * k + k * n),
              bytes_written=E * b * m * n, gemm=(b, m, k, n), **kw)


def vec(elements, kinds=("add",), inputs=2, flops=None):
    return Op("v", "elementwise", VC, flops=float(elements if flops is None else flops),
              bytes_read=E * elements * inputs, bytes_written=E * elements, elements=elements, vector_ops=tuple(kinds))


def graph(*ops):
    return OpGraph("t", "fwd", tuple(ops), ())


def chip(**kw):
    base = dict(num_tc=1, tc_x=4, tc_y=4, num_vc=1, vc_width=16, glb_bytes=2**20, glb_bw=1e12,
                hbm_bytes=2**30, hbm_bw=1e12, clock_hz=1e9)
    return Accelerator(**{**base, **kw})


def one(op, acc, **kw):
    s, p = estimate_one(graph(op), acc, **kw)
    return s[0], p[0]


# ---- hand-computed cases ----------------------------------------------------------------------------

def test_gemm_compute_bound_by_hand():
    # (1, M=64, K=8, N=8) on one 4x4 array: ceil(8/4) x ceil(8/4) = 4 folds of 2*4 + 4 + 64 - 2 = 74
    # cycles (SCALE-Sim weight-stationary fold), 296 cycles at 1 GHz. Memory: 2176 B HBM at 1 TB/s and
    # 1024*2 + 128 + 1024 = 3200 B of GLB traffic at 1 TB/s are far below.
    single, split = one(gemm(1, 64, 8, 8), chip())
    assert single == split == pytest.approx(296e-9)


def test_gemm_that_fits_the_glb_moves_each_operand_once():
    # (1, 64, 64, 64): A = B = C = 8 KiB, 24576 B compulsory. GLB 1 MiB: half of it (the resident block)
    # holds either operand, so HBM traffic is compulsory: 24576 B at 100 MB/s = 245.76 us (HBM-bound).
    single, _ = one(gemm(1, 64, 64, 64), chip(hbm_bw=1e8))
    assert single == pytest.approx(24576 / 1e8)


def test_gemm_that_spills_the_glb_rereads_the_streamed_operand():
    # Same GEMM, GLB 8 KiB: the resident half (4 KiB) holds half of either 8 KiB operand, so it is cut
    # into 2 chunks and the other operand is streamed twice: 24576 + 8192 = 32768 B -> 327.68 us.
    single, _ = one(gemm(1, 64, 64, 64), chip(hbm_bw=1e8, glb_bytes=8192))
    assert single == pytest.approx(32768 / 1e8)


def test_bandwidth_bound_vector_op_by_hand():
    # 1e6-element add, two inputs: 6e6 B. Two 16-lane VCs at 1 GHz compute it in 31.25 us, HBM at
    # 1 GB/s needs 6 ms. Split gets all the bandwidth; one core gets half of it (its fair share).
    acc = chip(num_vc=2, hbm_bw=1e9)
    single, split = one(vec(10**6), acc)
    assert split == pytest.approx(6e-3)
    assert single == pytest.approx(12e-3)


def test_compute_bound_vector_op_by_hand():
    # 1000 elements of softmax (8 cycles each) on 2 x 16 lanes: ceil(1000/32) * 8 = 256 cycles split,
    # ceil(1000/16) * 8 = 504 cycles on one core.
    single, split = one(vec(1000, kinds=("softmax",), inputs=1), chip(num_vc=2))
    assert split == pytest.approx(256e-9)
    assert single == pytest.approx(504e-9)


def test_fused_gemm_epilogue_overlaps():
    # GEMM 296 cycles (above); epilogue of 64*8 = 512 outputs x gelu (10 cycles) on 16 lanes = 320
    # cycles: the slower pipeline sets the pace.
    op = gemm(1, 64, 8, 8, unit=TCVC, elements=512, vector_ops=("gelu",))
    single, split = one(op, chip())
    assert single == split == pytest.approx(320e-9)


def test_ring_allreduce():
    op = Op("ar", "collective", NET, collective="allreduce", comm_bytes=1e6, group=8)
    single, split = one(op, chip(), interconnect=Interconnect(bandwidth_Bps=1e9, latency_s=1e-6))
    assert single == split == pytest.approx(2 * 7 / 8 * 1e6 / 1e9 + 2 * 7 * 1e-6)


def test_allgather_and_system_link():
    op = Op("ag", "collective", NET, collective="all_gather", comm_bytes=4e6, group=4)
    single, _ = one(op, chip(), interconnect=Link(bandwidth=2e9, latency=5e-6))
    assert single == pytest.approx(3 / 4 * 4e6 / 2e9 + 3 * 5e-6)


def test_collective_of_one_device_and_noop_are_free():
    ops = graph(Op("ar", "collective", NET, collective="allreduce", comm_bytes=1e9, group=1),
                Op("view", "noop", NONE))
    lat = estimate(ops, [chip()])
    assert not lat.single.any() and not lat.split.any()


def test_unknown_collective_and_tc_op_without_dims_raise():
    with pytest.raises(ValueError, match="unknown collective"):
        estimate(graph(Op("x", "collective", NET, collective="gossip", comm_bytes=1, group=2)), [chip()])
    with pytest.raises(ValueError, match=r"needs gemm=\(batch, M, K, N\)"):
        estimate(graph(Op("x", "gemm", TC, flops=10)), [chip()])


def test_vector_kind_table_and_unknown_kinds():
    assert cycles_per_element(vec(1, kinds=("dropout", "add")))[0] == 3
    assert cycles_per_element(vec(1, kinds=("gelu_backward",)))[0] == 20  # backward: twice the forward
    cpe, unknown = cycles_per_element(Op("n", "norm", VC, elements=1, vector_ops=("fancy_norm",)))
    assert cpe == 7 and unknown == ["fancy_norm"]  # costed as a norm, and reported
    lat = estimate(graph(Op("n", "norm", VC, elements=10, bytes_read=20, bytes_written=20, vector_ops=("fancy_norm",))), [chip()])
    assert lat.unknown_vector_ops == ("fancy_norm",)


def fraction_of_peak(acc, shapes):
    lat = estimate(graph(*(gemm(*s) for s in shapes)), [acc])
    return np.array([2.0 * math.prod(s) for s in shapes]) / acc.peak_flops / lat.split[0]


def test_big_gemms_on_tpuv4_reach_a_plausible_fraction_of_peak():
    # GPT-3 175B layer GEMMs at one 2048-token sequence: QKV, FC1, FC2 and the QKV data gradient.
    # Each fold streams the 2048 tokens and pays 2*128 + 128 - 2 cycles of fill and drain: 84%.
    shapes = [(1, 2048, 12288, 36864), (1, 2048, 12288, 49152), (1, 2048, 49152, 12288), (1, 2048, 36864, 12288)]
    frac = fraction_of_peak(load_arch("tpuv4"), shapes)
    assert ((0.60 <= frac) & (frac <= 0.95)).all(), frac


def test_long_streams_approach_but_never_reach_peak():
    # A weight gradient streams 12288 rows per fold: the fill/drain share shrinks to 3% (documented).
    frac = fraction_of_peak(load_arch("tpuv4"), [(1, 12288, 2048, 49152), (1, 8192, 8192, 8192)])
    assert ((0.9 < frac) & (frac < 0.99)).all(), frac


def test_many_designs_match_one_at_a_time():
    accs = [load_arch(n) for n in ("tpuv4", "a100-like", "h100-like")] + [chip(num_tc=4, num_vc=3)]
    g = graph(gemm(2, 300, 70, 130), vec(5000, kinds=("layernorm",)), gemm(1, 64, 8, 8, unit=TCVC, elements=512, vector_ops=("add",)))
    together = estimate(g, accs)
    arrays = estimate(g, DesignArrays.from_accelerators(accs))
    for i, acc in enumerate(accs):
        s, p = estimate_one(g, acc)
        np.testing.assert_array_equal(together.single[i], s)
        np.testing.assert_array_equal(together.split[i], p)
    np.testing.assert_array_equal(together.single, arrays.single)


# ---- an explicit fold-by-fold oracle for the GEMM compute time -----------------------------------------

def oracle_gemm_cycles(b, m, k, n, tx, ty, cores):
    """Deal the column tiles to cores one by one; with tiles to spare, cut the stream. Sum the folds."""
    tiles = [(bi, j) for bi in range(b) for j in range(-(-n // tx))]
    k_folds = -(-k // ty)
    per_core = [0] * cores
    if len(tiles) >= cores:
        for t in range(len(tiles)):
            per_core[t % cores] += k_folds * (2 * ty + tx + m - 2)
    else:
        parts = cores // len(tiles)
        chunk = -(-m // parts)
        c = 0
        for _ in tiles:
            left = m
            for _ in range(parts):
                rows = min(chunk, left)
                left -= rows
                if rows > 0:
                    per_core[c] = k_folds * (2 * ty + tx + rows - 2)
                c += 1
    return max(per_core)


small_pow2 = st.sampled_from([1, 2, 4, 8, 16])
dims = st.integers(min_value=1, max_value=300)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), dims, dims, dims, st.sampled_from([2, 4, 8, 16, 32]), st.sampled_from([2, 4, 8, 16, 32]), small_pow2)
def test_gemm_compute_matches_oracle(b, m, k, n, tx, ty, cores):
    # memory made irrelevant: huge bandwidths and GLB
    acc = chip(num_tc=cores, tc_x=tx, tc_y=ty, glb_bytes=2**40, glb_bw=1e30, hbm_bw=1e30)
    single, split = one(gemm(b, m, k, n), acc)
    assert split * 1e9 == pytest.approx(oracle_gemm_cycles(b, m, k, n, tx, ty, cores))
    assert single * 1e9 == pytest.approx(oracle_gemm_cycles(b, m, k, n, tx, ty, 1))


# ---- roofline and monotonicity ----------------------------------------------------------------------

designs = st.builds(
    chip,
    num_tc=small_pow2, tc_x=st.sampled_from([2, 8, 32, 128]), tc_y=st.sampled_from([2, 8, 32, 128]),
    num_vc=small_pow2, vc_width=st.sampled_from([2, 16, 128]),
    glb_bytes=st.sampled_from([2**12, 2**16, 2**20, 2**24]), glb_bw=st.sampled_from([1e10, 1e11, 1e12]),
    hbm_bw=st.sampled_from([1e9, 1e10, 1e11]), clock_hz=st.sampled_from([5e8, 1e9]),
)
ops = st.one_of(
    st.builds(gemm, st.integers(1, 8), dims, dims, dims),
    st.builds(lambda b, m, k, n, kinds: gemm(b, m, k, n, unit=TCVC, elements=b * m * n, vector_ops=kinds),
              st.integers(1, 4), dims, dims, dims, st.sampled_from([("add",), ("add", "gelu")])),
    st.builds(vec, st.integers(1, 10**6), st.sampled_from([("add",), ("softmax",), ("layernorm",), ("dropout", "add")]),
              st.integers(1, 3)),
)


def roofline(op, acc):
    """Seconds no implementation can beat on the whole chip."""
    mem = (op.bytes_read + op.bytes_written) / acc.hbm_bw
    if op.unit == VC:
        work = op.elements * cycles_per_element(op)[0] / (acc.num_vc * acc.vc_width * acc.clock_hz)
    else:
        work = op.flops / acc.peak_flops if op.unit == TC else 2.0 * math.prod(op.gemm) / acc.peak_flops
    return max(mem, work)


@settings(max_examples=300, deadline=None)
@given(designs, ops)
def test_nothing_beats_the_roofline(acc, op):
    single, split = one(op, acc)
    bound = roofline(op, acc)
    assert split >= bound * (1 - 1e-12)
    assert single >= bound * (1 - 1e-12)


@settings(max_examples=300, deadline=None)
@given(designs, ops)
def test_split_never_slower_than_single(acc, op):
    single, split = one(op, acc)
    assert split <= single * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(designs, ops, st.sampled_from(["num_tc", "num_vc"]))
def test_more_cores_never_slower_when_split(acc, op, field):
    more = replace(acc, **{field: getattr(acc, field) * 2})
    _, split_few = one(op, acc)
    _, split_many = one(op, more)
    assert split_many <= split_few * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(designs, ops, st.sampled_from(["glb_bytes", "glb_bw", "hbm_bw"]))
def test_more_memory_or_bandwidth_never_slower(acc, op, field):
    more = replace(acc, **{field: getattr(acc, field) * 4})
    for before, after in zip(one(op, acc), one(op, more)):
        assert after <= before * (1 + 1e-12)


@settings(max_examples=100, deadline=None)
@given(designs, ops)
def test_one_core_split_equals_single(acc, op):
    acc = replace(acc, num_tc=1, num_vc=1)
    single, split = one(op, acc)
    assert single == split


def test_latencies_are_finite_and_positive_on_the_phaze_grid_corners():
    from phaze_opt.design.space import load_space

    space = load_space("phaze")
    archs = space.architectures()
    picks = [archs[0], archs[len(archs) // 2], archs[-1]]
    accs = [space.accelerator({**{k: v for k, v in a.items() if k != "area_mm2"}, "hbm_gib": 32, "mbs": 1, "recompute": False}) for a in picks]
    g = graph(gemm(1, 2048, 12288, 49152), vec(2048 * 12288, kinds=("layernorm",)))
    lat = estimate(g, accs)
    assert np.isfinite(lat.single).all() and (lat.single > 0).all() and (lat.split > 0).all()


# ---- fused attention (FlashAttention) -------------------------------------------------------------

def flash_fwd(b=1, s=64, d=8):
    """The forward kernel over [b, s, s] scores: Q K^T and P V, softmax on the vector core."""
    gemms = ((b, s, d, s), (b, s, s, d))
    return Op("fa", "flash_attention", TCVC, flops=4.0 * b * s * s * d + 5.0 * b * s * s,
              bytes_read=3 * E * b * s * d, bytes_written=E * b * s * d + 4 * b * s,
              gemm=(b, s, 2 * d, s), gemms=gemms, elements=b * s * s, vector_ops=("softmax",))


def test_fused_attention_gemms_run_in_sequence():
    # (1, 64, 8, 64) then (1, 64, 64, 8) on one 4x4 array: 2 x 16 = 32 folds of 2*4 + 4 + 64 - 2 = 74
    # cycles each, 4736 cycles; the softmax (4096 x 8 cycles on 16 lanes = 2048) overlaps.
    single, split = one(flash_fwd(), chip())
    assert single == split == pytest.approx(4736e-9)


def test_fused_attention_softmax_and_hbm_bounds():
    # slow vector core: 4096 scores x 8 cycles on one lane
    assert one(flash_fwd(), chip(vc_width=1))[0] == pytest.approx(4096 * 8e-9)
    # slow HBM: only Q, K, V, O (1 KiB each) and the float32 log-sum-exp (256 B) move, no 64 x 64 scores
    assert one(flash_fwd(), chip(hbm_bw=1e6))[0] == pytest.approx((4 * 1024 + 256) / 1e6)


def test_fused_attention_beats_its_unfused_ops_when_memory_bound():
    acc = chip(hbm_bw=1e8, glb_bytes=2**16)
    b, s, d = 1, 64, 8
    unfused = [gemm(b, s, d, s), vec(b * s * s, ("softmax",), inputs=1), gemm(b, s, s, d)]
    assert sum(one(op, acc)[0] for op in unfused) > one(flash_fwd(b, s, d), acc)[0]


def test_traced_flash_block_is_costed_on_real_designs():
    from phaze_opt.hardware.energy import op_energy
    from phaze_opt.workload.graphs import build_layer_graph
    from phaze_opt.workload.models import load_model

    designs = [load_arch("tpuv4"), load_arch("a100-like")]
    graphs = {a: build_layer_graph(load_model("gpt3-175b"), 8, 1, 512, attention=a, cache=False).op_graphs["block"]
              for a in ("unfused", "flash")}
    for p in ("fwd", "bwd"):
        flash = estimate(graphs["flash"][p], designs)
        i = next(j for j, op in enumerate(graphs["flash"][p].ops) if op.kind == "flash_attention")
        assert np.all(flash.split[:, i] > 0) and np.all(flash.split[:, i] <= flash.single[:, i])
        assert not flash.unknown_vector_ops
        energy = op_energy(graphs["flash"][p], designs)
        op = graphs["flash"][p].ops[i]  # energy reads the MAC-equivalent GEMM: every GEMM's MACs counted
        assert np.all(energy.macs[:, i] == sum(math.prod(g) for g in op.gemms)) and np.all(np.isfinite(energy.compute))
        # the fused kernel moves no s x s tensor: less time than the unfused block's ops, op for op
        assert np.all(flash.split.sum(1) < estimate(graphs["unfused"][p], designs).split.sum(1))
