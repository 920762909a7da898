"""Reference architectures, the derived memory rules, and `phaze-opt arch`."""

import csv
import io
import json

import pytest
import yaml

from phaze_opt import cli
from phaze_opt.configs import shipped_dir
from phaze_opt.errors import PhazeError
from phaze_opt.hardware import memory
from phaze_opt.hardware.arch import accelerator_from_mapping, load_arch
from phaze_opt.hardware.area import area_mm2


@pytest.mark.parametrize("name, peak_tflops, hbm_gib, hbm_tbps", [
    ("tpuv4", 275, 32, 1.2),  # Jouppi et al., ISCA 2023: 275 TFLOP/s bf16, 32 GiB HBM2 at 1.2 TB/s
    ("a100-like", 312, 40, 1.555),  # A100 whitepaper: 312 TFLOP/s dense bf16, 40 GB HBM2 at 1555 GB/s
    ("h100-like", 989, 80, 3.35),  # H100 SXM5: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s
])
def test_reference_designs_match_their_datasheets(name, peak_tflops, hbm_gib, hbm_tbps):
    acc = load_arch(name)
    assert acc.name == name
    assert acc.peak_flops / 1e12 == pytest.approx(peak_tflops, rel=0.005)
    assert acc.hbm_bytes == hbm_gib * 2**30
    assert acc.hbm_bw == pytest.approx(hbm_tbps * 1e12)


def test_tpuv4_fields():
    acc = load_arch("tpuv4")
    assert (acc.num_tc, acc.tc_x, acc.tc_y, acc.num_vc, acc.vc_width) == (8, 128, 128, 2, 128)
    assert acc.glb_bytes == 128 * 2**20 and acc.clock_hz == 1.05e9
    assert acc.glb_bw == pytest.approx(4096 * 2 * 1.05e9)  # the published rule, not given in the file
    assert acc.l2_tc_bytes == 256 * 1024  # 16 B per PE
    assert acc.l2_vc_bytes == 2048


def test_memory_rules_by_hand():
    assert memory.l2_bytes(4) == 1024 and memory.l2_bytes(128 * 128) == 262144
    # one core: 16 words per PE of the longer array edge, at least 4, at most 4096
    assert memory.glb_bandwidth(1, 2, 2, 1, 2, 1e9) == pytest.approx(32 * 2 * 1e9)
    assert memory.glb_bandwidth(1, 256, 2, 1, 2, 1e9) == pytest.approx(4096 * 2 * 1e9)
    assert memory.glb_bandwidth(2, 2, 2, 1, 2, 1e9) == pytest.approx(4096 * 2 * 1e9)
    assert memory.hbm_bandwidth(64) == 1638.4e9
    with pytest.raises(KeyError, match="known"):
        memory.hbm_bandwidth(48)


GOOD = {"num_tc": 4, "tc_x": 64, "tc_y": 64, "num_vc": 4, "vc_width": 64, "glb_mib": 32, "hbm_gib": 32,
        "clock_ghz": 1.0}


@pytest.mark.parametrize("change, pattern", [
    ({"num_tc": 0}, r"field 'num_tc': must be a positive integer"),
    ({"tc_x": 2.5}, r"field 'tc_x': must be a positive integer"),
    ({"glb_mib": "big"}, r"field 'glb_mib': must be a positive number"),
    ({"colour": "red"}, r"field 'colour': unknown field"),
    ({"hbm_gib": 48}, r"field 'hbm_bw_gbps': required when hbm_gib"),
    ({"name": 3}, r"field 'name': must be a string"),
])
def test_arch_validation(change, pattern):
    with pytest.raises(PhazeError, match=pattern) as info:
        accelerator_from_mapping({**GOOD, **change}, "mine.yaml")
    assert str(info.value).startswith("mine.yaml") and "\n" not in str(info.value)


def test_missing_field():
    data = dict(GOOD)
    data.pop("clock_ghz")
    with pytest.raises(PhazeError, match="field 'clock_ghz': missing required field"):
        accelerator_from_mapping(data, "mine.yaml")


def test_user_arch_file(tmp_path):
    f = tmp_path / "mychip.yaml"
    f.write_text(yaml.safe_dump({**GOOD, "hbm_gib": 48, "hbm_bw_gbps": 1500, "glb_bw_gbps": 2000}))
    acc = load_arch(str(f))
    assert acc.name == "mychip" and acc.hbm_bw == 1.5e12 and acc.glb_bw == 2e12 and acc.hbm_bytes == 48 * 2**30


# ---- CLI ------------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def only_arch_command(monkeypatch):
    """The real dispatcher, with only this subcommand loaded (others may be mid-development)."""
    monkeypatch.setattr(cli, "COMMANDS", ("arch",))


def run_cli(capsys, *argv):
    code = cli.main(["arch", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_arch_json(capsys):
    code, out, _ = run_cli(capsys, "--arch", "tpuv4", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["area_mm2"] == pytest.approx(area_mm2(load_arch("tpuv4")))
    assert data["peak_flops"] == pytest.approx(275.2512e12)
    for field in ("num_tc", "tc_x", "tc_y", "num_vc", "vc_width", "glb_bytes", "glb_bw", "hbm_bytes", "hbm_bw", "clock_hz"):
        assert field in data


def test_cli_arch_text(capsys):
    code, out, _ = run_cli(capsys, "--arch", "a100-like")
    assert code == 0 and "mm^2" in out and "TFLOP/s" in out


def test_cli_space_count(capsys):
    code, out, _ = run_cli(capsys, "--space", "small", "--count")
    assert code == 0 and out.strip() == "18"


def test_cli_space_csv(capsys):
    code, out, _ = run_cli(capsys, "--space", "small", "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and len(rows) == 18
    assert {"num_tc", "num_vc", "tc_x", "tc_y", "glb_mib", "vc_width", "area_mm2"} <= set(rows[0])
    areas = [float(r["area_mm2"]) for r in rows]
    assert areas == sorted(areas, reverse=True)
    assert all(r["vc_width"] == r["tc_x"] for r in rows)


def test_cli_space_summary_json(capsys):
    code, out, _ = run_cli(capsys, "--space", "small", "--json")
    data = json.loads(out)
    assert code == 0 and data["architectures"] == 18 and data["points"] == 144


@pytest.mark.parametrize("argv, pattern", [
    (["--arch", "nope"], "unknown arch 'nope'"),
    (["--space", "nope", "--count"], "unknown space 'nope'"),
    (["--arch", "tpuv4", "--count"], "--count and --csv go with --space"),
])
def test_cli_errors_are_one_line(capsys, argv, pattern):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and pattern in err and err.count("\n") == 1 and out == ""


@pytest.mark.parametrize("change, pattern", [
    ({"hbm_bw_gbps": float("inf")}, r"field 'hbm_bw_gbps': must be a finite number, got inf"),
    ({"glb_bw_gbps": float("nan")}, r"field 'glb_bw_gbps': must be a positive number, got nan"),
    ({"clock_ghz": float("inf")}, r"field 'clock_ghz': must be a finite number"),
    ({"hbm_bw_gbps": 1e7}, r"field 'hbm_bw_gbps': must be at most 1,000,000 \("),
    ({"glb_bw_gbps": 1e12}, r"field 'glb_bw_gbps': must be at most 1,000,000,000 \("),
    ({"num_tc": 2**20}, r"field 'num_tc': must be at most 65,536 \("),
    ({"num_vc": 2**20}, r"field 'num_vc': must be at most 65,536 \("),
    ({"tc_x": 8192}, r"field 'tc_x': must be at most 4,096 \("),
    ({"tc_y": 8192}, r"field 'tc_y': must be at most 4,096 \("),
    ({"vc_width": 8192}, r"field 'vc_width': must be at most 4,096 \("),
    ({"glb_mib": 2**21}, r"field 'glb_mib': must be at most 1,048,576 \("),
    ({"hbm_gib": 2**15, "hbm_bw_gbps": 1000}, r"field 'hbm_gib': must be at most 16,384 \("),
    ({"clock_ghz": 1000}, r"field 'clock_ghz': must be at most 100 \("),
])
def test_non_finite_and_unphysical_fields_are_refused(change, pattern):
    test_arch_validation(change, pattern)


def test_an_arch_yaml_with_inf_bandwidth_is_refused(tmp_path):
    path = tmp_path / "fast.yaml"
    path.write_text(yaml.safe_dump(GOOD) + "hbm_bw_gbps: .inf\n")
    with pytest.raises(PhazeError, match=r"fast.yaml: field 'hbm_bw_gbps': must be a finite number, got inf"):
        load_arch(path)


def test_search_space_choices_obey_the_same_limits(tmp_path):
    from phaze_opt.design.space import load_space

    text = (tmp_path / "s.yaml")
    base = yaml.safe_load(open(shipped_dir() / "spaces" / "small.yaml"))
    for params, where in (({"num_tc": {"range": [1, 10**12]}}, "params.num_tc"),
                          ({"num_tc": {"pow2": [1, 2**40]}}, "params.num_tc"),
                          ({"mbs": [2**30]}, "params.mbs")):
        text.write_text(yaml.safe_dump({**base, "params": {**base["params"], **params}}))
        with pytest.raises(PhazeError, match=rf"field '{where}': must be at most"):
            load_space(text)
    text.write_text(yaml.safe_dump(base).replace("80: 2048", "80: .inf"))
    with pytest.raises(PhazeError, match=r"field 'hbm_bw_gbps.80': must be a finite number"):
        load_space(text)
