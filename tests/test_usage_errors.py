"""Every usage mistake is one line on stderr naming the flag (or name) and what is allowed, exit status 2,
with "did you mean" where a command, flag, choice or config name is close to a real one. Never
argparse's whole usage; `--help` still prints it."""

import pytest

from phaze_opt import cli

# (argv, words the one line must contain, the suggestion it must make or None)
MISTAKES = [
    # commands
    ([], ["give a command", "evaluate", "--help"], None),
    (["evalute"], ["unknown command 'evalute'", "choose one of workload"], "did you mean evaluate?"),
    (["stduy"], ["unknown command 'stduy'"], "did you mean study?"),
    (["exprot", "x"], ["unknown command 'exprot'"], "did you mean export?"),
    (["--bogus"], ["unknown flag --bogus", "'phaze-opt --help' lists them"], None),
    # flags
    (["study", "--trails", "5"], ["phaze-opt study: error: unknown flag --trails"], "did you mean --trials?"),
    (["study", "--trails=5"], ["unknown flag --trails"], "did you mean --trials?"),
    (["study", "--modle", "gpt2-xl"], ["unknown flag --modle"], "did you mean --model?"),
    (["evaluate", "--placment", "tp=1,pp=1,dp=1"], ["unknown flag --placment"], "did you mean --placement?"),
    (["study", "--zzz"], ["unknown flag --zzz", "'phaze-opt study --help' lists them"], None),
    (["evaluate", "gpt2-xl"], ["unexpected argument gpt2-xl"], None),
    # choices
    (["evaluate", "--precision", "fp16"], ["--precision: unknown value 'fp16'", "bf16, fp8, mxfp8, nvfp4"],
     "did you mean bf16?"),
    (["evaluate", "--precision", "fp9"], ["--precision"], "did you mean fp8?"),
    (["evaluate", "--recompute", "ful"], ["--recompute", "none, selective, full"], "did you mean full?"),
    (["evaluate", "--stack", "megatronlm"], ["--stack"], "did you mean megatron-lm?"),
    (["evaluate", "--attention", "flsh"], ["--attention"], "did you mean flash?"),
    (["evaluate", "--zero", "4"], ["--zero: unknown value '4'", "0, 1, 2, 3"], None),
    (["workload", "--model", "gpt2-xl", "--attention", "ring"], ["--attention", "unfused, flash"], None),
    (["schedule", "--model", "gpt2-xl", "--solver", "gurobi"], ["--solver", "highs, cbc"], None),
    # numbers and missing values
    (["study", "--trials", "abc"], ["--trials: expected a whole number, got 'abc'"], None),
    (["study", "--seed", "1.5"], ["--seed: expected a whole number"], None),
    (["evaluate", "--mbs", "x"], ["--mbs: expected a whole number"], None),
    (["evaluate", "--ilp-time-limit", "soon"], ["--ilp-time-limit: expected a number, got 'soon'"], None),
    (["workload", "--model", "gpt2-xl", "--tp", "x"], ["--tp: expected a whole number"], None),
    (["ui", "--port", "abc"], ["--port: expected a whole number"], None),
    (["study", "--trials"], ["--trials: expected one argument"], None),
    (["evaluate", "--placement"], ["--placement: expected one argument"], None),
    (["export"], ["phaze-opt export: error:", "STUDY"], None),
    (["compare"], ["phaze-opt compare: error:", "STUDY"], None),
    (["arch"], ["--arch", "--space", "required"], None),
    (["arch", "--arch", "tpuv4", "--space", "small"], ["--space: not allowed with --arch"], None),
    # config names and values the commands check
    (["evaluate", "--model", "gpt2xl"], ["unknown model 'gpt2xl'", "or give a path"], "did you mean gpt2-xl?"),
    (["evaluate", "--arch", "tpuv5"], ["unknown arch 'tpuv5'"], "did you mean tpuv4?"),
    (["arch", "--space", "smal"], ["unknown space 'smal'"], "did you mean small?"),
    (["evaluate", "--system", "tpuv4pod"], ["unknown system 'tpuv4pod'"], "did you mean tpuv4-pod?"),
    (["study", "--space", "precision-smal", "--tracking-uri", "off"], ["unknown space"],
     "did you mean precision-small?"),
    (["study", "--model", "llama3-8", "--tracking-uri", "off"], ["unknown model"], "did you mean llama3-8b?"),
    (["validate", "--suite", "tpuv4pod"], ["unknown validation suite"], "did you mean tpuv4-pod?"),
    (["study", "--sampler", "tep", "--tracking-uri", "off"], ["--sampler: unknown sampler 'tep'"],
     "did you mean tpe?"),
    (["study", "--order", "random", "--tracking-uri", "off"], ["--order", "area or grid"], None),
    (["export", "x", "--format", "xlsx"], ["--format xlsx", "csv, parquet, json"], None),
]


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exit_info:  # argparse's mistakes end the parse
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_table_covers_at_least_30_mistakes():
    assert len(MISTAKES) >= 30


@pytest.mark.parametrize("argv, words, suggestion", MISTAKES, ids=[" ".join(m[0]) or "(none)" for m in MISTAKES])
def test_a_mistake_is_one_line(tmp_path, monkeypatch, capsys, argv, words, suggestion):
    monkeypatch.chdir(tmp_path)  # a study that got past its checks would write here
    code, out, err = _run(argv, capsys)
    assert code == 2, (code, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line: no usage, no traceback
    assert "error: " in err and "usage:" not in err
    for word in words:
        assert word in err, (word, err)
    if suggestion:
        assert suggestion in err, err
    else:
        assert "did you mean" not in err, err


def test_help_still_prints_the_usage(capsys):
    code, out, _ = _run(["evaluate", "--help"], capsys)
    assert code == 0 and out.startswith("usage: phaze-opt evaluate") and "--precision" in out
    code, out, _ = _run(["--help"], capsys)
    assert code == 0 and "COMMAND" in out and "evaluate" in out
