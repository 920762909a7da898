"""The `study` and `compare` commands: documented options and one-line errors for bad input."""

import subprocess
import sys

import pytest

from phaze_opt import cli
from phaze_opt import compare as compare_module
from phaze_opt import study as study_module

STUDY_OPTIONS = ["--model", "--sampler", "--objectives", "--space", "--system", "--seed", "--study-name",
                 "--storage", "--tracking-uri", "--workers", "--exhaustive", "--order", "--hysteresis", "--json",
                 "--trials"]


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["study", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in STUDY_OPTIONS:
        assert option in text, option
    for sampler in ("tpe", "random", "cmaes", "qmc", "gp", "nsga2"):
        assert sampler in text
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    text = capsys.readouterr().out
    for option in ("STUDY", "--storage", "--tracking-uri", "--threshold", "--json"):
        assert option in text


def test_module_entry_points_are_the_same_commands(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert study_module.run(["--sampler", "bogus", "--tracking-uri", "off"]) == 2
    assert capsys.readouterr().err.startswith("error: --sampler: unknown sampler 'bogus'")
    assert compare_module.run(["only-one"]) == 2
    assert "at least two" in capsys.readouterr().err
    out = subprocess.run([sys.executable, "-m", "phaze_opt.study", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--hysteresis" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["study", "--sampler", "annealing"], "error: --sampler: unknown sampler 'annealing'; choose one of auto, bound, tpe, random"),
    (["study", "--objectives", "throughput,latency"], "error: --objectives: unknown objective 'latency'"),
    (["study", "--objectives", "area,throughput"], "error: --objectives: throughput must come first"),
    (["study", "--model", "gpt-17"], "error: unknown model 'gpt-17'"),
    (["study", "--space", "no-such-space"], "error: unknown space 'no-such-space'"),
    (["study", "--system", "nowhere"], "error: unknown system 'nowhere'"),
    (["study", "--exhaustive", "--hysteresis", "-2"], "error: --hysteresis"),
    (["study", "--exhaustive", "--order", "grid", "--hysteresis", "5"], "error: --hysteresis stops a sweep"),
    (["study", "--workers", "0"], "error: --workers"),
    (["compare", "a", "b"], "error: unknown study 'a'"),
])
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    code = cli.main(args + ["--tracking-uri", "off"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_user_space_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    space = tmp_path / "empty.yaml"
    space.write_text("params:\n  num_tc: []\n  num_vc: [2]\n  tc_x: [128]\n  tc_y: [128]\n  glb_mib: [128]\n"
                     "  hbm_gib: [32]\n  mbs: [1]\n  recompute: [false]\ntied: {vc_width: tc_x}\n"
                     "fixed: {clock_ghz: 1.05}\narea: {budget: tpuv4}\n")
    code = cli.main(["study", "--space", str(space), "--tracking-uri", "off"])
    err = capsys.readouterr().err
    assert code == 2 and "num_tc" in err and "no choices" in err and err.count("\n") == 1



def test_a_subcommand_mistake_names_that_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["study", "--trails", "50"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "phaze-opt study: error: unknown flag --trails (did you mean --trials?)\n"


@pytest.mark.parametrize("argv", [
    ["evaluate", "--model", "gpt2-xl", "--arch", "tpuv4", "--mbs", "0"],
    ["workload", "--model", "gpt2-xl", "--mbs", "0"],
    ["schedule", "--model", "gpt2-xl", "--arch", "tpuv4", "--mbs", "-2"],
])
def test_a_bad_microbatch_names_the_flag(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: --mbs must be a positive integer, got {argv[-1]}\n"
