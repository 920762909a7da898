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


def test_yaml_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(PhazeError) as info:
        configs.load("models", str(f))
    msg = str(info.value)
    assert msg.startswith(str(f)) and "not UTF-8" in msg and "0xe9" in msg and "\n" not in msg


def test_a_folder_or_unreadable_file_is_one_line_naming_it(tmp_path):
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(PhazeError, match=rf"^{folder}: cannot read: Is a directory$"):
        configs.read_yaml(folder)
    with pytest.raises(PhazeError, match="no such model file"):
        configs.load("models", str(folder))  # a folder is not a config file
    f = tmp_path / "locked.yaml"
    f.write_text("a: 1\n")
    f.chmod(0)
    try:
        if f.read_bytes():  # pragma: no cover - running as root: permissions do not apply
            pytest.skip("file permissions do not apply to this user")
    except PermissionError:
        with pytest.raises(PhazeError, match=rf"^{f}: cannot read: Permission denied$"):
            configs.load("models", str(f))
    finally:
        f.chmod(0o644)


def test_a_non_utf8_yaml_on_the_command_line_is_one_line(tmp_path):
    f = tmp_path / "sys.yaml"
    f.write_bytes(b"devices_per_node: 8\nname: \xff\xfe\n")
    out = subprocess.run([sys.executable, "-m", "phaze_opt", "evaluate", "--system", str(f)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert str(f) in out.stderr and "not UTF-8" in out.stderr and "Traceback" not in out.stderr
