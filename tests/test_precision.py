"""Precision as a recipe field: BF16 unchanged bit for bit, low-precision GEMMs never slower, the
weight copies in memory, an unsupported format infeasible, the area of extra formats."""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.design.evaluate import evaluate
from phaze_opt.design.space import datatype_set, space_from_mapping
from phaze_opt.errors import PhazeError
from phaze_opt.hardware.accelerator import Accelerator
from phaze_opt.hardware.arch import accelerator_from_mapping, load_arch
from phaze_opt.hardware.area import area_mm2, breakdown
from phaze_opt.hardware.latency import estimate
from phaze_opt.system import load_system
from phaze_opt.solve.placement.types import state_split
from phaze_opt.training import PRECISIONS, Training, recipe_points
from phaze_opt.workload.ops import Op, OpGraph
from phaze_opt.workload.precision import FORMATS, precision_ops

REPO = Path(__file__).resolve().parents[1]

SEQ, HID = 4096, 1024


def block_graph() -> OpGraph:
    """A norm, two linear GEMMs (one with a fused epilogue), an attention product and an all-reduce."""
    ops = (
        Op("ln", "norm", "vc", flops=5 * SEQ * HID, bytes_read=2 * SEQ * HID, bytes_written=2 * SEQ * HID,
           elements=SEQ * HID, vector_ops=("layernorm",)),
        Op("qkv", "gemm", "tc", flops=2 * SEQ * HID * 3072, bytes_read=2 * (SEQ * HID + HID * 3072),
           bytes_written=2 * SEQ * 3072, gemm=(1, SEQ, HID, 3072)),
        Op("fc1", "gemm", "tc+vc", flops=2 * SEQ * HID * 4096 + 10 * SEQ * 4096,
           bytes_read=2 * (SEQ * HID + HID * 4096), bytes_written=2 * SEQ * 4096, gemm=(1, SEQ, HID, 4096),
           elements=SEQ * 4096, vector_ops=("bias", "gelu")),
        Op("ar", "collective", "net", bytes_read=2 * SEQ * HID, collective="allreduce", comm_bytes=2 * SEQ * HID,
           group=4),
    )
    return OpGraph("block", "fwd", ops, ((0, 1), (1, 2), (2, 3)))


# The latencies of `block_graph` as the code computed them before precision existed (the same graph
# estimated by the parent commit of this feature, float.hex of single and split per op).
BEFORE = {
    "h100-like": (['0x1.5a97a26b4b724p-11', '0x1.83356773de49ap-7', '0x1.03f1b9d07895bp-6', '0x1.922ce4f9b8120p-15'],
                  ['0x1.5016eb12b5c42p-18', '0x1.84a8ca386a703p-15', '0x1.031b317af1a02p-14', '0x1.922ce4f9b8120p-15']),
    "h100-sxm": (['0x1.2a2dc2e088207p-10', '0x1.486be2074a1c9p-6', '0x1.b8dcab432eb93p-6', '0x1.922ce4f9b8120p-15'],
                 ['0x1.ab9f9cdf66222p-16', '0x1.bfc4faaf5c766p-15', '0x1.12bec8513be90p-14', '0x1.922ce4f9b8120p-15']),
    "tpuv4": (['0x1.ca213d840baf8p-13', '0x1.ad4e13d2ea859p-11', '0x1.67f58bc32dc0cp-10', '0x1.922ce4f9b8120p-15'],
              ['0x1.ca213d840baf8p-14', '0x1.ad4e13d2ea859p-14', '0x1.67f58bc32dc0cp-11', '0x1.922ce4f9b8120p-15']),
}


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_bf16_latencies_bit_identical_to_before(name):
    lat = estimate(precision_ops(block_graph(), "block", "bf16", 2), [load_arch(name)])
    assert ([float(x).hex() for x in lat.single[0]], [float(x).hex() for x in lat.split[0]]) == BEFORE[name]


def test_bf16_recipe_and_design_keys_unchanged():
    assert "precision" not in Training().recipe()
    assert Training(precision="fp8").recipe()["precision"] == "fp8"
    plain = load_arch("h100-like")
    assert "tc_datatypes" not in plain.fields() and len(plain.compute_key) == 9
    # supporting FP8 leaves a BF16 graph's latencies as they were
    fp8_chip = dataclasses.replace(plain, tc_datatypes={"bf16": 1, "fp8": 2})
    a, b = estimate(block_graph(), [plain]), estimate(block_graph(), [fp8_chip])
    assert (a.single == b.single).all() and (a.split == b.split).all()


designs = st.builds(
    lambda n, tx, ty, glb, bw, rate: Accelerator(
        num_tc=n, tc_x=tx, tc_y=ty, num_vc=n, vc_width=tx, glb_bytes=glb * 2**20, glb_bw=bw * 1e9,
        hbm_bytes=2**34, hbm_bw=bw * 1e9 / 4, clock_hz=1e9, tc_datatypes={"bf16": 1, "fp8": rate, "mxfp8": rate}),
    st.sampled_from([1, 4, 16, 128]), st.sampled_from([8, 32, 128]), st.sampled_from([8, 32, 128]),
    st.sampled_from([1, 8, 64]), st.sampled_from([100, 1000, 10000]), st.sampled_from([1.0, 2.0, 4.0]))
gemms = st.tuples(st.sampled_from([1, 3]), st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 5000))


@settings(max_examples=150, deadline=None)
@given(design=designs, shape=gemms, fused=st.booleans(), fmt=st.sampled_from(["fp8", "mxfp8"]))
def test_low_precision_gemm_never_slower(design, shape, fused, fmt):
    b, m, k, n = shape
    op = Op("mm", "gemm", "tc+vc" if fused else "tc", flops=2 * b * m * k * n + (b * m * n if fused else 0),
            bytes_read=2 * b * (m * k + k * n), bytes_written=2 * b * m * n, gemm=shape,
            elements=b * m * n if fused else 0, vector_ops=("bias",) if fused else ())
    graph = OpGraph("block", "fwd", (op,), ())
    low = precision_ops(graph, "block", fmt, 2)
    assert [o.unit for o in low.ops] == ["vc", op.unit] and low.edges == ((0, 1),)
    assert low.ops[1].datatype == fmt and low.ops[0].bytes_written == pytest.approx(b * m * k * FORMATS[fmt].operand_bytes)
    bf16, fp8 = estimate(graph, [design]), estimate(low, [design])
    assert fp8.single[0, 1] <= bf16.single[0, 0] and fp8.split[0, 1] <= bf16.split[0, 0]


def test_twice_the_rate_halves_a_compute_bound_gemm():
    chip = load_arch("h100-sxm")
    graph = OpGraph("block", "fwd", (Op("mm", "gemm", "tc", flops=2 * 8192**3, bytes_read=2 * 2 * 8192**2,
                                        bytes_written=2 * 8192**2, gemm=(1, 8192, 8192, 8192)),), ())
    bf16 = estimate(graph, [chip]).split[0, 0] - chip.efficiency.op_overhead_s
    fp8 = estimate(precision_ops(graph, "block", "fp8", 2), [chip]).split[0, 1] - chip.efficiency.op_overhead_s
    # twice the MACs per cycle, at the share of it that the measured FP8 kernels keep
    assert chip.efficiency.low_precision_fraction < 1
    assert fp8 == pytest.approx(bf16 / (2 * chip.efficiency.low_precision_fraction), rel=0.02)
    bare = replace(chip, efficiency=replace(chip.efficiency, low_precision_fraction=1.0))
    bare_fp8 = estimate(precision_ops(graph, "block", "fp8", 2), [bare]).split[0, 1] - chip.efficiency.op_overhead_s
    assert bare_fp8 == pytest.approx(bf16 / 2, rel=0.02)


def test_h100_low_precision_fraction_is_the_measured_fp8_speed_up():
    """The preset's value is the GEMM measurements' median FP8/BF16 speed-up over the nominal 2x."""
    data = json.loads((REPO / "phaze_opt/presets/validation/truth/h100-fp8-gemms-2026.json").read_text())
    speedups = sorted(g["bf16_s"] / g["fp8_s"] for g in data["gemm"])
    assert len(speedups) == 12 and "H100" in data["device"]
    assert load_arch("h100-sxm").efficiency.low_precision_fraction == pytest.approx(
        statistics.median(speedups) / 2, abs=0.005)


def test_which_gemms_run_low():
    attention = Op("bmm", "bgemm", "tc", flops=2.0, gemm=(1, 1, 1, 1), bytes_read=4, bytes_written=2)
    linear = Op("mm", "gemm", "tc", flops=2.0, gemm=(1, 1, 1, 1), bytes_read=4, bytes_written=2)
    graph = OpGraph("block", "fwd", (attention, linear), ((0, 1),))
    block = precision_ops(graph, "block", "fp8", 2)
    assert [o.datatype for o in block.ops] == ["", "", "fp8"]  # the attention product stays BF16; a cast joins
    head = precision_ops(dataclasses.replace(graph, layer="head"), "head", "fp8", 2)
    assert head is not graph and [o.datatype for o in head.ops] == ["", ""]  # Megatron's output layer: BF16


def _problem(training, accelerators=1):
    from test_placement_oracle import make_costs, make_system

    from phaze_opt.solve.placement.types import PlacementProblem

    costs = make_costs(1, [1.0] * 4, [2.0] * 4, [1000, 5000, 5000, 3000], [10.0] * 4, [5.0] * 4)
    return PlacementProblem(costs=(costs,), system=make_system(accelerators=accelerators, global_batch=4),
                            hbm_bytes=1e9, peak_flops=1e12, training=training)


# Bytes per parameter of the copies Transformer Engine keeps (workload/precision.py): FP8 a row-wise
# copy and Hopper's transposed column-wise one; MXFP8 row- and column-wise blocks; NVFP4 half-byte
# elements, each direction (scale bytes left out).
COPY_BYTES = {"fp8": 2, "mxfp8": 2, "nvfp4": 1}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("fmt", [p for p in PRECISIONS if p != "bf16"])
def test_weight_copies_in_memory(fmt, zero):
    """The copies are not optimizer state: under ZeRO 0, 1 and 2 each of the d = 4 data-parallel ranks
    holds all of its stage's copies (Megatron-Core's distributed optimizer shards only the optimizer
    state); under ZeRO-3 they are made from the gathered weight and sit in the layer's working set."""
    from phaze_opt.solve.placement.dp import even_placement
    from phaze_opt.solve.placement.evaluate import evaluate_placement
    from phaze_opt.solve.placement.types import weight_copies

    base = _problem(Training(mbs=1, zero=zero), accelerators=4)
    low = dataclasses.replace(base, training=Training(mbs=1, zero=zero, precision=fmt))
    assert state_split(low) == state_split(base)  # the optimizer's own bytes are unchanged
    assert weight_copies(low) == FORMATS[fmt].weight_copy_bytes == COPY_BYTES[fmt] and weight_copies(base) == 0
    t = base.tp_widths[0]
    a = evaluate_placement(base, even_placement(base, t, 1, 4))
    b = evaluate_placement(low, even_placement(low, t, 1, 4))
    params = float(sum(base.costs_at(t, 1).params))
    extra = b.stages[0].memory_bytes - a.stages[0].memory_bytes
    if zero < 3:
        assert extra == pytest.approx(params * COPY_BYTES[fmt])  # whole, not params x copies / 4
        assert b.stages[0].memory_split["low_precision_weights"] == pytest.approx(params * COPY_BYTES[fmt])
    else:  # the largest layer's copies, beside its gathered weight
        assert extra == pytest.approx(5000 * COPY_BYTES[fmt])
    assert "low_precision_weights" not in a.stages[0].memory_split  # BF16 reports as before


def test_unsupported_format_is_infeasible_with_reason():
    r = evaluate("megatron-gpt-1.7b", load_arch("tpuv4"), Training(precision="fp8"), "default")
    assert not r.feasible and "fp8" in r.reason and "bf16" in r.reason and r.throughput == 0.0 and r.area_mm2 > 0
    r = evaluate("megatron-gpt-1.7b", load_arch("h100-sxm"), Training(precision="nvfp4"), "dgx-h100")
    assert not r.feasible and "support bf16, fp8" in r.reason


@settings(max_examples=60, deadline=None)
@given(n=st.sampled_from([1, 8, 132]), tx=st.sampled_from([16, 64, 128]), ty=st.sampled_from([16, 32, 128]),
       rate=st.sampled_from([1.0, 2.0, 4.0]))
def test_area_grows_with_datatype_support(n, tx, ty, rate):
    base = Accelerator(n, tx, ty, n, tx, 2**25, 1e12, 2**34, 1e12, 1e9)
    sets = [{"bf16": 1}, {"bf16": 1, "fp8": rate}, {"bf16": 1, "fp8": rate, "mxfp8": rate},
            {"bf16": 1, "fp8": rate, "mxfp8": rate, "nvfp4": 2 * rate}]
    areas = [area_mm2(dataclasses.replace(base, tc_datatypes=s)) for s in sets]
    assert all(x < y for x, y in zip(areas, areas[1:]))
    faster = area_mm2(dataclasses.replace(base, tc_datatypes={"bf16": 1, "fp8": 2 * rate}))
    assert faster > areas[1]  # a higher rate costs more datapath
    parts = breakdown(dataclasses.replace(base, tc_datatypes=sets[-1]))
    assert sum(parts.values()) == pytest.approx(areas[-1])


def test_arch_file_datatypes_checked():
    good = dict(num_tc=4, tc_x=8, tc_y=8, num_vc=4, vc_width=8, glb_mib=8, hbm_gib=80, clock_ghz=1)
    assert accelerator_from_mapping({**good, "tc_datatypes": {"bf16": 1, "fp8": 2}}, "x.yaml").mac_rate("fp8") == 2
    for bad, field in (({"bf16": 1, "fp9": 2}, "tc_datatypes.fp9"), ({"fp8": 2}, "tc_datatypes.bf16"),
                       ({"bf16": 1, "fp8": -1}, "tc_datatypes.fp8"), ([1, 2], "tc_datatypes")):
        with pytest.raises(PhazeError) as exc:
            accelerator_from_mapping({**good, "tc_datatypes": bad}, "x.yaml")
        assert field in str(exc.value) and "x.yaml" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(PhazeError, match="precision must be one of"):
        Training(precision="fp16")
    assert load_arch("h100-sxm").mac_rate("fp8") == 2.0


SPACE = {
    "params": {"num_tc": [4, 8], "num_vc": [2], "tc_x": [128], "tc_y": [128], "glb_mib": [32], "hbm_gib": [80],
               "tc_datatypes": ["bf16", "bf16+fp8"], "mbs": [1], "recompute": [False], "precision": ["bf16", "fp8"]},
    "fixed": {"clock_ghz": 1.05}, "tied": {"vc_width": "tc_x"}, "hbm_bw_gbps": {80: 2048},
    "area": {"budget": 1000.0, "min_fraction": 0.0},
}


def test_space_samples_the_datatype_set():
    space = space_from_mapping(SPACE, "s.yaml")
    archs = space.architectures(order="grid")
    assert len(archs) == 4 and {a["tc_datatypes"] for a in archs} == {"bf16", "bf16+fp8"}
    for point in space.grid_points():
        acc = space.accelerator(point)
        assert acc.tc_datatypes == datatype_set(point["tc_datatypes"])
        assert space.area_check(point)[1] == pytest.approx(area_mm2(acc))  # the grid's area is the design's
    by = {(a["num_tc"], a["tc_datatypes"]): a["area_mm2"] for a in archs}
    assert by[(8, "bf16+fp8")] > by[(8, "bf16")]
    assert {p["precision"] for p in recipe_points(space.params)} == {"bf16", "fp8"}
    with pytest.raises(PhazeError, match="tc_datatypes"):
        space_from_mapping({**SPACE, "params": {**SPACE["params"], "tc_datatypes": ["fp8"]}}, "s.yaml")



def test_bound_pruning_is_not_used_on_a_low_precision_space():
    from phaze_opt.search.config import StudyConfig
    from phaze_opt.search.setup import resolve_strategy

    space = space_from_mapping(SPACE, "s.yaml")
    backend = type("B", (), {"evaluator": None, "space": space})()
    config = StudyConfig(models=("megatron-gpt-1.7b",), strategy="auto")
    assert resolve_strategy(config, backend) == "grid"
    with pytest.raises(PhazeError, match="BF16 GEMMs"):
        resolve_strategy(dataclasses.replace(config, strategy="branch-and-bound"), backend)
    bf16 = space_from_mapping({**SPACE, "params": {**SPACE["params"], "precision": ["bf16"]}}, "s.yaml")
    assert resolve_strategy(config, type("B", (), {"evaluator": None, "space": bf16})()) == "branch-and-bound"


def test_moe_experts_run_low_and_never_slower(tmp_path, monkeypatch):
    """The routed experts' grouped GEMMs run in the format (TE's GroupedLinear), in the layer times
    and in the expert-parallel terms alike."""
    from test_moe_design import TINY, small_system

    from phaze_opt.design.evaluate import training_problem
    from phaze_opt.workload.graphs import build_layer_graph
    from phaze_opt.workload.models import parse_model
    from phaze_opt.workload.precision import precision_graph

    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path))
    model = parse_model(dict(TINY, seq=1024), "tiny.yaml")
    graph = precision_graph(build_layer_graph(model, 1, 1), "fp8")
    experts = [op for passes in graph.op_graphs.values() for og in passes.values() for op in og.ops
               if op.kind == "grouped_gemm"]
    assert experts and all(op.datatype == "fp8" for op in experts)
    arch, system = load_arch("h100-sxm"), small_system()
    bf16 = training_problem(model, arch, Training(1), system, (1,), 2.0)[2]
    fp8 = training_problem(model, arch, Training(1, precision="fp8"), system, (1,), 2.0)[2]
    for a, b in zip(bf16.costs, fp8.costs):
        assert (b.expert_fwd_s <= a.expert_fwd_s).all() and (b.expert_bwd_s <= a.expert_bwd_s).all()
        assert (b.expert_fwd_s < a.expert_fwd_s).any()


def test_evaluate_prints_the_weight_copies_in_the_memory_line():
    """The memory line's parts add up to its total: the copies are printed when a recipe has them."""
    from phaze_opt.commands.evaluate import render

    gib = 2.0**30
    mem = {"stage": 0, "parameters": 2 * gib, "gradients": 2 * gib, "optimizer_state": 3 * gib,
           "activations": 4 * gib, "recompute_working_set": 0.0, "total": 13 * gib, "headroom": 67 * gib}
    r = {"model": "m", "arch": "a", "mbs": 1, "recompute": "none", "area_mm2": 1.0, "feasible": False,
         "reason": "x", "timings": {"graph_s": 0, "estimate_s": 0, "ilp_s": 0, "dp_s": 0}}
    assert "weight copies" not in render(dict(r, memory_per_device=mem))  # BF16: as before
    line = render(dict(r, memory_per_device=dict(mem, low_precision_weights=2 * gib))).splitlines()[1]
    assert "optimizer state 3.00, low-precision weight copies 2.00, activations 4.00" in line


def test_a_chip_reading_fp8_column_wise_keeps_one_weight_copy(monkeypatch, tmp_path):
    """Blackwell's tensor cores read a per-tensor FP8 operand in either major order, so Transformer
    Engine keeps one FP8 copy of a weight, not Hopper's row-wise + transposed pair; MXFP8 and NVFP4
    keep both directions (their scales run one way) on any chip. Checked from the arch file to the
    evaluated memory: the same design with and without the capability differs by 1 B per parameter
    held, in the weight copies only."""
    from phaze_opt.solve.placement.dp import even_placement
    from phaze_opt.solve.placement.evaluate import evaluate_placement
    from phaze_opt.solve.placement.types import weight_copies
    from phaze_opt.workload.precision import weight_copy_bytes

    assert load_arch("b200").tc_fp8_any_layout and not load_arch("h100-sxm").tc_fp8_any_layout
    assert "tc_fp8_any_layout" not in load_arch("h100-sxm").fields()  # earlier mappings unchanged
    assert [weight_copy_bytes(f, False) for f in ("bf16", "fp8", "mxfp8", "nvfp4")] == [0, 1, 2, 1]
    assert [weight_copy_bytes(f) for f in ("bf16", "fp8", "mxfp8", "nvfp4")] == [0, 2, 2, 1]
    for fmt in ("fp8", "mxfp8"):
        hopper = _problem(Training(mbs=1, zero=1, precision=fmt), accelerators=4)
        blackwell = dataclasses.replace(hopper, fp8_transposed_copy=False)
        t = hopper.tp_widths[0]
        a = evaluate_placement(hopper, even_placement(hopper, t, 1, 4)).stages[0]
        b = evaluate_placement(blackwell, even_placement(blackwell, t, 1, 4)).stages[0]
        params = float(sum(hopper.costs_at(t, 1).params))
        saved = params * (COPY_BYTES[fmt] - weight_copies(blackwell))
        assert a.memory_bytes - b.memory_bytes == pytest.approx(saved)
        assert saved == (params if fmt == "fp8" else 0.0)
    good = dict(num_tc=4, tc_x=8, tc_y=8, num_vc=4, vc_width=8, glb_mib=8, hbm_gib=80, clock_ghz=1)
    assert accelerator_from_mapping({**good, "tc_fp8_any_layout": True}, "x.yaml").tc_fp8_any_layout
    with pytest.raises(PhazeError) as exc:
        accelerator_from_mapping({**good, "tc_fp8_any_layout": "yes"}, "x.yaml")
    assert "x.yaml" in str(exc.value) and "tc_fp8_any_layout" in str(exc.value) and "\n" not in str(exc.value)
    # The evaluator takes the capability from the arch: a tiny dense model on a small B200-like chip.
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path / "cache"))
    model = tiny_llama()
    chip = dataclasses.replace(load_arch("b200"), num_tc=2, num_vc=2)
    system = dataclasses.replace(load_system("dgx-b200"), accelerators=2, global_batch=4)
    recipe = Training(1, placement="tp=1,pp=1,dp=2", precision="fp8", zero=1)
    one, two = (evaluate(model, c, recipe, system, 10.0) for c in (chip, dataclasses.replace(chip, tc_fp8_any_layout=False)))
    assert one.feasible and two.feasible
    (s1,), (s2,) = one.placement["stages"], two.placement["stages"]
    k1, k2 = s1["memory_split"]["low_precision_weights"], s2["memory_split"]["low_precision_weights"]
    assert k2 == pytest.approx(2 * k1) and k1 > 0 and s2["memory_bytes"] - s1["memory_bytes"] == pytest.approx(k1)
    assert one.time_per_batch_s == pytest.approx(two.time_per_batch_s)  # memory only


@pytest.mark.parametrize("transposed", [True, False])
def test_parameters_held_in_fp8_drop_the_bf16_weight_and_halve_the_gather(transposed):
    """`fp8_param_gather` (Megatron-Core --fp8-param-gather, as Megatron-Bridge's FP8 recipes set it):
    the FP8 weight is the parameter, so each rank drops the 2-byte BF16 weight and keeps 1 byte
    (the row-wise copy it already had becomes the parameter): 2 B per parameter fewer on Hopper and
    Blackwell alike; gradients and the optimizer's sharded state are unchanged; the distributed
    optimizer's all-gather moves 1-byte weights, so the exposed per-batch tail shrinks."""
    from phaze_opt.solve.placement.dp import even_placement
    from phaze_opt.solve.placement.evaluate import evaluate_placement
    from phaze_opt.solve.placement.types import weight_copies

    plain = dataclasses.replace(_problem(Training(mbs=1, zero=1, precision="fp8"), accelerators=4),
                                fp8_transposed_copy=transposed)
    held = dataclasses.replace(plain, training=Training(mbs=1, zero=1, precision="fp8", fp8_param_gather=True))
    assert state_split(held)[1:] == state_split(plain)[1:] and state_split(held)[0] == 1
    assert weight_copies(held) == weight_copies(plain) - 1
    t = plain.tp_widths[0]
    a = evaluate_placement(plain, even_placement(plain, t, 1, 4))
    b = evaluate_placement(held, even_placement(held, t, 1, 4))
    params = float(sum(plain.costs_at(t, 1).params))
    assert a.stages[0].memory_bytes - b.stages[0].memory_bytes == pytest.approx(2 * params)
    assert b.time_per_batch_s < a.time_per_batch_s  # the 1-byte all-gather
    for bad in ("bf16", "nvfp4"):
        with pytest.raises(PhazeError, match="fp8_param_gather needs precision fp8 or mxfp8"):
            Training(precision=bad, fp8_param_gather=True)
    assert Training(precision="fp8", fp8_param_gather=True).recipe()["fp8_param_gather"] is True
    assert "fp8_param_gather" not in Training(precision="fp8").recipe()  # earlier recipes unchanged


def tiny_llama(layers: int = 2, hidden: int = 128, ffn: int = 256, seq: int = 256):
    """A Llama-shaped model small enough to schedule exactly in a test."""
    from phaze_opt.workload.models import parse_model

    return parse_model(dict(name="tiny", family="llama", layers=layers, hidden=hidden, heads=4, kv_heads=2, ffn=ffn,
                            seq=seq, vocab=512, activation="swiglu", norm="rmsnorm", position="rotary",
                            tied_embeddings=False, bias=False, dropout=0.0, attention="flash"), "tiny.yaml")
