"""Config lookup and the one-line error contract shared by every config kind."""

import subprocess
import sys

import pytest

from phaze_opt import configs
from phaze_opt.errors import PhazeError


def test_unknown_name_lists_the_choices(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.yaml").write_text("name: tiny\n")
    monkeypatch.setenv("PHAZE_OPT_CONFIGS", str(tmp_path))
    with pytest.raises(PhazeError, match=r"unknown model 'nope': choose one of tiny"):
        configs.load("models", "nope")


def test_path_to_own_file_is_accepted(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("a: 1\n")
    data, path = configs.load("models", str(f))
    assert data == {"a": 1} and path == f


def test_missing_path_is_one_line(tmp_path):
    with pytest.raises(PhazeError, match="no such model file"):
        configs.load("models", str(tmp_path / "absent.yaml"))


def test_malformed_yaml_names_file_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("a: [1, 2\nb: 3\n")
    with pytest.raises(PhazeError) as info:
        configs.load("systems", str(f))
    msg = str(info.value)
    assert str(f) in msg and "malformed YAML" in msg and "line" in msg and "\n" not in msg


def test_top_level_must_be_mapping(tmp_path):
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(PhazeError, match="expected a mapping"):
        configs.load("archs", str(f))


def test_check_keys_unknown_and_missing():
    with pytest.raises(PhazeError, match=r"f.yaml: field 'colour': unknown field; allowed fields are a, b"):
        configs.check_keys({"a": 1, "colour": 2}, "f.yaml", ["a"], ["b"])
    with pytest.raises(PhazeError, match=r"field 'a': missing required field"):
        configs.check_keys({"b": 1}, "f.yaml", ["a"], ["b"])


@pytest.mark.parametrize("value", [0, -1, 1.5, "3", True])
def test_positive_int_rejects(value):
    with pytest.raises(PhazeError, match="must be a positive integer"):
        configs.positive_int({"x": value}, "x", "f.yaml")


def test_cli_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "phaze_opt", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "phaze-opt" in out.stdout
