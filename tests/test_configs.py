"""Config lookup and the one-line error contract shared by every config kind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from phaze_opt import configs
from phaze_opt.errors import PhazeError
from conftest import error_lines


def test_unknown_name_lists_the_choices(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.yaml").write_text("name: tiny\n")
    monkeypatch.setenv("PHAZE_OPT_CONFIGS", str(tmp_path))
    with pytest.raises(PhazeError, match=r"unknown model .nope.; choose one of .*gpt3-175b.*tiny"):
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
    assert out.returncode == 2 and len(error_lines(out.stderr)) == 1
    assert str(f) in out.stderr and "not UTF-8" in out.stderr and "Traceback" not in out.stderr


def _user_arch(folder, name, num_tc):
    (folder / "archs").mkdir(parents=True, exist_ok=True)
    text = (configs.shipped_dir() / "archs" / "tpuv4.yaml").read_text()
    text = text.replace("name: tpuv4", f"name: {name}").replace("num_tc: 8", f"num_tc: {num_tc}")
    (folder / "archs" / f"{name}.yaml").write_text(text)


def test_user_folders_add_and_override_shipped_configs_by_name(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    _user_arch(first, "tpuv4", 4)  # overrides the shipped tpuv4
    _user_arch(second, "tpuv4", 2)  # shadowed by the first folder
    _user_arch(second, "mine", 1)  # added
    monkeypatch.setenv(configs.ENV, f"{first}{os.pathsep}{second}")
    assert configs.resolve("archs", "tpuv4") == first / "archs" / "tpuv4.yaml"
    assert configs.resolve("archs", "mine") == second / "archs" / "mine.yaml"
    assert configs.resolve("archs", "h100-sxm") == configs.shipped_dir() / "archs" / "h100-sxm.yaml"
    assert {"tpuv4", "mine", "h100-sxm"} <= set(configs.available("archs"))
    assert configs.available("archs").count("tpuv4") == 1
    # a user folder without the constants files still finds the shipped ones
    assert configs.constants_file("area.yaml") == configs.shipped_dir() / "area.yaml"
    (second / "area.yaml").write_text("x: 1\n")
    assert configs.constants_file("area.yaml") == second / "area.yaml"


def test_configs_flag_reaches_the_command_and_comes_first(tmp_path, monkeypatch, capsys):
    from phaze_opt import cli

    env_dir, flag_dir = tmp_path / "env", tmp_path / "flag"
    _user_arch(env_dir, "mine", 2)
    _user_arch(flag_dir, "mine", 4)
    monkeypatch.setenv(configs.ENV, str(env_dir))
    assert cli.main(["arch", "--arch", "mine", "--json", "--configs", str(flag_dir)]) == 0
    assert '"num_tc": 4' in capsys.readouterr().out
    assert os.environ[configs.ENV] == str(env_dir)  # restored for the next call in this process
    assert cli.main(["arch", "--arch", "mine", "--json"]) == 0
    assert '"num_tc": 2' in capsys.readouterr().out


def test_missing_configs_folder_is_one_line(tmp_path, capsys):
    from phaze_opt import cli

    assert cli.main(["arch", "--arch", "tpuv4", "--configs", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --configs ") and "no such folder" in err and err.count("\n") == 1


def test_shipped_configs_are_found_through_the_package():
    root = configs.shipped_dir()
    assert root == Path(configs.__file__).resolve().parent / "presets"
    for kind in configs.KINDS:
        assert configs.available(kind), kind
