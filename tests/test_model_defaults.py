"""A model file's default chip, system and ILP limit: parsed with one-line errors, used by
`phaze-opt evaluate` when no flag names them, overridden by the flags, and stated in the output."""

import json

import pytest
import yaml

from phaze_opt import cli
from phaze_opt.errors import PhazeError
from phaze_opt.workload.models import load_model

TINY = {
    "name": "tiny", "family": "gpt", "layers": 2, "hidden": 64, "heads": 4, "ffn": 256, "seq": 32,
    "vocab": 100, "activation": "gelu", "norm": "layernorm", "position": "learned", "tied_embeddings": True,
}
DEFAULTS = {"default_arch": "h100-sxm", "default_system": "dgx-h100", "default_ilp_time_limit": 3}


def _write(tmp_path, data, name="m.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_are_read_and_leave_the_identity_alone(tmp_path):
    plain = load_model(_write(tmp_path, TINY, "plain.yaml"))
    named = load_model(_write(tmp_path, {**TINY, **DEFAULTS}))
    assert (plain.default_arch, plain.default_system, plain.default_ilp_time_limit) == ("", "", 0.0)
    assert (named.default_arch, named.default_system, named.default_ilp_time_limit) == ("h100-sxm", "dgx-h100", 3.0)
    # they change no graph: the same identity, hash and equality (so every cache key stays as it was)
    assert named.identity() == plain.identity() and hash(named) == hash(plain) and named == plain
    for name in ("deepseek-v3", "llama3-405b"):
        m = load_model(name)
        assert (m.default_arch, m.default_system) == ("h100-sxm", "dgx-h100")


@pytest.mark.parametrize("field, value, problem", [
    ("default_system", "dgx-h10", "unknown system 'dgx-h10'; did you mean dgx-h100?"),
    ("default_arch", "h100", "unknown arch 'h100'"),
    ("default_arch", 7, "must be the name of an arch preset, got 7"),
    ("default_system", "", "must be the name of a system preset"),
    ("default_ilp_time_limit", 0, "must be a positive number, got 0"),
    ("default_ilp_time_limit", "fast", "must be a positive number"),
    ("default_ilp_time_limit", 1e9, "at most"),
])
def test_a_bad_default_is_one_line_naming_file_and_field(tmp_path, field, value, problem):
    path = _write(tmp_path, {**TINY, field: value})
    with pytest.raises(PhazeError) as info:
        load_model(path)
    message = str(info.value)
    assert message.startswith(f"{path}: field '{field}': ") and problem in message, message
    assert "\n" not in message


def _evaluate(capsys, *args) -> str:
    assert cli.main(["evaluate", *args]) == 0
    return capsys.readouterr().out


def test_evaluate_uses_the_models_defaults_and_says_so(tmp_path, capsys):
    path = _write(tmp_path, {**TINY, **DEFAULTS})
    r = json.loads(_evaluate(capsys, "--model", path, "--json"))
    assert (r["arch"], r["system"], r["ilp_time_limit_s"]) == ("h100-sxm", "dgx-h100", 3.0)
    assert r["chosen_by"] == {"arch": "model", "system": "model", "ilp_time_limit": "model"}
    assert r["feasible"] and "hint" not in r
    text = _evaluate(capsys, "--model", path)
    assert ("chip h100-sxm (the model's default), system dgx-h100 (the model's default): 1024 devices, "
            "global batch 4096, ILP time limit 3 s per layer pass (the model's default)") in text, text


def test_flags_override_the_models_defaults(tmp_path, capsys):
    path = _write(tmp_path, {**TINY, **DEFAULTS})
    r = json.loads(_evaluate(capsys, "--model", path, "--arch", "tpuv4", "--system", "default",
                             "--ilp-time-limit", "5", "--json"))
    assert (r["arch"], r["system"], r["ilp_time_limit_s"]) == ("tpuv4", "default", 5.0)
    assert r["chosen_by"] == {"arch": "flag", "system": "flag", "ilp_time_limit": "flag"}
    text = _evaluate(capsys, "--model", path, "--system", "dgx-a100")
    assert "chip h100-sxm (the model's default), system dgx-a100: 1024 devices" in text, text
    # a model without defaults runs on the command's own, as before
    r = json.loads(_evaluate(capsys, "--model", _write(tmp_path, TINY, "plain.yaml"), "--json"))
    assert (r["arch"], r["system"], r["ilp_time_limit_s"]) == ("tpuv4", "default", 60.0)
    assert r["chosen_by"] == {"arch": "command", "system": "command", "ilp_time_limit": "command"}


def test_a_model_that_fits_nothing_by_default_is_told_which_flags_to_pass(tmp_path, capsys):
    """~6 B parameters on one 32 GiB TPUv4 (--devices 1) cannot hold their 16 bytes each of weights,
    gradients and Adam state: the result names the generic defaults and the flags to pass."""
    big = {**TINY, "hidden": 8192, "heads": 64, "ffn": 32768, "vocab": 256000}
    path = _write(tmp_path, big)
    text = _evaluate(capsys, "--model", path, "--devices", "1")
    hint = [line for line in text.splitlines() if line.startswith("hint: ")]
    assert "infeasible: " in text and len(hint) == 1, text
    assert hint[0].startswith("hint: --arch tpuv4 and --system default are the command's generic defaults and "
                              "tiny's file names no default_arch/default_system; pass --arch and --system"), hint
    assert "--arch b200 (the most HBM of the shipped chips, 180 GiB)" in hint[0] and "dgx-h100" in hint[0]
    # a chip the user chose is the user's: only the generic system is named
    r = json.loads(_evaluate(capsys, "--model", path, "--devices", "1", "--arch", "tpuv4", "--json"))
    assert not r["feasible"] and r["hint"].startswith("--system default are the command's generic defaults")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek-v3", "llama3-405b"])
def test_modern_models_are_feasible_with_no_flags(capsys, model):
    r = json.loads(_evaluate(capsys, "--model", model, "--json"))
    assert r["feasible"], r["reason"]
    assert (r["arch"], r["system"]) == ("h100-sxm", "dgx-h100")
    assert r["chosen_by"]["arch"] == r["chosen_by"]["system"] == "model"
    # an unproven result says so, with a proven bound above what it reaches
    assert r["proven"] or r["throughput_bound"] > r["throughput"]
