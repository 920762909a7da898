"""The project reads nothing beside the repository, and ships the data it needs with its provenance."""

from __future__ import annotations

import gzip
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from phaze_opt.errors import PhazeError
from phaze_opt.hardware import area, calibrate

from conftest import REPO, outside_guard


def test_guard_refuses_a_read_beside_the_repository(tmp_path, monkeypatch):
    log = tmp_path / "reads.log"
    monkeypatch.setenv("PHAZE_OPT_OUTSIDE_LOG", str(log))
    beside = REPO.parent / "shared" / "reference" / "phaze-cores.json"
    with pytest.raises(PermissionError, match="outside the repository"):
        open(beside, "rb")
    assert str(beside) in log.read_text()


def test_guard_is_active_in_subprocesses(tmp_path):
    log = tmp_path / "reads.log"
    env = {**os.environ, "PHAZE_OPT_OUTSIDE_LOG": str(log)}
    beside = REPO.parent / "shared" / "README.md"
    proc = subprocess.run([sys.executable, "-c", f"open({str(beside)!r})"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "PermissionError" in proc.stderr
    assert str(beside) in log.read_text()


def test_guard_allows_the_repository_and_elsewhere():
    repo = str(REPO)
    assert not outside_guard.outside(os.path.join(repo, "phaze_opt", "presets", "area.yaml"), repo)
    assert not outside_guard.outside("/tmp/x", repo)
    assert outside_guard.outside(os.path.join(os.path.dirname(repo), "shared", "x"), repo)
    assert outside_guard.outside(repo + "-sibling", repo)  # a prefix is not containment


def test_bundled_reference_is_the_published_set():
    assert calibrate.reference_path() == calibrate.BUNDLED_REFERENCE
    assert calibrate.BUNDLED_REFERENCE.is_relative_to(REPO)
    digest = hashlib.sha256(calibrate.reference_bytes()).hexdigest()
    recorded = yaml.safe_load((REPO / "phaze_opt" / "presets" / "area.yaml").read_text())["provenance"]["reference_sha256"]
    assert digest == recorded
    assert digest in (REPO / "phaze_opt" / "data" / "README.md").read_text()
    rows = calibrate.reference_rows()
    assert len(rows) == 29360 and set(calibrate.REFERENCE_KEYS) <= set(rows[0])


def test_reference_override_reads_plain_and_gzip(tmp_path, monkeypatch):
    rows = [{"num_tc": 1, "num_vc": 1, "width": 8, "depth": 8, "width_vc": 8, "GLB_Buffer": 2**20, "area": 5e6}]
    plain = tmp_path / "set.json"
    plain.write_text(__import__("json").dumps(rows))
    packed = tmp_path / "set.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        monkeypatch.setenv("PHAZE_OPT_REFERENCE", str(path))
        ref = calibrate.reference_designs()
        assert ref["area_mm2"].tolist() == [5.0] and ref["tc_x"].tolist() == [8]


@pytest.mark.parametrize("content, message", [
    (None, "reference design set not found"),
    (b"\x1f\x8b not gzip", "not readable gzip"),
    (b"{not json", "not JSON"),
    (b"[]", "non-empty JSON list"),
    (b'[{"num_tc": 1}]', "lack field"),
])
def test_bad_reference_file_is_one_line_error(tmp_path, content, message):
    path = tmp_path / "set.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(PhazeError, match=message) as info:
        calibrate.reference_designs(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
