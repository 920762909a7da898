"""Everything a file or an option can make large is bounded before it is used: YAML aliases, the
values echoed in errors, the grid's arrays, the number of worker processes."""

import time
from pathlib import Path

import pytest
import yaml

from phaze_opt import configs
from phaze_opt.design.space import MAX_AREA_CELLS, load_space
from phaze_opt.errors import SHOWN_CHARS, PhazeError, shown
from phaze_opt.search.runner import run_study
from phaze_opt.search.setup import max_workers
from test_study_fakes import backend, config

REPO = Path(__file__).resolve().parent.parent
LAUGHS = "\n".join(["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
                   + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)])


def _space_text(**params) -> str:
    data = yaml.safe_load((configs.shipped_dir() / "spaces" / "small.yaml").read_text())
    data["params"].update(params)
    return yaml.safe_dump(data)


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(_space_text() + "description:\n" + "\n".join("  " + line for line in LAUGHS.splitlines()) + "\n")
    start = time.monotonic()
    with pytest.raises(PhazeError, match="aliases"):
        load_space(str(path))
    assert time.monotonic() - start < 30  # not the minutes and gigabytes of the expansion


def test_an_oversized_config_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("name: x\n# " + "x" * (configs.MAX_CONFIG_BYTES + 10) + "\n")
    with pytest.raises(PhazeError, match="at most"):
        configs.read_yaml(path)


def test_deep_yaml_nesting_is_one_line(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("name: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(PhazeError, match="deep"):
        configs.read_yaml(path)


def test_echoed_values_are_bounded():
    shared = [0] * 10
    for _ in range(30):  # 10**30 elements if expanded
        shared = [shared] * 10
    assert len(shown(shared)) <= SHOWN_CHARS
    assert len(shown("x" * 10**6)) <= SHOWN_CHARS
    assert shown(3) == "3" and shown("ab") == "'ab'"


def test_a_huge_value_in_a_config_gives_a_short_error(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(_space_text().replace("name: small", "name: [" + ", ".join(["1"] * 20000) + "]"))  # 60 kB
    with pytest.raises(PhazeError) as info:
        load_space(str(path))
    assert "name" in str(info.value) and len(str(info.value)) < 400


def test_a_grid_too_large_to_hold_is_refused_before_allocation(tmp_path):
    path = tmp_path / "huge.yaml"
    # each field within its own limit; together 2.6e8 architectures
    path.write_text(_space_text(glb_mib={"range": [1, 65536]}, num_vc={"pow2": [1, 64]}, num_tc={"pow2": [1, 64]},
                                tc_x={"pow2": [1, 256]}, tc_y={"pow2": [1, 256]}))
    start = time.monotonic()
    with pytest.raises(PhazeError, match=f"architectures, more than the {MAX_AREA_CELLS:,}"):
        load_space(str(path)).size()
    assert time.monotonic() - start < 30


def test_workers_are_bounded_by_the_machine(tmp_path):
    assert max_workers() >= 1
    with pytest.raises(PhazeError, match="--workers: at most"):
        run_study(config(tmp_path, workers=max_workers() + 1), backend())
    assert not (tmp_path / "studies").exists() or not list((tmp_path / "studies").glob("*.db"))


def test_a_cache_write_the_disk_refuses_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk fails the write halfway: the cache entry is a miss, and no temporary file stays."""
    import os

    from phaze_opt import cache

    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache.os, "fdopen", lambda fd, *a, **k: Full(real(fd, *a, **k)))
    assert cache.write_atomic(tmp_path / "c" / "x.json", "{" + "0" * 1000 + "}") is False
    assert list((tmp_path / "c").iterdir()) == []


def test_a_key_repeated_in_a_yaml_mapping_is_one_line_naming_the_file_and_key(tmp_path):
    """`layers: 48` then `layers: 49` took the last value silently; now it names both lines."""
    from phaze_opt.workload.models import load_model

    text = (configs.shipped_dir() / "models" / "gpt2-xl.yaml").read_text()
    path = tmp_path / "twice.yaml"
    path.write_text(text + "layers: 49\n")
    line = 1 + next(i for i, s in enumerate(text.splitlines()) if s.startswith("layers:"))
    with pytest.raises(PhazeError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert f"key 'layers' given twice (first at line {line})" in message
    nested = tmp_path / "nested.yaml"
    nested.write_text("a:\n  b: 1\n  c: 2\n  b: 3\n")
    with pytest.raises(PhazeError, match=r"nested.yaml: malformed YAML at line 4: key 'b' given twice \(first at line 2\)"):
        configs.read_yaml(nested)
