"""Search spaces: the published design set, the area rule, the grid, and config validation."""

import itertools
import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.errors import PhazeError
from phaze_opt.hardware import area, calibrate
from phaze_opt.hardware.arch import load_arch
from phaze_opt.design.space import load_space, space_from_mapping


@pytest.fixture(scope="module")
def phaze():
    return load_space("phaze")


@pytest.fixture(scope="module")
def small():
    return load_space("small")


def _key(d):
    return (d["num_tc"], d["num_vc"], d["tc_x"], d["tc_y"], d["glb_mib"])


def test_phaze_space_reproduces_the_published_design_set(phaze):
    ref = calibrate.reference_rows()
    assert all(r["width_vc"] == r["width"] for r in ref)  # the tie the space encodes
    published = {(r["num_tc"], r["num_vc"], r["width"], r["depth"], r["GLB_Buffer"] // 2**20) for r in ref}
    ours = {_key(a) for a in phaze.architectures()}
    both = len(published & ours)
    assert len(published) == 29360
    assert both / len(published) >= 0.995  # published designs we keep
    assert both / len(ours) >= 0.995  # our designs the published set has


def test_phaze_space_counts(phaze):
    assert phaze.count() == len(phaze.architectures())
    assert phaze.size() == phaze.count() * 3 * 4 * 2  # x hbm x mbs x recompute
    assert list(phaze.params) == ["num_tc", "num_vc", "tc_x", "tc_y", "glb_mib", "hbm_gib", "mbs", "recompute"]
    assert phaze.params["mbs"] == [1, 2, 4, 8] and phaze.params["recompute"] == [False, True]


def test_budget_is_tpuv4_and_tpuv4_fits_exactly(phaze):
    assert phaze.area_budget_mm2 == pytest.approx(area.area_mm2(load_arch("tpuv4")))
    ok, a, reason = phaze.area_check(phaze.reference_point("tpuv4"))
    assert ok and reason == "" and a == pytest.approx(phaze.area_budget_mm2)


def test_area_check_reasons(phaze):
    ref = phaze.reference_point("tpuv4")
    ok, a, reason = phaze.area_check(dict(ref, num_tc=16))
    assert not ok and a > phaze.area_budget_mm2
    assert reason == f"area {a:.1f} mm^2 exceeds the {phaze.area_budget_mm2:.1f} mm^2 budget (tpuv4)"
    ok, a, reason = phaze.area_check(dict(ref, num_tc=2, tc_x=8, tc_y=8, glb_mib=2))
    assert not ok and a < 0.3 * phaze.area_budget_mm2
    assert reason.startswith(f"area {a:.1f} mm^2 is below the {0.3 * phaze.area_budget_mm2:.1f} mm^2 floor (0.3 of the ")
    assert reason.count("area") == 1
    # the same small design with one vector core is kept: the floor is waived
    ok, _, reason = phaze.area_check(dict(ref, num_tc=2, tc_x=8, tc_y=8, glb_mib=2, num_vc=1))
    assert ok, reason


def test_reference_point_builds_tpuv4(phaze):
    point = phaze.reference_point("tpuv4", recipe={"mbs": 4, "recompute": True})
    assert point["mbs"] == 4 and point["recompute"] is True
    built, tpu = phaze.accelerator(point), load_arch("tpuv4")
    for f in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_bytes", "glb_bw", "hbm_bytes", "hbm_bw", "clock_hz"):
        assert getattr(built, f) == pytest.approx(getattr(tpu, f)), f


def test_reference_point_of_an_inexpressible_arch_is_a_one_line_error(phaze):
    with pytest.raises(PhazeError, match="cannot express arch 'a100-like': clock_ghz is fixed at 1.05") as info:
        phaze.reference_point("a100-like")
    assert "\n" not in str(info.value)


def test_small_space_size_and_consistency(small):
    points = small.grid_points()
    assert 100 <= len(points) <= 300
    assert len(points) == small.size()
    for p in points:
        ok, _, reason = small.area_check(p)
        assert ok, reason


def test_grid_points_are_exactly_the_feasible_product(small):
    """Oracle: walk the full product by hand, keep what area_check accepts."""
    names = list(small.params)
    expected = [dict(zip(names, vals)) for vals in itertools.product(*small.params.values())
                if small.area_check(dict(zip(names, vals)))[0]]
    assert small.grid_points(order="grid") == expected


def test_area_order_is_decreasing_and_a_permutation(small):
    by_area = small.grid_points(order="area")
    areas = [small.area_check(p)[1] for p in by_area]
    assert all(a >= b for a, b in zip(areas, areas[1:]))
    key = lambda p: tuple(p.values())  # noqa: E731
    assert sorted(map(key, by_area)) == sorted(map(key, small.grid_points(order="grid")))


def test_bad_order_is_rejected(small):
    with pytest.raises(ValueError):
        small.grid_points(order="random")


@pytest.fixture(scope="module")
def phaze_keys(phaze):
    return {_key(a) for a in phaze.architectures()}


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_phaze_membership_matches_area_check(phaze, phaze_keys, data):
    """The vectorised grid filter and the one-point check agree."""
    point = {n: data.draw(st.sampled_from(c), label=n) for n, c in phaze.params.items()}
    ok, _, _ = phaze.area_check(point)
    assert ok == (_key(point) in phaze_keys)


def test_accelerator_derives_bandwidths(phaze):
    p = dict(phaze.reference_point("tpuv4"), hbm_gib=80, num_tc=1, tc_x=4, tc_y=8)
    acc = phaze.accelerator(p)
    assert acc.hbm_bw == 2048e9 and acc.hbm_bytes == 80 * 2**30
    assert acc.vc_width == 4  # tied to tc_x
    # more than one vector core: the full 4096 words/cycle of the published rule
    assert acc.glb_bw == pytest.approx(4096 * 2 * 1.05e9)
    single = phaze.accelerator(dict(p, num_vc=1))
    assert single.glb_bw == pytest.approx(16 * 8 * 2 * 1.05e9)  # 16 words per edge PE, edge = max(4, 8)


# ---- validation: one-line errors naming the file and the field ----------------------------------

BASE = {
    "name": "t",
    "params": {"num_tc": [4, 8], "num_vc": [2], "tc_x": [128], "tc_y": [128], "glb_mib": [128],
               "hbm_gib": [32], "mbs": [1], "recompute": [False]},
    "tied": {"vc_width": "tc_x"},
    "fixed": {"clock_ghz": 1.05},
    "area": {"budget": "tpuv4", "min_fraction": 0.3, "floor_exempt_if_one": ["num_tc", "num_vc"]},
}


def _with(**changes):
    data = json.loads(json.dumps(BASE))
    for path, value in changes.items():
        node = data
        *parents, last = path.split("__")
        for p in parents:
            node = node[p]
        if value is None:
            node.pop(last)
        else:
            node[last] = value
    return data


@pytest.mark.parametrize("changes, pattern", [
    ({"params__colour": [1]}, r"params.colour'.*unknown parameter"),
    ({"params__num_tc": []}, r"params.num_tc'.*no choices"),
    ({"params__tc_x": [3, 4]}, r"params.tc_x'.*powers of two, got 3"),
    ({"params__tc_x": {"pow2": [3, 64]}}, r"params.tc_x'.*pow2 needs"),
    ({"params__mbs": [1, 1]}, r"params.mbs'.*repeats"),
    ({"params__mbs": [0]}, r"params.mbs'.*positive"),
    ({"params__recompute": ["yes"]}, r"params.recompute'.*true or false"),
    ({"params__zero": [4]}, r"params.zero'.*zero must be one of 0, 1, 2, 3"),
    ({"params__virtual_stages": [65]}, r"params.virtual_stages'.*at most 64"),
    ({"params__attention": ["paged"]}, r"params.attention'.*unfused, flash"),
    ({"params__sequence_parallel": ["on"]}, r"params.sequence_parallel'.*true or false"),
    ({"params__glb_mib": "big"}, r"params.glb_mib'.*list of choices"),
    ({"params__mbs": None}, r"params.mbs'.*missing"),
    ({"tied": {}}, r"field 'vc_width'.*not given"),
    ({"fixed__tc_x": 64}, r"field 'tc_x'.*more than one"),
    ({"tied__vc_width": "colour"}, r"tied.vc_width'.*sampled accelerator parameter"),
    ({"fixed__clock_ghz": -1}, r"fixed.clock_ghz'.*positive"),
    ({"params__hbm_gib": [48]}, r"hbm_bw_gbps'.*no bandwidth for hbm_gib 48"),
    ({"area__budget": "nosuchchip"}, r"area.budget'.*not a reference design"),
    ({"area__budget": -5}, r"area.budget'.*positive number"),
    ({"area__min_fraction": 1.5}, r"area.min_fraction'.*\[0, 1\)"),
    ({"area__floor_exempt_if_one": ["tc_x"]}, r"floor_exempt_if_one'.*num_tc, num_vc"),
    ({"area__budget": 10.0}, r"field 'area'.*space is empty"),
    ({"extra": 1}, r"field 'extra'.*unknown field"),
])
def test_space_validation(changes, pattern):
    with pytest.raises(PhazeError, match=pattern) as info:
        space_from_mapping(_with(**changes), "my.yaml")
    msg = str(info.value)
    assert msg.startswith("my.yaml") and "\n" not in msg


def test_user_space_file_with_numeric_budget_and_ranges(tmp_path):
    data = _with(params__num_tc={"pow2": [1, 16]}, params__mbs={"range": [1, 3]}, params__glb_mib=[32, 64],
                 area__budget=150.0)
    f = tmp_path / "mine.yaml"
    f.write_text(yaml.safe_dump(data))
    s = load_space(str(f))
    assert s.params["num_tc"] == [1, 2, 4, 8, 16] and s.params["mbs"] == [1, 2, 3]
    assert s.area_budget_mm2 == 150.0 and s.count() > 0
    assert all(s.area_check(p)[1] <= 150.0 for p in s.grid_points())


def test_unknown_space_name_lists_choices():
    with pytest.raises(PhazeError, match="unknown space 'nope'; choose one of .*phaze.*small"):
        load_space("nope")


@pytest.mark.parametrize("space", ["small", "base", "base-fixed-glb-bw", "base-two-hbm"])
def test_constant_arch_fields_are_exactly_the_fields_no_point_changes(small, space):
    """Oracle: over every point of the full product (area rule aside), the fields the definition calls
    constant never change, and every other field that never changes is the GLB bandwidth, whose
    published rule may give one value for different cores (the definition cannot promise that)."""
    changes = {"base": {}, "base-fixed-glb-bw": {"glb_bw_gbps": 8601.6},
               "base-two-hbm": {"params__hbm_gib": [32, 80], "hbm_bw_gbps": {32: 1200, 80: 2048}}}
    s = small if space == "small" else space_from_mapping(_with(**changes[space]), "t.yaml")
    names = list(s.params)
    seen: dict = {}
    for vals in itertools.product(*s.params.values()):
        for k, v in s.accelerator(dict(zip(names, vals))).fields().items():
            seen.setdefault(k, set()).add(v)
    observed = {k: next(iter(v)) for k, v in seen.items() if len(v) == 1}
    declared = s.constant_arch_fields()
    assert declared.items() <= observed.items() and set(observed) - set(declared) <= {"glb_bw"}
    assert ("glb_bw" in declared) == (space == "base-fixed-glb-bw")
    assert "clock_hz" in declared and "num_tc" not in declared and "name" not in declared
