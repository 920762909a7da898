"""The analytical area model against the published system's Accelergy/CACTI areas."""

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from phaze_opt.errors import PhazeError
from phaze_opt.hardware import area, calibrate
from phaze_opt.hardware.accelerator import Accelerator
from phaze_opt.hardware.arch import load_arch

TPUV4_REFERENCE_MM2 = 278.83  # the largest design of phaze-cores.json, Phaze's budget


@pytest.fixture(scope="module")
def stats():
    return calibrate.calibration()


def test_calibration_median_within_one_percent(stats):
    assert stats["designs"] == 29360
    assert stats["median_abs_rel_err"] <= 0.01


def test_calibration_p95_within_five_percent(stats):
    assert stats["p95_abs_rel_err"] <= 0.05


def test_tpuv4_area_within_two_percent():
    a = area.area_mm2(load_arch("tpuv4"))
    assert abs(a - TPUV4_REFERENCE_MM2) / TPUV4_REFERENCE_MM2 <= 0.02


def test_reference_file_has_tpuv4_as_largest_design():
    ref = calibrate.reference_designs()
    i = int(np.argmax(ref["area_mm2"]))
    assert (ref["num_tc"][i], ref["num_vc"][i], ref["tc_x"][i], ref["tc_y"][i], ref["glb_bytes"][i]) == (8, 2, 128, 128, 2**27)
    assert ref["area_mm2"][i] == pytest.approx(TPUV4_REFERENCE_MM2, abs=0.01)


def test_refit_reproduces_the_shipped_constants():
    """The constants in configs/area.yaml are what the documented fit gives (their provenance)."""
    fitted, fit_stats = calibrate.fit()
    shipped = area.load_constants()
    np.testing.assert_allclose(fitted.as_vector(), shipped.as_vector(), rtol=1e-6, atol=1e-9)
    doc = yaml.safe_load(area.constants_path().read_text())
    assert doc["provenance"]["designs"] == fit_stats["designs"]
    assert doc["provenance"]["median_abs_rel_err"] == pytest.approx(fit_stats["median_abs_rel_err"], abs=1e-6)


def test_constants_are_physical():
    c = area.load_constants()
    for name in area.CONSTANT_FIELDS:
        if name not in area.SIGNED_FIELDS:
            assert getattr(c, name) >= 0, name
    # a PE (MAC + register file) is hundreds of um^2 in the published flow, not mm^2
    assert 100 < c.pe_um2 < 5000


def test_breakdown_sums_to_total():
    for name in ("tpuv4", "a100-like", "h100-like"):
        acc = load_arch(name)
        assert sum(area.breakdown(acc).values()) == pytest.approx(area.area_mm2(acc), rel=1e-12)


designs = st.builds(
    Accelerator,
    num_tc=st.sampled_from([2**i for i in range(13)]), tc_x=st.sampled_from([2**i for i in range(1, 9)]),
    tc_y=st.sampled_from([2**i for i in range(1, 9)]), num_vc=st.sampled_from([2**i for i in range(13)]),
    vc_width=st.sampled_from([2**i for i in range(1, 9)]), glb_bytes=st.sampled_from([2**i for i in range(20, 28)]),
    glb_bw=st.just(1e12), hbm_bytes=st.just(2**35), hbm_bw=st.just(1e12), clock_hz=st.just(1e9),
)


@settings(max_examples=60, deadline=None)
@given(designs, st.sampled_from(["num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_bytes"]))
def test_area_grows_with_every_resource(acc, field):
    from dataclasses import replace

    bigger = replace(acc, **{field: getattr(acc, field) * 2})
    assert area.area_mm2(bigger) > area.area_mm2(acc)


@settings(max_examples=30, deadline=None)
@given(st.lists(designs, min_size=1, max_size=8))
def test_vectorised_form_matches_scalar(accs):
    cols = {f: np.array([getattr(a, f) for a in accs]) for f in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_bytes")}
    vec = area.area_mm2_arrays(**cols)
    np.testing.assert_allclose(vec, [area.area_mm2(a) for a in accs], rtol=1e-12)


def _write_constants(tmp_path, **override):
    c = dict(vars(area.load_constants()), **override)
    p = tmp_path / "area.yaml"
    p.write_text(yaml.safe_dump({"constants": c}))
    return p


def test_negative_constant_is_a_one_line_error(tmp_path):
    p = _write_constants(tmp_path, pe_um2=-1.0)
    with pytest.raises(PhazeError, match=r"constants.pe_um2'.*>= 0") as info:
        area.load_constants(p)
    assert "\n" not in str(info.value)


def test_unknown_constant_is_rejected(tmp_path):
    p = _write_constants(tmp_path, wire_um2=3.0)
    with pytest.raises(PhazeError, match="wire_um2.*unknown field"):
        area.load_constants(p)


def test_missing_constants_file(tmp_path):
    with pytest.raises(PhazeError, match="area constants file not found"):
        area.load_constants(tmp_path / "nope.yaml")
