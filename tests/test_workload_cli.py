"""`phaze-opt workload`: JSON and text output, and one-line errors with exit status 2."""

import json

import pytest
import yaml

from phaze_opt import cli


@pytest.fixture(autouse=True)
def _only_workload(monkeypatch, tmp_path_factory):
    # Run the real dispatcher with just this command, so a sibling command under construction
    # cannot break these tests.
    monkeypatch.setattr(cli, "COMMANDS", ("workload",))
    monkeypatch.setenv("PHAZE_OPT_CACHE", str(tmp_path_factory.getbasetemp() / "workload-cache"))


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_summary(capsys):
    code, out, _ = run(capsys, "workload", "--model", "gpt3-175b", "--tp", "4", "--json")
    assert code == 0
    r = json.loads(out)
    assert r["params"] == 174_604_259_328 and r["tp"] == 4 and r["mbs"] == 1 and r["seq"] == 2048
    assert r["train_flops_per_sequence"] == pytest.approx(2.205e15, rel=1e-3)
    assert len(r["layers"]) == 98 and r["layers"][0]["name"] == "embedding" and r["layers"][-1]["name"] == "head"
    block = r["layers"][1]
    assert block["params"] == 453_080_064  # per device at TP 4
    assert block["fwd_ops"]["net"] == 2 and block["bwd_ops"]["tc"] == 12
    assert block["activation_bytes"] > 0 and r["time_s"] >= 0


def test_text_render_groups_identical_layers(capsys):
    code, out, _ = run(capsys, "workload", "--model", "bert-large", "--mbs", "2")
    assert code == 0
    assert "parameters (whole model):     335,174,458" in out
    assert "block.0..23 (x24)" in out and "microbatch 2" in out and "time:" in out


def test_users_own_yaml(tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({
        "name": "mine", "family": "gpt", "layers": 3, "hidden": 32, "heads": 4, "ffn": 128, "seq": 16,
        "vocab": 101, "activation": "gelu", "norm": "layernorm", "position": "learned",
        "tied_embeddings": True, "expert_placement": {"tp": 1, "pp": 1, "dp": 8},
    }))
    code, out, _ = run(capsys, "workload", "--model", str(path), "--tp", "2", "--json")
    r = json.loads(out)
    assert code == 0 and r["model"] == "mine" and len(r["layers"]) == 5
    assert r["params"] == 101 * 32 + 16 * 32 + 3 * (12 * 32 * 32 + 13 * 32) + 2 * 32


@pytest.mark.parametrize("argv,message", [
    (("--model", "nope"), "unknown model 'nope'"),
    (("--model", "gpt2-xl", "--tp", "2"), "TP width 2 not allowed"),
    (("--model", "gpt2-xl", "--mbs", "0"), "--mbs must be a positive integer"),
    (("--model", "gpt2-xl", "--seq", "4096"), "exceeds its 1024 learned positions"),
    (("--model", "/no/such/file.yaml"), "no such model file"),
])
def test_errors_are_one_line_with_status_2(capsys, argv, message):
    code, out, err = run(capsys, "workload", *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_json_memory_by_mode_and_flash_attention(capsys):
    code, out, _ = run(capsys, "workload", "--model", "gpt3-175b", "--tp", "4", "--seq", "512", "--json")
    assert code == 0
    unfused = json.loads(out)
    code, out, _ = run(capsys, "workload", "--model", "gpt3-175b", "--tp", "4", "--seq", "512", "--attention",
                       "flash", "--json")
    assert code == 0
    flash = json.loads(out)
    assert unfused["attention"] == "unfused" and flash["attention"] == "flash"
    b0, b1 = unfused["layers"][1], flash["layers"][1]
    modes = b0["activation_bytes_by_mode"]
    assert set(modes) == {"none", "selective", "full", "none+sp", "selective+sp", "full+sp"}
    assert modes["none"] == b0["activation_bytes"] and modes["full"] == b0["checkpoint_bytes"] == 512 * 12288 * 2
    assert modes["full+sp"] == b0["checkpoint_bytes_sp"] == modes["full"] // 4
    assert modes["selective"] == modes["none"] - b0["attention_core_bytes"]
    assert b1["attention_core_bytes"] == 0 and b1["bwd_ops"]["tc+vc"] == 1 and "tc+vc" not in b0["bwd_ops"]
    with pytest.raises(SystemExit) as exc:  # argparse rejects the choice in one line
        run(capsys, "workload", "--model", "gpt3-175b", "--attention", "ring")
    assert exc.value.code == 2 and "--attention" in capsys.readouterr().err
